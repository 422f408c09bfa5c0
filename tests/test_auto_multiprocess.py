"""width="auto" / compression="auto" on 2 real ranks under horovodrun (tests/mp/torch_auto.py)."""
import pytest

from launcher import run_ranks

# every test here launches ranks
pytestmark = pytest.mark.multiprocess


def test_auto_choice_and_switch_step_identical_across_ranks_and_training_stays_exact():
    out = run_ranks("mp/torch_auto.py")
    for rank in (0, 1):
        for check in ("auto-measured-identical", "auto-scripted-equals-reference", "auto-recheck-switches-codec"):
            assert f"PASS rank{rank} {check}" in out, out
