"""The throughput benchmark's analysis (benchmarks/throughput_analysis.py) on a made-up launch
whose numbers are chosen by hand: bounds, the timing model's inputs and predictions, the targets
and the cause it names. No cluster, no root: the cluster itself is tests/test_cluster.py."""
from __future__ import annotations

import pytest

from benchmarks.throughput_analysis import (Launch, auto_target, bucket_overlap, cause, extra_cpu, fit_model, phase_rates,
                                           speedup, targets, width1_buckets)
from benchmarks.throughput_worker import AUTO, CODECS, LOOPS, TRAINING

GRAD = 16_000_000          # bytes of float32 gradient
ROW = GRAD // 4 // 2       # an int8-sized chunk for 2 ranks (scales left out: round numbers)


def made_up(step: dict, comm: dict, comm_cpu: dict, compute: float = 0.2, auto: dict = None,
            idle_cpu: float = None, horovod_cpu: dict = None) -> Launch:
    """A 2-rank launch: rank 1 is always the slower by 1 ms, CPU numbers equal on both ranks.
    ``idle_cpu``: the threads' CPU over a 0.25 s idle segment (None: a record without one).
    ``horovod_cpu``: Horovod's threads' share of a collective's or segment's CPU, by key ("idle",
    "comm-int8", "w2-int8", ...; None: a record from before the worker told them apart)."""
    med = {"compute": compute, "forward": 0.07, "backward": 0.12, "update": 0.01, "add": GRAD * 0.2e-9,
           "ar-small": 0.002, "comm-none-quarter": comm["none"] / 4 + 0.0015, "a2a-int8": 0.1, "ag-int8": 0.1,
           "tcp-exchange": 0.05, **step, **{f"comm-{c}": t for c, t in comm.items()},
           **{f"codec-{c}": 0.03 for c in CODECS}, **{f"loop-{c}": step[f"w2-{c}" if c != "none" else "w2"]
                                                    for c in ("none", *CODECS)}}
    for key in ("compute", *TRAINING, *LOOPS, *([AUTO] if AUTO in step else [])):
        med[f"cpu-main/{key}"] = 0.9 * compute
        med[f"cpu-other/{key}"] = 0.02
        med[f"cpu-machine/{key}"] = 2 * med[key]
    med.update({f"cpu/comm-{c}": x for c, x in comm_cpu.items()})
    if idle_cpu is not None:
        med.update({"idle": 0.25, "cpu/idle": idle_cpu})
    med.update({f"cpu-hvd/{k}": x for k, x in (horovod_cpu or {}).items()})

    def rank(extra: float) -> dict:
        samples = {k: [v + (extra if not k.startswith("cpu") else 0.0)] * 3 for k, v in med.items()}
        return {"samples": samples, "our_cpu_s": 5.0, "machine_busy_s": 12.5, "machine_total_s": 20.0}

    raw = {"ranks": 2, "grad_bytes": GRAD, "layers": 4, "row_bytes": ROW, "per_rank": [rank(0.0), rank(0.001)],
           "wire_ratio": {k: 1.0 for k in TRAINING if k != "horovod"}, "int8_profile": [], "auto": auto}
    return Launch(2, "155mbit", 1024, raw)


# comm ~4x compute: Horovod hides a little, width 2 sits at the all-reduce, int8 is comm-bound.
STEP = {"horovod": 0.95, "w1": 1.0, "w1-layer": 0.95, "w2": 0.81, "w2-fp16": 0.6, "w2-bf16": 0.6,
        "w2-truncate16": 0.6, "w2-int8": 0.49, "w2-int4": 0.32}
COMM = {"none": 0.8, "fp16": 0.55, "bf16": 0.55, "truncate16": 0.55, "int8": 0.45, "int4": 0.3}
CPU = {"none": 0.02, "fp16": 0.04, "bf16": 0.04, "truncate16": 0.1, "int8": 0.1, "int4": 0.1}


