"""Lessons 10 (meshes) and 11 (beyond your laptop): each lesson's main line and hand-out, read from the notebook."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = {10: ROOT / "notebooks" / "10_meshes.ipynb", 11: ROOT / "notebooks" / "11_at_scale.ipynb"}


def _main_line(notebook: dict) -> str:
    text = "\n".join("".join(c["source"]) for c in notebook["cells"] if c["cell_type"] == "markdown")
    return re.sub(r"<details>.*?</details>", "", text, flags=re.DOTALL)


@pytest.mark.parametrize("lesson", [10, 11])
def test_the_lesson_keeps_its_main_line_short_and_its_citations_folded(lesson):
    notebook = json.loads(NOTEBOOKS[lesson].read_text())
    main = _main_line(notebook)
    assert len(main.split()) <= 3500, len(main.split())
    citations = re.findall(r"[\w/]+\.(?:py|cpp|h)(?::\d+|`?,? lines? \d+)", main)
    assert len(citations) <= 3, citations
    everything = json.dumps(notebook)
    for absent in ("tests/", "docs/facilitator", "facilitator.md", "SEED-CLAIMS", "stored run", "4 December",
                   "the solution's in this copy"):
        assert absent not in everything, absent  # a student copy has none of these
    for cell in notebook["cells"]:  # no listing over 40 lines in the main line, in a code cell or in its output
        assert cell["cell_type"] == "markdown" or len("".join(cell["source"]).splitlines()) <= 40
        for output in cell.get("outputs", []):
            listing = "".join(output.get("data", {}).get("text/plain", []))
            if listing.startswith(("def ", '"""')):
                assert len(listing.splitlines()) <= 40, listing[:80]
