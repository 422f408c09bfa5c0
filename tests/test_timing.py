"""Closed-form tests of the timing model (the auto rule's terms in pipesgd_hvd/auto/model.py, the
rest in benchmarks/timing_model.py): each formula by hand, its limits, the least-squares fits, and
the CLI."""
from __future__ import annotations

import numpy as np
import pytest

from benchmarks import timing_model as timing
from benchmarks.timing_model import (fit_link, pipelined_iteration_time, predict, ps_iteration_time,
                                     ring_allreduce_time, speedup, total_time)
from pipesgd_hvd.auto.model import CODECS, CodecParams, LinkParams, compressed_allreduce_time, sync_iteration_time

# The running example: 4 workers, 100 MB of gradients, 10 Gbit/s, 100 us per message, 0.1 ns/byte.
N, M = 4, 100e6
LINK = LinkParams(alpha=1e-4, bandwidth=1.25e9, gamma=1e-10)
# l_AR = 2*3*1e-4 + 2*3/4 * 1e8/1.25e9 + 3/4 * 1e8*1e-10 = 0.0006 + 0.12 + 0.0075
L_AR = 0.1281
COMPUTE = 0.15


def test_ring_allreduce_by_hand():
    assert ring_allreduce_time(N, M, LINK) == pytest.approx(L_AR, rel=1e-12)
    assert ring_allreduce_time(1, M, LINK) == 0.0  # one worker sends nothing
    # N=2, M=1e6: 2*1*1e-4 + 2*1/2 * 1e6/1.25e9 + 1/2 * 1e6*1e-10 = 0.0002 + 0.0008 + 0.00005
    assert ring_allreduce_time(2, 1e6, LINK) == pytest.approx(0.00105, rel=1e-12)


def test_compressed_allreduce_by_hand():
    codec = CodecParams("quarter", ratio=0.25, cost_per_byte=1e-10)
    # 2*3*1e-4 + 2*3/4 * 0.25*1e8/1.25e9 + 3/4 * 1e8*(1e-10 + 1e-10) = 0.0006 + 0.03 + 0.015
    assert compressed_allreduce_time(N, M, LINK, codec) == pytest.approx(0.0456, rel=1e-12)
    # int8 at zero codec cost: 0.0006 + 1.5 * (516/2048) * 0.08 + 0.0075
    assert compressed_allreduce_time(N, M, LINK, CODECS["int8"]) == pytest.approx(
        0.0006 + 1.5 * 0.251953125 * 0.08 + 0.0075, rel=1e-12)
    assert compressed_allreduce_time(N, M, LINK, CODECS["none"]) == ring_allreduce_time(N, M, LINK)


def test_ps_sync_and_pipelined_by_hand():
    # PS: 0.15 + 2*1e-4 + 2*4*1e8/1.25e9 = 0.15 + 0.0002 + 0.64
    assert ps_iteration_time(N, M, LINK, COMPUTE) == pytest.approx(0.7902, rel=1e-12)
    assert sync_iteration_time(COMPUTE, L_AR) == pytest.approx(0.2781, rel=1e-12)
    # half the all-reduce hidden in the backward pass: 0.15 + 0.5*0.1281
    assert sync_iteration_time(COMPUTE, L_AR, overlap=0.5) == pytest.approx(0.21405, rel=1e-12)
    assert pipelined_iteration_time(COMPUTE, L_AR) == COMPUTE
    assert pipelined_iteration_time(0.05, L_AR) == L_AR
    # interference 0.25, compute-bound: beside the 0.1 s all-reduce compute does 0.1/1.25 = 0.08 s of
    # its work, then the remaining 0.07 s at full speed: 0.1 + 0.07 = 0.15 + 0.1*0.25/1.25 = 0.17
    assert pipelined_iteration_time(0.15, 0.1, interference=0.25) == pytest.approx(0.17, rel=1e-12)
    # comm-bound: compute 0.05 * 1.25 = 0.0625 < 0.1, still hidden
    assert pipelined_iteration_time(0.05, 0.1, interference=0.25) == 0.1


def test_total_time_by_hand():
    # width 1: 10 * (0.15 + 0.1281); width 3: 10 * max(0.15, 0.1281) + 2 * 0.1281 (pipeline fill)
    assert total_time(10, COMPUTE, L_AR) == pytest.approx(2.781, rel=1e-12)
    assert total_time(10, COMPUTE, L_AR, width=3) == pytest.approx(1.7562, rel=1e-12)
    # overlap only applies to sync, interference only to the pipeline
    assert total_time(10, COMPUTE, L_AR, width=1, interference=0.3) == total_time(10, COMPUTE, L_AR)
    assert total_time(10, COMPUTE, L_AR, width=2, overlap=0.7) == total_time(10, COMPUTE, L_AR, width=2)


