"""What `make bench` launches (benchmarks/throughput_plan.py and the driver's arguments): the link
rate for a comm/compute aim from a calibration, in closed form; the configurations a subset
runs; the report of a subset with its aims. No cluster, no root."""
from __future__ import annotations

import dataclasses

import pytest

from benchmarks import throughput
from benchmarks.throughput_plan import (MAX_RATE, CommFit, fit_comm, off_aim, plan_rate, rate_bps, second_rate,
                                        select_configs, tc_rate, wire_bits)
from benchmarks.throughput_worker import AUTO, CODECS, TRAINING, segments_for
from test_throughput_analysis import COMM, CPU, STEP, made_up

# 12.5 MB of gradient on 2 ranks: 100 Mbit on the wire; all-reduce = 20 ms + wire at 80% of the rate.
FIT = CommFit(fixed=0.02, wire=100e6, efficiency=0.8)


def test_the_calibration_fit_splits_fixed_cost_from_wire_rate():
    # 250 Mbit/s: 20 ms + 100e6 / (0.8 * 250e6) = 0.52 s; 2.5 Gbit/s: 20 ms + 50 ms
    fit = fit_comm(2, 12.5e6, [(250e6, 0.52), (2.5e9, 0.07)])
    assert (fit.fixed, fit.wire, fit.efficiency) == pytest.approx((0.02, 100e6, 0.8), rel=1e-9)
    # more points: least squares, exact on points from the line
    assert fit_comm(2, 12.5e6, [(r, FIT.comm(r)) for r in (1e8, 3e8, 1e9)]).fixed == pytest.approx(0.02, rel=1e-9)
    # a fixed cost below zero (noise) is clamped: the line through the origin
    clamped = fit_comm(2, 12.5e6, [(250e6, 0.5), (2.5e9, 0.04)])
    assert clamped.fixed == 0.0 and clamped.comm(250e6) == pytest.approx(0.5, rel=0.01)
    with pytest.raises(ValueError, match="two different rates"):
        fit_comm(2, 12.5e6, [(250e6, 0.52), (250e6, 0.5)])
    with pytest.raises(ValueError, match="did not slow down"):
        fit_comm(2, 12.5e6, [(250e6, 0.05), (2.5e9, 0.07)])


def test_ring_all_reduce_sends_two_n_minus_one_over_n_of_the_gradient():
    assert wire_bits(2, 12.5e6) == 100e6
    assert wire_bits(4, 12.5e6) == 150e6   # 2 * 3/4
    assert fit_comm(4, 12.5e6, [(250e6, 0.52), (2.5e9, 0.07)]).efficiency == pytest.approx(1.2)


def test_rate_for_an_aim_solves_fixed_plus_wire_over_rate():
    # aim 1, compute 0.2 s: 0.2 = 0.02 + 100e6 / (0.8 R) -> R = 694.4 Mbit/s, rounded to 3 digits
    assert plan_rate(FIT, 1.0, 0.2) == ("694mbit", pytest.approx(1.0006, abs=1e-4))
    # aim 5: 1.0 = 0.02 + 125e6 / R -> 127.55 Mbit/s; aim 0.25: 0.05 = 0.02 + ... -> 4.17 Gbit/s
    assert plan_rate(FIT, 5.0, 0.2)[0] == "128mbit"
    assert plan_rate(FIT, 0.25, 0.2) == ("4170mbit", pytest.approx(0.25, rel=0.005))
    # out of reach: the fixed 20 ms alone is more than 0.05 x 0.2 s: the fastest rate, reported far off
    rate, predicted = plan_rate(FIT, 0.05, 0.2)
    assert rate_bps(rate) == MAX_RATE and off_aim(predicted, 0.05)
    with pytest.raises(ValueError):
        plan_rate(FIT, 0.0, 0.2)


