"""The emulated-cluster study's arithmetic, without a cluster: the calibration's link rates, the
timing model's inputs and predictions from a made-up launch (split_batch's two calls per update
included), the targets, and the tables a record renders to; the same for the hierarchical kind
(2 ranks per host). The cluster itself: tests/test_cluster.py."""
from __future__ import annotations

import argparse
import dataclasses
import time

import pytest

from benchmarks import step_time, throughput
from benchmarks.throughput_analysis import Launch, calls, fit_model, hierarchical_model, hierarchical_rows, speedup, targets
from benchmarks.throughput_plan import CommFit, fit_comm, plan_rate, rate_bps, second_rate
from benchmarks.throughput_report import render, render_hierarchical
from benchmarks.throughput_worker import CODECS, HIERARCHICAL, LOOPS, TRAINING, reduction_of, segments_for

GRAD = 16_000_000          # bytes of float32 gradient
# 12.5 MB of gradient on 2 ranks: 100 Mbit on the wire; all-reduce = 20 ms + wire at 80% of the rate.
FIT = CommFit(fixed=0.02, wire=100e6, efficiency=0.8)
# comm ~4x compute: Horovod hides a little, width 2 sits at the all-reduce, int8 is comm-bound.
STEP = {"horovod": 0.95, "w1": 1.0, "w1-layer": 0.95, "w2": 0.81, "w2-fp16": 0.6, "w2-bf16": 0.6,
        "w2-truncate16": 0.6, "w2-int8": 0.49, "w2-int4": 0.32, "w2-split-int8": 0.57, "w2-split-int4": 0.41}
COMM = {"none": 0.8, "fp16": 0.55, "bf16": 0.55, "truncate16": 0.55, "int8": 0.45, "int4": 0.3}
CPU = {"none": 0.02, "fp16": 0.04, "bf16": 0.04, "truncate16": 0.1, "int8": 0.1, "int4": 0.1}


def made_up(step: dict = STEP, comm: dict = COMM, compute: float = 0.2, configs=TRAINING) -> Launch:
    """A 2-rank launch: rank 1 always the slower by 1 ms; CPU equal on both ranks; the threads burn
    nothing idle, and Horovod's take none of a collective's CPU."""
    med = {"compute": compute, "forward": 0.07, "backward": 0.12, "update": 0.01, "add": GRAD * 0.2e-9,
           "ar-small": 0.002, "comm-none-quarter": comm["none"] / 4 + 0.0015, "idle": 0.25, "cpu/idle": 0.0,
           "cpu-hvd/idle": 0.0, **step, **{f"comm-{c}": t for c, t in comm.items()},
           **{f"loop-{c}": step[f"w2-{c}" if c != "none" else "w2"] for c in ("none", *CODECS)}}
    for key in ("compute", *TRAINING, *LOOPS):
        med.update({f"cpu-main/{key}": 0.9 * compute, f"cpu-other/{key}": 0.02, f"cpu-hvd/{key}": 0.0,
                    f"cpu-machine/{key}": 2 * med[key]})
    med.update({f"cpu/comm-{c}": x for c, x in CPU.items()})
    med.update({f"cpu-hvd/comm-{c}": 0.0 for c in CPU})

    def rank(extra: float) -> dict:
        samples = {k: [v + (extra if not k.startswith("cpu") else 0.0)] * 3 for k, v in med.items()}
        return {"samples": samples, "our_cpu_s": 5.0, "machine_busy_s": 12.5, "machine_total_s": 20.0}

    raw = {"ranks": 2, "grad_bytes": GRAD, "layers": 4, "configs": list(configs), "per_rank": [rank(0.0), rank(0.001)],
           "wire_ratio": {k: 1.0 for k in configs if k != "horovod"}, "auto": None}
    return Launch(2, "155mbit", 1024, raw)


