"""The model-zoo kind of the emulated-cluster study (`python -m benchmarks.throughput --models`)
without a cluster: the buckets it times (pipesgd's plan of a real model, Horovod's fused all-reduces
over the offloaded backward), its lean buffers, each launch's planned link rate and memory check,
the order of launches, the timing model fed with the recorded buckets, the table and the targets."""
from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch

from benchmarks import throughput
from benchmarks import throughput_zoo as zoo
from benchmarks.throughput_analysis import Launch, fit_model, zoo_targets
from benchmarks.throughput_report import render_zoo
from benchmarks.throughput_worker import fusion_buckets, horovod_buckets, lean_buffers, model_buckets
from pipesgd_hvd.compression import resolve_compression
from pipesgd_hvd.compression.allreduce import padded_numel

GRAD = 102_228_128  # resnet50's float32 gradient


def test_pipesgd_buckets_of_a_model_are_its_fusion_plan():
    linear = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    assert model_buckets(linear, 2 * 64 * 65 * 4) == fusion_buckets(4, 64, 2 * 64 * 65 * 4) == [2 * 64 * 65] * 2
    from benchmarks import models

    buckets = model_buckets(models.build("resnet50"), 64 * 2**20)
    assert sum(buckets) == GRAD // 4 and all(4 * b <= 64 * 2**20 for b in buckets[:-1])


def test_horovod_fuses_what_arrives_within_a_cycle_up_to_its_threshold():
    # 4 layers over a 40 ms backward, last first, one every 10 ms; Horovod wakes every 20 ms
    layers = [[100, 10], [200], [300], [400, 40]]
    assert horovod_buckets(layers, 0.04, 0.02, 10**6) == [440, 300 + 200, 110]
    # every 30 ms: the first wake takes 3 layers, the second 2; 2000 bytes (500 values) split the first
    assert horovod_buckets(layers, 0.04, 0.03, 2000) == [440, 300, 200 + 110]
    with pytest.raises(ValueError, match="at least one layer"):
        horovod_buckets([], 0.04, 0.02, 10**6)


def test_lean_buffers_hold_every_bucket_with_each_codecs_room_zero_past_it():
    codecs = [resolve_compression("int8"), resolve_compression("int4")]
    flat, views = lean_buffers(torch, [1000, 3], codecs, 2)
    rooms = [max(padded_numel(c, n, 2) for c in codecs) for n in (1000, 3)]
    assert [len(v) for v in views] == rooms and len(flat) == sum(rooms)
    assert views[0].untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    assert bool(views[0][:1000].ne(0).all()) and not views[0][1000:].any() and not views[1][3:].any()


def plan(update: float = 0.01) -> zoo.Plan:
    return zoo.Plan("resnet50", GRAD, 0.104, update)


def test_a_launch_rate_puts_horovods_ring_at_its_aim_times_compute():
    # 2 hosts: a rank sends the gradient once (817.8 Mbit); aim 5 x 114 ms, less 30 ms fixed: 0.54 s at 97%
    assert zoo.rate_for(plan(), 2, 5.0, 0.03) == "1560mbit"
    # 4 hosts send 1.5 times as much
    assert zoo.rate_for(plan(), 4, 5.0, 0.03) == "2340mbit"
    # out of reach (the fixed cost alone takes aim x compute): the fastest rate, the launch says how far it landed
    assert zoo.rate_for(plan(), 2, 0.2, 0.03) == "20000mbit"
    # what a launch measured beyond the wire time (>= 0)
    assert zoo.measured_fixed(2, GRAD, "1560mbit", 0.6) == pytest.approx(0.6 - 817.825e6 / (0.97 * 1560e6))
    assert zoo.measured_fixed(2, GRAD, "1560mbit", 0.1) == 0.0
    assert zoo.order([1.0, 5.0, 1.0]) == [5.0, 1.0]


