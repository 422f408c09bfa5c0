"""Horovod elastic training with the pipelined optimizer (width 2, int8): a worker joins, one is
killed mid-pipeline, training goes on. Run by tests/test_elastic.py under
``horovodrun --gloo --min-np 1 --max-np 3 --host-discovery-script DIR/discover.sh``.

Usage: DIR STEPS JOIN_HOST [--optimizer pipesgd|horovod] [--correction split_batch]

The discovery script prints ``DIR/hosts``. Each host name (localhost, 127.0.0.1, JOIN_HOST: all
this machine; JOIN_HOST is another name Horovod runs locally, e.g. the machine's host name) carries
one slot, so a worker is known by ``HOROVOD_HOSTNAME``. The job starts on localhost and 127.0.0.1.
At step ``JOIN`` rank 0 adds JOIN_HOST to ``DIR/hosts``; the ranks keep
committing every step (and wait a little per step, at most ``JOIN_WAIT`` s) until the new worker
is in. At step ``KILL`` the worker on JOIN_HOST SIGKILLs itself after its backward pass, so the
others lose it with reductions in flight (``HorovodInternalError``): they restore the last commit
(every ``COMMIT_EVERY`` steps) and go on as two. Every rank checks after each (re)start that all
replicas agree (weights, step count, in-flight steps, the committed batch), and rank 0 appends a
JSON line per event to ``DIR/log.jsonl`` for the test to check. Every rank checks the same
before each commit.

``--optimizer horovod`` runs the same schedule with Horovod's own DistributedOptimizer (the
baseline that shows Horovod elastic works on this machine). ``--correction split_batch``: the
accurate mode (two calls per update; each rank's look-ahead in its model between calls, so the
replicas compared are the real weights, ``opt.real_weights()``).
"""
import argparse
import hashlib
import json
import os
import signal
import time

import horovod.torch as hvd
import torch

parser = argparse.ArgumentParser()
parser.add_argument("dir")
parser.add_argument("steps", type=int)
parser.add_argument("join_host")
parser.add_argument("--optimizer", default="pipesgd", choices=["pipesgd", "horovod"])
parser.add_argument("--correction", default=None, choices=["split_batch"])
args = parser.parse_args()

JOIN, KILL, COMMIT_EVERY, JOIN_WAIT = 4, 14, 3, 40.0
HOST = os.environ.get("HOROVOD_HOSTNAME", "?")
LOG = os.path.join(args.dir, "log.jsonl")

hvd.init()
torch.manual_seed(0)  # the same initial model everywhere; sync() broadcasts rank 0's anyway
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
if args.optimizer == "pipesgd":
    import pipesgd_hvd.torch as psgd

    opt = psgd.DistributedOptimizer(inner, named_parameters=model.named_parameters(), width=2,
                                    compression="int8", staleness_correction=args.correction or False)
else:
    opt = hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters())


def batch(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 8, generator=g)
    return x, x[:, :4] * 2.0 - x[:, 4:].sum(dim=1, keepdim=True)


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def pipeline_view():
    """(steps ended, steps in flight, digest of the in-flight averaged gradients). Waits for the
    steps in flight, as the commit that follows does anyway."""
    if args.optimizer != "pipesgd":
        return None, 0, ""
    state = opt.engine.state_dict()
    grads = [g for entry in state["in_flight"] for _, g in sorted(entry["grads"].items())]
    return opt.engine.step, len(state["in_flight"]), digest(grads)


def log(event: str, **fields) -> None:
    if hvd.rank() == 0:
        with open(LOG, "a") as f:
            f.write(json.dumps({"event": event, "size": hvd.size(), **fields}) + "\n")


def check_replicas(state, event: str) -> None:
    """Every rank holds the same weights, step count, in-flight gradient and batch counter."""
    step, in_flight, pending = pipeline_view()
    if args.optimizer == "pipesgd":
        with opt.real_weights():
            weights = digest(model.parameters())
    else:
        weights = digest(model.parameters())
    mine = (weights, step, in_flight, pending, state.batch)
    views = hvd.allgather_object((HOST, mine), name=f"check.{event}.{state.rendezvous}.{state.batch}")
    if len({view for _, view in views}) != 1:
        raise AssertionError(f"{event}: replicas differ across ranks: {views}")
    log(event, batch=state.batch, rendezvous=state.rendezvous, weights=mine[0], step=step,
        in_flight=in_flight, pending=pending, hosts=sorted(h for h, _ in views))


@hvd.elastic.run
def train(state):
    state.rendezvous += 1
    check_replicas(state, "start")
    started = time.monotonic()
    while state.batch < args.steps:
        t = state.batch
        opt.zero_grad()
        x, y = batch(t, hvd.rank())
        torch.nn.functional.mse_loss(model(x), y).backward()
        if t == KILL and HOST == args.join_host:
            print(f"worker on {HOST} (rank {hvd.rank()}) kills itself at step {t}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)  # its reductions of step t are in flight
        opt.step()
        state.batch = t + 1
        if hvd.rank() == 0 and t == JOIN:
            with open(os.path.join(args.dir, "hosts"), "w") as f:
                f.write(f"localhost:1\n127.0.0.1:1\n{args.join_host}:1\n")
        waiting = JOIN <= t < KILL and hvd.size() < 3 and state.rendezvous == 1  # not joined yet
        if waiting:
            if time.monotonic() - started > JOIN_WAIT:
                raise AssertionError(f"the worker on {args.join_host} did not join within {JOIN_WAIT} s")
            time.sleep(0.5)  # until the driver sees the new host and notifies the workers
        if state.batch % COMMIT_EVERY == 0 or waiting:
            check_replicas(state, "commit")  # the joined worker's weights too
            state.commit()
    if state.batch > KILL and hvd.size() != 2:
        raise AssertionError(f"expected 2 workers after the kill, have {hvd.size()}")


def on_reset():
    log("reset", batch=state.batch)


state = hvd.elastic.TorchState(model=model, optimizer=opt, batch=0, rendezvous=0)
state.register_reset_callbacks([on_reset])
train(state)
if args.optimizer == "pipesgd":
    opt.flush()
check_replicas(state, "end")
print(f"DONE {HOST} rank {hvd.rank()} of {hvd.size()} at batch {state.batch}", flush=True)