def test_the_calibration_fit_splits_fixed_cost_from_wire_rate():
    # 250 Mbit/s: 20 ms + 100e6 / (0.8 * 250e6) = 0.52 s; 2.5 Gbit/s: 20 ms + 50 ms
    fit = fit_comm(2, 12.5e6, [(250e6, 0.52), (2.5e9, 0.07)])
    assert (fit.fixed, fit.wire, fit.efficiency) == pytest.approx((0.02, 100e6, 0.8), rel=1e-9)
    # a fixed cost below zero (noise) is clamped: the line through the origin
    clamped = fit_comm(2, 12.5e6, [(250e6, 0.5), (2.5e9, 0.04)])
    assert clamped.fixed == 0.0 and clamped.comm(250e6) == pytest.approx(0.5, rel=0.01)
    with pytest.raises(ValueError, match="did not slow down"):
        fit_comm(2, 12.5e6, [(250e6, 0.05), (2.5e9, 0.07)])


def test_rate_for_an_aim_solves_fixed_plus_wire_over_rate():
    # aim 1, compute 0.2 s: 0.2 = 0.02 + 100e6 / (0.8 R) -> R = 694.4 Mbit/s, rounded to 3 digits
    assert plan_rate(FIT, 1.0, 0.2) == ("694mbit", pytest.approx(1.0006, abs=1e-4))
    assert plan_rate(FIT, 5.0, 0.2)[0] == "128mbit"   # 1.0 = 0.02 + 125e6 / R
    # the second calibration rate: where the largest aim lands at full link use (fixed guessed 30 ms)
    assert second_rate(2, 12.5e6, 2.5e9, 0.07, 0.2, 5.0) == "103mbit"
    assert second_rate(2, 12.5e6, 2.5e9, 0.07, 0.2, 0.25) == "625mbit"  # at most a quarter of the first


def test_calibration_measures_twice_then_plans_every_aim():
    fit = CommFit(fixed=0.02, wire=128e6, efficiency=0.8)   # made_up's 16 MB on 2 ranks
    rates = []

    def fake_launch(setting, args, configs, quick):
        assert quick and configs == () and setting.batch == 512 and args.rounds == 2
        rates.append(setting.rate)
        # rank 1 adds 1 ms: compute 0.2 s, then 0.22 s (the machine got busier)
        la = made_up(comm=dict(COMM, none=fit.comm(rate_bps(setting.rate)) - 0.001),
                     compute=0.199 if len(rates) == 1 else 0.219)
        la.rate = setting.rate
        return la

    args = argparse.Namespace(aims=[1.0, 5.0], batch=512, rounds=3, steps=2, comm_reps=1)
    cal = throughput.calibrate(args, launch=fake_launch)
    # first 2.5 Gbit/s: 84 ms, fixed guessed 84 - 51.2 = 32.8 ms; aim 5 x 0.2 s: 128e6 / 0.9672 -> 132 Mbit/s
    assert rates == ["2500mbit", "132mbit"]
    assert cal["fit"] == pytest.approx(dataclasses.asdict(fit), rel=1e-9) and cal["compute_s"] == pytest.approx(0.21)
    # aim 1: 128e6 / (0.8 x 0.19) = 842 Mbit/s; aim 5: 128e6 / (0.8 x 1.03) = 155 Mbit/s
    assert [(a, r) for a, r, _ in cal["plans"]] == [(1.0, "842mbit"), (5.0, "155mbit")]


def test_model_gets_parts_only_and_reproduces_them():
    la = made_up()
    model = fit_model(la)
    assert model.comm["none"] == pytest.approx(la.comm("none"), rel=0.05)   # the link fit
    for c in CODECS:                                                         # each codec's cost
        assert model.comm[c] == pytest.approx(la.comm(c), rel=1e-9)
    assert model.step["w2-int8"] == pytest.approx(la.comm("int8"), rel=1e-9)  # comm-bound
    # Horovod's overlap: (L-1)/L of the backward pass over the all-reduce; pipesgd's default plan
    # gives this 4-layer model one bucket per layer, hence the same h
    h = 0.75 * 0.121 / model.comm["none"]
    assert model.overlap == pytest.approx({"horovod": h, "w1": h, "w1-layer": h}, rel=1e-9)
    assert model.step["w1"] == pytest.approx(la.compute + (1 - h) * model.comm["none"], rel=1e-9)