def test_the_second_calibration_rate_sits_where_the_largest_aim_lands():
    # first: 70 ms at 2.5 Gbit/s, 40 ms of it wire at full use: fixed guessed 30 ms;
    # aim 5 x 0.2 s: 1.0 = 0.03 + 100e6 / R -> R = 103.1 Mbit/s
    assert second_rate(2, 12.5e6, 2.5e9, 0.07, 0.2, 5.0) == "103mbit"
    # small aims only: at most a quarter of the first rate, so the two rates stay far apart
    assert second_rate(2, 12.5e6, 2.5e9, 0.07, 0.2, 0.25) == "625mbit"
    # a first all-reduce faster than its wire time (tbf's 512 kB burst): no negative fixed cost
    assert second_rate(2, 12.5e6, 2.5e9, 0.03, 0.2, 5.0) == "100mbit"


def test_calibration_measures_twice_then_plans_every_aim():
    fit = CommFit(fixed=0.02, wire=128e6, efficiency=0.8)   # made_up's 16 MB on 2 ranks
    rates = []

    def fake_launch(setting, args, quick, progress, configs):
        assert quick and configs == () and setting.batch == 512 and args.rounds == 2
        rates.append(setting.rate)
        # made_up adds 1 ms on the slower rank: compute 0.2 s, then 0.22 s (the machine got busier)
        compute = 0.199 if len(rates) == 1 else 0.219
        la = made_up(STEP, dict(COMM, none=fit.comm(rate_bps(setting.rate)) - 0.001), CPU, compute=compute)
        la.rate = setting.rate
        return la

    args = throughput.argparse.Namespace(aims=[1.0, 5.0], batch=512, rounds=3, steps=2, comm_reps=1)
    cal = throughput.calibrate(args, None, launch=fake_launch)
    # first 2.5 Gbit/s: 84 ms, fixed guessed 84 - 51.2 = 32.8 ms; aim 5 x 0.2 s: 128e6 / 0.9672 -> 132 Mbit/s
    assert rates == ["2500mbit", "132mbit"]
    # compute: the mean of both launches, 0.21 s
    assert cal["fit"] == pytest.approx(dataclasses.asdict(fit), rel=1e-9) and cal["compute_s"] == pytest.approx(0.21)
    # aim 1: 128e6 / (0.8 x 0.19) = 842 Mbit/s; aim 5: 128e6 / (0.8 x 1.03) = 155 Mbit/s
    assert [(a, r) for a, r, _ in cal["plans"]] == [(1.0, "842mbit"), (5.0, "155mbit")]
    assert [p for _, _, p in cal["plans"]] == pytest.approx([1.0, 5.0], rel=0.005)


def test_tc_rates_round_to_three_digits_and_parse_back():
    assert [tc_rate(x) for x in (3456e6, 623.4e6, 15.53e6, 155e3, 5e9)] == \
        ["3460mbit", "623mbit", "15.5mbit", "0.155mbit", "5000mbit"]
    assert [rate_bps(r) for r in ("620mbit", "2.5gbit", "800kbit", "5000mbit")] == [620e6, 2.5e9, 800e3, 5e9]
    for bad in ("620mbps", "fast", "620", "-1mbit"):
        with pytest.raises(ValueError, match="tc rate"):
            rate_bps(bad)
    with pytest.raises(ValueError):
        tc_rate(0.0)


def test_a_launch_misses_its_aim_beyond_20_percent():
    assert off_aim(1.2, 1.0) is None and off_aim(0.8, 1.0) is None and off_aim(5.9, 5.0) is None
    assert off_aim(1.25, 1.0) == "misses its aim 1 by 25% (above)"
    assert off_aim(0.19, 0.25) == "misses its aim 0.25 by 24% (below)"


def test_config_subsets_keep_horovod_and_what_auto_is_judged_against():
    assert select_configs(None) == (*TRAINING, AUTO)
    assert select_configs(["w2-int8", "w2"]) == ("horovod", "w2", "w2-int8")   # the worker's order
    assert select_configs(["w1,w2-int4"]) == ("horovod", "w1", "w2-int4")      # comma lists too
    assert select_configs([]) == ("horovod",)
    assert select_configs(["auto"]) == ("horovod", "w1", "w2", "w2-fp16", "w2-int8", "w2-int4", AUTO)
    with pytest.raises(ValueError, match="unknown configuration.*int9.*valid: horovod, w1, w1-layer, w2, "):
        select_configs(["w2", "int9"])


