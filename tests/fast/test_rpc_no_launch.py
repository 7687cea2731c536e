"""Lesson 05's helpers without a launch."""
from __future__ import annotations

from helpers.kit.rpc import worker_name


def test_worker_names_by_rank():
    assert [worker_name(rank) for rank in range(3)] == ["ps", "trainer1", "trainer2"]


def test_the_lesson_keeps_its_main_line_short_its_citations_folded_and_its_hand_out_clean():
    """The core path (issue 33): main-line prose (markdown outside <details>) at most 3,500 words and 3 source
    citations; no listing over 40 lines in a code cell; nothing a student copy lacks."""
    import json
    import re

    from helpers import REPO_ROOT

    notebook = json.loads((REPO_ROOT / "notebooks" / "05_rpc.ipynb").read_text(encoding="utf-8"))
    markdown = "\n".join("".join(c["source"]) for c in notebook["cells"] if c["cell_type"] == "markdown")
    main = re.sub(r"<details>.*?</details>", "", markdown, flags=re.S)
    citations = re.findall(r"[\w/]+\.(?:py|cpp|h):\d+", main)
    assert len(main.split()) <= 3500 and len(citations) <= 3, (len(main.split()), citations)
    # the exercise's own starting file (%%writefile) is the learner's code to edit, not a listing to read
    assert all(len("".join(c["source"]).splitlines()) <= 40 for c in notebook["cells"]
               if c["cell_type"] == "code" and not "".join(c["source"]).startswith("%%writefile"))
    text = json.dumps(notebook)
    for absent in ("SEED-CLAIMS", "tests/test_", "tests/fast", "docs/facilitator", "in this copy"):
        assert absent not in text, absent


def test_the_counter_check_reads_whether_add_kept_its_sleeps():
    """Review 05-2: without add()'s sleeps nothing overlaps and no lock is needed, so a serial, lockless counter
    would pass on its count alone; the check reads the learner's source for both sleeps."""
    from helpers import WORKERS
    from helpers.lessons.rpc import _sleeps_missing

    solution = (WORKERS / "rpc_counter_solution.py").read_text()
    assert not _sleeps_missing(solution)
    assert not _sleeps_missing(solution.replace("time.sleep(0.1)  # slow", "time.sleep( 0.1 )  # slow"))
    assert _sleeps_missing(solution.replace("            time.sleep(0.01)\n", ""))
    assert _sleeps_missing(solution.replace("        time.sleep(0.1)  # slow", "        pass  # slow"))
