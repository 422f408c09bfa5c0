"""width="auto" / compression="auto" in Keras's model.fit under horovodrun -np 2: the checks of
the PyTorch test (tests/mp/torch_auto.py), through the same controller.

* measured: real timings; every rank decides the same at the same steps, the replicas stay
  bitwise identical, rank 0 logs PyTorch's line;
* scripted: injected numbers (each rank its own, the maxima decide) for width 2 uncompressed
  after 4 synchronous steps: the run follows the reference rule; and a re-check that switches
  none -> int8 -> none, where the new pipeline really runs (the train function was traced again);
* a custom tf.function loop that never runs the checks fails with a message saying what to do.
"""
import logging
import sys

import horovod.tensorflow as hvd
import keras
import numpy as np
import tensorflow as tf

import pipesgd_hvd.keras as psgd
from keras_common import BATCH, LOSS, assert_replicas_identical, make_model, passed, rank_data, reference_weights
from scripted_timing import ScriptedProbe

hvd.init()
rank, size = hvd.rank(), hvd.size()
STEPS = 14
x, y = rank_data(rank, STEPS)


def sgd():
    return keras.optimizers.SGD(0.1)


class Trace(keras.callbacks.Callback):
    """The configuration each step runs with, and its pipeline's step counter."""

    def __init__(self, opt):
        super().__init__()
        self.opt, self.steps = opt, []

    def on_train_batch_begin(self, batch, logs=None):
        graph = self.opt.engine
        self.steps.append((graph.step, graph.config.width, graph.codec.name))


def fit(steps, compute_s=None, allreduce_s=None, flush=True, **kw):
    model = make_model()
    opt = psgd.DistributedOptimizer(sgd(), width="auto", compression="auto", **kw)
    model.compile(optimizer=opt, loss=LOSS)
    opt.build(model.trainable_variables)  # the pipeline exists before the first batch (for Trace)
    if compute_s is not None:
        controller = opt.core.auto_controller
        controller.probe = ScriptedProbe(allreduce_s)
        record = controller.record_compute
        controller.record_compute = lambda seconds: record(compute_s)
    trace = Trace(opt)
    # Any of pipesgd_hvd's callbacks runs the checks between steps; the flush callback also applies
    # the last in-flight gradient when fit ends.
    driver = psgd.callbacks.PipelineFlushCallback() if flush else psgd.callbacks.MetricAverageCallback()
    model.fit(x[:steps * BATCH], y[:steps * BATCH], batch_size=BATCH, shuffle=False, verbose=0,
              callbacks=[trace, driver])
    history = [(r.step, r.decision.width, r.decision.compression, r.decision.reason)
               for r in opt.core.auto_controller.history]
    return model, opt, trace.steps, history


def same_everywhere(value, what):
    everyone = hvd.allgather_object(value, name=f"auto.{what}")
    assert all(v == everyone[0] for v in everyone), f"{what} differs across ranks: {everyone}"


def check_measured():
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("pipesgd_hvd.auto.rule").addHandler(handler)
    logging.getLogger("pipesgd_hvd.auto.rule").setLevel(logging.INFO)
    model, opt, trace, history = fit(STEPS, auto_measure_steps=4, auto_recheck_every=5)
    assert [h[0] for h in history] == [4, 9, 14], history
    same_everywhere((trace, history), "measured")
    assert_replicas_identical(model, "auto-measured")
    if rank == 0:
        assert len(lines) == 3 and all(line.startswith("pipesgd_hvd auto, step ") for line in lines), lines
        assert "measured (slowest of 2 ranks): compute" in lines[0], lines[0]
        print("AUTO", opt.auto_decision.describe(), flush=True)
    else:
        assert not lines, lines
    passed("keras-auto-measured-identical")


def check_scripted_matches_reference():
    steps = 12
    # rank 0: 100 ms compute, 90 ms all-reduce; rank 1 alone would stay synchronous (50 ms, 3 ms)
    compute, allreduce = [(0.100, [0.090]), (0.050, [0.003])][rank]
    model, opt, trace, history = fit(steps, compute, allreduce, flush=False, auto_measure_steps=4,
                                     auto_recheck_every=0)
    assert [h[:3] for h in history] == [(4, 2, "none")], history
    assert [w for _, w, _ in trace] == [1] * 4 + [2] * 8, trace
    assert opt.engine.step == steps, opt.engine.step  # the new pipeline ran (traced again)
    assert_replicas_identical(model, "auto-scripted")
    # The rule computed in one process (to float32 round-off, as in keras_pipeline.py: the traced
    # step and the eager reference fuse ops differently).
    want = reference_weights(sgd, steps, size, width=2, warmup=4)
    for got, ref in zip(model.trainable_variables, want):
        np.testing.assert_allclose(got.numpy(), ref, rtol=2e-5, atol=2e-6, err_msg="auto (2, none)")
    passed("keras-auto-scripted-equals-reference")


def check_recheck_switches_codec():
    steps = 12
    # compute 110 ms; 400 ms needs int8, then 60 ms pipelines uncompressed (rank 1 sees less)
    allreduce = [[0.400, 0.060], [0.100, 0.010]][rank]
    model, opt, trace, history = fit(steps, 0.110, allreduce, auto_measure_steps=3, auto_recheck_every=4)
    assert [h[:3] for h in history] == [(3, 2, "int8"), (7, 2, "none"), (11, 2, "none")], history
    assert [c for _, _, c in trace] == ["none"] * 3 + ["int8+ef"] * 4 + ["none"] * 5, trace
    assert [s for s, _, _ in trace] == list(range(steps)), trace  # each new pipeline counted on
    same_everywhere(trace, "recheck")
    assert_replicas_identical(model, "auto-recheck")
    passed("keras-auto-recheck-switches-codec")


def check_custom_loop_without_driver_fails_clearly():
    model = make_model()
    opt = psgd.DistributedOptimizer(sgd(), width="auto", auto_measure_steps=3)

    @tf.function
    def train_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = LOSS(yb, model(xb))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))

    try:
        for t in range(5):
            train_step(x[t * BATCH:(t + 1) * BATCH], y[t * BATCH:(t + 1) * BATCH])
    except tf.errors.InvalidArgumentError as exc:
        assert "optimizer.after_steps()" in str(exc) and t == 3, (t, str(exc)[:300])
        passed("keras-auto-custom-loop-without-driver-fails")
        return
    raise AssertionError("a traced loop that never ran the auto checks went on")


checks = sys.argv[1:] or ["measured", "scripted", "recheck", "custom"]
if "measured" in checks:
    check_measured()
if "scripted" in checks:
    check_scripted_matches_reference()
if "recheck" in checks:
    check_recheck_switches_codec()
if "custom" in checks:
    check_custom_loop_without_driver_fails_clearly()