def test_slowest_rank_bound_speedup_and_rates():
    la = made_up(STEP, COMM, CPU)
    assert la.median("w2") == pytest.approx(0.811)           # the slower rank's
    assert la.bound("w2-int8") == pytest.approx(0.451)        # max(compute 0.201, int8 all-reduce 0.451)
    assert speedup(la, "w2-int8") == pytest.approx(0.951 / 0.491)
    assert la.horovod_hidden() == pytest.approx((0.201 + 0.801 - 0.951) / 0.801)
    assert la.foreign_share() == pytest.approx(1 - 10 / 12.5)  # ours: 5 + 5 CPU s of 12.5 busy
    rates = phase_rates(la)
    assert rates["alltoall"] == pytest.approx(ROW * 8 / 0.101)
    assert rates["plain TCP"] == pytest.approx(ROW * 8 / 0.051)


def test_model_gets_parts_only_and_reproduces_them():
    la = made_up(STEP, COMM, CPU)
    model = fit_model(la)
    # The link is fitted from the float32 all-reduces and the add; it reproduces them closely.
    assert model.comm["none"] == pytest.approx(la.comm("none"), rel=0.05)
    # Each codec's cost makes the model's compressed all-reduce equal the measured one.
    for c in CODECS:
        assert model.comm[c] == pytest.approx(la.comm(c), rel=1e-9)
    # Pipelined, comm-bound: the all-reduce.
    assert model.step["w2-int8"] == pytest.approx(la.comm("int8"), rel=1e-9)
    # Horovod's overlap: (L-1)/L of the backward pass over the all-reduce (3/4 * 0.121 / ~0.8);
    # pipesgd's default plan gives this 4-layer model one bucket per layer, hence the same h.
    h = 0.75 * 0.121 / model.comm["none"]
    assert model.overlap == pytest.approx({"horovod": h, "w1": h, "w1-layer": h}, rel=1e-9)
    assert model.step["w1"] == pytest.approx(la.compute + (1 - h) * model.comm["none"], rel=1e-9)


def test_width1_overlap_follows_the_buckets():
    # one bucket: nothing hidden; the last bucket's share is never hidden; the window is the
    # backward pass after the first bucket is ready
    assert bucket_overlap([1.0], 0.1, 0.2) == 0.0
    assert bucket_overlap([0.25, 0.75], 10.0, 0.2) == pytest.approx(0.25)
    assert bucket_overlap([0.25, 0.25, 0.5], 0.1, 0.3) == pytest.approx(0.1 * 0.75 / 0.3)
    buckets = width1_buckets(4, 4 * (1024 * 1024 + 1024) * 4)
    assert buckets["horovod"] == buckets["w1"] == buckets["w1-layer"] == pytest.approx([0.25] * 4)
    assert width1_buckets(2, 2 * (64 * 64 + 64) * 4)["w1"] == [1.0]  # 33 KB: under the first bucket's 1 MiB


def test_compute_bound_codec_is_blamed_on_the_cpu_and_comm_bound_on_the_all_reduce():
    fast = dict(COMM, int8=0.15)                              # int8 all-reduce shorter than compute
    la = made_up(dict(STEP, **{"w2-int8": 0.32}), fast, CPU)
    assert cause(la, "w2-int8").startswith("CPU:")            # compute 0.201 + 0.1 CPU > 0.151
    assert cause(made_up(STEP, COMM, CPU), "w2-int8").startswith("the all-reduce:")
    # where the record tells Horovod's threads apart, the CPU cause gives their share of a step's
    assert "20 ms CPU per step (compute thread" in cause(la, "w2-int8")
    told = made_up(dict(STEP, **{"w2-int8": 0.32}), fast, CPU, horovod_cpu={"w2-int8": 0.012})
    assert "20 ms CPU per step, 12 ms of it Horovod's (compute thread 180 ms)" in cause(told, "w2-int8")


