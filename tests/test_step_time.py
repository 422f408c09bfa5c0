"""benchmarks/step_time.py, the step-time benchmark users run under horovodrun: a tiny real run
(one rank) prints the table and writes the JSON; the rows' arithmetic from made-up samples (the
slowest rank's median, host time beyond compute alone, wire bytes per update with split_batch's
two all-reduces); the before/after ratio table."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks import step_time
from launcher import ROOT, rank_env


@pytest.mark.multiprocess
def test_a_tiny_run_prints_the_table_and_writes_every_row(tmp_path):
    out = tmp_path / "step_time.json"
    proc = subprocess.run([sys.executable, "benchmarks/step_time.py", "--small", "--configs", "w2-int8",
                           "w2-split-int8", "auto", "--rounds", "2", "--steps", "2", "--out", str(out)],
                          cwd=ROOT, env=rank_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for config in ("horovod", "w2-int8", "w2-split-int8", "auto"):
        assert f"| {config} | " in proc.stdout
    assert "auto chose: width=1 compression=none" in proc.stdout       # one rank: nothing to communicate
    result = json.loads(out.read_text())
    rows = {r["config"]: r for r in result["rows"]}
    assert list(rows) == ["horovod", "w2-int8", "w2-split-int8", "auto"]
    assert rows["horovod"]["speedup"] == 1.0 and all(r["step_s"] > 0 for r in rows.values())
    assert rows["w2-int8"]["wire"] is None                              # one rank sends nothing
    samples = result["per_rank"][0]["samples"]
    assert set(samples) == {"compute", "compute-split", *rows}
    assert all(len(s["wall"]) == 4 for s in samples.values())           # 2 rounds of 2 updates


def ranked(wall: dict, main: dict, wire: dict) -> list:
    """Two ranks' samples: rank 1's walls 10 ms longer, both ranks' CPU alike."""
    def rank(extra: float) -> dict:
        return {"samples": {k: {"wall": [w + extra for w in v], "main": main[k], "other": [0.001] * len(v)}
                            for k, v in wall.items()}, "wire": wire}
    return [rank(0.0), rank(0.01)]


def test_rows_take_the_slowest_rank_host_time_beyond_compute_and_wire_per_update():
    wall = {"compute": [0.1] * 3, "compute-split": [0.11] * 3, "horovod": [0.3, 0.2, 0.4], "w2-int8": [0.12] * 3,
            "w2-split-int8": [0.15, 0.16, 0.14]}
    main = {"compute": [0.09] * 3, "compute-split": [0.1] * 3, "horovod": [0.1] * 3, "w2-int8": [0.095] * 3,
            "w2-split-int8": [0.11] * 3}
    # per rank: bytes sent, a float32 ring's bytes, over the segment's calls
    wire = {"w2-int8": [252, 1000], "w2-split-int8": [504, 2000]}
    rows = {r["config"]: r for r in step_time.summarize(ranked(wall, main, wire), ["horovod", "w2-int8", "w2-split-int8"],
                                                         None)}
    assert rows["horovod"]["step_s"] == pytest.approx(0.31)             # median of the slower rank's
    assert rows["w2-int8"]["speedup"] == pytest.approx(0.31 / 0.13)
    assert rows["w2-int8"]["host_s"] == pytest.approx(0.005)            # 95 ms of the thread beyond 90
    assert rows["w2-split-int8"]["host_s"] == pytest.approx(0.01)       # beyond two half-batch calls' 100
    assert rows["w2-int8"]["wire"] == pytest.approx(0.252)
    assert rows["w2-split-int8"]["wire"] == pytest.approx(0.252)        # one all-reduce per update
    assert rows["horovod"]["wire"] is None


def test_compare_prints_after_over_before():
    def result(step: float, host: float) -> dict:
        return {"rows": [{"config": "w2", "step_s": step, "host_s": host}, {"config": "horovod", "step_s": 0.3,
                                                                           "host_s": 0.0}]}
    text = step_time.compare(result(0.2, 0.004), result(0.15, 0.002))
    assert "| w2 | 200.0 | 150.0 | 0.750 | 4.00 | 2.00 | 0.500 |" in text
    assert "| horovod | 300.0 | 300.0 | 1.000 | 0.00 | 0.00 | - |" in text


def test_unknown_configurations_and_odd_batches_are_refused(capsys):
    assert step_time.select(["w2-int8,w2"]) == ["horovod", "w2", "w2-int8"]
    for argv, message in ((["--configs", "w3"], "unknown configuration(s) w3"), (["--batch", "7"], "must be even")):
        with pytest.raises(SystemExit):
            step_time.parse(argv)
        assert message in capsys.readouterr().err


@pytest.mark.multiprocess
def test_a_model_zoo_run_builds_one_configuration_at_a_time(tmp_path):
    out = tmp_path / "step_time.json"
    proc = subprocess.run([sys.executable, "benchmarks/step_time.py", "--model", "resnet50", "--batch", "2", "--size",
                           "64", "--configs", "w2-int8", "--rounds", "2", "--steps", "1", "--out", str(out)],
                          cwd=ROOT, env=rank_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "resnet50 (25.6M parameters in 161 tensors, 102.2 MB of float32 gradient), 2 images of 64x64" in proc.stdout
    result = json.loads(out.read_text())
    assert result["args"]["one_at_a_time"] and [r["config"] for r in result["rows"]] == ["horovod", "w2-int8"]
    assert all(len(s["wall"]) == 2 for s in result["per_rank"][0]["samples"].values())


def test_model_zoo_arguments(capsys):
    args = step_time.parse(["--model", "gpt2"])
    assert (args.batch, args.size, args.one_at_a_time) == (8, 1024, True)
    args = step_time.parse(["--model", "bert-base", "--batch", "4", "--size", "64", "--no-one-at-a-time"])
    assert (args.batch, args.size, args.one_at_a_time) == (4, 64, False)
    assert (step_time.parse([]).batch, step_time.parse([]).one_at_a_time) == (256, False)
    for argv, message in ((["--model", "resnet18"], "unknown --model 'resnet18'; valid: linear, resnet50, bert-base"),
                          (["--model", "gpt2", "--size", "2048"], "--size must be within 1..1024 for gpt2"),
                          (["--size", "64"], "--size is a model-zoo input's size: add --model"),
                          (["--small", "--model", "gpt2"], "--small sets Linear layers")):
        with pytest.raises(SystemExit):
            step_time.parse(argv)
        assert message in capsys.readouterr().err
