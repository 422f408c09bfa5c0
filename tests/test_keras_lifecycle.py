"""Keras 3 / TensorFlow under horovodrun -np 2, the optimizer's life cycle: a checkpoint mid-pipeline
restored in fresh processes, and the auto mode deciding and switching by retracing."""
import pytest

from launcher import assert_passed, run_ranks


@pytest.mark.multiprocess
def test_keras_checkpoint_mid_pipeline_restores_bitwise_in_fresh_processes(tmp_path):
    args = [str(tmp_path), "30", "17"]
    run_ranks("mp/keras_checkpoint.py", *args, "full,part1", timeout=300)
    out = run_ranks("mp/keras_checkpoint.py", *args, "part2", timeout=300)
    assert "PASS rank0 restored-equals-uninterrupted" in out and "PASS rank1 restored-equals-uninterrupted" in out


@pytest.mark.multiprocess
def test_keras_auto_mode_decides_alike_on_every_rank_and_switches_by_retracing():
    out = run_ranks("mp/keras_auto.py", timeout=420)
    assert_passed(out, ["keras-auto-measured-identical", "keras-auto-scripted-equals-reference",
                         "keras-auto-recheck-switches-codec", "keras-auto-custom-loop-without-driver-fails"])
