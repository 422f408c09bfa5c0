"""The build works: Horovod's collectives through PyTorch and TensorFlow, on both controllers
(launched as the suite launches; horovodrun itself: tests/test_drop_in.py)."""
import pytest

from launcher import run_ranks

# every test here launches ranks
pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize("controller", ["mpi", "gloo"])
def test_horovod_allreduce_torch_and_tensorflow(controller):
    out = run_ranks("mp/horovod_ops.py", controller=controller)
    for rank in (0, 1):
        assert f"rank {rank}: horovod.torch allreduce ok" in out
        assert f"rank {rank}: horovod.tensorflow allreduce ok (eager and tf.function)" in out
