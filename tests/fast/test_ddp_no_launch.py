"""Lesson 02's helpers without a launch: the shipped digits, the article's fixes, the step-time verdicts, torchrun's
failure report made the same on every machine."""


from helpers.kit.data import DIGITS_NAME, load
from helpers.kit.ddp import article_source
from helpers.lessons.ddp import undefined_names


def test_data_falls_back_to_the_shipped_digits():
    train_set, source = load(train=True)
    test_set, _ = load(train=False)
    assert source == DIGITS_NAME and (len(train_set), len(test_set)) == (1437, 360)
    images, labels = train_set.tensors
    assert images.shape[1:] == (1, 28, 28) and images.min() >= 0 and images.max() <= 1
    assert set(labels.tolist()) == set(range(10))


def test_article_with_every_fix_leaves_no_undefined_name():
    """The lesson checks the names the article as printed misses; here, that the fixes supply all of them."""
    assert undefined_names(article_source(["imports", "port", "gloo", "data", "cpu"])) == []


def test_step_time_reading_prints_the_protocols_verdicts(capsys):
    """Section 7 reads ddp_step_time.py's timings through verdict(): "faster" only where every round of one setting
    beat every round of the other, "not distinguishable on this machine" otherwise, wall and CPU time apart."""
    from helpers.kit.timing import NOT_DISTINGUISHABLE, Timing
    from helpers.lessons.ddp import read_step_times, step_settings

    def rounds(centre: float, spread: float) -> list[float]:
        return [(centre + spread * k) / 1e3 for k in (-2, -1, 0, 1, 2)]

    timings = {}
    for model in ("simple", "cnn"):
        names = step_settings(model)
        ddp_spread = 0.1 if model == "simple" else 3.0  # the CNN's DDP rounds overlap the one-process rounds
        for role, centre, spread in (("one", 10.0, 0.1), ("two_threads", 10.0, 0.1), ("half", 5.0, 0.1),
                                     ("quiet", 6.0, 0.1), ("python_hook", 14.5, ddp_spread), ("ddp", 14.0, ddp_spread),
                                     ("bare", 1.0, 0.1)):
            wall = rounds(centre, spread)
            two_ranks = role in ("ddp", "python_hook", "quiet", "bare")  # two ranks' CPU add up
            cpu = rounds(2 * centre if two_ranks else 3 * centre if role == "two_threads" else centre, 0.1)
            timings[names[role]] = Timing(names[role], wall, cpu)
    verdicts = read_step_times(timings, {"simple": 8070, "cnn": 20490})
    out = capsys.readouterr().out
    assert verdicts["simple"]["ddp"].faster == "simple, 1 rank, 1 thread" and not verdicts["cnn"]["ddp"].distinguishable
    assert "DDP on 2 ranks against 1 rank, 1 thread (wall): 1 rank, 1 thread is faster, 1.40x" in out
    assert f"DDP on 2 ranks against 1 rank, 1 thread (wall): {NOT_DISTINGUISHABLE}" in out
    assert not verdicts["simple"]["threads"].distinguishable and verdicts["simple"]["all-reduce cpu"].distinguishable
    # a CPU-time verdict says "uses less CPU time", never "is faster"
    assert "2 threads against 1 thread, one process: wall: " + NOT_DISTINGUISHABLE + "; CPU: 1 rank, 1 thread uses " \
        "less CPU time, 3.00x" in out
    # the all-reduce's cost compares the two Python hooks, not the built-in hook with a Python one
    assert verdicts["simple"]["all-reduce"].faster == "simple, DDP, no all-reduce"
    assert verdicts["simple"]["all-reduce"].slower == "simple, DDP, Python all-reduce hook"
    assert "communicating against computing, all-reduce alone against 1 rank's whole step (wall): all-reduce " \
        "alone is faster, 10.00x" in out
    assert "  DDP, 2 ranks" in out and "wall 14.0 ms (13.8-14.2)" in out


