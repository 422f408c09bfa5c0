"""Horovod elastic (``hvd.elastic.run`` + ``hvd.elastic.TorchState``) with the pipelined optimizer.

The rule (``pipesgd_hvd/optimizer/elastic_rule.py``): a world change drops the old world's unwaited reductions
on every rank, a lost worker sends every survivor back to the last commit (its in-flight gradient
included), and every rank of the new world, joining ones too, continues from rank 0's state.
"""
import json
import re
import stat
import sys

import pytest
import torch

import pipesgd_hvd.torch as psgd
from launcher import HOROVODRUN_CHECKED, TESTS, run_command
from pipesgd_hvd.optimizer import elastic_rule as elastic
from pipesgd_hvd.ops.torch import TORCH_OPS
from pipesgd_hvd.testing import LocalWorld
from threads import run_threads


def third_local_name() -> str:
    """A third name for this machine, besides localhost and 127.0.0.1, that Horovod runs without
    ssh: one that resolves to an address of a local interface (Horovod's own test of "local").
    The host name usually does; else a non-loopback address of the machine."""
    import socket

    import psutil  # a dependency of horovodrun

    local = {a.address for addrs in psutil.net_if_addrs().values() for a in addrs if a.family == socket.AF_INET}
    for name in (socket.gethostname(), socket.getfqdn()):
        try:
            if name not in ("localhost", "127.0.0.1") and socket.gethostbyname(name) in local:
                return name
        except OSError:
            continue
    others = sorted(local - {"127.0.0.1"})
    if not others:
        pytest.skip("no third local host name for Horovod elastic (the host name does not resolve to a local "
                    "address and there is no other interface)")
    return others[0]


