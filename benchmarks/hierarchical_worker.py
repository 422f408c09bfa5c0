"""One rank of the hierarchical benchmark (``benchmarks/hierarchical.py`` starts it on every rank of
every host through horovodrun).

Everything compared is measured in this one launch, interleaved in rounds (the load of the shared
machine hits every configuration alike). Per round, a different configuration first each time:

* training segments: compute alone, Horovod's ``DistributedOptimizer``, pipesgd width 2 with
  int8 / int4 flat and hierarchical. Forward and backward passes are waits of fixed device times
  (``benchmarks/offloaded_compute.py``): compute off the cores. One untimed step, ``steps`` timed
  steps, ``flush()``; the bytes the host's link sent from before the untimed step to after the
  flush (the kernel's counter, ``/proc/net/dev``), i.e. over ``steps + 1`` reductions;
* each reduction alone, as the engine runs it (bucket by bucket, on the pipeline channel and its
  node groups): the float32 all-reduce (Horovod's), the compressed ones flat and hierarchical,
  with the bytes each sent to the other host counted per collective;
* what the timing model needs: the link between hosts (alltoall of uint8 rows on the cross-node
  groups, all groups at once as the hierarchical stage runs them, at two sizes), the links inside
  the host (alltoall of float32 rows on the node group), a float32 add (gamma) and each codec's
  encode + decode of the gradient.

Rank 0 prints one JSON line (``MARKER``) with every rank's samples.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

MARKER = "HIERARCHICAL_RESULT "
CODECS = ("int8", "int4")
CONFIGS = ("horovod", *(f"{form}-{c}" for c in CODECS for form in ("flat", "hier")))


def eth0_tx() -> int:
    """Bytes this host's link has sent (the kernel's counter, read in the host's namespace)."""
    with open("/proc/net/dev") as f:
        for line in f:
            if line.strip().startswith("eth0:"):
                return int(line.split(":", 1)[1].split()[8])
    raise RuntimeError("no eth0: not on the emulated cluster")


