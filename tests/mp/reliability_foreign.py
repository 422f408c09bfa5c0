"""Someone outside the job reaches a running job's store and ports (issue 32).

Usage: reliability_foreign.py CODEC   (under horovodrun -np 2)

After 4 of 12 steps, rank 0 checks that the pipeline's store listens on the channel's address
only (not on every interface), then starts a foreign client in a process of its own (no secret)
that connects to the store and writes keys: a forged status-board entry saying rank 1 is exiting
(were it believed, rank 0 would stop with "rank 1 is exiting"; the board's request counter is
left alone here, so that the ranks' own entries are not rewritten before rank 0 reads
the board: a bump only makes each rank publish again), and every key it can list overwritten with
a pickled object; then it sends random bytes and a pickled object
(which, unpickled, would create a file) to the store's port and to every port either rank
listens on. The job must finish unaffected: equal replicas, the forged entry refused (counted),
the file absent. Prints ``PASS rank<r> foreign-<codec>``.
"""
import os
import subprocess
import sys
import tempfile

import horovod.torch as hvd
import torch

import pipesgd_hvd.torch as psgd
from common import assert_replicas_identical, passed
from reference import loss_fn, make_batches, make_model

ATTACKER = r"""
import datetime, json, os, pickle, socket, sys, time
import torch.distributed as dist
host, port, board, marker = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
ports = [int(p) for p in sys.argv[5:]]

class Boom:
    def __reduce__(self):
        return (open, (marker, "w"))

store = dist.TCPStore(host, port, None, False, timeout=datetime.timedelta(seconds=10))
forged = {"rank": 1, "phase": "exit", "begun": 0, "ended": 0, "wait": None, "for_s": 0, "where": None,
          "hvd_join": False, "in_horovod": False, "flushes": [], "joined_at": None, "error": None,
          "knows": [], "answers": 10 ** 6, "host": "evil", "pid": 1}
for key in store.list_keys() if hasattr(store, "list_keys") else []:
    if not key.endswith("/requests"):
        store.set(key, pickle.dumps(Boom()))
store.set(f"{board}/status/1", json.dumps(forged))
for p in ports:
    for data in (os.urandom(4096), pickle.dumps(Boom()), b"\xff" * 65536):
        try:
            with socket.create_connection((host, p), timeout=2) as s:
                s.sendall(data)
                time.sleep(0.05)
        except OSError:
            pass
print("ATTACKED", len(ports), "ports", flush=True)
"""


def listening_ports():
    out = subprocess.run(["ss", "-ltnp"], capture_output=True, text=True).stdout
    return [line.split()[3] for line in out.splitlines() if f"pid={os.getpid()}," in line]


codec = sys.argv[1]
hvd.init()
rank = hvd.rank()
batches = make_batches(12, hvd.size())
model = make_model()
opt = psgd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                named_parameters=model.named_parameters(), compression=codec)
marker = os.path.join(tempfile.gettempdir(), f"psgd-foreign-{os.getppid()}")


def step(t):
    opt.zero_grad()
    loss_fn(model, batches[t][rank]).backward()
    opt.step()


for t in range(4):
    step(t)
channel = getattr(opt._core.comm, "inner", opt._core.comm)  # the channel behind the process's shared communicator
everyone = hvd.allgather_object(listening_ports(), name="foreign.ports")
if rank == 0:
    store_port = channel._store.port
    listens = [a for a in everyone[0] if a.endswith(f":{store_port}")]
    assert listens == [f"{channel.address}:{store_port}"], f"the store listens on {listens}, not on the channel's address"
board = opt._core.inspector.board
if rank == 0:
    ports = sorted({int(a.rsplit(":", 1)[1]) for addresses in everyone for a in addresses})
    attack = subprocess.run([sys.executable, "-c", ATTACKER, channel.address, str(store_port),
                             f"board/{board._ns}", marker, *map(str, ports)],
                            capture_output=True, text=True, timeout=60)
    print(attack.stdout.strip(), attack.stderr.strip()[-500:], flush=True)
    assert "ATTACKED" in attack.stdout
    # The forged entry sits where the board reads rank 1's (issue 40: it was written under the
    # channel's prefix twice, a key nothing reads), and is refused there.
    assert b'"host": "evil"' in channel._store.get(f"board/{board._ns}/status/1")
    entries = board.read()
    assert entries[1] is None or entries[1]["host"] != "evil", entries[1]
    assert board.forged >= 1, "the forged board entry was not counted"
    opt._core.inspector._judge(entries, opt._core.engine.step)  # what a waiting rank concludes from them
    assert opt._core.inspector.verdict is None, opt._core.inspector.verdict
hvd.allreduce(torch.zeros(1), name="foreign.attacked")  # rank 1 trains on only after the attack
for t in range(4, 12):
    step(t)
opt.flush()
assert not os.path.exists(marker), "something unpickled the foreign bytes"
assert_replicas_identical(model.parameters(), "foreign")
passed(f"foreign-{codec}")