def test_targets_are_the_issues_and_name_the_misses():
    la = made_up(STEP, COMM, CPU)
    found = {t.name: t for t in targets([la], {0: fit_model(la)})}
    int8 = next(t for name, t in found.items() if "int8 (EF) >= 3.5x" in name)
    assert not int8.met and int8.measured == f"{0.951 / 0.491:.2f}x" and int8.cause
    int4 = next(t for name, t in found.items() if "int4 (EF) >= 4.5x" in name)
    assert not int4.met and int4.measured == f"{0.951 / 0.321:.2f}x"  # 2.96x
    # every pipelined row is within 10% of its bound (int8: 0.451 / 0.491 = 92%)
    assert all(t.met for name, t in found.items() if "within 10%" in name)
    # CPU per all-reduce against 20% of compute (0.201 s): none and the 16-bit codecs pass, 0.1 s does not
    cpu = {c: next(t for name, t in found.items() if name.endswith(f" {c} all-reduce's CPU on a rank < 20% of compute"))
           for c in CODECS}
    assert cpu["fp16"].met and not cpu["int8"].met and "encode + decode" in cpu["int8"].cause
    # width 1 / Horovod = 1.001 / 0.951: missed, with both overlaps named
    w1 = next(t for name, t in found.items() if "width 1 within 3%" in name)
    assert not w1.met and w1.measured == f"width 1 / Horovod = {1.001 / 0.951:.3f}" and "Horovod hid" in w1.cause
    assert not any("auto" in name or ">= 1.25x" in name for name in found)
    assert sum("within 15% of the model" in name for name in found) == 1


def decided(width: int, compression: str) -> dict:
    return {"step": 5, "seconds": 9.0, "measurements": {"compute_s": 0.2, "reduction_s": {"none": 0.8},
                                                         "reduction_cpu_s": {"none": 0.02}},
            "decision": {"width": width, "compression": compression, "reason": "the rule", "predicted_s": {}}}


def test_auto_is_judged_against_the_fastest_configuration_it_could_choose():
    # It chose int4 and ran as fast as the fixed int4 row (the fastest of w1, w2, fp16, int8, int4).
    good = auto_target(made_up(dict(STEP, auto=0.33), COMM, CPU, auto=decided(2, "int4")))
    assert good.met and good.measured == "chose pipesgd width 2 + int4 (EF); auto / fastest (pipesgd width 2 + " \
                                         f"int4 (EF)) = {0.331 / 0.321:.2f}"
    # It chose int8: 0.49 s against int4's 0.32 s is 53% slower: missed, with the reason it gave.
    bad = auto_target(made_up(dict(STEP, auto=0.49), COMM, CPU, auto=decided(2, "int8")))
    assert not bad.met and "491 ms" in bad.cause and "the rule" in bad.cause
    la = made_up(dict(STEP, auto=0.81), COMM, CPU, auto=decided(2, "none"))
    assert la.auto_choice() == "w2"
    assert made_up(STEP, COMM, CPU, auto=decided(1, "none")).auto_choice() == "w1"


def test_interference_bills_only_the_cpu_beyond_the_threads_background():
    # compute alone: other threads 0.02 s CPU per 0.201 s step; int8 all-reduce 0.151 s, 0.1 s CPU
    la = made_up(STEP, dict(COMM, int8=0.15), CPU)
    x = 0.1 - 0.02 / 0.201 * 0.151
    assert extra_cpu(la, "int8") == pytest.approx(x)
    model = fit_model(la)
    assert model.step["w2-int8"] == pytest.approx(0.201 + x / la.core_share())  # compute-bound: compute + X
    assert extra_cpu(made_up(STEP, COMM, dict(CPU, none=0.01)), "none") == 0.0  # under the background: nothing


def test_cpu_miss_names_what_the_threads_burn_idle():
    def t16(la: Launch):
        found = {t.name: t for t in targets([la], {0: fit_model(la)})}
        return next(t for name, t in found.items()
                    if name.endswith(" truncate16 all-reduce's CPU on a rank < 20% of compute"))

    # truncate16: 90 ms on the rank's threads (the whole is judged: 45% of compute, missed), over its
    # 551 ms, threads that burn 0.1 core idle (25.1 ms per 251 ms idle segment): 55 ms of it, the
    # codec 31 ms (the slower rank's), the rest 4 ms
    miss = t16(made_up(STEP, COMM, dict(CPU, truncate16=0.09), idle_cpu=0.0251))
    assert not miss.met and miss.measured == "90 ms = 45% of compute 201 ms"
    assert "alone took 31 ms" in miss.cause and "burn 55 ms with nothing to do" in miss.cause
    assert miss.cause.endswith("CPU (4 ms) is its transport, copies and sum")
    # threads that burn more idle over as long than the all-reduce's whole CPU: said so
    busy_idle = t16(made_up(STEP, COMM, dict(CPU, truncate16=0.09), idle_cpu=0.05))
    assert busy_idle.cause.endswith("more than its 90 ms: what it costs here is the threads' background")
    # the model bills the all-reduce 90 - 55 = 35 ms; threads that burn nothing idle: all 90 ms
    assert extra_cpu(made_up(STEP, COMM, dict(CPU, truncate16=0.09), idle_cpu=0.0251), "truncate16") == \
        pytest.approx(0.09 - 0.0251 / 0.251 * 0.551)
    assert extra_cpu(made_up(STEP, COMM, dict(CPU, truncate16=0.09), idle_cpu=0.0), "truncate16") == pytest.approx(0.09)


