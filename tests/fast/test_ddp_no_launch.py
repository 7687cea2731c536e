"""Lesson 02's helpers without a launch: the shipped digits, the article's fixes, the step-time explanation."""


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


def test_step_time_explanation_says_why_a_share_is_over_100_percent(capsys):
    """Section 8's printed share (DDP - no all-reduce) / (DDP - 1 rank at batch 32) exceeds 100% when the control
    without all-reduce ran faster than 1 rank at batch 32: the line must say so, and whether the blocks' spread
    covers it."""
    from helpers.lessons.ddp import STEP_SETTINGS, explain_step_times

    parameters = {"simple": 8070, "cnn": 20490}

    def medians(quiet_ms: float, spread: float, parameters: dict) -> tuple:
        step_ms, blocks = {}, {}
        values = {"one": 10.0, "half": 5.5, "quiet": quiet_ms, "ddp": 7.0, "two_threads": 8.0}
        for model in parameters:
            for key, value in values.items():
                step_ms[f"{model}, {STEP_SETTINGS[key]}"] = value
                blocks[f"{model}, {STEP_SETTINGS[key]}"] = [(value - spread / 2) / 1e3, value / 1e3,
                                                            (value + spread / 2) / 1e3]
            step_ms[f"{model}, all_reduce alone, {parameters[model]} floats"] = 0.3
            blocks[f"{model}, all_reduce alone, {parameters[model]} floats"] = [0.3e-3] * 3
        return step_ms, parameters, blocks

    speedup = explain_step_times(*medians(5.4, 0.5, parameters))
    out = capsys.readouterr().out
    assert "removes 107%" in out and "cannot tell them apart" in out and speedup["cnn\n2 ranks"] == 10.0 / 7.0
    explain_step_times(*medians(4.0, 0.1, parameters))
    out = capsys.readouterr().out
    assert "removes 200%" in out and "not noise between blocks alone" in out
    explain_step_times(*medians(6.0, 0.1, parameters))
    assert "over 100%" not in capsys.readouterr().out
