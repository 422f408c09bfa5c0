"""Unnamed hvd.allreduce / allgather / broadcast beside the pipeline's reductions complete (issue 15).

Horovod names an unnamed op after a per-process counter that every Horovod op advances; when the
pipeline's reductions were Horovod ops issued by the engine's comm thread at timing-dependent
moments, the ranks' names drifted apart and the job hung (5 of 5 runs with int8 at width 2). The
pipeline's traffic now goes through its own channel (pipesgd_hvd/comm/pipeline_channel.py), which
never touches that counter. Checked to hang with ``PIPESGD_COMMUNICATOR=horovod`` (the old path).
Horovod's stall shutdown turns a hang into a failure with the names in the log; the launcher's
limit is the backstop. Every byte codec runs 50 steps in each launch (the old path hung within 40
in 3 of 3 runs: Gloo at width 2 twice, MPI at width 3 once; 2026-12-07); width 2 under MPI, width 3
under Gloo (the two launches cover both widths and both controllers).
"""
import pytest

from launcher import run_ranks

# every test here launches ranks
pytestmark = pytest.mark.multiprocess

STALL = {"HOROVOD_STALL_CHECK_TIME_SECONDS": "10", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "30"}
CODECS = ("fp16", "bf16", "truncate16", "int8", "int4")


@pytest.mark.parametrize("controller,width", [("mpi", 2), ("gloo", 3)])
def test_unnamed_collectives_between_and_inside_steps_complete(controller, width):
    out = run_ranks("mp/unnamed_collectives.py", str(width), "50", controller=controller, timeout=300, env=STALL)
    for rank in (0, 1):
        for codec in CODECS:
            assert f"PASS rank{rank} unnamed-{codec}-w{width}" in out, out[-3000:]
