"""Horovod ranks on the emulated cluster, one per host, started by ``mpirun`` from host 0.

``horovodrun`` would reach other hosts over ssh, which is not here; Open MPI's rsh launcher
calls ``rsh_agent.sh`` instead, which enters the host's namespace. Rendezvous and all traffic go
over the shaped links (198.18.0.0/24), never loopback: ``btl tcp,self`` leaves out shared memory.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from .netns import SUBNET, Cluster

AGENT = Path(__file__).resolve().with_name("rsh_agent.sh")

# Why each setting (measured on this emulated cluster when it was built): Open MPI's progress thread
# spins without yield_when_idle and took 40-75% of the core compute needs (compute alone went from
# ~150 to 240-270 ms); its default ring allreduce of 25 MB on 2 ranks ran ~1.5x slower than the
# link, recursive doubling (algorithm 3) reached the link's rate.
MPI_SETTINGS = [
    "--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_include", SUBNET, "--mca", "oob_tcp_if_include", SUBNET,
    "--bind-to", "none", "--mca", "mpi_yield_when_idle", "1",
    "--mca", "coll_tuned_use_dynamic_rules", "1", "--mca", "coll_tuned_allreduce_algorithm", "3",
]


def mpirun_command(cluster: Cluster, cmd: Sequence[str], env: Optional[Dict[str, str]] = None,
                   ranks_per_host: int = 1) -> List[str]:
    hosts = ",".join(f"{cluster.address(i)}:{ranks_per_host}" for i in range(cluster.hosts))
    forwarded: List[str] = []
    for name in sorted(env or {}):
        forwarded += ["-x", name]
    mpirun = ["mpirun", "--allow-run-as-root", "-np", str(cluster.hosts * ranks_per_host), "-H", hosts,
              "--mca", "plm_rsh_agent", str(AGENT), *MPI_SETTINGS, *forwarded, *cmd]
    return cluster.exec(0, mpirun)


def run(cluster: Cluster, cmd: Sequence[str], env: Optional[Dict[str, str]] = None, timeout: float = 900,
        ranks_per_host: int = 1) -> subprocess.CompletedProcess:
    """Runs ``cmd`` on every host; returns the finished process (output captured). The child
    environment gets ``env`` (also forwarded to every rank) and the namespace prefix for the agent."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    full_env["PSGD_CLUSTER_PREFIX"] = cluster.prefix
    return subprocess.run(mpirun_command(cluster, cmd, env, ranks_per_host), env=full_env, capture_output=True,
                          text=True, timeout=timeout)