class RankBench:
    def __init__(self, args: argparse.Namespace) -> None:
        import horovod.torch as hvd
        import torch

        from pipesgd_hvd.comm.pipeline_channel import PipelineChannel
        from pipesgd_hvd.comm.topology import resolve_topology
        from pipesgd_hvd.compression import resolve_compression
        from pipesgd_hvd.pipeline.fusion import DEFAULT_FUSION_THRESHOLD

        from .offloaded_compute import OffloadedCompute
        from .throughput_worker import fusion_buckets

        hvd.init()
        torch.set_num_threads(1)
        self.args, self.hvd, self.torch = args, hvd, torch
        self.channel = PipelineChannel.from_horovod(name="bench.hier")
        self.topology = resolve_topology(True, self.channel, name="bench.hier.topology")
        self.host_of = [p[0] for p in self.channel.allgather_object([hvd.cross_rank(), hvd.local_rank()],
                                                                      "bench.hier.places")]
        self.codecs = {c: resolve_compression(c) for c in ("none", *CODECS)}
        self.runs = {key: self._make(key) for key in ("compute", *CONFIGS)}
        model = self.runs["compute"][0]
        self.numel = sum(p.numel() for p in model.parameters())
        self.buckets = fusion_buckets(args.layers, args.dim, DEFAULT_FUSION_THRESHOLD)
        self.offloaded = OffloadedCompute(list(model), forward_s=args.device_times[0], backward_s=args.device_times[1])
        self.flat = torch.randn(self.numel)
        self.samples: Dict[str, List[float]] = {}
        self._calls = 0

    def _make(self, key: str) -> Tuple[Any, Any]:
        import pipesgd_hvd.torch as psgd

        torch, args = self.torch, self.args
        torch.manual_seed(1)
        model = torch.nn.Sequential(*[torch.nn.Linear(args.dim, args.dim) for _ in range(args.layers)])
        inner = torch.optim.SGD(model.parameters(), lr=1e-6)
        if key == "compute":
            return model, inner
        if key == "horovod":
            return model, self.hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters())
        form, codec = key.split("-")
        return model, psgd.DistributedOptimizer(inner, named_parameters=model.named_parameters(), width=2,
                                                compression=codec, hierarchical=form == "hier")

    # ------------------------------------------------------------------------------ plumbing
    def record(self, key: str, value: float) -> None:
        self.samples.setdefault(key, []).append(value)

    def uid(self, tag: str) -> str:
        """A label for the channel's collectives (matched by issue order; only the main thread draws)."""
        self._calls += 1
        return f"bench.{tag}.{self._calls}"

    def barrier(self) -> None:
        self.hvd.allreduce(self.torch.zeros(1), name="bench.barrier")

    # ------------------------------------------------------------------------------ training
    def step(self, model: Any, opt: Any) -> None:
        opt.zero_grad()
        self.offloaded.loss(list(model)).backward()
        opt.step()

    def segment(self, key: str) -> None:
        model, opt = self.runs[key]
        self.barrier()
        tx = eth0_tx()
        self.step(model, opt)  # untimed: refills the pipeline flushed at the end of the last segment
        for _ in range(self.args.steps):
            start = time.perf_counter()
            self.step(model, opt)
            self.record(key, time.perf_counter() - start)
        if hasattr(opt, "flush"):
            opt.flush()
        self.barrier()
        if self.hvd.local_rank() == 0:
            self.record(f"host-bytes/{key}", (eth0_tx() - tx) / (self.args.steps + 1))

    # --------------------------------------------------------------------------- collectives
    def reduce_alone(self, key: str) -> None:
        """One reduction of the gradient as the configuration's engine runs it, timed alone right
        after an untimed one (TCP past its slow start, as in training: the host restarts it
        after an idle second), its payload counted per collective (``pipesgd_hvd/comm/counting.py``)."""
        self.barrier()
        self.reduce(key)
        self.barrier()
        start = time.perf_counter()
        counted = self.reduce(key)
        self.record(f"alone/{key}", time.perf_counter() - start)
        if counted is not None:
            self.record(f"payload/{key}", counted)

    def reduce(self, key: str) -> Optional[int]:
        """The reduction of ``key`` on the gradient; returns the bytes it sent to other hosts."""
        from pipesgd_hvd.comm.counting import CountingComm
        from pipesgd_hvd.comm.topology import Topology
        from pipesgd_hvd.compression.allreduce import compressed_allreduce
        from pipesgd_hvd.compression.hierarchical import hierarchical_allreduce
        from pipesgd_hvd.ops.torch import TORCH_OPS

        if key == "horovod":
            self.hvd.allreduce(self.flat, name="bench.ar", op=self.hvd.Average)
            return None
        form, codec = key.split("-")
        topo = self.topology
        flat = CountingComm(self.channel, lambda peer: self.host_of[peer])
        cross = CountingComm(topo.cross, lambda peer: peer)  # one rank per host in each cross-node group
        counted = Topology(topo.layout, CountingComm(topo.local, lambda peer: 0), cross)
        offset = 0
        for i, numel in enumerate(self.buckets):
            part = self.flat[offset:offset + numel]
            offset += numel
            if form == "hier":
                hierarchical_allreduce(TORCH_OPS, counted, self.codecs[codec], part, name=self.uid(key),
                                       key=f"{key}/b{i}", seed=0)
            else:
                compressed_allreduce(TORCH_OPS, flat, self.codecs[codec], part, name=self.uid(key), key=f"{key}/b{i}",
                                     seed=0)
        return cross.cross_bytes if form == "hier" else flat.cross_bytes

    def link_samples(self) -> None:
        """For the model: the link between hosts (every cross-node group exchanging at once, as the
        hierarchical stage does; two sizes), the links inside a host, a float32 add, the codecs.
        Each after an untimed run of itself, every rank at once."""
        from pipesgd_hvd.compression.allreduce import padded_numel
        from pipesgd_hvd.ops.torch import TORCH_OPS

        torch, topo = self.torch, self.topology
        for nbytes in (self.args.small_bytes, self.args.large_bytes):
            rows = torch.zeros(topo.cross.size, nbytes, dtype=torch.uint8)
            self.timed(f"cross-a2a/{nbytes}", lambda: topo.cross.alltoall_async(rows, self.uid("xa2a")).wait())
        local_rows = torch.zeros(topo.local.size, -(-self.numel // topo.local.size))
        self.timed("local-a2a", lambda: topo.local.alltoall_async(local_rows, self.uid("la2a")).wait())
        acc, summand = torch.zeros(self.numel), torch.randn(self.numel)
        self.timed("add", lambda: acc.add_(summand))
        for c in CODECS:
            codec = self.codecs[c]
            rows = torch.zeros(padded_numel(codec, self.numel, self.hvd.size())).view(self.hvd.size(), -1)
            self.timed(f"codec/{c}", lambda: codec.decode(TORCH_OPS, *codec.encode(TORCH_OPS, rows, key="k", seed=0)))

    def timed(self, key: str, fn: Callable[[], Any]) -> None:
        for _ in range(self.args.link_reps):
            self.barrier()
            fn()  # untimed: a fresh output's pages, a connection past slow start
            self.barrier()
            start = time.perf_counter()
            fn()
            self.record(key, time.perf_counter() - start)

    # ----------------------------------------------------------------------------------- run
    def run(self) -> None:
        segments = ("compute", *CONFIGS)
        for r in range(self.args.rounds):
            for key in segments[r % len(segments):] + segments[:r % len(segments)]:
                self.segment(key)
            for key in CONFIGS:
                self.reduce_alone(key)
            self.link_samples()
            if self.hvd.rank() == 0:
                print(f"round {r + 1}/{self.args.rounds} done", file=sys.stderr, flush=True)
        everyone = self.hvd.allgather_object(self.samples, name="bench.result")
        if self.hvd.rank() == 0:
            result = {"ranks": self.hvd.size(), "local_size": self.hvd.local_size(), "cross_size": self.hvd.cross_size(),
                      "grad_bytes": self.numel * 4, "buckets": self.buckets, "device_times": self.args.device_times,
                      "small_bytes": self.args.small_bytes, "large_bytes": self.args.large_bytes,
                      "per_rank": everyone,
                      "wire_ratio": {k: self.runs[k][1].stats.ratio for k in CONFIGS if k != "horovod"}}
            sys.stdout.write(MARKER + json.dumps(result) + "\n")
            sys.stdout.flush()
        self.topology.close()
        self.channel.close()


def main(argv: List[str]) -> None:
    from .throughput_worker import device_times

    parser = argparse.ArgumentParser(description="one rank of benchmarks/hierarchical.py")
    parser.add_argument("--rounds", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--dim", type=int, required=True)
    parser.add_argument("--layers", type=int, required=True)
    parser.add_argument("--device-times", type=device_times, required=True, metavar="FORWARD,BACKWARD")
    parser.add_argument("--small-bytes", type=int, default=4096, help="the small cross-host exchange (latency)")
    parser.add_argument("--large-bytes", type=int, default=1 << 21, help="the large cross-host exchange (bandwidth)")
    parser.add_argument("--link-reps", type=int, default=3, help="samples of each link measurement per round")
    RankBench(parser.parse_args(argv)).run()


if __name__ == "__main__":
    main(sys.argv[1:])
