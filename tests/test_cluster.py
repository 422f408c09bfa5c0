"""The emulated cluster (tools/cluster): hosts reach each other over shaped links, ranks start
one per host, and tear-down leaves no namespace behind, also after a failure or a signal."""
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tools.cluster.netns import Cluster, leftover_namespaces


def _why_no_netns() -> str:
    """Why this machine cannot host the emulated cluster ('' if it can)."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    missing = [tool for tool in ("ip", "tc", "unshare") if shutil.which(tool) is None]
    if missing:
        return f"needs iproute2 and util-linux ({', '.join(missing)} not found)"
    # Root inside a container may still lack CAP_SYS_ADMIN: try an anonymous network namespace
    # (nothing named, nothing left behind).
    probe = subprocess.run(["unshare", "--net", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot create network namespaces here: {probe.stderr.strip()}"
    return ""


WHY_NOT = _why_no_netns()
pytestmark = pytest.mark.skipif(bool(WHY_NOT), reason=WHY_NOT)


def test_two_hosts_talk_over_the_shaped_link_and_leave_nothing_behind():
    with Cluster(2, rate="200mbit") as cluster:
        prefix = cluster.prefix
        assert sorted(leftover_namespaces(prefix)) == sorted([cluster.switch, cluster.namespace(0), cluster.namespace(1)])
        # 2 MB from host 1 to host 0 at 200 Mbit/s takes >= 80 ms: the link is shaped, not loopback.
        server = subprocess.Popen(cluster.exec(0, [sys.executable, "-c", (
            "import socket; s = socket.socket(); s.bind(('198.18.0.1', 18600)); s.listen(); print('READY', flush=True); "
            "c, _ = s.accept(); n = 0\nwhile True:\n d = c.recv(1 << 16)\n if not d: break\n n += len(d)\nprint(n)")]),
            stdout=subprocess.PIPE, text=True)
        assert server.stdout.readline().strip() == "READY"  # listening: the client may connect
        start = time.perf_counter()
        subprocess.run(cluster.exec(1, [sys.executable, "-c", (
            "import socket; c = socket.create_connection(('198.18.0.1', 18600)); c.sendall(b'x' * 2_000_000); "
            "c.close()")]), check=True, timeout=30)
        received = server.communicate(timeout=30)[0]
        elapsed = time.perf_counter() - start
        assert int(received) == 2_000_000
        assert elapsed >= 0.06, f"2 MB took {elapsed:.3f} s: faster than a 200 Mbit/s link allows"
        assert subprocess.run(cluster.exec(1, ["hostname"]), capture_output=True, text=True).stdout.strip() \
            == "198.18.0.2"
    assert leftover_namespaces(prefix) == []


@pytest.mark.multiprocess
@pytest.mark.parametrize("controller", ["mpi", "gloo"])
def test_horovod_ranks_start_one_per_host(controller):
    from tools.cluster import gloo, launch

    script = ("import os, socket, horovod.torch as hvd, torch; hvd.init(); "
              "t = hvd.allreduce(torch.ones(4) * (hvd.rank() + 1), op=hvd.Sum); "
              "names = hvd.allgather_object(socket.gethostname()); "
              # one write(2) per line: mpirun split print()'s separate writes of two ranks into each other
              "os.write(1, f'RANK {hvd.rank()} {socket.gethostname()} {float(t[0])} {names}\\n'.encode())")
    with Cluster(2) as cluster:
        prefix = cluster.prefix
        out = (launch if controller == "mpi" else gloo).run(cluster, [sys.executable, "-c", script],
                                                            env={"OMP_NUM_THREADS": "1"}, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    # (the Gloo launcher returns rank 0's output; mpirun's holds every rank's)
    assert "RANK 0 198.18.0.1 3.0 ['198.18.0.1', '198.18.0.2']" in out.stdout, out.stdout
    assert leftover_namespaces(prefix) == []


def test_tear_down_after_an_error_and_after_sigterm():
    with pytest.raises(RuntimeError):
        with Cluster(2) as cluster:
            prefix = cluster.prefix
            raise RuntimeError("the benchmark failed")
    assert leftover_namespaces(prefix) == []

    prefix = f"psgdt{os.getpid() % 100000}"  # unique: another test run may hold its own cluster
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from tools.cluster.netns import Cluster\n"
        f"with Cluster(2, prefix='{prefix}') as c:\n print('UP', flush=True); time.sleep(60)")],
        stdout=subprocess.PIPE, text=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert holder.stdout.readline().strip() == "UP"
    assert leftover_namespaces(prefix), "the cluster is up"
    holder.send_signal(signal.SIGTERM)
    holder.wait(timeout=30)
    assert leftover_namespaces(prefix) == []