def test_a_split_batch_update_is_two_calls_whose_one_all_reduce_starts_in_the_fresh_half_s_backward():
    la = made_up()
    assert calls("w2-split-int8") == 2 and calls("w2-int8") == 1
    # one all-reduce of 0.451 s per update, after the fresh half's forward pass (half of 0.071 s)
    assert la.bound("w2-split-int8") == pytest.approx(0.451 + 0.071 / 2)
    assert la.bound("w2-int8") == pytest.approx(0.451)
    model = fit_model(la)
    assert model.step["w2-split-int8"] == pytest.approx(model.comm["int8"] + 0.071 / 2, rel=1e-9)
    # compute off the cores (no interference): the fresh forward, then width 2's over the rest
    for compute in (0.2, 0.8):     # int4's all-reduce (0.3 s) longer, then shorter than the rest of compute
        off = made_up(compute=compute)
        off.raw["offloaded"] = True
        model = fit_model(off)
        fresh_forward = 0.071 / 2
        rest = compute + 0.001 - fresh_forward
        assert model.step["w2-split-int4"] == pytest.approx(fresh_forward + max(rest, model.comm["int4"]))
        assert off.bound("w2-split-int4") == pytest.approx(max(compute + 0.001, fresh_forward + 0.3 + 0.001), abs=2e-3)
    assert la.loop("w2-split-int8") is None and la.loop("w2-int8") == pytest.approx(0.491)


def test_targets_come_from_the_launch():
    la = made_up()
    found = {t.name: t for t in targets([la], [fit_model(la)])}
    int8 = next(t for name, t in found.items() if "int8 (EF) >= 3.5x" in name)
    assert not int8.met and int8.measured == f"{0.951 / 0.491:.2f}x"
    # every plain pipelined row within 10% of its bound; split int8's: 0.4865 / 0.571 = 85%, missed
    assert all(t.met for name, t in found.items() if "within 10% of its bound" in name and "split" not in name)
    split = next(t for name, t in found.items() if "split_batch + int8 (EF) within 10%" in name)
    assert not split.met and split.measured == "bound / step = 85%"
    cpu = {c: next(t for name, t in found.items() if name.endswith(f" {c} all-reduce's CPU on a rank < 20% of compute"))
           for c in CODECS}
    assert cpu["fp16"].met and not cpu["int8"].met                      # 0.1 s against 20% of 0.201 s
    w1 = next(t for name, t in found.items() if "width 1 within 3%" in name)
    assert not w1.met and w1.measured == f"width 1 / Horovod = {1.001 / 0.951:.3f}"
    assert speedup(la, "w2-split-int4") == pytest.approx(0.951 / 0.411)


def test_the_accurate_mode_s_rows_run_at_every_comm_compute_of_the_two_host_study():
    configs = ["horovod", "w2-int8", "w2-split-int8"]
    aimed = {aim: throughput.launch_configs(configs, throughput.Setting(2, "1gbit", 1024, aim))
             for aim in (0.25, 1.0, 2.5, 5.0)}
    assert all(launched == configs for launched in aimed.values())
    assert throughput.launch_configs(configs, throughput.Setting(2, "1gbit", 1024)) == configs
    assert throughput.launch_configs(configs, throughput.Setting(4, "1gbit", 512)) == configs[:2]