def test_launches_that_would_not_fit_are_refused_naming_the_fix():
    zoo.check_memory("gpt2", 497_759_232, 4, 30 * 2**30)  # 4 x 14 x 498 MB = 26.0 GiB fits in 30
    with pytest.raises(RuntimeError, match=r"gpt2 on 4 hosts needs about 26.0 GiB .* 23.0 GiB are available: .*--hosts 2"):
        zoo.check_memory("gpt2", 497_759_232, 4, 23 * 2**30)  # this machine: refused before it starts
    zoo.check_memory("gpt2", 497_759_232, 4, None)  # no /proc/meminfo: not checked


def made_up_zoo(hosts: int, aim: float, rate: str, compute: float = 0.12, comm_none: float = 0.6) -> Launch:
    """A model-zoo launch of resnet50: int8 at its all-reduce, Horovod at compute + 90% of its all-reduce."""
    step = {"horovod": compute + 0.9 * comm_none, "w2": comm_none, "w2-int8": comm_none / 4 + 0.02,
            "w2-int4": max(compute, comm_none / 8 + 0.02), "w2-split-int8": 2 * (comm_none / 4 + 0.02)}
    med = {"compute": compute, "forward": 0.035, "backward": 0.07, "update": 0.015, "add": GRAD * 0.1e-9,
           "ar-small": 0.002, "comm-none": comm_none, "comm-none-quarter": comm_none / 4 + 0.002,
           "comm-int8": comm_none / 4 + 0.02, "comm-int4": comm_none / 8 + 0.02, "idle": 0.25, "cpu/idle": 0.0,
           "cpu-hvd/idle": 0.0, **step}
    for c in ("none", "int8", "int4"):
        med.update({f"cpu/comm-{c}": 0.01, f"cpu-hvd/comm-{c}": 0.0})
    raw = {"ranks": hosts, "grad_bytes": GRAD, "layers": 4, "configs": list(zoo.CONFIGS), "model": "resnet50",
           "per_rank": [{"samples": {k: [v] * 3 for k, v in med.items()}} for _ in range(hosts)],
           "wire_ratio": {}, "auto": None, "offloaded": True, "buckets": [GRAD // 8] * 2,
           "width1_shares": {"horovod": [0.6, 0.4], "w1": [0.5, 0.5]}}
    return Launch(hosts, rate, 0, raw)


def test_the_model_takes_the_recorded_width1_buckets():
    la = made_up_zoo(2, 5.0, "1560mbit")
    model = fit_model(la)
    # Horovod's first fused all-reduce holds 60% of the gradient: the backward pass hides at most 40% of it
    h = min(0.6, 0.07 * 0.4 / model.comm["none"])
    assert model.overlap["horovod"] == pytest.approx(h)
    assert model.step["horovod"] == pytest.approx(0.12 + (1 - h) * model.comm["none"])
    assert model.step["w2-int8"] == pytest.approx(la.comm("int8"), rel=1e-6)   # compute off the cores: max


def test_measure_plans_each_models_launches_largest_aim_first_from_the_last_ones_fixed_cost(monkeypatch):
    monkeypatch.setattr(zoo, "host_update_seconds", lambda name: (GRAD, 0.01))
    launched = []

    def fake_launch(setting, args, configs):
        launched.append((setting.model, setting.hosts, setting.target, setting.rate, tuple(configs)))
        # the link: 40 ms fixed + wire at 97%
        comm = 0.04 + 817.825e6 * (1.5 if setting.hosts == 4 else 1.0) / (0.97 * throughput.rate_bps(setting.rate))
        return made_up_zoo(setting.hosts, setting.target, setting.rate, comm_none=comm)

    args = argparse.Namespace(models=["resnet50"], hosts=[2, 4], aims=[1.0, 5.0], configs=list(zoo.CONFIGS))
    record = throughput.measure_zoo(args, launch=fake_launch, available=lambda: None)
    assert [(m, h, a) for m, h, a, _, _ in launched] == [("resnet50", 2, 5.0), ("resnet50", 2, 1.0),
                                                         ("resnet50", 4, 5.0), ("resnet50", 4, 1.0)]
    assert all(configs == zoo.CONFIGS for *_, configs in launched)  # split_batch on 4 hosts too
    # first launch on each host count: the guessed 30 ms; the next: the 40 ms its predecessor measured
    assert launched[0][3] == zoo.rate_for(plan(), 2, 5.0, 0.03)
    assert launched[1][3] == zoo.rate_for(plan(), 2, 1.0, 0.04 + 817.825e6 / (0.97 * 1560e6) - 817.825e6 / (0.97 * 1560e6))
    assert record["plans"] == [dataclasses.asdict(plan())] and [s["model"] for s in record["settings"]] == ["resnet50"] * 4
    launched.clear()
    with pytest.raises(RuntimeError, match="resnet50 on 4 hosts needs about"):  # 2 hosts would fit in 4 GiB
        throughput.measure_zoo(args, launch=fake_launch, available=lambda: 4 * 2**30)
    assert launched == []  # every launch is checked before the first: nothing measured is lost


def test_a_zoo_record_renders_per_model_rows_and_the_issue_targets():
    settings = [throughput.Setting(2, "1560mbit", 0, 5.0, "resnet50"), throughput.Setting(2, "6000mbit", 0, 1.0, "resnet50")]
    launches = [made_up_zoo(2, 5.0, "1560mbit"), made_up_zoo(2, 1.0, "6000mbit", comm_none=0.13)]
    record = {"machine": "test", "elapsed_s": 60.0, "load_before": [0.5, 0, 0], "load_after": [1.0, 0, 0],
              "args": {"models": ["resnet50"], "rounds": 2, "steps": 3, "horovod_cycle_ms": 20},
              "plans": [dataclasses.asdict(plan())], "settings": [dataclasses.asdict(s) for s in settings],
              "launches": [dataclasses.asdict(la) for la in launches]}
    text = render_zoo(record)
    assert "### resnet50: 25.6M parameters in 161 tensors, 102 MB of float32 gradient" in text
    assert "2470 img/s" in text and "the host's update 10 ms" in text
    # 0.12 + 0.54 = 660 ms against int8's 170: 3.88x, at its all-reduce alone (step / bound 1.00)
    assert "| 2 hosts, 1560mbit: 5.00x (aim 5); compute 120 (35 / 70 / 15) | Horovod DistributedOptimizer (sync) | 660 |" in text
    assert "| pipesgd width 2 + int8 (EF) | 170 | 3.88x | 170 | 1.00 |" in text
    found = {t.name: t for t in zoo_targets(record["settings"], launches, [fit_model(la) for la in launches])}
    assert found["resnet50, 2 hosts, 1560mbit: pipesgd width 2 + int8 (EF) >= 3.5x over Horovod"].met
    assert "resnet50, 2 hosts, 6000mbit: pipesgd width 2 + int8 (EF) >= 3.5x over Horovod" not in found  # aim 1
    assert found["resnet50, 2 hosts, 6000mbit: comm/compute within 20% of its aim 1"].measured == "1.08"


def test_the_command_line_of_the_model_zoo_kind(capsys):
    args = throughput.parse(["--models"])
    assert (args.models, args.hosts, args.aims, args.rounds, args.steps) == (["resnet50", "bert-base", "gpt2"], [2, 4],
                                                                             [1.0, 5.0], 2, 3)
    assert args.configs == list(zoo.CONFIGS) and args.offload_compute
    assert throughput.parse(["--models", "gpt2,resnet50", "--hosts", "2"]).models == ["resnet50", "gpt2"]
    assert throughput.section_key(vars(args)) == "model-zoo" and throughput.section_key({"models": None}) == "throughput"
    for argv, message in ((["--models", "vgg16"], "unknown model 'vgg16'"),
                          (["--models", "--hosts", "1"], "--hosts must be >= 2 each"),
                          (["--models", "--hierarchical"], "--models plans its own launches")):
        with pytest.raises(SystemExit):
            throughput.parse(argv)
        assert message in capsys.readouterr().err
