"""Lesson 00's reading of torchrun's own failure report (helpers.lessons.mp_spawn): the report is cut out of
torchrun's output, its Root Cause entry read field by field, and this machine's paths shortened. The runs
themselves (a bare torchrun with and without @record, the fork probe) are lesson 00's cells, checked by nbval."""
from pathlib import Path

from helpers import REPO_ROOT
from helpers.lessons.mp_spawn import POISONED, _shorter, failure_report, root_cause, root_cause_fields

OUTPUT = f"""step 2: sum 2.000
[rank1]: ZeroDivisionError: float division by zero
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
helpers/workers/broken_demo.py FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-12-06_12:41:46
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 27828)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 27828
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-06_12:41:46
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : 1 (pid: 27829)
  error_file: /tmp/torchelastic_ab12/0f_xy/attempt_0/1/error.json
  traceback : Traceback (most recent call last):
    File "{REPO_ROOT}/helpers/workers/broken_demo.py", line 19, in scale
  ZeroDivisionError: float division by zero
============================================================
"""


def test_the_report_and_its_root_cause_are_cut_out_of_torchruns_output():
    report = failure_report(OUTPUT)
    assert report.startswith("=" * 60) and report.endswith("=" * 60) and "[rank1]" not in report
    cause = root_cause(report)
    assert cause.startswith("Root Cause (first observed failure):") and "SIGTERM" not in cause
    fields = root_cause_fields(report)
    assert fields["rank"] == "1 (local_rank: 1)" and fields["exitcode"] == "1 (pid: 27829)"
    assert fields["error_file"].endswith("error.json") and fields["traceback"] == "Traceback (most recent call last):"


def test_no_report_reads_as_empty():
    assert failure_report("Traceback (most recent call last):\nValueError: x\n") == ""
    assert root_cause("") == "" and root_cause_fields("") == {}


def test_paths_of_this_machine_are_shortened():
    shortened = _shorter(OUTPUT)
    assert str(REPO_ROOT) not in shortened and '"helpers/workers/broken_demo.py", line 19' in shortened
    assert "<torchrun's temporary folder>/error.json" in shortened and "/tmp/torchelastic" not in shortened


def test_the_poison_message_is_the_one_torch_raises():
    import torch.cuda

    assert POISONED in Path(torch.cuda.__file__).read_text(encoding="utf-8")


def test_torchruns_workers_write_each_line_whole(monkeypatch, capsys):
    """The workers share one pipe: with PYTHONUNBUFFERED set, a print's line and newline are two writes and two ranks'
    lines glue ("step 0: sum 1.333step 0: sum 1.333", as a learner saw in lesson 00). The terminal run drops it."""
    import subprocess

    from helpers.launcher import api
    from helpers.lessons import mp_spawn

    seen = {}

    class Finished:
        returncode = 1

        def __init__(self, command, env, **_):
            seen.update(env=env)
            self.stdout = iter(["step 0: sum 1.333\n"])

        def wait(self, timeout=None):
            return 1

        def kill(self):
            pass

    monkeypatch.setenv("PYTHONUNBUFFERED", "1")
    monkeypatch.setattr(api, "stop_launch_server", lambda before: None)
    monkeypatch.setattr(subprocess, "Popen", Finished)
    outputs = mp_spawn.torchrun_in_a_terminal("helpers/workers/broken_demo.py", {"plain": []})
    assert "PYTHONUNBUFFERED" not in seen["env"] and str(REPO_ROOT) in seen["env"]["PYTHONPATH"]
    assert outputs == {"plain": "step 0: sum 1.333\n"} and "[plain] step 0: sum 1.333\n" in capsys.readouterr().out