@pytest.mark.parametrize("compute,comm", [(0.15, 0.1281), (0.05, 0.1281), (0.1, 0.1)])
def test_pipelined_per_iteration_tends_to_max(compute, comm):
    t = 10 ** 8
    # the fill adds (K-1)*comm / (T*max(compute, comm)) <= 1/T = 1e-8 relative
    assert total_time(t, compute, comm, width=2) / t == pytest.approx(max(compute, comm), rel=1e-7)
    assert speedup(compute, comm, iterations=t) == pytest.approx(speedup(compute, comm), rel=1e-7)
    assert speedup(compute, comm) == pytest.approx((compute + comm) / max(compute, comm), rel=1e-12)


def test_width_one_is_sync():
    for t in (1, 7, 1000):
        assert total_time(t, COMPUTE, L_AR, width=1, overlap=0.3) == pytest.approx(
            t * sync_iteration_time(COMPUTE, L_AR, overlap=0.3), rel=1e-12)
    assert speedup(COMPUTE, L_AR, width=1) == 1.0
    p = predict(N, M, LINK, COMPUTE, widths=(1, 2))
    assert p.iteration[("none", 1)] == pytest.approx(p.sync, rel=1e-12)
    assert p.speedup[("none", 1)] == pytest.approx(1.0, rel=1e-12)


def test_int8_pipelined_beats_sync_3x_when_comm_is_4x_compute():
    compute = L_AR / 4
    p = predict(N, M, LINK, compute, widths=(1, 2))
    # sync 5 * 0.032025 = 0.160125; int8 all-reduce 0.0006 + 0.030234 + 0.0075 = 0.038334 > compute
    assert p.sync == pytest.approx(5 * compute, rel=1e-12)
    assert p.speedup[("int8", 2)] == pytest.approx(0.160125 / 0.0383344, rel=1e-5)
    assert p.speedup[("int8", 2)] > 3
    # without compression the pipeline can at best hide compute: 5/4
    assert p.speedup[("none", 2)] == pytest.approx(1.25, rel=1e-12)
    assert p.speedup[("int4", 2)] >= p.speedup[("int8", 2)] > p.speedup[("fp16", 2)] > p.speedup[("int8", 1)]


def test_codec_table_ratios():
    assert set(CODECS) == {"none", "fp16", "bf16", "truncate16", "int8", "int4"}
    assert CODECS["none"].ratio == 1.0
    assert all(CODECS[name].ratio == 0.5 for name in ("fp16", "bf16", "truncate16"))
    # one byte (half a byte) per value + one float32 scale per 512 values, over 4 bytes per value
    assert CODECS["int8"].ratio == pytest.approx((512 + 4) / 2048, rel=1e-12)
    assert CODECS["int4"].ratio == pytest.approx((256 + 4) / 2048, rel=1e-12)
    assert round(CODECS["int8"].ratio, 3) == 0.252 and round(CODECS["int4"].ratio, 3) == 0.127
    with pytest.raises(TypeError):
        CODECS["int2"] = CodecParams("int2", 0.07)  # read-only: no hidden mutable module state


def test_predict_with_iterations_spreads_the_fill():
    p = predict(N, M, LINK, COMPUTE, widths=(2,), codecs=[CODECS["none"]], iterations=10)
    assert p.iteration[("none", 2)] == pytest.approx(0.16281, rel=1e-12)  # (10*0.15 + 1*0.1281) / 10
    assert p.speedup[("none", 2)] == pytest.approx(2.781 / 1.6281, rel=1e-12)
    assert "none" in p.table() and "ps (sync)" in p.table()


def test_bad_arguments_say_what_is_wrong():
    with pytest.raises(ValueError, match="bandwidth"):
        LinkParams(alpha=0.0, bandwidth=0.0)
    with pytest.raises(ValueError, match="width"):
        total_time(10, 1.0, 1.0, width=0)
    with pytest.raises(ValueError, match="overlap"):
        sync_iteration_time(1.0, 1.0, overlap=1.5)
    with pytest.raises(ValueError, match="interference"):
        pipelined_iteration_time(1.0, 1.0, interference=-0.1)
    with pytest.raises(ValueError, match="iterations"):
        predict(N, M, LINK, COMPUTE, iterations=0)


