"""Horovod ranks on the emulated cluster with the Gloo controller: our own rendezvous server on
host 0 and, per host, the ``HOROVOD_*`` environment ``horovodrun --gloo`` would set.

Why Gloo here: measured on this machine (2 hosts, 700 Mbit/s, 26 MB all-reduce), an MPI
all-reduce took 326 ms alone and 661 ms with a compute step running on the same core: Open MPI's
TCP transport progresses only while its thread polls, which it gets to do in scheduler slices
beside compute. Gloo's TCP pairs are woken by the kernel when data arrives (epoll), so they keep
the link busy beside compute, which is what pipelining needs.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from .netns import Cluster

ROOT = Path(__file__).resolve().parents[2]


def rank_env(cluster: Cluster, rank: int, port: int) -> Dict[str, str]:
    n = cluster.hosts
    return {"HOROVOD_HOSTNAME": cluster.address(rank), "HOROVOD_RANK": str(rank), "HOROVOD_SIZE": str(n),
            "HOROVOD_LOCAL_RANK": "0", "HOROVOD_LOCAL_SIZE": "1", "HOROVOD_CROSS_RANK": str(rank),
            "HOROVOD_CROSS_SIZE": str(n), "HOROVOD_GLOO_RENDEZVOUS_ADDR": cluster.address(0),
            "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port), "HOROVOD_CONTROLLER": "gloo",
            "HOROVOD_CPU_OPERATIONS": "gloo", "HOROVOD_GLOO_IFACE": "eth0"}


def run(cluster: Cluster, cmd: Sequence[str], env: Optional[Dict[str, str]] = None,
        timeout: float = 900) -> subprocess.CompletedProcess:
    """Runs ``cmd`` once per host (rank = host index); returns rank 0's output and the first
    failure's return code (all ranks' stderr joined)."""
    base = dict(os.environ)
    base.update(env or {})
    base["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), base.get("PYTHONPATH", "")]))
    server = subprocess.Popen(cluster.exec(0, [sys.executable, "-m", "tools.cluster.gloo", "--serve",
                                               str(cluster.hosts), "--prefix", cluster.prefix]),
                              stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True, env=base, cwd=ROOT)
    ranks: List[subprocess.Popen] = []
    try:
        port = int(server.stdout.readline().split()[-1])
        for i in range(cluster.hosts):
            ranks.append(subprocess.Popen(cluster.exec(i, list(cmd)), env={**base, **rank_env(cluster, i, port)},
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT))
        deadline = time.monotonic() + timeout
        outputs = []
        for proc in ranks:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outputs.append((proc.returncode, out, err))
    finally:
        for proc in ranks:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        server.kill()
        server.wait()
    code = next((rc for rc, _, _ in outputs if rc != 0), 0)
    return subprocess.CompletedProcess(list(cmd), code, outputs[0][1], "\n".join(err for _, _, err in outputs))


def _serve(hosts: int, prefix: str) -> None:
    from horovod.runner.common.util.hosts import SlotInfo
    from horovod.runner.http.http_server import RendezvousServer

    cluster = Cluster(hosts, prefix=prefix)
    server = RendezvousServer(verbose=0)
    port = server.start()
    server.init([SlotInfo(hostname=cluster.address(i), rank=i, local_rank=0, cross_rank=i, size=hosts,
                          local_size=1, cross_size=hosts) for i in range(hosts)])
    print(f"rendezvous port {port}", flush=True)
    sys.stdin.read()  # serve until the launcher closes our stdin or kills us


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--serve", type=int, required=True)
    parser.add_argument("--prefix", required=True)
    a = parser.parse_args()
    _serve(a.serve, a.prefix)
