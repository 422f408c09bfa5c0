"""Issue 15's hang: a width-2 int8 training loop with an unnamed ``hvd.allreduce(metric)`` after
every step. Usage: TRANSPORT (channel | horovod) [STEPS]

Horovod names an unnamed op ``allreduce.noname.<handle>`` from a per-process counter that every
async op advances. With Horovod's ops as the pipeline's transport, the compressed all-reduce's
alltoall/allgather start on the engine's comm thread at timing-dependent moments, so the counter
(hence the metric's name) differs across ranks and the metric all-reduce never matches: the job
hangs. Run with a short HOROVOD_STALL_SHUTDOWN_TIME_SECONDS, Horovod then shuts down and the
metric call raises, which this script reports as ``HUNG rank<r> at step <t>`` (Horovod's Gloo
controller has no stall shutdown: there it just hangs). With ``channel`` the pipeline's traffic
goes through PipelineChannel, which never touches that counter: every step completes, the
replicas stay identical, and the metric is the true mean. ``horovod-named`` is the control:
Horovod's ops again, but the metric all-reduce named, so the counter no longer matters.
"""
import sys
import time

import horovod.torch as hvd
import torch

import pipesgd_hvd.torch as psgd
from common import assert_replicas_identical, passed
from pipesgd_hvd.comm.pipeline_channel import PipelineChannel

transport = sys.argv[1]
assert transport in ("channel", "horovod", "horovod-named"), transport
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 200
hvd.init()
rank, size = hvd.rank(), hvd.size()
torch.manual_seed(0)
# Large enough that a step's compressed all-reduce (about 0.5 MB of int8) is still on the comm
# thread when the training thread reaches the metric call.
model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                            torch.nn.ReLU(), torch.nn.Linear(512, 10))
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
communicator = PipelineChannel.from_horovod() if transport == "channel" else None
if communicator is not None:
    print(f"rank{rank} channel address {communicator.address}", flush=True)
opt = psgd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters(),
                                width=2, compression="int8", communicator=communicator)
g = torch.Generator().manual_seed(rank)
started = time.monotonic()
for t in range(steps):
    x, y = torch.randn(64, 256, generator=g), torch.randint(0, 10, (64,), generator=g)
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    try:
        metric_name = f"metric.{t}" if transport == "horovod-named" else None  # None: unnamed, as users write it
        mean = hvd.allreduce(loss.detach().reshape(1), name=metric_name)
    except Exception as exc:  # noqa: BLE001 - Horovod's stall shutdown ends the hang
        print(f"HUNG rank{rank} at step {t} after {time.monotonic() - started:.1f} s: {type(exc).__name__}: "
              f"{str(exc).splitlines()[0][:200]}", flush=True)
        sys.exit(3)
    if t % 10 == 0:
        print(f"rank{rank} step {t}", flush=True)
    losses = hvd.allgather_object(loss.item(), name=f"check.{t}")
    assert abs(float(mean) - sum(losses) / size) < 1e-6, f"step {t}: metric {float(mean)} vs {losses}"
opt.flush()
assert_replicas_identical(model.parameters(), f"unnamed-metric-{transport}")
print(f"rank{rank} {steps} steps in {time.monotonic() - started:.1f} s", flush=True)
passed(f"unnamed-metric-{transport}-{steps}-steps")