def _samples(link, rng=None, noise=0.0):
    """All-reduce and allgather timings over 2..8 workers and 1 kB..100 MB, with multiplicative noise."""
    out = []
    for n in (2, 4, 8):
        for m in np.logspace(3, 8, 11):
            share = (n - 1) / n
            times = {"allreduce": ring_allreduce_time(n, m, link),
                     "allgather": (n - 1) * link.alpha + share * m / link.bandwidth}
            for kind, t in times.items():
                if rng is not None:
                    t *= 1 + noise * rng.standard_normal()
                out.append((n, m, t, kind))
    return out


def _assert_link(got, want, rel):
    assert got.alpha == pytest.approx(want.alpha, rel=rel)
    assert got.bandwidth == pytest.approx(want.bandwidth, rel=rel)
    assert got.gamma == pytest.approx(want.gamma, rel=rel)


def test_fit_link_noiseless():
    want = LinkParams(alpha=5e-5, bandwidth=1.25e9, gamma=1e-10)
    _assert_link(fit_link(_samples(want)), want, rel=1e-8)
    # all-reduce samples plus local reductions separate bandwidth from gamma too
    mixed = [s[:3] for s in _samples(want) if s[3] == "allreduce"]
    mixed += [(1, m, m * want.gamma, "reduce") for m in (1e6, 1e7, 1e8)]
    _assert_link(fit_link(mixed), want, rel=1e-8)


def test_fit_link_noisy():
    want = LinkParams(alpha=5e-5, bandwidth=1.25e9, gamma=1e-10)
    got = fit_link(_samples(want, np.random.default_rng(0), noise=0.01))
    # 1% timing noise over 66 samples; worst errors over 200 seeds: alpha 0.5%, bandwidth 0.7%, gamma
    # 16% (gamma is a small share of each all-reduce: 0.0075 s of 0.128 s at 100 MB). 2-3x margins.
    assert got.alpha == pytest.approx(want.alpha, rel=0.02)
    assert got.bandwidth == pytest.approx(want.bandwidth, rel=0.02)
    assert got.gamma == pytest.approx(want.gamma, rel=0.4)


def test_fit_link_needs_something_to_split_bandwidth_from_gamma():
    want = LinkParams(alpha=5e-5, bandwidth=1.25e9, gamma=1e-10)
    only_allreduce = [s[:3] for s in _samples(want) if s[3] == "allreduce"]
    with pytest.raises(ValueError, match="gamma"):
        fit_link(only_allreduce)
    _assert_link(fit_link(only_allreduce, gamma=want.gamma), want, rel=1e-8)


def test_fit_link_is_non_negative():
    # no latency at all, plus noise: an unconstrained fit could give alpha < 0
    want = LinkParams(alpha=0.0, bandwidth=1.25e9, gamma=1e-10)
    got = fit_link(_samples(want, np.random.default_rng(1), noise=0.02))
    assert got.alpha >= 0 and got.gamma >= 0 and got.bandwidth > 0
    assert got.bandwidth == pytest.approx(want.bandwidth, rel=0.05)  # 2% noise; worst of 200 seeds: 1.2%


def test_exact_nnls_matches_scipy():
    optimize = pytest.importorskip("scipy.optimize")
    rng = np.random.default_rng(2)
    for _ in range(20):
        a, b = rng.standard_normal((12, 3)), rng.standard_normal(12)
        np.testing.assert_allclose(timing._nnls(a, b), optimize.nnls(a, b)[0], atol=1e-10)


def test_cli_prints_table(capsys):
    assert timing.main(["--workers", "4", "--model-mb", "100", "--bandwidth-gbit", "10",
                        "--compute-ms", "150", "--width", "2", "4", "--alpha-us", "100", "--gamma-ns", "0.1"]) == 0
    out = capsys.readouterr().out
    assert "sync iteration 278.10 ms" in out  # 150 + 128.1, the running example
    for name in CODECS:
        assert name in out
    assert "1.85x" in out  # none, width 2: 278.1 / 150


def test_cli_writes_png(tmp_path, capsys):
    png = tmp_path / "speedup.png"
    assert timing.main(["--workers", "4", "--model-mb", "100", "--bandwidth-gbit", "10", "--compute-ms", "150",
                        "--width", "2", "--plot", str(png)]) == 0
    assert "int8" in capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