def test_horovods_threads_are_left_out_of_an_all_reduces_cpu():
    # truncate16: 90 ms CPU on all the rank's threads over its 551 ms alone, 60 ms of it Horovod's
    # background loop (read on its own threads' clocks); idle, the rank burns 25.1 ms per 251 ms,
    # 20 ms of it Horovod's: the other threads burn 5.1 ms per 251 ms
    hvd = {"comm-truncate16": 0.06, "idle": 0.020}
    la = made_up(STEP, COMM, dict(CPU, truncate16=0.09), idle_cpu=0.0251, horovod_cpu=hvd)
    assert la.reduction_cpu("truncate16") == pytest.approx(0.03)
    # the model bills what the other threads spent beyond their own idle rate over as long, not the
    # all-threads background rate (which Horovod's loop, slowed by a busy link, need not keep up)
    assert extra_cpu(la, "truncate16") == pytest.approx(0.03 - 0.0051 / 0.251 * 0.551)
    found = {t.name: t for t in targets([la], {0: fit_model(la)})}
    t16 = next(t for name, t in found.items() if name.endswith(" truncate16 all-reduce's CPU on a rank < 20% of compute"))
    assert t16.met and t16.measured == "30 ms = 15% of compute 201 ms (Horovod's threads another 60 ms over as long)"
    # a codec whose all-reduce has no Horovod share recorded is judged on all its threads, as before
    int8 = next(t for name, t in found.items() if name.endswith(" int8 all-reduce's CPU on a rank < 20% of compute"))
    assert not int8.met and int8.measured == "100 ms = 50% of compute 201 ms"
    # float32's all-reduce timed alone is Horovod's own op: its threads do that work and stay in
    with_none = made_up(STEP, COMM, CPU, idle_cpu=0.0251, horovod_cpu=dict(hvd, **{"comm-none": 0.015}))
    assert with_none.reduction_cpu("none") == pytest.approx(0.02)
    assert extra_cpu(with_none, "none") == pytest.approx(max(0.0, 0.02 - 0.0251 / 0.251 * 0.801))
    # a miss names what the threads other than Horovod's burn idle over as long
    slow = made_up(STEP, COMM, dict(CPU, truncate16=0.12), idle_cpu=0.0251, horovod_cpu=hvd)
    miss = next(t for t in targets([slow], {0: fit_model(slow)}) if " truncate16 all-reduce's CPU" in t.name)
    assert not miss.met and miss.measured.startswith("60 ms = 30% of compute")
    assert "the rank's threads other than Horovod's burn 11 ms with nothing to do" in miss.cause


def test_compute_off_the_cores_loses_nothing_to_the_all_reduces_cpu():
    # int8's all-reduce (151 ms, 100 ms CPU) within compute (201 ms): on one core per rank the model
    # bills compute that CPU and a miss is blamed on it; with compute off the cores (waits on its
    # device, --offload-compute) it bills nothing: the bound is max(compute, all-reduce)
    step, comm = dict(STEP, **{"w2-int8": 0.32}), dict(COMM, int8=0.15)
    on_core = made_up(step, comm, CPU)
    assert fit_model(on_core).step["w2-int8"] > 0.201 + 0.05
    assert cause(on_core, "w2-int8").startswith("CPU:")
    off = made_up(step, comm, CPU)
    off.raw["offloaded"] = True
    model = fit_model(off)
    assert model.interference["int8"] == 0.0
    for key, codec in (("w2-int8", "int8"), ("w2", "none")):
        assert model.step[key] == pytest.approx(max(0.201, model.comm[codec]))
    assert cause(off, "w2-int8").startswith("the schedule, with compute off the cores (it held no core): "
                                            "the engine-free loop took 321 ms")
    assert cause(off, "w2").startswith("the all-reduce:")                  # 0.8 s all-reduce > compute
