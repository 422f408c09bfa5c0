"""Keras 3 / TensorFlow under horovodrun -np 2: model.fit, custom loops, the graph's overlap, callbacks."""
from launcher import run_ranks


def _assert_passed(out: str, checks) -> None:
    for rank in (0, 1):
        for check in checks:
            assert f"PASS rank{rank} {check}" in out, f"missing: rank {rank} {check}"


def test_model_fit_follows_the_pipelined_rule_with_every_codec_and_saves_a_plain_keras_model():
    out = run_ranks("mp/keras_pipeline.py", timeout=300)
    _assert_passed(out, [f"keras-rule-{c}" for c in ("sgd-width1-warmup0", "sgd-width2-warmup0", "adam-width2-warmup0",
                                                     "sgd-width2-warmup3", "sgd-width3-warmup0")]
                   + ["keras-rule-weight-prediction"]
                   + [f"keras-codec-{c}" for c in ("fp16", "bf16", "truncate16", "int8", "int4")]
                   + ["keras-save-load-without-pipesgd"])


def test_custom_loop_eager_and_traced_and_the_stale_reduction_waits_for_nothing_of_the_step():
    out = run_ranks("mp/tf_custom_loop.py", timeout=300)
    _assert_passed(out, [f"tf-loop-{m}-width2-warmup{w}" for m in ("eager", "tf.function") for w in (0, 2)]
                   + ["tf-loop-int8-eager", "tf-loop-int8-tf.function",
                      "tf-graph-stale-reduction-independent-of-the-step"])


def test_horovods_keras_callbacks_work_on_keras_3():
    out = run_ranks("mp/keras_callbacks.py", timeout=300)
    _assert_passed(out, ["keras-broadcast-callback", "keras-metric-average-callback", "keras-lr-warmup-callback",
                         "keras-flush-callback", "keras-load-model", "keras-best-model-checkpoint"])


def test_keras_checkpoint_mid_pipeline_restores_bitwise_in_fresh_processes(tmp_path):
    args = [str(tmp_path), "30", "17"]
    run_ranks("mp/keras_checkpoint.py", *args, "full", timeout=300)
    run_ranks("mp/keras_checkpoint.py", *args, "part1", timeout=300)
    out = run_ranks("mp/keras_checkpoint.py", *args, "part2", timeout=300)
    assert "PASS rank0 restored-equals-uninterrupted" in out and "PASS rank1 restored-equals-uninterrupted" in out


def test_keras_bad_arguments_get_errors_that_name_the_problem():
    _assert_passed(run_ranks("mp/keras_reliability.py", "arguments", timeout=300), ["keras-bad-arguments"])


def test_keras_models_that_differ_across_ranks_raise_on_every_rank():
    import re

    out = run_ranks("mp/keras_reliability.py", "mismatch", expect_failure=True, timeout=300)
    for rank in (0, 1):
        found = re.search(rf"RAISED rank{rank}: (.*?differ across ranks.*)", out)
        assert found is not None, out[-3000:]
        assert "(12, 33)" in found.group(1) or "(12, 32)" in found.group(1), found.group(1)


def test_keras_sparse_embedding_gradients_are_reduced_dense():
    _assert_passed(run_ranks("mp/keras_reliability.py", "sparse", timeout=300), ["keras-sparse-embedding"])


def test_keras_nonfinite_gradients_leave_replicas_equal():
    _assert_passed(run_ranks("mp/keras_reliability.py", "nonfinite", timeout=300),
                   ["keras-nonfinite-int8", "keras-nonfinite-bf16", "keras-nonfinite-none"])


def test_keras_digits_width_1_and_2_reach_95_percent_within_a_point():
    import re

    out = run_ranks("../examples/keras_digits.py", "--configs", "1:none", "2:none", timeout=400)
    found = dict(re.findall(r"width=(\d) none\s+([0-9.]+)", out))
    assert set(found) == {"1", "2"}, out[-3000:]
    sync, pipelined = float(found["1"]), float(found["2"])
    assert sync >= 0.95 and pipelined >= 0.95, found
    assert abs(sync - pipelined) <= 0.01, found
