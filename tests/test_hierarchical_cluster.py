"""Hierarchical reductions for real: horovodrun --gloo on 2 emulated hosts with 2 ranks each
(network namespaces, tools/cluster/horovodrun.py; skipped where they cannot be made). Replicas
stay bitwise equal to a communicator-free reference, and the bytes that cross between hosts
shrink by the ranks per host: counted per collective, and on each host's link by the kernel."""
import re
import sys

import pytest

from launcher import ROOT, TESTS
from test_cluster import WHY_NOT

pytestmark = [pytest.mark.skipif(bool(WHY_NOT), reason=WHY_NOT), pytest.mark.multiprocess]

# The kernel counts more than the reductions' payload (TCP/IP headers and acks, the membership sums,
# Horovod's own coordination): 0.9-1.7% above the int8 payload the schedule sends (38.09 MB flat,
# 19.05 MB hierarchical over 6 steps) in the runs of this commit, whose ratios were 0.498 and 0.5005
# (the payload alone: 0.500, counted in the rank script). The margin on 1/local_size; a
# hierarchical run that sent flat's bytes measured 1.003 of them.
OVERHEAD = 0.02
# Horovod's coordination grows with the run's length, not its payload: its Gloo controller talks
# across the hosts every cycle (1 ms by default), and a hierarchical phase slowed by the other test
# worker once sent 0.70 MB above its payload against flat's 0.46 (ratio 0.5123, over the margin).
# At the 20 ms cycle `make bench` runs with (docs/transports.md), that term is a twentieth.
CYCLE_MS = "20"


def test_two_hosts_of_two_ranks_under_horovodrun():
    from tools.cluster import horovodrun
    from tools.cluster.netns import Cluster, leftover_namespaces

    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}:{TESTS}:{TESTS / 'mp'}", "PYTHONUNBUFFERED": "1",
           "HOROVOD_CYCLE_TIME": CYCLE_MS}
    with Cluster(2, rate="10gbit") as cluster:
        prefix = cluster.prefix
        out = horovodrun.run(cluster, [sys.executable, str(TESTS / "mp" / "hierarchical_cluster.py"), "6"],
                             ranks_per_host=2, env=env, timeout=400)
    assert leftover_namespaces(prefix) == []
    assert out.returncode == 0, out.stdout[-6000:]
    for check in ["hierarchical-int8", "hierarchical-int4", "hierarchical-fp16", "hierarchical-int8-bf16-node",
                  "counted-cross-host-bytes", "train-flat", "train-hierarchical",
                  "train-second-hierarchical"]:
        assert len(re.findall(rf"PASS rank\d {re.escape(check)}\n", out.stdout)) == 4, (check, out.stdout[-4000:])
    host_bytes = {mode: [int(b) for b in re.findall(rf"HOSTBYTES {mode} (\d+)", out.stdout)]
                  for mode in ("flat", "hierarchical")}
    assert all(len(v) == 2 for v in host_bytes.values()), out.stdout[-4000:]
    flat, hier = sum(host_bytes["flat"]), sum(host_bytes["hierarchical"])
    print(f"bytes sent on the hosts' links over the training: flat {flat}, hierarchical {hier} ({hier / flat:.4f})")
    assert hier <= flat / 2 * (1 + OVERHEAD)
