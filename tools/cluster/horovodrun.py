"""``horovodrun`` itself on the emulated cluster, several ranks per host, as users launch jobs.

``horovodrun -H 198.18.0.1:2,198.18.0.2:2 --gloo`` reaches other hosts over ssh, which is not
here: it runs inside host 0's namespace with ``ssh.sh`` first on PATH as ``ssh``, which enters
the host's namespace instead. Ranks of one host share its namespace, so their traffic to each
other stays on the host (loopback, unshaped) and only traffic between hosts crosses the shaped
links, as on machines whose GPUs talk over NVLink inside a node. ``--network-interface eth0``:
every host's link (and no interface probe, which would start a task server on every host).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, Optional, Sequence

from .netns import Cluster

SSH = Path(__file__).resolve().with_name("ssh.sh")
HOROVODRUN = Path(sys.executable).with_name("horovodrun")
ROOT = Path(__file__).resolve().parents[2]


def command(cluster: Cluster, cmd: Sequence[str], ranks_per_host: int) -> list:
    hosts = ",".join(f"{cluster.address(i)}:{ranks_per_host}" for i in range(cluster.hosts))
    return cluster.exec(0, [str(HOROVODRUN), "-np", str(cluster.hosts * ranks_per_host), "-H", hosts, "--gloo",
                            "--network-interface", "eth0", "--disable-cache", "--start-timeout", "120", *cmd])


def run(cluster: Cluster, cmd: Sequence[str], ranks_per_host: int = 2, env: Optional[Dict[str, str]] = None,
        timeout: float = 900) -> subprocess.CompletedProcess:
    """Runs ``cmd`` on ``ranks_per_host`` ranks of every host through horovodrun; returns the
    finished launch (stdout and stderr together: horovodrun tags each rank's lines). On a timeout
    the whole launch (horovodrun and every rank it started, here or through ssh.sh) is killed."""
    with tempfile.TemporaryDirectory(prefix="psgd-ssh-") as bindir:
        os.symlink(SSH, os.path.join(bindir, "ssh"))
        full_env = dict(os.environ)
        full_env.update(env or {})
        full_env["PATH"] = os.pathsep.join([bindir, full_env.get("PATH", "")])
        full_env["PSGD_CLUSTER_PREFIX"] = cluster.prefix
        full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), full_env.get("PYTHONPATH", "")]))
        proc = subprocess.Popen(command(cluster, cmd, ranks_per_host), env=full_env, cwd=ROOT, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # horovodrun and the ranks it started here
            kill_namespace_processes(cluster)     # and those it started through ssh.sh
            out, _ = proc.communicate()
            return subprocess.CompletedProcess(list(cmd), 124, out + f"\n[timed out after {timeout:g} s]", "")
        return subprocess.CompletedProcess(list(cmd), proc.returncode, out, "")


def kill_namespace_processes(cluster: Cluster) -> None:
    """Ends every process left in the cluster's host namespaces (all of them started by this launch)."""
    for host in range(cluster.hosts):
        pids = subprocess.run(["ip", "netns", "pids", cluster.namespace(host)], capture_output=True, text=True).stdout
        for pid in pids.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
