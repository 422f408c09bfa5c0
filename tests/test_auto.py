"""The auto mode's decision rule, against hand-computed cases."""
import pytest

from pipesgd_hvd.auto import Measurements, decide, link_from_allreduce

MB = 2**20


def measured(compute_ms, allreduce_ms, codec_ms=None, ranks=2, mbytes=100):
    return Measurements(ranks=ranks, gradient_bytes=mbytes * MB, compute_s=compute_ms / 1e3,
                        allreduce_s=allreduce_ms / 1e3, codec_s={k: v / 1e3 for k, v in (codec_ms or {}).items()})


def test_link_from_allreduce_inverts_the_ring_formula():
    # 2 ranks: a ring sends 2 (N-1)/N M = M bytes; 100 MiB in 0.5 s is 200 MiB/s.
    assert link_from_allreduce(2, 100 * MB, 0.5).bandwidth == pytest.approx(200 * MB)
    # 4 ranks: 1.5 M bytes.
    assert link_from_allreduce(4, 100 * MB, 0.5).bandwidth == pytest.approx(300 * MB)


def test_cheap_communication_stays_synchronous():
    d = decide(measured(compute_ms=100, allreduce_ms=4))
    assert (d.width, d.compression) == (1, "none")
    assert d.predicted_s["sync"] == pytest.approx(0.104)


def test_comm_about_compute_pipelines_without_compression():
    d = decide(measured(compute_ms=100, allreduce_ms=90))
    assert (d.width, d.compression) == (2, "none")
    assert d.predicted_s["none"] == pytest.approx(0.100)


def test_comm_twice_compute_takes_fp16_and_four_times_takes_int8():
    # fp16 halves the bytes: 200 ms -> 100 ms fits under 100 ms of compute.
    assert decide(measured(100, 200)).compression == "fp16"
    # 400 ms: fp16 gives 200 ms (too slow), int8 gives 400 * 0.252 = 100.8 ms > 100: no fit;
    # then the shortest predicted step wins: int4 (400 * 0.127 = 50.8 ms -> max(100, 50.8)).
    d = decide(measured(100, 400))
    assert d.compression == "int4" and d.predicted_s["int4"] == pytest.approx(0.100)
    assert d.predicted_s["int8"] == pytest.approx(0.4 * (516 / 2048))
    assert decide(measured(110, 400)).compression == "int8"


def test_codec_cost_counts_against_the_codec():
    # int8 would fit (100.8 ms < 110) but costs 40 ms to encode + decode on 2 ranks (half rides
    # with the reduction: (N-1)/N * cost): 100.8 + 20 = 120.8 > 110, so int4 (cheap here) wins.
    d = decide(measured(110, 400, codec_ms={"int8": 40.0, "int4": 0.0}))
    assert d.compression == "int4"
    assert d.predicted_s["int8"] == pytest.approx(0.4 * (516 / 2048) + 0.020)


def test_one_rank_has_nothing_to_decide():
    assert (decide(measured(100, 400, ranks=1)).width, decide(measured(100, 400, ranks=1)).compression) == (1, "none")
