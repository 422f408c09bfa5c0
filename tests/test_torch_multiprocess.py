"""The PyTorch optimizer on 2 real ranks under horovodrun."""
import re

import pytest

from launcher import run_ranks, run_torchrun

# every test here launches ranks
pytestmark = pytest.mark.multiprocess


def test_parity_with_horovod_and_with_the_reference_rule():
    out = run_ranks("mp/torch_pipeline.py")
    for rank in (0, 1):
        for check in ("width1-equals-horovod-sgd-momentum", "width1-equals-horovod-adam",
                      "width2-reference-warmup0-passes1", "width2-reference-warmup3-passes1",
                      "width2-reference-warmup0-passes2"):
            assert f"PASS rank{rank} {check}" in out


@pytest.mark.parametrize("compression", ["none"])
def test_checkpoint_mid_pipeline_restores_exactly_in_fresh_processes(tmp_path, compression):
    args = [str(tmp_path), compression, "12", "7"]
    run_ranks("mp/torch_checkpoint.py", *args, "full,part1")
    out = run_ranks("mp/torch_checkpoint.py", *args, "part2")
    assert "PASS rank0 restored-equals-uninterrupted" in out and "PASS rank1 restored-equals-uninterrupted" in out


def test_staleness_correction_follows_the_reference_rule_and_real_weights_shows_the_real_ones():
    out = run_ranks("mp/torch_prediction.py")
    for rank in (0, 1):
        for check in ("prediction-reference-warmup0", "prediction-reference-warmup3"):
            assert f"PASS rank{rank} {check}" in out


def test_checkpoint_with_staleness_correction_restores_exactly(tmp_path):
    """int8+EF with weight prediction; the model saved holding the prediction and inside real_weights()."""
    args = [str(tmp_path), "int8", "12", "7"]
    run_ranks("mp/torch_checkpoint.py", *args, "full,part1", "prediction")
    out = run_ranks("mp/torch_checkpoint.py", *args, "part2", "prediction")
    assert "PASS rank0 restored-equals-uninterrupted" in out and "PASS rank1 restored-equals-uninterrupted" in out


@pytest.mark.parametrize("kind,needle", [("shape", "(3, 2)"), ("name", "renamed.0.weight"), ("dtype", "float64")])
def test_model_mismatch_across_ranks_raises_on_every_rank(kind, needle):
    out = run_ranks("mp/torch_mismatch.py", kind, expect_failure=True, timeout=90)
    for rank in (0, 1):
        found = re.search(rf"RAISED rank{rank}: (.*?optimizer settings)", out)
        assert found is not None, out
        assert "differ across ranks" in found.group(1) and needle in found.group(1), found.group(1)


@pytest.mark.parametrize("controller", ["mpi", "gloo"])
def test_compressed_allreduce_and_training_on_two_ranks(controller):
    out = run_ranks("mp/compressed.py", controller=controller)
    comms = ["horovod", "mpi4py"] if controller == "mpi" else ["horovod"]
    for rank in (0, 1):
        for comm in comms:
            for name in ["fp16", "bf16", "truncate16", "int8", "int4"]:
                assert f"PASS rank{rank} compressed-allreduce-{comm}-{name}" in out
        assert f"PASS rank{rank} train-int8" in out and f"PASS rank{rank} train-int4" in out


@pytest.mark.parametrize("compression", ["none", "int8"])
def test_torchrun_without_horovod(compression):
    out = run_torchrun("mp/torchrun_pipeline.py", compression)
    assert f"PASS rank0 torchrun-{compression}-gloo" in out and f"PASS rank1 torchrun-{compression}-gloo" in out


@pytest.mark.parametrize("compression", ["none", "int8"])
def test_torchrun_with_a_device_only_default_group(compression):
    """torchrun + NCCL (issue 34): ``cuda:gloo`` gives the default group no host backend, as
    ``init_process_group("nccl")`` does; the membership flags and host gradients must still be
    reduced (they went to a group of the default backend: "No backend type associated with
    device type cpu" at the first step)."""
    out = run_torchrun("mp/torchrun_pipeline.py", compression, "cuda:gloo")
    assert all(f"PASS rank{r} torchrun-{compression}-cuda:gloo" in out for r in (0, 1)), out
