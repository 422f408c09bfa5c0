"""The step path (issue 41): one PyTorch ``step()`` in the steady state, at width 2 with a byte codec
and its all-reduce hidden (done before the step), runs in at most 4 of pipesgd_hvd's files on the
training thread and never calls from a lower layer back up into a higher one, as Horovod's
``step -> synchronize -> the wrapped optimizer's step`` does (3 files, none)."""
import sys
import time
from pathlib import Path

import torch

import pipesgd_hvd
import pipesgd_hvd.torch as psgd
from pipesgd_hvd.testing import LocalWorld
from pipesgd_hvd.ops.torch import TORCH_OPS
from threads import run_threads

PACKAGE = str(Path(pipesgd_hvd.__file__).parent) + "/"
#: Layers, top to bottom (DESIGN.md's target layout): a call from a lower layer into a higher one climbs.
LAYERS = {"torch": 0, "keras": 0, "tensorflow": 0, "optimizer": 1, "staleness": 2, "auto": 2, "pipeline": 3,
          "compression": 4, "comm": 5, "ops": 6, "testing": 5}  # testing: the in-process transport here


def layer(path: str) -> int:
    return LAYERS[path.split("/")[0]]


def trace_one_step(compression: str, correction=False):
    """(files entered in order, climbs) of rank 0's steady-state step()."""

    def rank_fn(rank, comm):
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
        opt = psgd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                        named_parameters=model.named_parameters(), communicator=comm,
                                        compression=compression, staleness_correction=correction)
        x = torch.randn(4, 8)
        for _ in range(6):
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
        opt.zero_grad()
        model(x).sum().backward()
        time.sleep(0.3)  # the reductions launched in the backward pass are done: the all-reduce is hidden
        files, climbs = [], []

        def profile(frame, event, arg):
            if event != "call" or not frame.f_code.co_filename.startswith(PACKAGE):
                return
            here = frame.f_code.co_filename[len(PACKAGE):]
            if here not in files:
                files.append(here)
            caller = frame.f_back
            while caller is not None and not caller.f_code.co_filename.startswith(PACKAGE):
                caller = caller.f_back
            if caller is not None:
                there = caller.f_code.co_filename[len(PACKAGE):]
                if layer(there) > layer(here):
                    climbs.append(f"{there}:{caller.f_code.co_name} -> {here}:{frame.f_code.co_name}")

        if rank == 0:
            sys.setprofile(profile)
        try:
            opt.step()
        finally:
            sys.setprofile(None)
        opt.flush()
        return files, climbs

    return run_threads(LocalWorld(2, TORCH_OPS), rank_fn)[0]


def test_a_steady_step_at_width_2_with_int8_stays_in_four_files_and_never_climbs():
    files, climbs = trace_one_step("int8")
    assert files == ["torch/distributed_optimizer.py", "optimizer/core.py", "torch/tensors.py", "pipeline/engine.py"]
    assert climbs == []


def test_without_a_codec_the_wait_goes_down_to_the_transport_and_never_climbs():
    """A summable codec's all-reduce is the transport's own handle, waited for and decoded where it
    was started (compression/allreduce.py, the transport's file): down the layers only."""
    files, climbs = trace_one_step("none")
    assert files[:4] == ["torch/distributed_optimizer.py", "optimizer/core.py", "torch/tensors.py",
                         "pipeline/engine.py"]
    assert {layer(f) for f in files[4:]} <= {LAYERS["compression"], LAYERS["comm"], LAYERS["ops"]}, files  # (testing: comm's)
    assert climbs == []
