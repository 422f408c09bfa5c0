"""A peer of the pipeline channel is lost mid-run. Usage: MODE (kill | freeze)

  kill    rank 1 SIGKILLs itself: rank 0's next alltoall must raise PeerLostError (the kernel
          closes the dead process's sockets, Gloo reports the reset);
  freeze  rank 1 SIGSTOPs itself (alive but silent): rank 0 must raise PeerLostError once
          PIPESGD_TIMEOUT passes.

Rank 0 prints ``RAISED rank0 PeerLostError after <s> s: ...`` and ends itself at once (what a
transport's shutdown does after a lost peer is the adapters' concern, not the channel's). It
ignores SIGTERM, as horovodrun terminates the other ranks when one dies.
"""
import os
import signal
import sys
import time

import horovod.torch as hvd
import torch

from pipesgd_hvd.comm.base import PeerLostError
from pipesgd_hvd.comm.pipeline_channel import PipelineChannel

mode = sys.argv[1]
signal.signal(signal.SIGTERM, signal.SIG_IGN)
hvd.init()
rank = hvd.rank()
channel = PipelineChannel.from_horovod()
x = torch.zeros(2, 1 << 16, dtype=torch.uint8)
for step in range(20):
    if rank == 1 and step == 10:
        print(f"rank1 {mode} at step {step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL if mode == "kill" else signal.SIGSTOP)
    started = time.monotonic()
    try:
        channel.alltoall_async(x, f"a2a.{step}").wait()
        channel.allgather_async(x[:1], f"ag.{step}").wait()
    except PeerLostError as exc:
        print(f"RAISED rank{rank} PeerLostError after {time.monotonic() - started:.2f} s: {exc}", flush=True)
        os._exit(1)
    time.sleep(0.01)
print(f"rank{rank} finished without an error", flush=True)
