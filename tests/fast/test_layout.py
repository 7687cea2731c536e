"""Where code lives. The rules between helpers/'s rooms are import-linter contracts in pyproject.toml; here: that
they hold, that they catch a wrong import, that the notebooks keep to the launcher's public surface, and that only
the run-files module spells run-folder file names. Launches nothing."""
from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO_ROOT

HELPERS = REPO_ROOT / "helpers"
ROOMS = {"kit", "lessons", "launcher", "tools", "workers"}
LINT_IMPORTS = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command as c; "
                "sys.exit(c())"]


def _lint_imports(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*LINT_IMPORTS, "--no-cache"], cwd=root, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})


def test_helpers_has_one_folder_per_audience():
    folders = {path.name for path in HELPERS.iterdir() if path.is_dir() and path.name != "__pycache__"}
    modules = {path.name for path in HELPERS.glob("*.py")}
    assert folders == ROOMS and modules == {"__init__.py"}, (folders, modules)


def test_the_import_contracts_hold():
    done = _lint_imports(REPO_ROOT)
    assert done.returncode == 0 and "0 broken" in done.stdout, done.stdout + done.stderr


@pytest.mark.parametrize(("path", "line", "contract"), [
    ("workers/bad_worker.py", "from helpers.lessons.zero import check_step", "Workers import the kit only"),
    ("workers/bad_worker.py", "from helpers import launch", "Workers import the kit only"),
    ("kit/bad_kit.py", "from helpers.launcher import run_folder", "The kit imports nothing"),
    ("lessons/bad_lesson.py", "from helpers.launcher.processes import LaunchServer", "public surface"),
    ("lessons/bad_lesson.py", "def f():\n    from helpers.workers import whoami", "No library imports a worker"),
])
def test_the_contracts_catch_a_wrong_import(tmp_path, path, line, contract):
    """A copy of helpers/ with one wrong import (at the top, or inside a function) must break a named contract."""
    shutil.copytree(HELPERS, tmp_path / "helpers", ignore=shutil.ignore_patterns("__pycache__", "*.csv.gz"))
    shutil.copy(REPO_ROOT / "pyproject.toml", tmp_path)
    (tmp_path / "helpers" / path).write_text(line + "\n")
    done = _lint_imports(tmp_path)
    assert done.returncode != 0, done.stdout
    broken = done.stdout.split("Broken contracts")[-1]
    assert contract in broken and Path(path).stem in broken, done.stdout


def _notebook_imports(path: Path) -> set[str]:
    """Every helpers module a notebook's code cells import in the kernel. IPython's own transformer turns the cells
    into Python (`x = %ranks get ...` becomes a call, a %%ranks cell's body a string: it runs on the ranks)."""
    from IPython.core.inputtransformer2 import TransformerManager

    found = set()
    for cell in json.loads(path.read_text())["cells"]:
        if cell["cell_type"] != "code":
            continue
        source = TransformerManager().transform_cell("".join(cell["source"]))
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("helpers"):
                found.update(f"{node.module}.{alias.name}" for alias in node.names)
                found.add(node.module)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names if alias.name.startswith("helpers"))
    return found


def test_the_rule_reads_a_notebooks_imports(tmp_path):
    notebook = {"cells": [{"cell_type": "code", "source": ["%load_ext helpers\n",
                                                          "def f():\n    from helpers.launcher import processes\n"]}]}
    (tmp_path / "n.ipynb").write_text(json.dumps(notebook))
    assert "helpers.launcher.processes" in _notebook_imports(tmp_path / "n.ipynb")


@pytest.mark.parametrize("notebook", sorted(p.name for p in (REPO_ROOT / "notebooks").glob("*.ipynb")))
def test_notebooks_use_only_the_launchers_public_surface(notebook):
    launcher = {m for m in _notebook_imports(REPO_ROOT / "notebooks" / notebook) if m.startswith("helpers.launcher")}
    outside = {m for m in launcher if not (m == "helpers.launcher.api" or m.startswith("helpers.launcher.api."))}
    assert not outside, f"{notebook} imports launcher internals {sorted(outside)}: add what it needs to the api"


RUN_FOLDER_NAMES = re.compile(r"rank\{[^}]*\}\.log|rank\d+\.log|-attempt\{|rank\d+-attempt\d+|rank\*-attempt"
                              r"|/ \"stacks\" /|glob\(\"workers/")


def test_only_the_run_files_module_spells_run_folder_file_names():
    files = sorted([*HELPERS.rglob("*.py"), *(REPO_ROOT / "tests").rglob("*.py")])
    spelled = [str(path.relative_to(REPO_ROOT)) for path in files
               if path.name not in ("run_files.py", "test_layout.py") and RUN_FOLDER_NAMES.search(path.read_text())]
    assert not spelled, f"run-folder file names spelled outside helpers/kit/run_files.py: {spelled}"
