"""Learner and teacher copies of the course, from the one source in this repository.

    python -m helpers.tools.workshop student handout/              # solutions removed, outputs kept
    python -m helpers.tools.workshop student handout/ --clear-outputs
    python -m helpers.tools.workshop teacher teacher-copy/         # everything, solutions included

A student copy keeps every lesson, every exercise's starting code and every check, and removes:
- cells tagged `solution`, and the solution blocks (`<details><summary>Solution</summary> ... </details>`);
- cells that run a solution file, with the one-line markdown cell that introduces them;
- the solution files themselves (`helpers/workers/*_solution.py`).
It copies what a learner needs to install and run the lessons (README, requirements, pyproject, binder,
helpers, notebooks), not the tests or CI.
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import re
import shutil
import subprocess
from pathlib import Path

from helpers import REPO_ROOT as ROOT

LEARNER_FILES = ("README.md", "requirements.txt", "pyproject.toml", "binder", "helpers", "notebooks")
SOLUTION_FILE = re.compile(r"[\w/.-]*_solution\.py")
TEST_HARNESS = {"notebooks/sanitize.cfg"}  # nbval's settings: the teacher's test run needs them, a learner does not
DETAILS = re.compile(r"<details>\s*<summary>\s*Solution.*?</details>\s*", re.IGNORECASE | re.DOTALL)


def _source(cell: dict) -> str:
    return "".join(cell.get("source", []))


def _is_solution_runner(cell: dict) -> bool:
    return cell["cell_type"] == "code" and bool(SOLUTION_FILE.search(_source(cell)))


def _introduces(cell: dict) -> bool:
    """A short markdown line such as "The solution, checked:" that only introduces the next cell."""
    text = _source(cell).strip()
    return cell["cell_type"] == "markdown" and len(text) < 120 and "solution" in text.lower()


def student_cells(cells: list[dict], clear_outputs: bool = False) -> list[dict]:
    """The cells of a learner's copy of one notebook (see the module docstring for what goes)."""
    kept = []
    for index, cell in enumerate(cells):
        if "solution" in cell.get("metadata", {}).get("tags", []) or _is_solution_runner(cell):
            continue
        if _introduces(cell) and index + 1 < len(cells) and _is_solution_runner(cells[index + 1]):
            continue
        cell = json.loads(json.dumps(cell))
        if cell["cell_type"] == "markdown" and DETAILS.search(_source(cell)):
            text = DETAILS.sub("", _source(cell)).strip()
            if not text:
                continue
            cell["source"] = text.splitlines(keepends=True)
        if clear_outputs and cell["cell_type"] == "code":
            cell["outputs"], cell["execution_count"] = [], None
        kept.append(cell)
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


def _ignore_patterns() -> list[str]:
    gitignore = ROOT / ".gitignore"
    lines = gitignore.read_text(encoding="utf-8").splitlines() if gitignore.exists() else []
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def _ignored(relative: Path, patterns: list[str]) -> bool:
    """.gitignore's rules as this project uses them: `name/` is a folder anywhere, `/name` or `a/b` is anchored
    at the root, a bare `*.ext` matches a file name anywhere (no negations)."""
    for pattern in patterns:
        folder_only = pattern.endswith("/")
        body = pattern.rstrip("/")
        anchored = "/" in body
        body = body.lstrip("/")
        candidates = [Path(*relative.parts[:i]) for i in range(1, len(relative.parts) + (0 if folder_only else 1))]
        for candidate in candidates:
            if candidate.match(body) if not anchored else fnmatch.fnmatchcase(candidate.as_posix(), body):
                return True
    return False


def _not_ignored(paths: tuple[str, ...]) -> list[Path]:
    patterns = _ignore_patterns()
    found = []
    for name in paths:
        top = ROOT / name
        files = [top] if top.is_file() else sorted(f for f in top.rglob("*") if f.is_file())
        found += [f.relative_to(ROOT) for f in files if not _ignored(f.relative_to(ROOT), patterns)]
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
