"""A peer lost in the middle of a pipelined (width 2), int8-compressed ``model.fit``. Usage: MODE

  kill    rank 1 SIGKILLs itself before step 15: rank 0 must fail (the transport sees the broken
          connection, or the launcher ends the job);
  freeze  rank 1 SIGSTOPs itself before step 15 (alive but silent, as a hung host): rank 0 must
          end once PIPESGD_TIMEOUT passes (the step watchdog) or the transport's own timeout.

Rank 1 prints ``rank1 MODE at step 15, wall clock T``. Rank 0 prints ``RAISED rank0 <type> at wall
clock T: <message>`` and exits 1 when ``model.fit`` raises; when the watchdog ends it, the line is
the watchdog's (``pipesgd_hvd: PeerLostError: ...``). Rank 0 ignores SIGTERM, as the PyTorch
script does: when rank 1 dies horovodrun terminates the other ranks at once; ignoring it lets the
test see what rank 0 reports first, as on a multi-host job where the launcher is slower.
"""
import os
import signal
import sys
import time

import horovod.tensorflow as hvd
import keras

import pipesgd_hvd.keras as psgd
from keras_common import BATCH, LOSS, make_model, rank_data

mode = sys.argv[1]
signal.signal(signal.SIGTERM, signal.SIG_IGN)
hvd.init()
rank = hvd.rank()
STEPS, LOST_AT = 30, 15
x, y = rank_data(rank, STEPS)


class LosePeer(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        if rank == 1 and batch == LOST_AT:
            print(f"rank1 {mode} at step {batch}, wall clock {time.time():.3f}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL if mode == "kill" else signal.SIGSTOP)
        time.sleep(0.01)  # steps of a few ms: keep rank 0 from racing far ahead of the loss


model = make_model()
model.compile(optimizer=psgd.DistributedOptimizer(keras.optimizers.SGD(0.05), width=2, compression="int8"),
              loss=LOSS)
try:
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[LosePeer()])
except Exception as exc:  # noqa: BLE001 - reported, then the rank fails
    text = " ".join(str(exc).split())  # TensorFlow's message spans lines; one line for the test
    print(f"RAISED rank{rank} {type(exc).__name__} at wall clock {time.time():.3f}: {text}", flush=True)
    sys.exit(1)
print(f"NO ERROR rank{rank}", flush=True)
