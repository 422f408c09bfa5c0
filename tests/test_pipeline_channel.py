"""PipelineChannel (pipesgd_hvd/comm/pipeline_channel.py) on 2 real ranks under horovodrun.

* its alltoall, allgather, all-reduce and object allgather give what Horovod's own ops give, on
  random data, and the compressed all-reduce through it equals the one through Horovod's ops;
* a peer lost by SIGKILL, or frozen by SIGSTOP, makes the other rank raise PeerLostError, within
  PIPESGD_TIMEOUT;
* issue 15 (tests/test_unnamed_collectives.py): unnamed Horovod collectives beside the pipeline
  complete with the channel, the default. By hand, ``tests/mp/channel_unnamed_metric.py horovod``
  shows the hang with Horovod's ops as the pipeline's transport (Horovod's stall log names
  ``allreduce.noname.N`` on one rank and ``.N+1`` on the other), and ``horovod-named`` that naming
  the metric avoids it: the handle counter is the cause.
The optimizer's own lost-peer tests (tests/test_reliability_torch.py) run over the channel too:
SIGKILL under Gloo, SIGSTOP under MPI; here the channel alone, the other two combinations.
"""
import re

import pytest

from launcher import run_ranks

pytestmark = pytest.mark.multiprocess
CONTROLLERS = ["mpi", "gloo"]


def _passed(out: str, check: str) -> bool:
    return all(f"PASS rank{rank} {check}" in out for rank in (0, 1))


@pytest.mark.parametrize("controller", CONTROLLERS)
def test_channel_gives_what_horovods_ops_give(controller):
    out = run_ranks("mp/channel_parity.py", controller=controller, timeout=240)
    for check in ("channel-alltoall-allgather-equal-horovod", "channel-allreduce-equal-horovod",
                  "channel-compressed-allreduce-equal-horovod", "channel-allgather-object-equal-horovod",
                  "channel-rendezvous-waits-without-spinning"):
        assert _passed(out, check), out


# PIPESGD_TIMEOUT=6: a kill must be noticed long before it (the broken connection), a freeze at it.
@pytest.mark.parametrize("controller,mode,low,high", [("mpi", "kill", 0.0, 3.0), ("gloo", "freeze", 5.5, 9.0)])
def test_lost_peer_raises_peer_lost_error_within_the_timeout(controller, mode, low, high):
    out = run_ranks("mp/channel_lost_peer.py", mode, controller=controller, timeout=120, expect_failure=True,
                    env={"PIPESGD_TIMEOUT": "6"})
    found = re.search(r"RAISED rank0 PeerLostError after ([0-9.]+) s: (.*)", out)
    assert found is not None, out
    assert low <= float(found.group(1)) <= high, found.group(0)
    assert "pipeline channel" in found.group(2) and "PIPESGD_TIMEOUT" in found.group(2)
