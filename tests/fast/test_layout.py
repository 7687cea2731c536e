"""Where code lives: workers import only the worker kit, lesson libraries never import a worker, and only the
run-folder module spells run-folder file names. Parses the source; launches nothing."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from helpers import REPO_ROOT, WORKERS

HELPERS = REPO_ROOT / "helpers"
# The worker kit: the only helpers modules a worker script may import (helpers/README.md lists what each holds).
WORKER_KIT = {"helpers", "helpers.reporting", "helpers.distributed", "helpers.models", "helpers.data",
              "helpers.checkpoint", "helpers.checks", "helpers.tensors", "helpers.instruments",
              "helpers.cpu_data_parallel", "helpers.article", "helpers.rpc_training", "helpers.mystery_data",
              "helpers.zero_kit", "helpers.transformer", "helpers.twin",
              "helpers.launcher.run_folder", "helpers.launcher"}


def helpers_imports(path: Path) -> set[str]:
    """Every helpers module that the file imports, at any depth of the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "helpers":
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names
                         if (HELPERS / node.module.removeprefix("helpers").strip(".").replace(".", "/")
                             / f"{alias.name}.py").exists())
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.split(".")[0] == "helpers")
    return found


def test_the_rule_sees_an_import_that_breaks_it(tmp_path):
    bad = tmp_path / "bad_worker.py"
    bad.write_text("def main():\n    from helpers.ddp import check_ddp_worker\n")
    assert helpers_imports(bad) - WORKER_KIT == {"helpers.ddp"}  # catches a parser that skips nested imports


@pytest.mark.parametrize("worker", sorted(p.name for p in WORKERS.glob("*.py") if p.name != "__init__.py"))
def test_workers_import_only_the_worker_kit(worker):
    outside = helpers_imports(WORKERS / worker) - WORKER_KIT
    assert not outside, f"{worker} imports {sorted(outside)}: move what it needs into the worker kit"


def test_the_worker_kit_imports_only_itself():
    for module in sorted(WORKER_KIT - {"helpers", "helpers.launcher"}):
        path = HELPERS / (module.removeprefix("helpers.").replace(".", "/") + ".py")
        outside = helpers_imports(path) - WORKER_KIT
        assert not outside, f"{module} (worker kit) imports {sorted(outside)}"


def test_no_library_imports_a_worker():
    for path in sorted(HELPERS.rglob("*.py")):
        if WORKERS in path.parents:
            continue
        assert not [m for m in helpers_imports(path) if m.startswith("helpers.workers")], path


RUN_FOLDER_NAMES = re.compile(r"rank\{[^}]*\}\.log|rank\d+\.log|-attempt\{|rank\d+-attempt\d+"
                              r"|/ \"stacks\" /|glob\(\"workers/")


def test_only_the_run_folder_module_spells_run_folder_file_names():
    files = sorted([*HELPERS.rglob("*.py"), *(REPO_ROOT / "tests").rglob("*.py")])
    spelled = [str(path.relative_to(REPO_ROOT)) for path in files
               if path.name not in ("run_folder.py", "test_layout.py") and RUN_FOLDER_NAMES.search(path.read_text())]
    assert not spelled, f"run-folder file names spelled outside helpers/launcher/run_folder.py: {spelled}"