def test_the_worker_runs_compute_the_chosen_rows_and_their_loops():
    assert segments_for(["horovod", "w2", "w2-int8"]) == ("compute", "horovod", "w2", "w2-int8", "loop-none",
                                                          "loop-int8")
    assert segments_for(["horovod", "w2"], quick=True) == ("compute", "horovod", "w2")  # controller check
    assert segments_for([], quick=True) == ("compute",)                                  # calibration
    assert len(segments_for([*TRAINING, AUTO])) == 1 + len(TRAINING) + 1 + 1 + len(CODECS)


@pytest.mark.parametrize("argv, message", [
    (["--configs", "w2", "int9"], "unknown configuration(s) int9; valid: horovod"),
    (["--aims", "1", "0"], "--aims must be > 0"),
    (["--settings", "620mbit"], "not RATE:BATCH: '620mbit'"),
    (["--settings", "620mbps:1024"], "not a tc rate in bit/s: '620mbps'"),
    (["--four-hosts", "fast:512"], "not a tc rate"),
    (["--horovod-cycle-ms", "-1"], "--horovod-cycle-ms must be >= 0 (0: Horovod's default), got -1"),
])
def test_bad_arguments_stop_before_any_launch_and_say_why(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(throughput, "measure", lambda args: pytest.fail("launched"))
    with pytest.raises(SystemExit):
        throughput.main(argv)
    assert message in capsys.readouterr().err


def subset(configs: tuple) -> "throughput.Launch":
    """A made-up launch that ran only ``configs``: the other rows' samples are gone."""
    la = made_up(STEP, COMM, CPU)
    la.raw["configs"] = list(configs)
    gone_codecs = [c for c in CODECS if f"w2-{c}" not in configs]
    gone = {k for k in TRAINING if k not in configs} | {f"{kind}-{c}" for c in gone_codecs
                                                        for kind in ("comm", "codec", "loop")}
    for r in la.raw["per_rank"]:
        for key in list(r["samples"]):
            if key.split("/")[-1] in gone:
                del r["samples"][key]
    return la


def record(launches, settings, calibration=None) -> dict:
    args = {"controller": "gloo", "layers": 4, "dim": 1000, "rounds": 1, "steps": 2, "controller_check": ""}
    return {"machine": "test", "args": args, "elapsed_s": 60.0, "load_before": [0, 0, 0], "load_after": [0, 0, 0],
            "settings": [dataclasses.asdict(s) for s in settings],
            "launches": [dataclasses.asdict(la) for la in launches],
            "pair": [], "calibration": calibration}


def test_the_report_of_a_subset_holds_its_rows_and_each_launchs_aim():
    configs = ("horovod", "w2", "w2-int8")
    la = subset(configs)  # comm/compute 0.801 / 0.201 = 3.99
    hit, miss = throughput.Setting(2, "155mbit", 1024, "aimed at comm ~4x compute", 4.0), \
        throughput.Setting(2, "155mbit", 1024, "aimed at comm ~5x compute", 5.0)
    calibration = {"compute_s": 0.2, "points": [["250mbit", 0.2, 0.52], ["2500mbit", 0.2, 0.07]],
                   "fit": dataclasses.asdict(FIT), "plans": [[4.0, "155mbit", 4.0], [5.0, "125mbit", 5.0]]}
    text = throughput.render(record([la, la], [hit, miss], calibration), None)
    assert "pipesgd width 2 + int8 (EF) |" in text and "pipesgd width 1 |" not in text
    assert "pipesgd width 2 + fp16" not in text
    assert "**comm/compute 3.99** (aim 4: within 20%)" in text
    assert "**comm/compute 3.99** (**misses its aim 5 by 20% (below)**)" in text
    assert "| 2 hosts, 155mbit: comm/compute within 20% of its aim 5 | **missed** | 3.99 | comm/compute 3.99 " \
           "misses its aim 5 by 20% (below); compute alone 201 ms, float32 all-reduce alone 801 ms |" in text
    assert "- **Width 1 against Horovod**: not run (`--configs`)." in text
    assert "two short launches at 250mbit and 2500mbit" in text and "4x: 155mbit (predicted 4.00)" in text
    # fixed --settings: no aim, no calibration, no aim target
    fixed = throughput.render(record([la], [throughput.Setting(2, "155mbit", 1024, "rate set by --settings")]), None)
    assert "fixed by `--settings`" in fixed and "of its aim" not in fixed


def test_horovods_cycle_is_set_for_every_rank_or_left_to_horovod(capsys, monkeypatch):
    monkeypatch.delenv("HOROVOD_CYCLE_TIME", raising=False)
    assert throughput.horovod_cycle_env(20.0) == {"HOROVOD_CYCLE_TIME": "20"}
    assert throughput.horovod_cycle_env(2.5) == {"HOROVOD_CYCLE_TIME": "2.5"}
    assert throughput.horovod_cycle_env(0.0) == {}
    # Horovod's default asked for while this environment sets the variable: every rank would inherit it
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "5")
    monkeypatch.setattr(throughput, "measure", lambda args: pytest.fail("launched"))
    with pytest.raises(SystemExit):
        throughput.main(["--horovod-cycle-ms", "0"])
    assert "HOROVOD_CYCLE_TIME=5 is set in this environment: unset it" in capsys.readouterr().err
    assert throughput.horovod_cycle_env(20.0) == {"HOROVOD_CYCLE_TIME": "20"}   # the option wins


