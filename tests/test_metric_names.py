"""benchmarks/metric_names.py's summary: the rows and the unnamed / named ratio it prints."""
from benchmarks.metric_names import render


def test_render_gives_each_setting_its_row_and_the_unnamed_over_named_ratio():
    medians = {"unnamed": {"step": 0.260, "others": 0.045}, "named": {"step": 0.208, "others": 0.015}}
    text = render(medians, "133mbit", "int4", before=1500, reps=3, steps=30)
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| `hvd.allreduce")]
    assert [r[1:] for r in rows] == [["260", "45 |"], ["208", "15 |"]]
    assert 'name="metric"' in rows[1][0] and "name=" not in rows[0][0]
    assert "Unnamed / named step: **1.25**" in text
    assert "1500 such all-reduces" in text
