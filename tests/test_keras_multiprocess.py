"""Keras 3 / TensorFlow under horovodrun -np 2: model.fit, custom loops, the graph's overlap, callbacks,
the digits example. The optimizer's life cycle: tests/test_keras_lifecycle.py; failures:
tests/test_keras_reliability.py."""
import pytest

from launcher import assert_passed, run_ranks

SCRIPTS = ("keras_pipeline.py", "tf_custom_loop.py", "keras_callbacks.py")


@pytest.fixture(scope="module")
def scripts_out():
    """The three scripts in one launch (tests/mp/in_one_launch.py: TensorFlow is imported once)."""
    return run_ranks("mp/in_one_launch.py", *SCRIPTS, timeout=600)


@pytest.mark.multiprocess
def test_model_fit_follows_the_pipelined_rule_with_every_codec_and_saves_a_plain_keras_model(scripts_out):
    assert_passed(scripts_out, [f"keras-rule-{c}" for c in ("sgd-width1-warmup0", "sgd-width2-warmup0", "adam-width2-warmup0",
                                                     "sgd-width2-warmup3", "sgd-width3-warmup0")]
                   + ["keras-rule-weight-prediction"]
                   + [f"keras-codec-{c}" for c in ("fp16", "bf16", "truncate16", "int8", "int4")]
                   + ["keras-save-load-without-pipesgd"])


@pytest.mark.multiprocess
def test_custom_loop_eager_and_traced_and_the_stale_reduction_waits_for_nothing_of_the_step(scripts_out):
    assert_passed(scripts_out, [f"tf-loop-{m}-width2-warmup{w}" for m in ("eager", "tf.function") for w in (0, 2)]
                   + ["tf-loop-int8-eager", "tf-loop-int8-tf.function",
                      "tf-graph-stale-reduction-independent-of-the-step"])


@pytest.mark.multiprocess
def test_horovods_keras_callbacks_work_on_keras_3(scripts_out):
    assert_passed(scripts_out, ["keras-broadcast-callback", "keras-metric-average-callback", "keras-lr-warmup-callback",
                         "keras-flush-callback", "keras-load-model", "keras-best-model-checkpoint"])


@pytest.mark.multiprocess
def test_keras_digits_width_1_and_2_reach_95_percent_within_a_point():
    import re

    out = run_ranks("../examples/keras_digits.py", "--configs", "1:none", "2:none", timeout=400)
    found = dict(re.findall(r"width=(\d) none\s+([0-9.]+)", out))
    assert set(found) == {"1", "2"}, out[-3000:]
    sync, pipelined = float(found["1"]), float(found["2"])
    assert sync >= 0.95 and pipelined >= 0.95, found
    assert abs(sync - pipelined) <= 0.01, found
