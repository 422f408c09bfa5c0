"""The auto mode's decision rule, against hand-computed cases."""
import pytest

from pipesgd_hvd.auto.rule import Measurements, decide, link_from_allreduce, settled

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
    # 400 ms: fp16 gives 200 ms (too slow), int8 400 * 0.252 = 100.8 ms: 0.8% over compute, within
    # the 10% tolerance of the fastest (int4: max(100, 50.8) = 100), so the less lossy int8 is taken.
    d = decide(measured(100, 400))
    assert d.compression == "int8" and d.predicted_s["int4"] == pytest.approx(0.100)
    assert d.predicted_s["int8"] == pytest.approx(0.4 * (516 / 2048))
    # 800 ms: int8 gives 201.6 ms, twice int4's step (max(100, 101.6)): int4 is worth its loss.
    assert decide(measured(100, 800)).compression == "int4"
    # tolerance 0: the fastest, whatever it loses
    assert decide(measured(100, 400), tolerance=0.0).compression == "int4"


def test_codec_cost_counts_against_the_codec():
    # int8 would fit (100.8 ms < 110) but costs 60 ms to encode + decode on 2 ranks (half rides
    # with the reduction: (N-1)/N * cost): 100.8 + 30 = 130.8 > 1.1 * 110, so int4 (cheap here) wins.
    d = decide(measured(110, 400, codec_ms={"int8": 60.0, "int4": 0.0}))
    assert d.compression == "int4"
    assert d.predicted_s["int8"] == pytest.approx(0.4 * (516 / 2048) + 0.030)


def timed(compute_ms, reduction_ms, cpu_ms=None, ranks=2):
    """Measurements as a check produces them: the reductions timed, the model not used."""
    return Measurements(ranks=ranks, gradient_bytes=100 * MB, compute_s=compute_ms / 1e3,
                        allreduce_s=reduction_ms["none"] / 1e3,
                        reduction_s={k: v / 1e3 for k, v in reduction_ms.items()},
                        reduction_cpu_s={k: v / 1e3 for k, v in (cpu_ms or {}).items()})


def test_timed_reductions_replace_the_model():
    # As measured on Horovod's Gloo controller at 155 Mbit/s: the byte codecs' alltoall/allgather
    # run at about half the link rate, so fp16 barely beats float32 and int8 halves it (the model
    # would say 0.5x and 0.25x). Nothing hides under 200 ms of compute; int8 is not within 10% of
    # int4, so int4.
    m = timed(200, {"none": 900, "fp16": 860, "int8": 500, "int4": 300})
    d = decide(m)
    assert (d.width, d.compression) == (2, "int4")
    assert d.predicted_s == {"sync": pytest.approx(1.1), "none": 0.9, "fp16": 0.86, "int8": 0.5, "int4": 0.3}
    # only the timed candidates are considered (the measuring loop stopped where the rest cannot win)
    assert set(decide(timed(200, {"none": 900, "fp16": 860, "int8": 210})).predicted_s) == {"sync", "none", "fp16",
                                                                                           "int8"}


def test_reduction_cpu_is_taken_from_compute():
    # comm ~ compute: the float32 all-reduce (230 ms) is 10% over compute (210 ms) but needs 30 ms
    # of CPU; int8 and int4 hide on the wire but their codec needs 110 ms of the rank's core:
    # max(210 + 110, 150) = 320 ms against none's max(240, 230) = 240 ms: stay uncompressed.
    m = timed(210, {"none": 230, "fp16": 245, "int8": 150, "int4": 100},
              cpu_ms={"none": 30, "fp16": 40, "int8": 110, "int4": 105})
    d = decide(m)
    assert (d.width, d.compression) == (2, "none")
    assert d.predicted_s["none"] == pytest.approx(0.240) and d.predicted_s["int8"] == pytest.approx(0.320)
    # without the CPU, int4 would look 2.3x faster than none
    assert decide(timed(210, {"none": 480, "int8": 150, "int4": 100})).compression == "int8"


@pytest.mark.parametrize("name, reductions, expected", [
    ("none", {"none": 4}, True),             # synchronous: nothing else matters
    ("none", {"none": 105}, True),           # within 10% of compute: no codec can do better by more
    ("none", {"none": 111}, False),
    ("fp16", {"none": 200, "fp16": 109}, True),
])
def test_settled_stops_when_lossier_codecs_cannot_win(name, reductions, expected):
    assert settled(timed(100, reductions), name) is expected
    # the CPU counts: 100 ms of compute + 20 ms of reduction CPU is 120 ms, over 110
    assert settled(timed(100, {"none": 105}, {"none": 20}), "none") is False


def test_one_rank_has_nothing_to_decide():
    assert (decide(measured(100, 400, ranks=1)).width, decide(measured(100, 400, ranks=1)).compression) == (1, "none")
