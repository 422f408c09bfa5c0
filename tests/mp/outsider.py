"""An outsider attacks a running job's store and ports (issue 40): the job must not notice.

Usage: outsider.py CODEC   (under horovodrun -np N, N >= 2)

After 3 steps rank 0 checks that the pipeline's store listens on the channel's address only,
then starts the outsider: a process of its own, without the job's secret, that reaches the store
and every port any rank listens on, as anyone on the host could. It first reads every key it can
list (keeping the genuine values), then, while the ranks train (rank N-1 sleeps 3 s mid-training,
so that the others wait, and their stall inspectors ask, read and warn through the board under
attack), it loops: random bytes, a forged JSON status entry saying a rank is exiting, a non-number
at the request counter and the genuine values it read earlier (replayed) written to the keys it
lists; keys deleted; a flood of new keys; random bytes and a pickle (which, unpickled, would
create a file) sent to every port, and a flood of connections to the store's.

Then, deterministically: every rank publishes a fresh entry and reads everyone's; the outsider
writes back rank 1's first entry (replayed), random bytes at rank 0's (forged), a non-number at
the request counter (forged) and deletes rank 2's entry (with 3 or more ranks), over and over,
while every rank reads the board: each such value must be counted and ignored (every entry read
is its rank's genuine latest one), and the board must keep working (a poke after the non-number).

Then training goes on to the end and flushes: the replicas must be equal on every rank and, with
no compression, equal to the plain reference of the pipelined rule (tests/reference.py). Each
rank prints ``COUNTS rank<r> forged=.. replayed=.. removed=..`` and
``PASS rank<r> outsider-<codec> in <s> s`` (from the attack's start to the end of training).
"""
import json
import os
import subprocess
import sys
import tempfile
import time

import horovod.torch as hvd
import torch

import pipesgd_hvd.torch as psgd
from common import assert_replicas_identical, passed
from reference import loss_fn, make_batches, make_model, reference_sgd

ATTACKER = r"""
import datetime, json, os, pickle, random, socket, sys, threading, time
import torch.distributed as dist

host, port, board, size, marker = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5]
ports = [int(p) for p in sys.argv[6:]]
ABSENT = b"\x00outsider:absent\x00"


class Boom:
    def __reduce__(self):
        return (open, (marker, "w"))


store = dist.TCPStore(host, port, None, False, timeout=datetime.timedelta(seconds=10))
read = lambda key: bytes(store.compare_set(key, ABSENT, ABSENT))
statuses = [f"{board}/status/{r}" for r in range(size)]
deadline = time.time() + 30
while not all(k in store.list_keys() for k in statuses) and time.time() < deadline:
    time.sleep(0.1)
first = {k: read(k) for k in store.list_keys()}  # the genuine values of now, to replay later
assert all(first.get(k, ABSENT) != ABSENT for k in statuses), sorted(first)
print("READY", len(first), "keys", flush=True)
forged_exit = json.dumps({"rank": 1, "phase": "exit", "begun": 0, "ended": 0, "wait": None, "for_s": 0,
                          "where": None, "hvd_join": False, "in_horovod": False, "flushes": [], "joined_at": None,
                          "error": None, "knows": [], "answers": 10 ** 6, "host": "evil", "pid": 1})
attacks = {"set": 0, "replay": 0, "delete": 0, "flood": 0, "connect": 0}


def poke_ports(rng):
    for p in ports:
        data = rng.choice([os.urandom(4096), pickle.dumps(Boom()), b"\xff" * 65536])
        try:
            with socket.create_connection((host, p), timeout=1) as s:
                s.sendall(data)
        except OSError:
            pass
        attacks["connect"] += 1
    held = []
    for _ in range(50):  # a flood of connections to the store's port, held a moment
        try:
            held.append(socket.create_connection((host, port), timeout=1))
        except OSError:
            pass
    time.sleep(0.05)
    for s in held:
        s.sendall(os.urandom(64))
        s.close()
    attacks["connect"] += len(held)


def chaos(stop):
    rng = random.Random(0)
    flood = 0
    while not stop.is_set():
        for key in [k for k in store.list_keys() if not k.startswith("flood/")]:
            r = rng.random()
            if r < 0.25:
                store.set(key, os.urandom(rng.randint(0, 512)))
            elif r < 0.35:
                store.set(key, forged_exit if "/status/" in key else b"not a number")
            elif r < 0.55 and key in first:
                store.set(key, first[key])
                attacks["replay"] += 1
                continue
            elif r < 0.65:
                store.delete_key(key)
                attacks["delete"] += 1
                continue
            else:
                continue
            attacks["set"] += 1
        for i in range(100):  # bounded: 100 KiB of new keys a round
            store.set(f"flood/{flood}/{i}", os.urandom(1024))
        flood += 1
        attacks["flood"] += 100
        if flood % 5 == 1:
            poke_ports(rng)
        time.sleep(0.02)


stop = threading.Event()
thread = threading.Thread(target=chaos, args=(stop,))
thread.start()
assert sys.stdin.readline().strip() == "calm"
stop.set()
thread.join()
print("CHAOS", json.dumps(attacks), flush=True)
assert sys.stdin.readline().strip() == "final"
final = {statuses[1]: first[statuses[1]], statuses[0]: os.urandom(200), f"{board}/requests": b"not a number"}
stop = threading.Event()


def repeat():  # over and over: a rank's own monitor may write its entry anew in between
    while not stop.is_set():
        for key, value in final.items():
            store.set(key, value)
        if size >= 3:
            store.delete_key(statuses[2])
        time.sleep(0.005)


thread = threading.Thread(target=repeat)
thread.start()
print("FINAL", flush=True)
assert sys.stdin.readline().strip() == "stop"
stop.set()
thread.join()
print("DONE", flush=True)
"""