def test_a_record_renders_one_row_per_configuration_the_targets_and_the_plot(tmp_path):
    two = made_up(configs=("horovod", "w2", "w2-int8", "w2-split-int8"))
    settings = [throughput.Setting(2, "155mbit", 1024, 5.0)]
    record = {"machine": "test", "elapsed_s": 60.0, "load_before": [0.5, 0, 0], "load_after": [1.0, 0, 0],
              "args": {"controller": "gloo", "layers": 4, "dim": 1000, "rounds": 1, "steps": 2, "horovod_cycle_ms": 20},
              "calibration": None, "settings": [dataclasses.asdict(s) for s in settings],
              "launches": [dataclasses.asdict(two)]}
    text = render(record, tmp_path / "throughput.png")
    assert (tmp_path / "throughput.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| pipesgd width 2 + split_batch + int8 (EF) | 571 | 1.67x | 487 | 85% |  |" in text
    assert "| pipesgd width 2 + int8 (EF) | 491 | 1.94x | 451 | 92% | 491 (1.00) |" in text
    assert "pipesgd width 1 |" not in text and "HOROVOD_CYCLE_TIME=20" in text
    # comm/compute 0.801 / 0.201 = 3.99 misses the aim 5 by 20%
    assert "| 2 hosts, 155mbit: comm/compute within 20% of its aim 5 | **missed** | 3.99 |" in text


# The hierarchical kind: 2 hosts x 2 ranks; links: alpha 1 ms, 12.5 MB/s between hosts (a host's link
# carries both local ranks' exchanges), 1 GB/s inside a host. Made-up times, medians per rank.
HIER_STEP = {"compute": 0.1, "horovod": 0.9, "w2-flat-int8": 0.45, "w2-hier-int8": 0.24, "w2-flat-int4": 0.25,
             "w2-hier-int4": 0.13}
HIER_ALONE = {"comm-none": 0.8, "comm-int8": 0.42, "comm-hier-int8": 0.22, "comm-int4": 0.24, "comm-hier-int4": 0.12}


def made_up_hierarchical(grad: int = 8_396_800) -> Launch:
    small, large = 4096, 1 << 21
    med = {**HIER_STEP, **HIER_ALONE, "add": grad * 0.25e-9, "codec/int8": grad * 1e-9, "codec/int4": grad * 1e-9,
           f"cross-a2a/{small}": 0.001 + 2 * small / 12.5e6, f"cross-a2a/{large}": 0.001 + 2 * large / 12.5e6,
           "local-a2a": 4 * (grad // 8) / 1e9,
           **{f"payload/comm-{r}": b for r, b in (("int8", 1.6e6), ("hier-int8", 0.8e6), ("int4", 0.8e6),
                                                  ("hier-int4", 0.4e6))}}

    def rank(local_rank: int, extra: float) -> dict:
        samples = {k: [v + (0 if k.startswith("payload") else extra)] * 3 for k, v in med.items()}
        if local_rank == 0:  # the host's link: flat sends about twice hierarchical's bytes
            samples.update({f"host-bytes/{k}": [b] * 3 for k, b in (("horovod", 13e6), ("w2-flat-int8", 3.3e6),
                            ("w2-hier-int8", 1.66e6), ("w2-flat-int4", 1.7e6), ("w2-hier-int4", 0.86e6))})
        return {"samples": samples}

    raw = {"ranks": 4, "local_size": 2, "cross_size": 2, "grad_bytes": grad, "layers": 2,
           "buckets": [grad // 8, grad // 8], "configs": ["horovod", *HIERARCHICAL],
           "per_rank": [rank(0, 0.0), rank(1, 0.0), rank(0, 0.0), rank(1, 0.002)]}
    return Launch(2, "202mbit", 1024, raw)


def test_the_hierarchical_kind_runs_flat_and_hierarchical_rows_at_rates_from_its_aims():
    assert step_time.options("w2-hier-int8") == {"width": 2, "compression": "int8", "hierarchical": True}
    assert step_time.options("w2-flat-int4")["hierarchical"] is False and "hierarchical" not in step_time.options("w2")
    assert [reduction_of(k) for k in HIERARCHICAL] == ["int8", "hier-int8", "int4", "hier-int4"]
    assert segments_for(["horovod", *HIERARCHICAL]) == ("compute", "horovod", *HIERARCHICAL)  # no engine-free loops
    # 2 x Linear(1024, 1024): 8.4 MB; a ring over 4 ranks sends 1.5 x 67.2 Mbit = 100.8 Mbit per host link,
    # in 1x (then 5x) the 100 ms of device time
    args = argparse.Namespace(layers=2, dim=1024, device_times=[0.03, 0.07], aims=[1.0, 5.0], batch=1024)
    assert [(s.rate, s.target) for s in throughput.hierarchical_settings(args)] == [("1010mbit", 1.0), ("202mbit", 5.0)]


def test_the_hierarchical_model_takes_its_links_from_the_launch():
    la = made_up_hierarchical()
    model = hierarchical_model(la)
    # Horovod's ring over 4 ranks on the link between hosts: 6 alpha + 1.5 M / B + 0.75 M gamma
    assert model["horovod"] == pytest.approx(6 * 0.001 + 1.5 * 8_396_800 / 12.5e6 + 0.75 * 8_396_800 * 0.25e-9)
    # flat int8, per 4.2 MB bucket: 6 alpha + 2 x the node's link carrying L (N-L)/N r M + 3/4 M (gamma + c)
    r, m = 516 / 2048, 4_198_400
    bucket = 6 * 0.001 + 2 * 2 * 2 / 4 * r * m / 12.5e6 + 0.75 * m * (0.25e-9 + 1e-9)
    assert model["w2-flat-int8"] == pytest.approx(2 * bucket, rel=1e-6)
    assert model["w2-hier-int8"] < 0.55 * model["w2-flat-int8"]         # half the bytes cross between hosts
    rows = {r["config"]: r for r in hierarchical_rows(la)}
    # a width-2 step at max(compute, reduction); Horovod's at compute + its all-reduce (the slowest rank's)
    assert rows["w2-hier-int8"]["model_step"] == pytest.approx(max(0.102, model["w2-hier-int8"]))
    assert rows["horovod"]["model_step"] == pytest.approx(0.102 + model["horovod"])
    assert rows["w2-hier-int8"]["step"] == pytest.approx(0.242) and rows["w2-hier-int8"]["alone"] == pytest.approx(0.222)
    # both hosts' links per step, and what all ranks' reductions sent to the other host
    assert rows["w2-flat-int8"]["host_bytes"] == 6.6e6 and rows["w2-hier-int8"]["counted"] == pytest.approx(4 * 0.8e6)


def test_the_hierarchical_targets_and_table():
    la = made_up_hierarchical()
    record = {"machine": "test", "elapsed_s": 60.0, "settings": [dataclasses.asdict(throughput.Setting(2, "202mbit",
                                                                                                        1024, 5.0))],
              "args": {"layers": 2, "dim": 1024, "device_times": [0.03, 0.07], "horovod_cycle_ms": 20, "rounds": 3,
                       "steps": 10}, "launches": [dataclasses.asdict(la)]}
    text = render_hierarchical(record)
    where = "202mbit (aim 5x, measured 7.86x)"   # comm-none 0.802 s over compute 0.102 s
    assert f"| {where}: hierarchical int8's bytes between hosts <= 1/2 of flat's | met | 0.500 counted" in text
    assert f"| {where}: hierarchical int8 >= 1.5x faster than flat int8 | met | 1.87x |" in text
    # 0.242 s against max(compute 0.102, its all-reduce alone 0.222): 1.09, within 10%
    assert f"| {where}: hierarchical int8 within 10% of max(compute, its all-reduce alone) | met | step / bound = 1.09 |" \
        in text
    assert f"| {where} | w2-hier-int8 | 242 | 182 | 222 | 182 | 3.32 | 3.20 | 3.73x |" in text
    assert f"| {where}: w2-hier-int8 within 15% of the model | **missed** | step / model = 1.33 |" in text
    assert "2 x Linear(1024, 1024), 8.4 MB" in text and "4 of 6 targets met" in text


def test_a_launch_relays_rank_0s_progress_lines_to_stderr_as_they_come(tmp_path, capsys):
    progress, seen = tmp_path / "progress.log", ""
    with throughput.relayed(progress):
        with open(progress, "a") as rank0:  # as the worker appends, after the relay has started
            rank0.write("    round 1/3 done\n")
        deadline = time.monotonic() + 10  # the relay looks every second
        while "round 1/3" not in seen and time.monotonic() < deadline:
            time.sleep(0.05)
            seen += capsys.readouterr().err
        assert seen == "    round 1/3 done\n"  # during the launch, not at its end
        with open(progress, "a") as rank0:
            rank0.write("    round 2/3 done\n")
    with open(progress, "a") as late:
        late.write("after the launch\n")  # the relay stopped with its launch
    assert capsys.readouterr().err == "    round 2/3 done\n"
