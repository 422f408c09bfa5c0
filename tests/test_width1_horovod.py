"""Width 1 against horovod.torch.DistributedOptimizer at 2, 3 and 4 ranks (issue 41): what
docs/options.md ("Width 1 and Horovod's optimizer") and the README claim, for every compression
Horovod has and both communicators that can carry it (tests/mp/width1_horovod.py says each check).

Bit for bit at 2 ranks everywhere, and at any size on communicator="horovod" for a model this
small; at 3 and 4 ranks on the default communicator, equal up to the order of the sum (Gloo's ring
starts each chunk's sum at another rank; Horovod's Open MPI all-reduce sums in its own order).
"""
import pytest

from launcher import assert_passed, run_ranks

pytestmark = pytest.mark.multiprocess

COMPRESSIONS = ("none", "ours-none", "fp16")  # Horovod's none and fp16; ours is psgd.Compression.none
COMMUNICATORS = ("default", "horovod")


@pytest.mark.parametrize("size", [2, 3, 4])
def test_width_1_beside_horovods_optimizer(size):
    out = run_ranks("mp/width1_horovod.py", np=size, timeout=300)
    checks = [f"sum-order-{c}-horovods-optimizer" for c in ("none", "fp16")]
    checks += [f"sum-order-{c}-{comm}" for c in COMPRESSIONS for comm in COMMUNICATORS]
    checks += [f"bitwise-{c}-{comm}" for c in COMPRESSIONS for comm in COMMUNICATORS
               if size == 2 or comm == "horovod"]
    assert_passed(out, checks, ranks=range(size))
