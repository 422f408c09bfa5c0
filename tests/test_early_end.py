"""Issue 32, on 2 real ranks under horovodrun: every way a rank can stop early ends cleanly on
every rank, in seconds, with words; the stall warning names a sleeping rank. Width 2, MPI and Gloo
controllers, a byte codec and none. docs/reliability.md ("Ranks that stop early") is the table
these keep true; someone outside the job is tests/test_outsider.py's.

Each failed on the code before (checked on 488e5e8, the tests and scripts copied over it):
flush() then join() hung until the launcher's timeout; join() with check_replicas_every or auto
was refused with a ValueError; Horovod's own hvd.join() and a rank that leaves the loop left the
other rank waiting for PIPESGD_TIMEOUT (600 s) with no output; no stall warning appeared."""
import re

import pytest

from launcher import run_ranks

pytestmark = pytest.mark.multiprocess
COMBOS = [("mpi", "none"), ("mpi", "int8"), ("gloo", "none"), ("gloo", "int8")]
LIMIT_S = 60.0  # "within 60 s at the default settings": measured inside the ranks, from the pattern's start
# Where a rank has raised, its exit waits PIPESGD_EXIT_GRACE (10 s by default) for Horovod's receive
# from the rank that is gone (docs/reliability.md); the errors, not that wait, are what these check.
FAILING = {"PIPESGD_EXIT_GRACE": "2"}


@pytest.mark.parametrize("controller,codec", COMBOS)
def test_mp_flush_then_join_and_join_with_checks_work(controller, codec):
    out = run_ranks("mp/reliability_early_end.py", "works", "2", codec, controller=controller, timeout=240)
    for scenario in ("flush-join", "join-replicas", "join-auto"):
        for rank in (0, 1):
            found = re.search(rf"PASS rank{rank} {scenario} in (\d+\.\d+) s", out)
            assert found is not None and float(found.group(1)) < LIMIT_S, (scenario, rank, out[-3000:])


@pytest.mark.parametrize("controller,codec", COMBOS)
def test_mp_horovods_own_join_beside_the_optimizer_is_an_error_naming_it(controller, codec):
    out = run_ranks("mp/reliability_early_end.py", "hvd-join", "2", codec, controller=controller, timeout=240,
                    env=FAILING, expect_failure=True)
    found = re.search(r"RAISED rank1 (?:Horovod)?PeerLostError after (\d+\.\d+) s: rank 0 is inside Horovod's own "
                      r"hvd\.join\(\) \(reliability_early_end\.py:\d+ in <module>\) after 6 step\(s\).*Call "
                      r"pipesgd_hvd\.torch\.join\(\) instead", out)
    assert found is not None and float(found.group(1)) < LIMIT_S, out[-3000:]
    assert re.search(r"pipesgd_hvd: this rank is inside Horovod's own hvd\.join\(\) .* after 6 step\(s\) while other "
                     r"ranks wait for its share", out), out[-3000:]


@pytest.mark.parametrize("controller,codec,pattern", [(c, k, "leave" if k == "none" else "leave-flush")
                                                       for c, k in COMBOS])
def test_mp_a_rank_that_leaves_the_loop_without_join_is_an_error_on_every_rank(controller, codec, pattern):
    out = run_ranks("mp/reliability_early_end.py", pattern, "2", codec, controller=controller, timeout=240,
                    env=FAILING, expect_failure=True)
    # rank 1 raises (or, if the launcher ends it first, its inspector has said the same words)
    found = re.search(r"(?:RAISED rank1 (?:Horovod)?PeerLostError after (\d+\.\d+) s: |pipesgd_hvd: )rank 0 is exiting "
                      r"after 6 step\(s\) while this rank waits for its share of step 6", out)
    assert found is not None and (found.group(1) is None or float(found.group(1)) < LIMIT_S), out[-3000:]
    assert re.search(r"pipesgd_hvd: error: this rank exits after 6 step\(s\) while rank\(s\) \[1\] still need its share",
                     out), out[-3000:]


def test_mp_the_stall_warning_names_the_rank_that_sleeps_and_where():
    """Rank 1 sleeps 6 s after step 3; with a 2 s threshold rank 0 warns twice, naming rank 1 and
    the line it sleeps on; training then completes (a stall is not an error)."""
    out = run_ranks("mp/reliability_stall.py", "int8", "6", controller="gloo", timeout=240,
                    env={"PIPESGD_STALL_CHECK_TIME_SECONDS": "2"})
    assert "PASS rank0 stall-int8" in out and "PASS rank1 stall-int8" in out, out[-3000:]
    warnings = re.findall(r"pipesgd_hvd stall: rank 0 has waited (\d+) s for the reduction of step 4, bucket \d+ "
                          r"\(pipeline psgd\.\d+\)\. Not arrived: (.*?)\. Likely causes", out)
    assert warnings and warnings[0][0] == "2", out[-3000:]  # at the threshold (the monitor ticks every 0.5 s)
    assert any(re.fullmatch(r"rank 1 \(outside the pipeline for \d+ s, at reliability_stall\.py:\d+ in <module>, has "
                            r"ended 4 step\(s\)\)", missing) for _, missing in warnings), warnings

