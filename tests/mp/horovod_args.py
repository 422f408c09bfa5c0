"""Horovod's optimizer arguments, ours against Horovod's on the same data (issue 17).

Usage: horovod_args.py OUT_DIR FEATURE [FEATURE ...]   (under horovodrun -np 2)

For each feature, trains 6 steps with horovod.torch.DistributedOptimizer, then with ours at
width 1 and width 2 (codec none), prints one line per rank and appends it as JSON to
OUT_DIR/rank<r>.jsonl (the launcher may split long lines of two ranks into each other):

  RESULT rank<r> <feature> horovod=<outcome> w1=<outcome> w2=<outcome>

where an outcome is ``ok``, ``ok(=horovod)`` (width 1 bitwise equal to Horovod's weights),
``ok(differs by X)``, or ``<ErrorType>: <message>``. Features: groups_int, groups_list,
num_groups, predivide, sparse_as_dense, sparse, adasum, process_set_self, process_set_0.
"""
import json
import sys
import warnings
from pathlib import Path

import horovod.torch as hvd
import torch

import pipesgd_hvd.torch as psgd
from reference import loss_fn, make_batches, make_model

# process_set_*: Horovod's static process sets, registered at init ([0, 1] would be the global
# set again: Horovod invalidates such a duplicate, so only proper subsets exist with 2 ranks)
SETS = [hvd.ProcessSet([0]), hvd.ProcessSet([1])]
hvd.init(process_sets=SETS)
rank, size = hvd.rank(), hvd.size()
BATCHES = make_batches(6, size)


class Embed(torch.nn.Module):
    def __init__(self, sparse):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(10, 3, sparse=sparse)

    def forward(self, idx):
        return self.emb(idx).sum()


def run(feature, which):
    """Trains 6 steps; returns the parameters (or raises)."""
    kwargs, sparse = {}, None
    if feature == "groups_int":
        kwargs["groups"] = 2
    elif feature == "num_groups":
        kwargs["num_groups"] = 2
    elif feature == "predivide":
        kwargs["gradient_predivide_factor"] = 2.0
    elif feature == "sparse_as_dense":
        kwargs["sparse_as_dense"], sparse = True, True
    elif feature == "sparse":
        sparse = True
    elif feature == "adasum":
        kwargs["op"] = hvd.Adasum
    elif feature == "process_set_self":
        kwargs["process_set"] = SETS[rank]  # each rank reduces over a set of itself: local training
    elif feature == "process_set_0":
        kwargs["process_set"] = SETS[0]  # rank 1 is outside the set: Horovod trains it locally
    if sparse is not None:
        model = Embed(sparse)
        inner = torch.optim.SparseAdam(list(model.parameters()), lr=0.1) if feature == "sparse_as_dense" \
            else torch.optim.SGD(model.parameters(), lr=0.1)
    else:
        model = make_model()
        inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if feature == "groups_list":
        kwargs["groups"] = [[p for _, p in list(model.named_parameters())[:2]]]
    named = model.named_parameters()
    if which == "horovod":
        opt = hvd.DistributedOptimizer(inner, named_parameters=named, **kwargs)
    else:
        opt = psgd.DistributedOptimizer(inner, named_parameters=named, width=which, **kwargs)
    for t in range(6):
        opt.zero_grad()
        if sparse is not None:
            idx = torch.tensor([[1, 2, 4], [4, 3, 9]]) if rank == 0 else torch.tensor([[1, 3, 4], [7, 7, 9]])
            model((idx + t) % 10).backward()
        else:
            loss_fn(model, BATCHES[t][rank]).backward()
        opt.step()
    if which != "horovod":
        opt.flush()
    return [p.detach().clone() for p in model.parameters()]


def outcome(feature, which, reference=None):
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            params = run(feature, which)
        deprecations = [w for w in caught if w.category is DeprecationWarning]  # Horovod's for num_groups
        note = " warned=DeprecationWarning" if deprecations else ""
    except Exception as exc:  # noqa: BLE001 - the outcome is what we report
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    if reference is None:
        return params, "ok" + note
    diff = max((a - b).abs().max().item() for a, b in zip(params, reference))
    return params, ("ok(=horovod)" if diff == 0 else f"ok(differs by {diff:.3g})") + note


out_dir = Path(sys.argv[1])
for feature in sys.argv[2:]:
    ref, theirs = outcome(feature, "horovod")
    _, w1 = outcome(feature, 1, ref)
    _, w2 = outcome(feature, 2, None)
    print(f"RESULT rank{rank} {feature} horovod={theirs} | w1={w1} | w2={w2}", flush=True)
    with open(out_dir / f"rank{rank}.jsonl", "a") as results:
        results.write(json.dumps({"feature": feature, "horovod": theirs, "w1": w1, "w2": w2}) + "\n")