STEPS, AFTER, STALL_AT, LR = 10, 3, 6, 0.1


def listening_ports():
    out = subprocess.run(["ss", "-ltnp"], capture_output=True, text=True).stdout
    return [line.split()[3] for line in out.splitlines() if f"pid={os.getpid()}," in line]


def barrier(name):
    hvd.allreduce(torch.zeros(1), name=f"outsider.{name}")


codec = sys.argv[1]
hvd.init()
rank, size = hvd.rank(), hvd.size()
batches = make_batches(STEPS + AFTER, size)
model = make_model()
opt = psgd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR), named_parameters=model.named_parameters(),
                                compression=codec)
marker = os.path.join(tempfile.gettempdir(), f"psgd-outsider-{os.getppid()}")


def step(t):
    opt.zero_grad()
    loss_fn(model, batches[t][rank]).backward()
    opt.step()


for t in range(3):
    step(t)
channel = getattr(opt._core.comm, "inner", opt._core.comm)  # the channel behind the process's shared communicator
board = opt._core.inspector.board
everyone = hvd.allgather_object(listening_ports(), name="outsider.ports")
attacker = None
if rank == 0:
    store_port = channel._store.port
    listens = [a for a in everyone[0] if a.endswith(f":{store_port}")]
    assert listens == [f"{channel.address}:{store_port}"], f"the store listens on {listens}, not on the channel's address"
    ports = sorted({int(a.rsplit(":", 1)[1]) for addresses in everyone for a in addresses})
    attacker = subprocess.Popen([sys.executable, "-c", ATTACKER, channel.address, str(store_port),
                                 f"board/{board._ns}", str(size), marker, *map(str, ports)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = attacker.stdout.readline()
    assert line.startswith("READY"), line
    print(f"OUTSIDER {line.strip()}, {len(ports)} ports", flush=True)
barrier("ready")
started = time.monotonic()

# Training under attack; the last rank stalls, so that the others' inspectors use the board.
for t in range(3, STEPS):
    step(t)
    if t == STALL_AT and rank == size - 1:
        time.sleep(3.0)

# The deterministic part: the chaos stops; fresh genuine entries, read by everyone; then the
# outsider's chosen values, written over and over while every rank reads.
barrier("trained")
if rank == 0:
    attacker.stdin.write("calm\n")
    attacker.stdin.flush()
    print(f"OUTSIDER {attacker.stdout.readline().strip()}", flush=True)  # what the chaos did
barrier("calm")
opt._core.inspector._publish_quietly()
barrier("published")
assert all(e is not None and e["rank"] == r for r, e in enumerate(board.read())), board.read()
pids = hvd.allgather_object(os.getpid(), name="outsider.pids")
barrier("seen")
if rank == 0:
    attacker.stdin.write("final\n")
    attacker.stdin.flush()
    assert attacker.stdout.readline().strip() == "FINAL"
barrier("final")
before = (board.forged, board.replayed, board.removed)
for _ in range(20):
    entries = board.read()
    assert [e["pid"] for e in entries] == pids, (entries, pids)  # only genuine entries of this job
    requests = board.requests()
    time.sleep(0.02)
poked = board.poke()
assert poked > requests, (poked, requests)  # the board's connection survived the non-number
forged, replayed, removed = (board.forged - before[0], board.replayed - before[1], board.removed - before[2])
barrier("counted")
if rank == 0:
    attacker.stdin.write("stop\n")
    attacker.stdin.flush()
    assert attacker.stdout.readline().strip() == "DONE"
    assert attacker.wait(timeout=30) == 0
print(f"COUNTS rank{rank} forged={board.forged} replayed={board.replayed} removed={board.removed} "
      f"(of the final values: {forged}, {replayed}, {removed})", flush=True)
assert forged >= 2, ("the forged entry of rank 0 and the forged request number were not both counted", forged)
assert replayed >= 1, ("rank 1's replayed entry was not counted", replayed)
assert size < 3 or removed >= 1, ("rank 2's deleted entry was not counted", removed)

for t in range(STEPS, STEPS + AFTER):
    step(t)
opt.flush()
elapsed = time.monotonic() - started
assert not os.path.exists(marker), "something unpickled the outsider's bytes"
assert_replicas_identical(model.parameters(), "outsider")
if codec == "none":
    ref = reference_sgd(STEPS + AFTER, size, 2, LR, batches=lambda t: batches[t], flush=True)
    for (name, p), r in zip(model.named_parameters(), ref):
        # The channel's ring all-reduce sums in another order than the reference (4 ranks): a few ulps.
        assert torch.allclose(p, r, rtol=1e-5, atol=1e-6), f"{name} off the reference by {(p - r).abs().max()}"
passed(f"outsider-{codec} in {elapsed:.1f} s")
print(json.dumps({"rank": rank, "elapsed": round(elapsed, 1)}), flush=True)