def test_failure_report_keeps_what_a_learner_reads_and_drops_what_changes():
    """failure_report() cuts torchrun's ChildFailedError report out of its output (a rank's own lines, which can
    arrive after it, left out) and replaces times, hosts, process ids, temporary folders, ports and absolute paths,
    so that a stored report reads the same on any machine."""
    from helpers.lessons.ddp import failure_report

    output = """[rank1]: ValueError: boom
E1206 12:34:07.140000 16342 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1)
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
/home/ana/course/helpers/workers/ddp_failure_report.py FAILED
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-06_12:34:19
  host      : node17.cluster
  rank      : 1 (local_rank: 1)
  exitcode  : 1 (pid: 16693)
  error_file: /tmp/torchelastic_8acl8vn6/22eb_s3nqy2pa/attempt_0/1/error.json
  traceback : Traceback (most recent call last):
    File "/home/ana/.venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py", line 83, in wrapper
  RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by peer \
[127.0.0.1]:18323. Signal 15 (SIGTERM) received by PID 16406
============================================================
[rank1]: ValueError: a late line of rank 1's own output, after the report"""
    report = failure_report(output)
    assert report.startswith("torch.distributed.elastic.multiprocessing.errors.ChildFailedError:")
    assert "helpers/workers/ddp_failure_report.py FAILED" in report.splitlines()[2]
    for gone in ("ana", "node17", "12:34", "16693", "16406", "torchelastic_8acl8vn6", "18323", "/__w/", "ValueError"):
        assert gone not in report, gone
    assert 'File "torch/distributed/c10d_logger.py", line 83' in report and "[third_party/gloo" in report
    assert "<torchrun's temporary folder>/attempt_0/1/error.json" in report and "rank      : 1" in report


def test_coloured_diff_folds_the_hunks_before_the_lines_that_matter():
    """Section 2's diff shows main()'s changes first and folds the helper functions, under 40 lines in view."""
    from helpers.kit import WORKERS
    from helpers.lessons.ddp import coloured_diff

    whole = coloured_diff(WORKERS / "ddp_single.py", WORKERS / "ddp_train.py", context=0).data
    folded = coloured_diff(WORKERS / "ddp_single.py", WORKERS / "ddp_train.py", context=0,
                           fold_before="rank, world_size, device = init_distributed()", fold_summary="the rest").data
    shown, rest = folded.split("<details>")
    assert whole.count("<div") == folded.count("<div")  # every line of the diff is still there
    assert "DistributedSampler(train_set" in shown and "DDP(build_model" in shown and "def evaluate" in rest
    assert shown.count("<div") <= 45 and rest.startswith("<summary>the rest (")


def test_failure_reports_run_again_when_the_raising_rank_dies_of_sigabrt(monkeypatch, capsys):
    """torchrun_failure_reports runs the two launches one after the other, runs the pair again when a report names
    SIGABRT (torch's teardown of a gloo group killing the rank that raised), at most `attempts` times, and returns the
    first pair without it."""
    from helpers.lessons import ddp

    aborted = {"without @record": "exitcode  : -6 (pid: 1)  (SIGABRT)", "with @record": "exitcode  : 1"}
    plain = {"without @record": "exitcode  : 1", "with @record": "exitcode  : 1"}
    pairs, calls = [], []

    def one_at_a_time(commands, timeout):
        assert len(commands) == 1  # never both launches at once
        calls.append(*commands)
        (name,) = commands
        return {name: pairs[(len(calls) - 1) // 2][name]}

    monkeypatch.setattr(ddp, "_run_together", one_at_a_time)
    pairs[:] = [aborted, aborted, plain]
    assert ddp.torchrun_failure_reports() == plain and len(calls) == 6
    assert capsys.readouterr().out.count("running the pair again") == 2  # every rerun is said before it starts
    pairs[:], calls[:] = [aborted, aborted, aborted, plain], []
    assert ddp.torchrun_failure_reports(attempts=2) == aborted and len(calls) == 4  # gives up, shows what it got