def test_the_report_says_how_horovods_cycle_was_set():
    la = subset(("horovod", "w2"))
    fixed = [throughput.Setting(2, "155mbit", 1024, "rate set by --settings")]
    rec = record([la], fixed)
    assert "Horovod's default cycle (`HOROVOD_CYCLE_TIME` unset)" in throughput.render(rec, None)  # an older record
    rec["args"]["horovod_cycle_ms"] = 20.0
    assert "`HOROVOD_CYCLE_TIME=20` for every rank, Horovod's synchronous optimizer included" in \
        throughput.render(rec, None)


def test_a_run_with_compute_off_the_cores_has_its_own_section_record_and_plot():
    la = subset(("horovod", "w2"))
    la.raw["offloaded"] = True
    for r in la.raw["per_rank"]:
        r["samples"].update({"device-forward": [0.07], "device-backward": [0.13]})
    rec = record([la], [throughput.Setting(2, "155mbit", 1024, "rate set by --settings")])
    assert throughput.render(rec, None).startswith("## Throughput on the emulated cluster")  # the flag decides
    rec["args"].update(offload_compute=True, batch=1024)
    text = throughput.render(rec, None)
    assert text.startswith("## Throughput with compute off the cores (`benchmarks/throughput.py --offload-compute`")
    # fixed --settings: each launch timed the real passes itself
    assert "ms: 155mbit: forward 70, backward 130), then every step waited" in text and "not a GPU measurement" in text
    assert "`build/throughput-offloaded.json`" in text and "(img/throughput-offloaded.png)" in text
    assert "- **Compute off the cores.**" in text and "computing alone (off the cores) a rank used" in text
    assert throughput.section_key(True) == "throughput-offloaded" and throughput.section_key(False) == "throughput"
    assert throughput.record_path("throughput-offloaded", no_doc=True).name == "throughput-offloaded-nodoc.json"
    assert throughput.image_path("throughput").name == "throughput.png"


