"""The pre-flight check's real launch; the rest of the workshop kit (learner and teacher copies, the pre-flight
check's verdicts) launches nothing and is tested in tests/fast/test_workshop_no_launch.py."""
from helpers.tools import preflight


def test_preflight_passes_here_and_launches(capsys):
    status, text = preflight.check_launch()
    assert status == "OK", text  # a real 2-rank launch with an all_reduce
    assert preflight.check_loopback()[0] == "OK"
    assert preflight.check_runs_folder()[0] == "OK"

