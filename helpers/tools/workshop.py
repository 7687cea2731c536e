"""Learner and teacher copies of the course, from the one source in this repository.

    python -m helpers.tools.workshop student handout/              # solutions removed, outputs kept
    python -m helpers.tools.workshop student handout/ --clear-outputs
    python -m helpers.tools.workshop teacher teacher-copy/         # everything, solutions included

A student copy keeps every lesson, every exercise's starting code and every check, and removes every cell tagged
`solution` (nbconvert's TagRemovePreprocessor: the answers, the cells that run a solution, the line that introduces
them) and the solution files themselves (`helpers/workers/*_solution.py`). It copies what a learner needs to install
and run the lessons (README, requirements, pyproject, binder, helpers, notebooks), not the tests or CI.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
from pathlib import Path

import nbformat
import pathspec
from nbconvert.preprocessors import TagRemovePreprocessor

from helpers import REPO_ROOT as ROOT

LEARNER_FILES = ("README.md", "requirements.txt", "pyproject.toml", "binder", "helpers", "notebooks")
SOLUTION_FILE = re.compile(r"[\w/.-]*_solution\.py")
TEST_HARNESS = {"notebooks/sanitize.cfg"}  # nbval's settings: the teacher's test run needs them, a learner does not
SOLUTION_BLOCK = re.compile(r"<details>\s*<summary>\s*Solution", re.IGNORECASE)


def _source(cell: dict) -> str:
    return "".join(cell.get("source", []))


def _tagged(cell: dict) -> bool:
    return "solution" in cell.get("metadata", {}).get("tags", [])


def untagged_solutions(cells: list[dict]) -> list[int]:
    """Cells that look like answers but lack the `solution` tag: one that runs a `*_solution.py` file, or holds a
    solution block. The tag is what removes a cell; this is the maintainers' check that no answer was left untagged."""
    return [index for index, cell in enumerate(cells) if not _tagged(cell)
            and ((cell["cell_type"] == "code" and SOLUTION_FILE.search(_source(cell)))
                 or (cell["cell_type"] == "markdown" and SOLUTION_BLOCK.search(_source(cell))))]


def student_cells(cells: list[dict], clear_outputs: bool = False) -> list[dict]:
    """The cells of a learner's copy of one notebook: every cell tagged `solution` removed."""
    notebook = nbformat.from_dict({"cells": json.loads(json.dumps(cells)), "metadata": {}, "nbformat": 4,
                                   "nbformat_minor": 5})
    notebook, _ = TagRemovePreprocessor(remove_cell_tags={"solution"}).preprocess(notebook, {})
    kept = json.loads(json.dumps(notebook["cells"]))
    for cell in kept:  # the maintainer's execution timestamps, if a notebook still carries them
        cell.get("metadata", {}).pop("execution", None)
    if clear_outputs:
        for cell in kept:
            if cell["cell_type"] == "code":
                cell["outputs"], cell["execution_count"] = [], None
    return kept


def _tracked(paths: tuple[str, ...]) -> list[Path]:
    """The files git tracks under `paths` (no caches, run folders or virtual environments). Outside a git
    checkout (a downloaded zip, a copied folder) the same list comes from the files on disk minus .gitignore."""
    try:
        listing = subprocess.run(["git", "ls-files", "--", *paths], cwd=ROOT, capture_output=True, text=True,
                                 check=True)
    except (OSError, subprocess.CalledProcessError):
        return _not_ignored(paths)
    return [Path(line) for line in listing.stdout.splitlines() if line]


def _not_ignored(paths: tuple[str, ...]) -> list[Path]:
    """The files under `paths` that .gitignore does not exclude, read as git reads it (pathspec's gitwildmatch)."""
    gitignore = ROOT / ".gitignore"
    spec = pathspec.GitIgnoreSpec.from_lines(gitignore.read_text(encoding="utf-8").splitlines()
                                             if gitignore.exists() else [])
    found = []
    for name in paths:
        top = ROOT / name
        files = [top] if top.is_file() else sorted(f for f in top.rglob("*") if f.is_file())
        found += [f.relative_to(ROOT) for f in files if not spec.match_file(f.relative_to(ROOT).as_posix())]
    return found


def learner_readme(text: str) -> str:
    """The README for a hand-out: the maintainers' part (the test suite, the repository layout) left out, since
    a student copy has no tests/ or docs/ folder."""
    sections = re.split(r"(?m)^(?=## )", text)
    kept = []
    for section in sections:
        title = section.splitlines()[0] if section.strip() else ""
        if title.startswith("## Layout"):
            continue
        if title.startswith("## Start"):
            head, _, _ = section.partition("To check that every lesson")
            section = head.rstrip() + "\n\n"
        if title.startswith("## How the lessons launch"):  # the maintainers' way to re-execute a lesson
            section = re.sub(r" After editing a lesson, run it with\s+`python -m helpers\.tools\.notebook_tools[^`]*`"
                             r"\s+\(executes it in place, as the tests expect\)\.", "", section)
        kept.append(section)
    return "".join(kept)


def write_copy(destination: str | Path, student: bool, clear_outputs: bool = False) -> list[Path]:
    """Write a learner (student=True) or teacher copy into `destination`; return the files written."""
    destination = Path(destination)
    if destination.exists() and any(destination.iterdir()):
        raise FileExistsError(f"{destination} is not empty: choose a new folder, so that nothing is overwritten")
    written = []
    for relative in _tracked(LEARNER_FILES):
        if student and (SOLUTION_FILE.fullmatch(relative.as_posix()) or relative.as_posix() in TEST_HARNESS):
            continue
        target = destination / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        if student and relative.as_posix() == "README.md":
            target.write_text(learner_readme((ROOT / relative).read_text(encoding="utf-8")), encoding="utf-8")
        elif relative.suffix == ".ipynb" and (student or clear_outputs):
            notebook = json.loads((ROOT / relative).read_text(encoding="utf-8"))
            cells = notebook["cells"]
            notebook["cells"] = student_cells(cells, clear_outputs) if student else [
                {**c, "outputs": [], "execution_count": None} if c["cell_type"] == "code" else c for c in cells]
            target.write_text(json.dumps(notebook, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        else:
            shutil.copy2(ROOT / relative, target)
        written.append(target)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=["student", "teacher"])
    parser.add_argument("destination")
    parser.add_argument("--clear-outputs", action="store_true", help="notebooks without stored outputs")
    args = parser.parse_args()
    written = write_copy(args.destination, student=args.kind == "student", clear_outputs=args.clear_outputs)
    notebooks = sum(path.suffix == ".ipynb" for path in written)
    print(f"{args.kind} copy: {len(written)} files ({notebooks} notebooks) in {args.destination}")
    print("Learners start in that folder with:  pip install -r requirements.txt && "
          "jupyter lab --LabApp.default_url=/lab/tree/notebooks/00_start_here.ipynb")
    print("(from the folder itself, not notebooks/: the lessons link to ../helpers/workers/*.py, which a server "
          "rooted in notebooks/ cannot open)")


if __name__ == "__main__":
    main()
