"""Maintainers' tool: run a lesson top to bottom in place, then drop machine paths from stored tracebacks.

    python -m helpers.notebook_tools notebooks/02_ddp.ipynb [more.ipynb ...]

IPython always prints the frame that raised, with its absolute path; nbval never compares tracebacks,
so rewriting them to repository-relative paths changes no checked output. LESSONS_DATA=digits is set
so that the stored outputs match what `pytest --nbval` computes.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def execute(notebook: Path) -> None:
    env = {**os.environ, "LESSONS_DATA": "digits"}
    subprocess.run([sys.executable, "-m", "jupyter", "nbconvert", "--to", "notebook", "--execute", "--inplace",
                    "--ExecutePreprocessor.timeout=600", notebook.name], cwd=notebook.parent, env=env, check=True)


def strip_traceback_paths(notebook: Path) -> int:
    """Rewrite absolute paths under the repository in stored tracebacks; return how many lines changed."""
    data = json.loads(notebook.read_text())
    prefix, changed = f"{REPO_ROOT}{os.sep}", 0
    for cell in data["cells"]:
        for output in cell.get("outputs", []):
            lines = output.get("traceback", [])
            for i, line in enumerate(lines):
                if prefix in line:
                    lines[i], changed = line.replace(prefix, ""), changed + 1
    notebook.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    return changed


def main() -> None:
    for name in sys.argv[1:]:
        notebook = Path(name).resolve()
        execute(notebook)
        print(f"{name}: executed; {strip_traceback_paths(notebook)} traceback lines made relative")


if __name__ == "__main__":
    main()
