"""Unnamed Horovod collectives beside the pipeline's in-flight reductions (issue 15).

Usage: unnamed_collectives.py WIDTHS [STEPS [named]]   (under horovodrun -np 2, --mpi or --gloo)

For every byte codec (fp16, bf16, truncate16, int8, int4) at each width of WIDTHS ("2,3"), in one
process, trains
STEPS (default 200) steps while calling unnamed ``hvd.allreduce``, ``hvd.allgather`` and
``hvd.broadcast`` the way training scripts do: the loss right after ``backward()`` (before
``step()``), a gather and a broadcast after ``step()``, and every 20 steps a small evaluation
block. Every result is checked.

Horovod names an unnamed op ``<op>.noname.<handle>`` from a per-process handle counter that
every Horovod op of the process advances, named or not. The pipeline's reductions must therefore
never be Horovod ops issued at timing-dependent moments (a byte codec's alltoall + allgather run
on the engine's comm thread): the counter would differ across ranks at the user's next unnamed op
and the ranks would wait for different names forever. With ``named`` the same ops get explicit
names (the control). Prints ``PASS rank<r> unnamed-<codec>-w<width>`` per configuration.
"""
import sys

import horovod.torch as hvd
import torch

import pipesgd_hvd.torch as psgd

widths = [int(w) for w in sys.argv[1].split(",")]
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 200
named = len(sys.argv) > 3 and sys.argv[3] == "named"
hvd.init()
rank, size = hvd.rank(), hvd.size()


def name(what, t):
    return f"user.{what}.{t}" if named else None


def check(cond, what, t):
    if not cond:
        raise AssertionError(f"rank {rank} step {t}: {what}")


def train(codec, width):
    torch.manual_seed(0)
    # Big enough (~0.2 M parameters) that a compressed reduction takes a moment on the comm thread.
    model = torch.nn.Sequential(torch.nn.Linear(128, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 64),
                                torch.nn.ReLU(), torch.nn.Linear(64, 10))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = psgd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                    named_parameters=model.named_parameters(),
                                    compression=getattr(psgd.Compression, codec), width=width)
    g = torch.Generator().manual_seed(100 + rank)
    for t in range(steps):
        x, y = torch.randn(32, 128, generator=g), torch.randint(0, 10, (32,), generator=g)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        # between backward() and step(): the bucket's reduction has just started
        marker = torch.tensor([float(rank + t)])
        mean = hvd.allreduce(marker, name=name("loss", t))  # unnamed unless `named`
        check(torch.allclose(mean, torch.tensor([t + (size - 1) / 2])), f"allreduce gave {mean.item()}", t)
        opt.step()
        # after step(): the pipelined reductions of this step are still in flight
        rows = hvd.allgather(torch.full((1, 3), float(rank)), name=name("rows", t))
        check(rows[:, 0].tolist() == [float(r) for r in range(size)], f"allgather gave {rows[:, 0].tolist()}", t)
        root = hvd.broadcast(torch.tensor([float(rank * 10 + t)]), 0, name=name("root", t))
        check(root.item() == float(t), f"broadcast gave {root.item()}", t)
        if t % 20 == 19:  # an evaluation block between steps
            correct = torch.tensor([float((model(x).argmax(1) == y).sum())])
            total = hvd.allreduce(correct, op=hvd.Sum, name=name("correct", t))
            check(total.item() >= 0, "metric", t)
            gathered = hvd.allgather_object({"rank": rank, "step": t}, name=name("obj", t))
            check([d["rank"] for d in gathered] == list(range(size)), "allgather_object", t)
    opt.flush()
    print(f"PASS rank{rank} unnamed-{codec}-w{width}{'-named' if named else ''}", flush=True)


for codec in ("fp16", "bf16", "truncate16", "int8", "int4"):
    for width in widths:
        train(codec, width)
