"""Maintainers' tool: give every lesson the kernelspec JupyterLab writes, so that opening one does not mark it modified.

    python -m helpers.tools.kernelspec            # rewrites notebooks/*.ipynb where needed, lists them
    python -m helpers.tools.kernelspec --check    # exit 1 if any notebook differs (tests/fast/test_kernelspec.py)

JupyterLab (ipykernel's kernel.json) names the python3 kernel "Python 3 (ipykernel)"; a notebook stored with
"Python 3" is rewritten on open and shows as modified. Only metadata.kernelspec changes.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from helpers import REPO_ROOT

KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}


def fix(notebook: Path, write: bool = True) -> bool:
    """Set the kernelspec; return True if it differed (and, with write, rewrite the file)."""
    data = json.loads(notebook.read_text(encoding="utf-8"))
    if data.get("metadata", {}).get("kernelspec") == KERNELSPEC:
        return False
    if write:
        data.setdefault("metadata", {})["kernelspec"] = dict(KERNELSPEC)
        notebook.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report; exit 1 if any notebook differs")
    args = parser.parse_args()
    changed = [path for path in sorted((REPO_ROOT / "notebooks").glob("*.ipynb")) if fix(path, write=not args.check)]
    for path in changed:
        print(f"{path.relative_to(REPO_ROOT)}: kernelspec {'differs' if args.check else 'set'}")
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    sys.exit(main())
