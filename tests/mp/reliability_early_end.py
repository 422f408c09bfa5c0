"""Every way a rank can stop early (issue 32), with uneven data: rank 0 has 6 batches, rank 1 12.

Usage: reliability_early_end.py PATTERN WIDTH CODEC   (under horovodrun -np 2)

works        three scenarios that must work, one after the other, each ending with equal replicas
             and rank 1 as the rank that joined last:
             flush-join      rank 0 runs out and calls opt.flush() then psgd.join() (README + docs);
                             rank 1 trains on, then does the same
             join-replicas   psgd.join() with check_replicas_every=2 (a check falls inside the join)
             join-auto       psgd.join() with width="auto" (measure 3 steps, re-check every 4: a check
                             and a switch fall inside the join)
             Prints ``PASS rank<r> <scenario> in <s> s``.
hvd-join     rank 0 calls Horovod's own hvd.join() beside the pipelined optimizer (the README's two
             imports); rank 1 must stop with an error naming rank 0 and the fix, rank 0's log must
             say it too. Prints ``RAISED rank1 <type> after <s> s: <message>``.
leave        rank 0 leaves the loop without join(): it "evaluates" for 1 s, "saves", and its script
             ends; leave-flush: the same after opt.flush(). Rank 1 must stop with an error naming
             rank 0; rank 0 must end with status 1 and say why.

Named metric all-reduces run beside each step (Horovod's pattern; named, because uneven steps
leave Horovod's per-process counter of unnamed ops apart between scenarios), except in leave.
"""
import gc
import signal
import sys
import time

import horovod.torch as hvd
import torch

import pipesgd_hvd.torch as psgd
from common import weights_digest
from reference import loss_fn, make_batches, make_model

signal.signal(signal.SIGTERM, signal.SIG_IGN)  # see what each rank reports before the launcher ends it
pattern, width, codec = sys.argv[1], sys.argv[2], sys.argv[3]
hvd.init()
rank, size = hvd.rank(), hvd.size()
BATCHES = make_batches(12, size)
STEPS = 6 if rank == 0 else 12


def optimizer(model, **kw):
    inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    kw.setdefault("width", int(width))
    return psgd.DistributedOptimizer(inner, named_parameters=model.named_parameters(), compression=codec, **kw)


def train(model, opt, tag, metric=True):
    for t in range(STEPS):
        opt.zero_grad()
        loss = loss_fn(model, BATCHES[t][rank])
        loss.backward()
        opt.step()
        if metric:
            hvd.allreduce(loss.detach(), name=f"{tag}.loss.{t}")


def scenario(tag, flush_first=False, **kw):
    started = time.monotonic()
    model = make_model()
    opt = optimizer(model, **kw)
    train(model, opt, tag)
    if flush_first:
        opt.flush()
    last = psgd.join()
    hvd.broadcast_parameters(model.state_dict(), root_rank=last)
    assert last == 1, f"{tag}: rank {last} joined last, expected 1"
    digests = hvd.allgather_object(weights_digest(model.parameters()), name=f"{tag}.digest")
    assert len(set(digests)) == 1, f"{tag}: replicas differ after the broadcast from rank {last}"
    print(f"PASS rank{rank} {tag} in {time.monotonic() - started:.1f} s", flush=True)
    del opt
    gc.collect()


if pattern == "works":
    scenario("flush-join", flush_first=True)
    scenario("join-replicas", check_replicas_every=2)
    scenario("join-auto", width="auto", auto_measure_steps=3, auto_recheck_every=4)
    sys.exit(0)

model = make_model()
opt = optimizer(model)
started = time.monotonic()
try:
    # leave: no metric all-reduce, so that rank 1 waits in the pipeline, not in Horovod's op for a
    # rank that left (it then logs the same words and the launcher ends it: docs/reliability.md)
    train(model, opt, pattern, metric=pattern == "hvd-join")
    started = time.monotonic()
    if rank == 1:
        opt.flush()
        hvd.join()
        print(f"NO ERROR rank{rank}", flush=True)
        sys.exit(0)
    if pattern == "hvd-join":
        hvd.join()  # Horovod's own, not ours: it knows nothing of the pipeline
    else:
        if pattern == "leave-flush":
            opt.flush()
        time.sleep(1.0)  # "evaluates"
        torch.save(model.state_dict(), "/dev/null")  # "saves"
        print(f"LEFT rank{rank} at {time.time():.3f}", flush=True)
except Exception as exc:  # noqa: BLE001 - reported, then the rank fails
    print(f"RAISED rank{rank} {type(exc).__name__} after {time.monotonic() - started:.2f} s: {exc}", flush=True)
    sys.exit(1)
