"""benchmarks/cycle_time.py's summary: closed-form checks of the medians and the ratios it prints."""
from benchmarks.cycle_time import CONFIGS, DEFAULT, render, summarize


def test_summary_is_the_median_over_launches_of_each_launch_median():
    samples = {"gloo/default": {"compute": [[1.0, 2.0, 9.0], [4.0, 5.0, 6.0], [0.5, 0.5, 0.7]]}}
    assert summarize(samples) == {"gloo/default": {"compute": 2.0}}  # launches' medians 2, 5, 0.5
    # one long launch does not outvote two others: the pooled median here would be 1.0
    long_launch = {"mpi/default": {"compute": [[1.0, 1.0, 1.0, 1.0, 1.0], [5.0], [6.0]]}}
    assert summarize(long_launch)["mpi/default"]["compute"] == 5.0


def test_render_gives_the_tuned_over_default_ratio_per_controller():
    medians = {f"gloo/{DEFAULT}": {c: 0.200 for c in CONFIGS}, "gloo/20 ms": {c: 0.150 for c in CONFIGS}}
    text = render(medians, ["gloo"], 20.0, reps=3, rounds=2, steps=10)
    row = next(line for line in text.splitlines() if line.startswith("| pipesgd width 2 + int8 |"))
    assert row.split(" | ")[1:] == ["200", "150", "0.75 |"]
    assert "HOROVOD_CYCLE_TIME=20" in text
