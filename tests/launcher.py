"""Runs a script on several ranks under ``horovodrun`` and fails with every rank's output.

Used by the multi-process tests: ``run_ranks("mp/script.py", "--flag")`` launches
``horovodrun -np 2 -H localhost:2 python tests/mp/script.py --flag`` in its own process group,
kills the whole group when ``timeout`` passes, and raises AssertionError (with the output) when
any rank fails. Returns the combined output so a test can check what the ranks printed.

Under the MPI controller the launcher runs the ``mpirun`` command that ``horovodrun --mpi``
builds for one host (the same flags less one unused transport, see ``mpirun_command``; the ranks
see the same environment), without horovodrun's start-up checks, which cost 3-5 s per launch here
(about 80 launches in the suite).
``via_horovodrun=True`` keeps horovodrun itself: the drop-in tests use it, as users do.
Gloo launches go through horovodrun, less its per-launch build check
(tests/horovodrun_checked_at_install.py).
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterable, List, Optional

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
HOROVODRUN = Path(sys.executable).with_name("horovodrun")
# horovodrun without the build check it repeats at every launch (the install checks it once)
HOROVODRUN_CHECKED = [sys.executable, str(TESTS / "horovodrun_checked_at_install.py")]


def rank_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    env = dict(os.environ)
    env.update({
        "PYTHONUNBUFFERED": "1",
        "TF_CPP_MIN_LOG_LEVEL": "3",
        # two ranks share two cores: one compute thread each, or they thrash
        "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
        # ... with the other test worker's ranks too: the machine is oversubscribed, which Open MPI
        # cannot see from -H localhost:2, so it would busy-poll. A rank whose Horovod thread waits
        # for the other rank in the controller's MPI collective then spins a whole core; yielding,
        # Horovod's own collectives of tests/mp/horovod_ops.py ran in 7.5 s and 14.6 CPU-s instead
        # of 11.2 s and 22.1 (both ranks import TensorFlow while the first's Horovod waits).
        "OMPI_MCA_mpi_yield_when_idle": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), str(TESTS), env.get("PYTHONPATH", "")])),
    })
    env.update(extra or {})
    return env


def run_ranks(script: str, *args: str, np: int = 2, timeout: float = 180, controller: str = "mpi",
              env: Optional[Dict[str, str]] = None, expect_failure: bool = False,
              via_horovodrun: bool = False) -> str:
    """Launch ``script`` (relative to tests/) on ``np`` ranks; ``controller`` is "mpi" or "gloo"."""
    cmd = launch_command(script, *args, np=np, controller=controller, via_horovodrun=via_horovodrun)
    return run_command(cmd, f"{script} {' '.join(args)}", timeout, env, expect_failure)


def launch_command(script: str, *args: str, np: int = 2, controller: str = "mpi",
                   via_horovodrun: bool = False) -> List[str]:
    """The command that ``run_ranks`` runs."""
    program = [sys.executable, str(TESTS / script), *args]
    if controller == "mpi" and not via_horovodrun:
        return mpirun_command(np) + program
    launcher = [str(HOROVODRUN)] if via_horovodrun else HOROVODRUN_CHECKED
    return [*launcher, "-np", str(np), "-H", f"localhost:{np}", f"--{controller}", *program]


def assert_passed(out: str, checks: Iterable[str], ranks: Iterable[int] = (0, 1)) -> None:
    """Every rank of ``ranks`` printed ``PASS rank<r> <check>`` (tests/mp/common.py ``passed``) for every check."""
    for rank in ranks:
        for check in checks:
            assert f"PASS rank{rank} {check}" in out, f"missing: rank {rank} {check}"


def mpirun_command(np: int) -> List[str]:
    """What ``horovodrun -np N -H localhost:N --mpi`` runs with Open MPI (horovod/runner/mpi_run.py),
    less Open MPI's libfabric transport (btl ofi): the ranks talk over TCP on loopback and never
    use it, but closing it sleeps 1 s in every rank's MPI_Finalize (seen in gdb: mca_btl_ofi's
    component close in ``sleep``), which was 1.3 s of each MPI launch's 2.9 s for a script that
    only imports torch and calls hvd.init()."""
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        raise AssertionError("mpirun is not on PATH: run scripts/install.sh (it installs Open MPI)")
    return [mpirun, "--allow-run-as-root", "--tag-output", "-np", str(np), "-H", f"localhost:{np}",
            "-bind-to", "none", "-map-by", "slot", "-mca", "pml", "ob1", "-mca", "btl", "^openib,ofi",
            "-mca", "btl_tcp_if_include", "lo", "-x", "NCCL_SOCKET_IFNAME=lo"]


def run_torchrun(script: str, *args: str, np: int = 2, timeout: float = 180) -> str:
    """``torchrun --nproc_per_node np`` (torch.distributed without Horovod); fails with the output."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(np),
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(TESTS / script), *args]
    return run_command(cmd, f"torchrun {script} {' '.join(args)}", timeout, None, False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_command(cmd: List[str], what: str, timeout: float, env: Optional[Dict[str, str]], expect_failure: bool) -> str:
    proc = subprocess.Popen(cmd, cwd=ROOT, env=rank_env(env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and every rank it started
        out, _ = proc.communicate()
        raise AssertionError(f"{what}: no result within {timeout:.0f} s; output:\n{_tail(out)}")
    if expect_failure and proc.returncode == 0:
        raise AssertionError(f"{what} was expected to fail but exited 0; output:\n{_tail(out)}")
    if not expect_failure and proc.returncode != 0:
        raise AssertionError(f"{what} failed (exit {proc.returncode}); output:\n{_tail(out)}")
    return out


def _tail(text: str, lines: int = 200) -> str:
    return "\n".join(text.splitlines()[-lines:])
