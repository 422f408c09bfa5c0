"""PipelineChannel on the emulated cluster (tools/cluster): two hosts, shaped links, Horovod
launched by mpirun and by our Gloo launcher. The channel must pick each host's address on the
link (the host name's under mpirun, HOROVOD_GLOO_IFACE's under Gloo), never loopback, and the
issue-15 loop (width 2, int8, an unnamed metric all-reduce after each step) must finish."""
import sys

import pytest

from launcher import ROOT, TESTS
from test_cluster import WHY_NOT

pytestmark = [pytest.mark.skipif(bool(WHY_NOT), reason=WHY_NOT), pytest.mark.multiprocess]


@pytest.mark.parametrize("controller", ["mpi", "gloo"])
def test_channel_runs_the_unnamed_metric_loop_across_hosts(controller):
    from tools.cluster import gloo, launch
    from tools.cluster.netns import Cluster, leftover_namespaces

    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}:{TESTS}"}
    with Cluster(2, rate="1gbit") as cluster:
        prefix = cluster.prefix
        out = (launch if controller == "mpi" else gloo).run(
            cluster, [sys.executable, str(TESTS / "mp" / "channel_unnamed_metric.py"), "channel", "60"], env=env,
            timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    # (the Gloo launcher returns rank 0's output; mpirun's holds every rank's)
    assert "rank0 channel address 198.18.0.1" in out.stdout, out.stdout
    assert "PASS rank0 unnamed-metric-channel-60-steps" in out.stdout, out.stdout
    assert leftover_namespaces(prefix) == []