def test_compute_off_the_cores_waits_what_the_calibration_timed_in_every_launch():
    def fake_launch(setting, args, quick, progress, configs):
        assert throughput.offload_flags(args, setting.batch) == ["--offload-compute"]  # it times the real passes
        fit = CommFit(fixed=0.02, wire=128e6, efficiency=0.8)          # made_up's 16 MB on 2 ranks
        la = made_up(STEP, dict(COMM, none=fit.comm(rate_bps(setting.rate))), CPU)
        la.rate = setting.rate
        forward = 0.06 if setting.rate == "2500mbit" else 0.08       # the second launch's compute was slower
        for r in la.raw["per_rank"]:
            r["samples"].update({"device-forward": [forward], "device-backward": [2 * forward]})
        return la

    args = throughput.argparse.Namespace(aims=[5.0], batch=512, rounds=3, steps=2, comm_reps=1, offload_compute=True)
    cal = throughput.calibrate(args, None, launch=fake_launch)
    assert cal["device_s"] == pytest.approx([0.07, 0.14])
    args.device_times = cal["device_s"]
    assert throughput.offload_flags(args, 512) == ["--offload-compute", "--device-times", "0.070000,0.140000"]
    assert throughput.offload_flags(args, 256) == ["--offload-compute"]  # another batch: its own times
    assert throughput.offload_flags(throughput.argparse.Namespace(offload_compute=False), 512) == []
    two, four = subset(("horovod", "w2")), subset(("horovod", "w2"))
    two.batch, four.hosts, four.batch = 512, 4, 256
    for la in (two, four):
        la.raw["offloaded"] = True
        for r in la.raw["per_rank"]:
            r["samples"].update({"device-forward": [0.03], "device-backward": [0.05]})
    rec = record([two, four], [throughput.Setting(2, "155mbit", 512, "aimed at comm ~5x compute", 5.0),
                               throughput.Setting(4, "155mbit", 256, "4 ranks on 2 cores")],
                 {"compute_s": 0.2, "points": [["2500mbit", 0.2, 0.07], ["132mbit", 0.2, 1.0]],
                  "fit": dataclasses.asdict(FIT), "plans": [[5.0, "155mbit", 5.0]], "device_s": [0.07, 0.14]})
    rec["args"].update(offload_compute=True, batch=512)
    assert ("their mean: forward 70 ms, backward 140 ms), and every step of every launch of batch 512 waited as long "
            "instead; the 4-host launch (batch 256) timed its own: forward 30 ms, backward 50 ms") in \
        throughput.render(rec, None)


@pytest.mark.parametrize("argv, message", [
    (["--offload-compute", "--device-times", "0.1"], "not FORWARD,BACKWARD in seconds (each >= 0): '0.1'"),
    (["--offload-compute", "--device-times", "0.1,-1"], "not FORWARD,BACKWARD"),
    (["--offload-compute", "--device-times", "nan,0.1"], "not FORWARD,BACKWARD"),
    (["--device-times", "0.1,0.2"], "--device-times sets the waits of --offload-compute: pass both, or neither"),
])
def test_the_worker_refuses_device_times_it_cannot_wait(argv, message, capsys, monkeypatch):
    from benchmarks import throughput_worker

    monkeypatch.setattr(throughput_worker, "RankBench", lambda args: pytest.fail("started"))
    base = ["--rounds", "1", "--steps", "1", "--comm-reps", "1", "--batch", "8", "--dim", "8", "--layers", "1"]
    with pytest.raises(SystemExit):
        throughput_worker.main(base + argv)
    assert message in capsys.readouterr().err


def test_the_findings_say_whether_the_bare_schedule_missed_where_the_engine_did():
    # int8: step 0.6 s against its bound 0.451 s (the all-reduce), the engine-free loop as slow
    la = made_up(dict(STEP, **{"w2-int8": 0.6}), COMM, CPU)
    assert throughput.loop_misses([la]) == "Of the 1 width-2 rows more than 10% over their bound, the engine-free " \
                                           "loop was too in 1."
    for r in la.raw["per_rank"]:
        r["samples"]["loop-int8"] = [0.46] * 3                  # the bare schedule reached its bound
    assert throughput.loop_misses([la]).endswith("the engine-free loop was too in 0.")
    assert throughput.loop_misses([made_up(STEP, COMM, CPU)]) == "Every width-2 row came within 10% of its bound."
