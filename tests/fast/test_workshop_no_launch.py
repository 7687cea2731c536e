"""The workshop kit without a launch: learner copies without solutions, teacher copies, the pre-flight check's
verdicts (its real launch is in tests/test_workshop.py)."""
import json
import re
from pathlib import Path

import pytest

from helpers import REPO_ROOT as ROOT
from helpers.lessons.system import pinned
from helpers.tools import preflight, workshop

CHECK_CALL = re.compile(r"\bcheck_\w+\(")


def _notebooks(folder: Path) -> dict[str, dict]:
    return {p.name: json.loads(p.read_text(encoding="utf-8")) for p in sorted((folder / "notebooks").glob("*.ipynb"))}


def _text(notebook: dict) -> str:
    return "\n".join("".join(cell["source"]) for cell in notebook["cells"])


@pytest.fixture(scope="module")


def student_copy(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("student")
    workshop.write_copy(folder, student=True)
    return folder


FIRST_LESSONS = ("00_start_here.ipynb", "01_collectives.ipynb", "02_ddp.ipynb")


def test_student_copy_has_every_lesson_and_no_solution(student_copy):
    originals, copies = _notebooks(ROOT), _notebooks(student_copy)
    assert sorted(copies) == sorted(originals)  # catches a lesson lost on the way
    solutions = [p.name for p in (ROOT / "helpers" / "workers").glob("*_solution.py")]
    assert solutions, "the repository has solution files; otherwise this test checks nothing"
    for name in solutions:
        assert not (student_copy / "helpers" / "workers" / name).exists()
    for name, notebook in copies.items():
        text = _text(notebook)
        assert not re.search(r"<summary>\s*Solution", text, re.IGNORECASE), name
        assert "_solution.py" not in text, name
        assert not [c for c in notebook["cells"] if "solution" in c["metadata"].get("tags", [])], name


def test_student_copy_keeps_every_check_on_the_learners_work(student_copy):
    originals, copies = _notebooks(ROOT), _notebooks(student_copy)
    for name, original in originals.items():
        kept = [cell for cell in copies[name]["cells"]]
        wanted = [cell for cell in original["cells"] if "solution" not in cell["metadata"].get("tags", [])]
        # exactly the untagged cells survive, in order: every check on the learner's own work among them (catches a
        # hand-out that drops a learner's cell, or keeps an answer)
        assert ["".join(c["source"]) for c in kept] == ["".join(c["source"]) for c in wanted], name


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb")))


def test_every_answer_in_a_lesson_is_tagged_solution(name):
    """The tag removes a cell from the hand-out: a cell that runs a *_solution.py file, or holds a solution block,
    without the tag would hand the answer out."""
    cells = json.loads((ROOT / "notebooks" / name).read_text(encoding="utf-8"))["cells"]
    assert workshop.untagged_solutions(cells) == [], f"{name}: tag these cells `solution`"


def test_the_tag_check_sees_an_untagged_answer():
    cells = [{"cell_type": "code", "metadata": {}, "source": ["check_it('x_solution.py')"]},
             {"cell_type": "markdown", "metadata": {}, "source": ["<details><summary>Solution</summary>x</details>"]},
             {"cell_type": "markdown", "metadata": {"tags": ["solution"]}, "source": ["<details><summary>Solution"]},
             {"cell_type": "code", "metadata": {}, "source": ["check_it('mine.py')  # a learner's own file"]}]
    assert workshop.untagged_solutions(cells) == [0, 1]


def test_student_copy_can_clear_outputs(tmp_path):
    workshop.write_copy(tmp_path, student=True, clear_outputs=True)
    for notebook in _notebooks(tmp_path).values():
        assert all(not c.get("outputs") for c in notebook["cells"] if c["cell_type"] == "code")


def test_teacher_copy_keeps_solutions(tmp_path):
    workshop.write_copy(tmp_path, student=False)
    assert list((tmp_path / "helpers" / "workers").glob("*_solution.py"))
    assert _notebooks(tmp_path).keys() == _notebooks(ROOT).keys()
    for name, notebook in _notebooks(tmp_path).items():
        assert notebook == json.loads((ROOT / "notebooks" / name).read_text(encoding="utf-8"))


def test_copy_refuses_a_folder_with_files(tmp_path):
    (tmp_path / "precious.txt").write_text("a learner's work")
    with pytest.raises(FileExistsError, match="not empty"):
        workshop.write_copy(tmp_path, student=True)


def test_only_cells_tagged_solution_go():
    cells = [
        {"cell_type": "markdown", "metadata": {}, "source": ["Hint: use a ring."]},
        {"cell_type": "markdown", "metadata": {"tags": ["solution"]}, "source": ["<details><summary>Solution"]},
        {"cell_type": "markdown", "metadata": {}, "source": ["A learner's note that mentions the solution."]},
        {"cell_type": "code", "metadata": {"tags": ["solution", "nbval-ignore-output"]}, "source": ["answer = 42"],
         "outputs": [], "execution_count": 4},
        {"cell_type": "code", "metadata": {"execution": {"iopub.execute_input": "2026-12-06T12:20:00Z"}},
         "source": ["check_it('mine.py')"], "outputs": [], "execution_count": 5},
    ]
    kept = workshop.student_cells(cells, clear_outputs=True)
    assert "execution" not in kept[-1]["metadata"]  # no timestamps of the maintainer's run in a hand-out
    assert ["".join(c["source"]) for c in kept] == ["Hint: use a ring.", "A learner's note that mentions the solution.",
                                                    "check_it('mine.py')"]
    assert kept[-1]["execution_count"] is None


def test_preflight_says_what_to_fix(monkeypatch, capsys):
    monkeypatch.setattr(preflight, "memory_limit_bytes", lambda: 1 * preflight.GIB)
    monkeypatch.setattr(preflight, "check_launch", lambda: ("OK", "skipped in this test"))
    monkeypatch.setattr("sys.argv", ["preflight"])
    assert preflight.main() == 1  # catches a preflight that prints FIX but exits 0
    out = capsys.readouterr().out
    assert "FIX  memory" in out and "about 2 GiB" in out and "Not ready" in out


def test_pinned_version_reads_requirements(tmp_path):
    requirements = tmp_path / "requirements.txt"
    requirements.write_text("numpy==2.4.6\ntorch==2.14.1  # CPU or GPU\n")
    assert pinned("torch", requirements) == "2.14.1"  # catches a comment read as part of the version
    with pytest.raises(KeyError):
        pinned("scipy", requirements)


def test_every_lesson_in_the_student_copy_has_a_check_that_says_not_yet_on_the_starting_code(student_copy):
    # nbval re-runs these cells and compares their text, so "Not yet" here is what the learner's untouched
    # starting code really gets; catches an exercise whose check passes (or crashes) before any work is done
    lessons = {name: notebook for name, notebook in _notebooks(student_copy).items() if re.match(r"\d\d_", name)}
    assert lessons, "the student copy has lessons"
    for name, notebook in lessons.items():  # appendices (A0_...) have no exercise
        said = ["".join(o.get("text", "")) for cell in notebook["cells"] if cell["cell_type"] == "code"
                and CHECK_CALL.search("".join(cell["source"]))
                and "nbval-ignore-output" not in cell["metadata"].get("tags", [])
                for o in cell.get("outputs", []) if o["output_type"] == "stream"]
        assert any(text.startswith("Not yet: ") for text in said), f"{name}: no check says Not yet: {said}"


def test_the_student_copy_readme_has_no_maintainer_commands(student_copy):
    readme = (student_copy / "README.md").read_text()
    assert "## Start" in readme and "jupyter lab" in readme and "## The lessons" in readme
    assert "pytest" not in readme and "tests/" not in readme and "## Layout" not in readme
    # the maintainers' re-execution tool (W-2): a learner runs lessons in JupyterLab
    assert "notebook_tools" not in readme and "as the tests expect" not in readme
    assert "`%load_ext helpers` then `%%torchrun -n 2` runs a cell as a worker." in readme


def test_the_student_copy_leaves_out_nbvals_settings(student_copy):
    assert (workshop.ROOT / "notebooks" / "sanitize.cfg").exists()
    assert not (student_copy / "notebooks" / "sanitize.cfg").exists()


def test_the_student_copy_shows_no_test_harness_markers(student_copy):
    # nbval reads cell tags (nbval-ignore-output, raises-exception); a "# NBVAL_..." comment is text a learner reads
    marked = [(name, index) for name, notebook in _notebooks(student_copy).items()
              for index, cell in enumerate(notebook["cells"]) if "NBVAL" in "".join(cell["source"])]
    assert not marked, f"cells that show nbval markers to learners: {marked}"


def test_every_file_a_lesson_writes_lands_in_a_folder_a_fresh_clone_has(student_copy):
    # IPython's %%writefile does not create folders: a lesson that writes to runs/ works after lesson 00
    # made runs/ and fails for a learner who starts a fresh clone (or a student copy) at that lesson
    written = [(name, match.group(1)) for name, notebook in _notebooks(student_copy).items()
               for cell in notebook["cells"] if cell["cell_type"] == "code"
               for match in [re.match(r"%%writefile\s+(?:-a\s+)?(\S+)", "".join(cell["source"]))] if match]
    assert written, "the lessons' exercises write their files with %%writefile"
    missing = [(name, path) for name, path in written if not (student_copy / "notebooks" / path).parent.is_dir()]
    assert not missing, f"%%writefile into a folder that a fresh copy lacks: {missing}"


def test_a_copy_outside_git_takes_the_same_files_as_git_would(monkeypatch):
    # a downloaded zip has no .git: the copy then walks the folders and applies .gitignore itself; catches a
    # fallback that copies run folders, caches or learners' exercise files, or drops tracked files
    with_git = workshop._tracked(workshop.LEARNER_FILES)
    monkeypatch.setenv("PATH", "")  # no git to run
    assert sorted(workshop._tracked(workshop.LEARNER_FILES)) == sorted(with_git)


def test_preflight_notes_other_users_kernels_on_the_same_loopback():
    kernel = ["python", "-m", "ipykernel_launcher", "-f", "k.json"]
    processes = [{"username": "ana", "cmdline": kernel, "network": "net:[1]"},        # another learner, same net
                 {"username": "ben", "cmdline": kernel, "network": "net:[2]"},        # own namespace: isolated
                 {"username": "cho", "cmdline": kernel, "network": None},             # unreadable: may be shared
                 {"username": "me", "cmdline": kernel, "network": "net:[1]"},         # my own kernel
                 {"username": "dan", "cmdline": ["bash"], "network": "net:[1]"}]      # not a kernel
    assert preflight.shared_kernels(processes, "me", "net:[1]") == ["ana", "cho"]
    assert preflight.shared_kernels(processes[1:2], "me", "net:[1]") == []  # catches a check that ignores namespaces


def test_the_first_lessons_point_to_no_file_the_student_copy_lacks_and_word_checks_for_learners(student_copy):
    # SEED-CLAIMS.md lives outside the repository: a hand-out that cites its rows sends the learner to nothing.
    # Check cells say what they would catch in a learner's words ("this would fail if ..."), not a test suite's
    # ("catches a ...", "fails if ...").
    maintainer_voice = re.compile(r"#\s*(catches\b|fails if\b)", re.IGNORECASE)
    for name in FIRST_LESSONS:
        notebook = _notebooks(student_copy)[name]
        assert "SEED-CLAIMS" not in _text(notebook), name
        voiced = [line for cell in notebook["cells"] if cell["cell_type"] == "code"
                  for line in "".join(cell["source"]).splitlines() if maintainer_voice.search(line)]
        assert not voiced, f"{name}: {voiced}"


def test_lesson_00_keeps_torch_citations_in_folds(student_copy):
    # every torch file:line citation of lesson 00 stays, inside a "Where this is in torch's source" fold
    cells = _notebooks(student_copy)["00_start_here.ipynb"]["cells"]
    cited = 0
    for cell in cells:
        if cell["cell_type"] != "markdown":
            continue
        text = "".join(cell["source"])
        outside = re.sub(r"<details><summary>Where this is in torch's source</summary>.*?</details>", "", text,
                         flags=re.DOTALL)
        assert not re.search(r"\.py:\d", outside), text[:200]
        cited += len(re.findall(r"\.py:\d", text))
    assert cited >= 10, "the citations were dropped, not folded"


def test_lesson_02_links_the_exercise_file_only_after_the_cell_that_writes_it(student_copy):
    cells = _notebooks(student_copy)["02_ddp.ipynb"]["cells"]
    writer = next(i for i, c in enumerate(cells) if 'Path("my_ddp_worker.py")' in "".join(c["source"]))
    links = [i for i, c in enumerate(cells) if c["cell_type"] == "markdown"
             and "](my_ddp_worker.py)" in "".join(c["source"])]
    assert links and all(i > writer for i in links), (writer, links)