@pytest.mark.multiprocess
@pytest.mark.parametrize("correction", [None, "split_batch"], ids=["plain", "split-batch"])
def test_elastic_worker_joins_then_one_is_killed_and_training_continues(tmp_path, correction):
    """``tests/mp/elastic_torch.py`` (width 2, int8 + error feedback, commit every 3 steps):
    starts on 2 workers, a third joins after step 4 (the discovery script's output changes), the
    joined one SIGKILLs itself mid-pipeline at step 14, the 2 survivors finish 24 steps. With
    ``split_batch`` (two calls per update) a new world takes rank 0's real weights and restarts
    the pair; the replicas' real weights agree at every check."""
    join_host = third_local_name()
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:1\n127.0.0.1:1\n")  # two host names, both this machine
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {hosts}\n")
    discover.chmod(discover.stat().st_mode | stat.S_IEXEC)
    cmd = [*HOROVODRUN_CHECKED, "-np", "2", "--min-np", "1", "--max-np", "3", "--gloo",
           "--host-discovery-script", str(discover),
           sys.executable, str(TESTS / "mp" / "elastic_torch.py"), str(tmp_path), "24", join_host,
           *(["--correction", correction] if correction else [])]
    # Gloo's timeout bounds how long the survivor that was not connected to the killed worker
    # waits before its Horovod shuts down (default 30 s); 10 s leaves room for a loaded machine.
    out = run_command(cmd, "elastic_torch.py", 150, {"HOROVOD_GLOO_TIMEOUT_SECONDS": "10"}, False)
    events = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]

    starts = [e for e in events if e["event"] == "start"]
    assert [(s["size"], s["hosts"]) for s in starts] == [
        (2, ["127.0.0.1", "localhost"]), (3, sorted(["127.0.0.1", "localhost", join_host])),
        (2, ["127.0.0.1", "localhost"])], events
    # Every rank checked (allgather) that all ranks hold the same weights, step count, in-flight
    # gradient and batch at each start and before each commit; the engine's step is the batch.
    checked = [e for e in events if e["event"] in ("start", "commit", "end")]
    if correction is None:
        assert all(e["step"] == e["batch"] for e in checked), events
    else:  # an update is two calls; a new world restarts the pair, so a step may take three
        assert all(e["batch"] // 3 <= e["step"] <= e["batch"] // 2 for e in checked), events
    assert any(e["event"] == "commit" and e["size"] == 3 for e in events), "no commit with the joined worker"

    def last_commit_before(start):
        before = events[:events.index(start)]
        return [e for e in before if e["event"] == "commit"][-1]

    # Join (HostsUpdatedInterrupt at a commit): nothing was in flight unwaited, nothing is lost;
    # the new worker starts with the others' weights and their pending (averaged) gradient.
    joined, committed = starts[1], last_commit_before(starts[1])
    assert joined["batch"] == committed["batch"] and joined["in_flight"] == committed["in_flight"], events
    assert joined["in_flight"] == 1 or correction is not None, events
    assert (joined["weights"], joined["pending"]) == (committed["weights"], committed["pending"]), events
    # Kill at step 14 (HorovodInternalError): the survivors drop the reductions in flight and go
    # back to the commit at step 12, pending gradient included.
    resumed, committed = starts[2], last_commit_before(starts[2])
    assert committed["size"] == 3 and resumed["batch"] == committed["batch"] == 12, events
    assert (resumed["weights"], resumed["pending"]) == (committed["weights"], committed["pending"]), events
    end = events[-1]
    assert end["event"] == "end" and end["batch"] == 24 and end["in_flight"] == 0, events
    assert end["step"] == 24 or correction is not None, events
    assert re.search(rf"worker on {re.escape(join_host)} \(rank \d\) kills itself at step 14", out), out
    done = sorted(re.findall(r"DONE (\S+) rank (\d) of 2 at batch 24", out))  # ranks are assigned by host order
    assert [host for host, _ in done] == ["127.0.0.1", "localhost"] and {r for _, r in done} == {"0", "1"}, out


def test_elastic_job_is_detected_from_horovodrun_environment(monkeypatch):
    monkeypatch.delenv("HOROVOD_ELASTIC", raising=False)
    assert not elastic.is_elastic_job()
    monkeypatch.setenv("HOROVOD_ELASTIC", "1")  # what an elastic horovodrun sets for its workers
    assert elastic.is_elastic_job()


def test_state_for_a_new_world_keeps_the_pending_gradient_and_drops_residuals():
    held = {"format": 1, "step": 7, "in_flight": [{"step": 6, "grads": {"w": 1}}], "codec": {"residuals": {"k": 2}}}
    state = elastic.state_for_new_world(held, {"residuals": {}})
    assert state["step"] == 7 and state["in_flight"] == held["in_flight"] and state["codec"] == {"residuals": {}}


def test_abandon_drops_unwaited_steps_keeps_waited_ones_and_stops_the_engine():
    """In-process ranks: after abandon(), the state holds exactly the steps already waited for
    and nothing waits on the abandoned collectives; the engine refuses further use."""
    world = LocalWorld(2, TORCH_OPS)

    def rank_fn(rank, comm):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2)
        opt = psgd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters(), width=2,
                                        communicator=comm)
        for _ in range(3):
            opt.zero_grad()
            model(torch.ones(4, 3) * (rank + 1)).sum().backward()
            opt.step()
        engine = opt.engine
        waited = engine.state_dict()  # waits for step 2's reduction: it stays in the queue, reduced
        opt.zero_grad()
        model(torch.ones(4, 3)).sum().backward()  # step 3 opened, its reduction started
        held = engine.abandon()
        assert [e["step"] for e in held["in_flight"]] == [e["step"] for e in waited["in_flight"]] == [2]
        assert held["step"] == 3  # step 3 never ended
        with pytest.raises(RuntimeError, match="abandoned at a change of the Horovod world"):
            engine.flush()
        return True

    assert run_threads(world, rank_fn) == [True, True]


def test_torch_state_uses_our_handler_and_refuses_what_it_does_not_support_yet():
    import horovod.torch as hvd

    from pipesgd_hvd.torch.elastic_state import PipelinedOptimizerStateHandler

    comm = LocalWorld(1, TORCH_OPS).communicator(0)
    model = torch.nn.Linear(3, 2)
    opt = psgd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                    named_parameters=model.named_parameters(), communicator=comm)
    state = hvd.elastic.TorchState(model=model, optimizer=opt, batch=0)
    assert isinstance(state._handlers["optimizer"], PipelinedOptimizerStateHandler)
    assert type(state._handlers["model"]).__name__ == "ModelStateHandler"  # Horovod's, untouched
    predicted = psgd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                          named_parameters=model.named_parameters(), communicator=comm,
                                          staleness_correction=True)
    with pytest.raises(ValueError, match="does not support staleness_correction='weight_prediction'.*'split_batch'"):
        hvd.elastic.TorchState(model=model, optimizer=predicted)
    accurate = psgd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters(), communicator=comm,
                                         staleness_correction="split_batch")
    hvd.elastic.TorchState(model=model, optimizer=accurate)  # the accurate mode runs under elastic
