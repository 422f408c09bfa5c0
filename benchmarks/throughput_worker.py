"""One rank of the emulated-cluster study: ``benchmarks/throughput.py`` starts it on every rank with
its settings in a JSON file; rank 0 prints one JSON line (``MARKER``) with every rank's samples.
Everything compared runs in this one launch, interleaved in rounds, so that the load of the shared
machine hits all alike: per round a segment per configuration, then the collectives alone.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from pipesgd_hvd.pipeline.fusion import DEFAULT_FUSION_THRESHOLD, TensorSpec, plan_buckets

from .step_time import CODECS, Configurations, calls_per_update
from .thread_cpu import ThreadClock, ThreadGroupClock, machine_busy, native_thread_ids

if TYPE_CHECKING:
    from .offloaded_compute import OffloadedCompute

MARKER = "THROUGHPUT_RESULT "
# "w1-layer" (buckets capped at one layer, as Horovod's per-tensor reductions) is the control for the
# default fusion plan; names: step_time.options.
TRAINING = ("horovod", "w1", "w1-layer", "w2", *(f"w2-{c}" for c in CODECS), "w2-split-int8", "w2-split-int4")
# The hierarchical kind's rows (2 ranks per host): width 2, flat and hierarchical reductions.
HIERARCHICAL = tuple(f"w2-{form}-{c}" for c in ("int8", "int4") for form in ("flat", "hier"))
# "loop-<codec>": the width-2 schedule without the engine (compute step t, start its all-reduce, wait
# for step t-1's): what this machine allows; the engine's own overhead is the difference.
LOOPS = tuple(f"loop-{c}" for c in ("none", *CODECS))
AUTO = "auto"  # width and compression "auto", timed in what it chose before the rounds
CROSS_BYTES = (4096, 1 << 21)  # the alltoalls across hosts (hierarchical kind): latency, then bandwidth
SEGMENTS = ("compute", *TRAINING, *HIERARCHICAL, AUTO, *LOOPS)


def reduction_of(key: str) -> str:
    """The reduction a width-2 row runs, as timed alone: its codec, ``hier-<codec>`` if hierarchical."""
    return ("hier-" if "-hier-" in key else "") + key.rsplit("-", 1)[1]


def eth0_tx() -> int:
    """Bytes this host's link has sent (the kernel's counter, read in the host's namespace)."""
    with open("/proc/net/dev") as f:
        for line in f:
            if line.strip().startswith("eth0:"):
                return int(line.split(":", 1)[1].split()[8])
    raise RuntimeError("no eth0: not on the emulated cluster")


def timed(fn: Callable[[], Any]) -> float:
    """Seconds ``fn()`` took."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def fusion_buckets(layers: int, dim: int, threshold: int) -> List[int]:
    """Values per bucket, in launch order, of pipesgd's fusion plan for ``layers`` x Linear(dim, dim)
    in float32, whose gradients are ready last layer first."""
    specs = [spec for i in range(layers) for spec in (TensorSpec(f"{i}.weight", (dim, dim), "float32"),
                                                       TensorSpec(f"{i}.bias", (dim,), "float32"))]
    layout = plan_buckets(specs, list(range(len(specs)))[::-1], threshold)
    return [sum(specs[member.index].numel for member in bucket.members) for bucket in layout.buckets]


def model_buckets(model: Any, threshold: int) -> List[int]:
    """Values per bucket, in launch order, of pipesgd's fusion plan for ``model``'s parameters in
    order, whose gradients are ready last first (``fusion_buckets`` for any model)."""
    specs = [TensorSpec(name, tuple(p.shape), "float32") for name, p in model.named_parameters()]
    layout = plan_buckets(specs, list(range(len(specs)))[::-1], threshold)
    return [sum(specs[member.index].numel for member in bucket.members) for bucket in layout.buckets]


def horovod_buckets(layer_numels: Sequence[Sequence[int]], backward_s: float, cycle_s: float,
                    threshold_bytes: int) -> List[int]:
    """Values per fused all-reduce, in launch order, that Horovod's optimizer runs over a backward pass
    of ``backward_s`` in which each layer's gradients (``layer_numels``, forward order) arrive after
    its equal slice, last layer first (``offloaded_compute.py``): its background loop wakes every
    ``cycle_s`` and fuses the float32 tensors that arrived since, up to ``threshold_bytes`` each."""
    if not layer_numels:
        raise ValueError("horovod_buckets needs at least one layer")
    slice_s, groups = backward_s / len(layer_numels), {}
    for i, numels in enumerate(reversed(layer_numels)):
        # ready at the end of its slice; taken at the next wake (the loop's cycles start with backward)
        wake = int((i + 1) * slice_s / cycle_s) if cycle_s > 0 else i
        groups.setdefault(wake, []).extend(numels)
    out: List[int] = []
    for wake in sorted(groups):
        fused = 0
        for n in groups[wake]:
            if fused and (fused + n) * 4 > threshold_bytes:
                out.append(fused)
                fused = 0
            fused += n
        out.append(fused)
    return out


def layers(model: Any) -> List[Any]:
    """The modules that own ``model``'s parameters, in order (``models.layers``; for Linear layers,
    the layers): what the offloaded backward hands gradients to."""
    from .models import layers as owned

    return owned(model)


def lean_buffers(torch: Any, buckets: Sequence[int], codecs: Sequence[Any], size: int) -> Tuple[Any, List[Any]]:
    """One random float32 storage holding every bucket, each with the room the largest padding of
    ``codecs`` needs over ``size`` ranks, zero past its values; returns it and the buckets' views."""
    from pipesgd_hvd.compression.allreduce import padded_numel

    rooms = [max([numel, *(padded_numel(c, numel, size) for c in codecs)]) for numel in buckets]
    flat = torch.zeros(sum(rooms))
    views, at = [], 0
    for numel, room in zip(buckets, rooms):
        views.append(flat[at:at + room])
        views[-1][:numel].normal_()
        at += room
    return flat, views


def segments_for(configs: Sequence[str], quick: bool = False, loops: bool = True) -> Tuple[str, ...]:
    """A launch's segments: compute alone, ``configs``, and each plain width-2 row's engine-free loop
    unless ``quick`` (the calibration: compute and the float32 all-reduce) or not ``loops``."""
    loops = () if quick or not loops else tuple(f"loop-{k[3:] or 'none'}" for k in configs
                                   if k.startswith("w2") and not k.startswith("w2-split"))
    return tuple(k for k in SEGMENTS if k == "compute" or k in configs or k in loops)


class RankBench:
    """This rank's side of one launch: the models, the timed segments and collectives, the samples."""

    def __init__(self, args: argparse.Namespace) -> None:
        import horovod.torch as hvd
        import torch

        from pipesgd_hvd.comm.horovod_torch import HorovodTorchCommunicator
        from pipesgd_hvd.comm.pipeline_channel import PipelineChannel
        from pipesgd_hvd.comm.topology import resolve_topology
        from pipesgd_hvd.compression import resolve_compression
        from pipesgd_hvd.compression.allreduce import padded_numel

        # Horovod's threads (its loop's, its Gloo context's): those born while it starts and runs an op
        before = native_thread_ids()
        hvd.init()
        hvd.allreduce(torch.zeros(1), name=self.horovod_name("barrier"))
        self.horovod_clock = ThreadGroupClock(native_thread_ids() - before)
        torch.set_num_threads(1)
        torch.manual_seed(hvd.rank())
        self.args, self.hvd, self.torch = args, hvd, torch
        # a model-zoo shape (benchmarks/models.py): compute off the cores only, no engine-free loops,
        # one configuration's copy at a time, lean buffers for the collectives alone (4 ranks of
        # GPT-2 on one machine: every extra copy of the gradient is 2 GB)
        self.zoo = getattr(args, "model", None) is not None
        if self.zoo and not args.offload_compute:
            raise ValueError("a model-zoo launch runs with compute off the cores (offload_compute)")
        self.x = None if self.zoo else torch.randn(args.batch, args.dim)
        self.segments = segments_for(args.configs, args.quick, loops=not self.zoo)
        self.configs = tuple(k for k in (*TRAINING, *HIERARCHICAL) if k in self.segments)
        # the compressed all-reduces timed alone: those this launch's width-2 rows run
        self.reductions = tuple(dict.fromkeys(reduction_of(k) for k in self.configs if k.startswith("w2-")))
        self.runs = Configurations([k for k in self.segments if not k.startswith("loop-")], args, hvd,
                                   one_at_a_time=self.zoo, kept=(AUTO,), alias_weights=self.zoo)
        self.wire: Dict[str, float] = {}  # wire / fp32 per configuration, read as each segment ends
        model = self.runs.model()
        self.numel = sum(p.numel() for p in model.parameters())
        # a width-2 optimizer reduces these buckets one after another on its comm thread: so do we
        self.buckets = model_buckets(model, DEFAULT_FUSION_THRESHOLD)
        # Horovod's float32 all-reduce is what its own optimizer runs; the compressed all-reduces and
        # the engine-free loops run on a pipeline channel, the transport the training rows use.
        self.comm = HorovodTorchCommunicator()
        self.channel = PipelineChannel.from_horovod(name="bench.channel")
        # several ranks per host: the node groups of the hierarchical reductions timed alone
        self.topology = resolve_topology(True, self.channel, name="bench.topology") if hvd.local_size() > 1 else None
        self.host_of = self.channel.allgather_object(hvd.cross_rank(), "bench.hosts")
        self.codecs = {c: resolve_compression(c) for c in CODECS}
        # the buckets as the engine holds them: each in a buffer with room for its codec's padded rows,
        # zero past the bucket (the reductions only read them)
        codecs = tuple(dict.fromkeys(r.rsplit("-", 1)[-1] for r in self.reductions))
        if self.zoo:  # one storage: every codec's buckets are views of it, the float32 all-reduces run on it
            self.flat, self.buffers = lean_buffers(torch, self.buckets, [self.codecs[c] for c in codecs], hvd.size())
            self.buffers = {c: self.buffers for c in codecs}
        else:
            self.flat = torch.randn(self.numel)
            self.buffers = {c: [torch.nn.functional.pad(part, (0, padded_numel(self.codecs[c], len(part), hvd.size())
                                                               - len(part))) for part in self.flat.split(self.buckets)]
                            for c in codecs}
        self.clock = ThreadClock()
        self.samples: Dict[str, List[float]] = {}
        self._calls = 0
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="bench-comm")
        self.offloaded: Optional["OffloadedCompute"] = None
        if args.offload_compute:
            self.offloaded = self.offload_compute()

    # ------------------------------------------------------------------------------ plumbing
    def record(self, key: str, value: float) -> None:
        self.samples.setdefault(key, []).append(value)

    def uid(self, tag: str) -> str:
        """A label for the channel's collectives (matched by issue order; only the main thread draws)."""
        self._calls += 1
        return f"bench.{tag}.{self._calls}"

    @staticmethod
    def horovod_name(tag: str) -> str:
        """A Horovod op's name, the same for one role, as a training job's: fresh names fill Horovod's
        response cache, which its loop walks every cycle (3000 of them: 26-71 ms CPU per step, not 11-27)."""
        return f"bench.{tag}"

    def progress(self, line: str) -> None:
        """Rank 0 appends ``line`` to the file the driver relays to its stderr (``progress``); best
        effort: a line that cannot be written is only lost."""
        if self.args.progress and self.hvd.rank() == 0:
            with contextlib.suppress(OSError), open(self.args.progress, "a") as f:
                f.write(f"    {line}\n")

    def barrier(self) -> None:
        self.settled(self.hvd.allreduce_async(self.torch.zeros(1), name=self.horovod_name("barrier")))

    def settled(self, handle: Any) -> Any:
        """Horovod's result for ``handle``, waited for in a sleeping poll as the engine waits. Horovod's
        own synchronize() spins in sched_yield: with 2 ranks per core (the hierarchical kind: 4 ranks on
        2 cores) the waiting ranks took the cores from the rank they waited for and from Horovod's
        background loops, until Horovod's Gloo controller gave up after its 30 s timeout; on a GPU
        node each rank spins on a core of its own."""
        self.done(handle)
        return self.hvd.synchronize(handle)

    def done(self, handle: Any) -> None:
        """Returns once Horovod's ``handle`` is done, leaving its result to whoever synchronizes it."""
        from pipesgd_hvd.comm.base import PolledHandle

        PolledHandle(lambda: self.hvd.poll(handle), lambda: None, "horovod").wait()

    @contextlib.contextmanager
    def billed(self, key: str) -> Iterator[None]:
        """CPU per step of a segment: this rank's threads, and the machine's (network work, other jobs)."""
        cpu0, busy0, hvd0 = self.clock.read(), machine_busy()[0], self.horovod_clock.read()
        yield
        cpu1, busy1, hvd1 = self.clock.read(), machine_busy()[0], self.horovod_clock.read()
        self.record(f"cpu-main/{key}", (cpu1[0] - cpu0[0]) / self.args.steps)
        self.record(f"cpu-other/{key}", (cpu1[1] - cpu0[1]) / self.args.steps)
        self.record(f"cpu-hvd/{key}", (hvd1 - hvd0) / self.args.steps)
        self.record(f"cpu-machine/{key}", (busy1 - busy0) / self.args.steps)

    # ------------------------------------------------------------------------------ training
    def offload_compute(self) -> "OffloadedCompute":
        """From here on waits stand in for the forward and backward passes (``offloaded_compute.py``),
        ``device_times`` long, or as the real passes took here (median of 5 steps after one, the
        slowest rank's); recorded as ``device-forward`` and ``device-backward``."""
        from .offloaded_compute import OffloadedCompute

        model = self.runs.model()
        if self.args.device_times is not None:
            times = self.args.device_times
        else:
            model, opt = self.runs.get("compute")
            for i in range(6):
                self.step(model, opt, split=i > 0)
            measured = [statistics.median(self.samples.pop(k)) for k in ("forward", "backward")]
            self.samples.pop("update")
            times = self.settled(self.hvd.allreduce_async(self.torch.tensor(measured, dtype=self.torch.float64),
                                                          op=self.hvd.Max, name=self.horovod_name("offload"))).tolist()
        self.record("device-forward", times[0])
        self.record("device-backward", times[1])
        return OffloadedCompute(layers(model), forward_s=times[0], backward_s=times[1])

    def step(self, model: Any, opt: Any, split: bool = False, calls: int = 1) -> None:
        """One update, in ``calls`` calls on as many parts of the batch (split_batch: 2); ``split``
        records a one-call update's forward, backward and update times."""
        for x in (self.x.chunk(calls) if self.offloaded is None else [None] * calls):
            opt.zero_grad()
            t0 = time.perf_counter()
            if self.offloaded is not None:
                loss = self.offloaded.loss(layers(model), share=1 / calls)
            else:
                loss = model(x).square().mean()
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            for handle, _ in getattr(opt, "_handles", {}).values():  # Horovod's optimizer: see settled()
                if isinstance(handle, int):
                    self.done(handle)
            opt.step()
        if split:
            self.record("forward", t1 - t0)
            self.record("backward", t2 - t1)
            self.record("update", time.perf_counter() - t2)

    def segment(self, key: str) -> None:
        """``steps`` timed steps of one configuration."""
        if key.startswith("loop-"):
            return self.loop(key, key[len("loop-"):])
        model, opt = self.runs.get(key)
        calls, sent = calls_per_update(key), eth0_tx()
        # untimed: refills the pipeline flushed at the last segment's end (a model-zoo copy is new, its
        # buffers come from memory the last segment's copy freed: its ranks keep freed memory mapped)
        warm = 1
        self.step(model, opt, calls=calls)
        with self.billed(key):
            for _ in range(self.args.steps):
                self.record(key, timed(lambda: self.step(model, opt, split=key == "compute", calls=calls)))
        if hasattr(opt, "flush"):
            opt.flush()  # nothing of this configuration stays on the wire during the next one
        if hasattr(opt, "stats"):
            self.wire[key] = opt.stats.ratio
        self.barrier()
        if self.hvd.local_rank() == 0:  # all ranks of the host, over the segment's reductions
            self.record(f"host-bytes/{key}", (eth0_tx() - sent) / (self.args.steps + warm))
        del model, opt
        self.runs.release(key, kept=(AUTO,))

    def loop(self, key: str, codec: str) -> None:
        """The pipelined schedule without the engine: step t computes while step t-1's all-reduce
        runs, started as the engine starts it (Horovod's thread; a comm thread for byte codecs)."""
        model, opt = self.runs.get("compute")
        slots = [self.flat.clone(), self.flat.clone()]  # the engine's two buffers: step t's, t-1's
        self.step(model, opt)
        pending = self.start(codec, slots[0])  # untimed: fills the pipeline
        with self.billed(key):
            for i in range(self.args.steps):
                start = time.perf_counter()
                self.step(model, opt)
                started = self.start(codec, slots[(i + 1) % 2])
                pending()
                pending = started
                self.record(key, time.perf_counter() - start)
        pending()
        self.barrier()

    # --------------------------------------------------------------------------- collectives
    def compressed(self, reduction: str, name: str) -> int:
        """``reduction`` (``reduction_of`` a row) of the gradient as the engine runs it: bucket by bucket,
        each in a buffer with the engine's room (one call on the whole gradient missed a fixed cost per
        bucket and each transfer's burst on the shaped links: at 130mbit the pipelined fp16 step was 546
        ms against 647 ms). Returns the bytes this rank sent to other hosts, counted per collective."""
        from pipesgd_hvd.testing import CountingComm
        from pipesgd_hvd.comm.topology import Topology
        from pipesgd_hvd.compression.allreduce import compressed_allreduce
        from pipesgd_hvd.compression.hierarchical import hierarchical_allreduce
        from pipesgd_hvd.ops.torch import TORCH_OPS

        codec = reduction.rsplit("-", 1)[-1]
        if reduction.startswith("hier-"):  # a cross-node group holds one rank per host: all it sends leaves
            counted = CountingComm(self.topology.cross, lambda peer: peer)
            comm, reduce = Topology(self.topology.layout, self.topology.local, counted), hierarchical_allreduce
        else:
            counted = comm = CountingComm(self.channel, self.host_of.__getitem__)
            reduce = compressed_allreduce
        for i, (numel, buffer) in enumerate(zip(self.buckets, self.buffers[codec])):
            reduce(TORCH_OPS, comm, self.codecs[codec], buffer, numel=numel, name=f"{name}.b{i}",
                   key=f"{reduction}/b{i}", seed=0)
        return counted.cross_bytes

    def start(self, codec: str, values: Any) -> Callable[[], Any]:
        """Starts one all-reduce the way the engine does; returns its wait. ``values``: the float32
        all-reduce's buffer (a byte codec reduces ``buffers``)."""
        from pipesgd_hvd.comm.base import ReduceOp

        if codec == "none":
            return self.channel.allreduce_async_(values, self.uid("loop"), ReduceOp.AVERAGE).wait
        return self.pool.submit(self.compressed, codec, self.uid(codec)).result

    def collectives(self) -> Dict[str, Callable[[], Any]]:
        """The collectives timed alone: float32 all-reduces of three sizes (through the communicator,
        which waits as the engine does, in a sleeping poll: Horovod's synchronize() spins and would
        bill its spin as communication CPU) and the compressed all-reduce of each width-2 row."""
        from pipesgd_hvd.comm.base import ReduceOp

        def float32(values: Any, tag: str) -> Callable[[], Any]:
            # in place on a buffer of its own: repeated averaging changes the values, not the time
            return lambda: self.comm.allreduce_async_(values, self.horovod_name(tag), ReduceOp.AVERAGE).wait()

        def compressed(reduction: str) -> Callable[[], Any]:
            return lambda: self.compressed(reduction, self.uid(reduction))

        # lean (a model-zoo launch): in place on the buckets' own storage (averaging keeps the zeros past
        # each bucket zero), the quarter on a view of it
        whole, quarter = ((self.flat, self.flat[: self.numel // 4]) if self.zoo
                          else (self.flat.clone(), self.flat[: self.numel // 4].clone()))
        return {"comm-none": float32(whole, "ar"),
                "comm-none-quarter": float32(quarter, "arq"),
                "ar-small": float32(self.torch.zeros(256), "ars"),
                # nothing: what the rank's threads burn with nothing to do (Horovod's background
                # loop wakes every cycle); the model leaves it out of a collective's CPU
                "idle": lambda: time.sleep(0.25),
                **{f"comm-{r}": compressed(r) for r in self.reductions}}

    def alone(self, key: str, fn: Callable[[], Any]) -> None:
        """A collective alone: its time, the CPU it costs this rank (all threads; Horovod's apart), a
        compressed one's bytes to other hosts. With several ranks per host, after an untimed one: TCP
        past its slow start, as in training (the host restarts it after an idle second)."""
        if self.topology is not None:
            self.barrier()
            fn()
            self.barrier()
        cpu0, hvd0, start = sum(self.clock.read()), self.horovod_clock.read(), time.perf_counter()
        sent = fn()
        self.record(key, time.perf_counter() - start)
        self.record(f"cpu/{key}", sum(self.clock.read()) - cpu0)
        self.record(f"cpu-hvd/{key}", self.horovod_clock.read() - hvd0)
        if isinstance(sent, int):
            self.record(f"payload/{key}", sent)

    def link_samples(self) -> None:
        """What the hierarchical model needs, every rank at once, each after an untimed run: alltoalls
        of ``CROSS_BYTES`` on the cross-node groups (all at once, as the hierarchical stage runs them),
        one of the gradient's shards on the node group, each codec's encode + decode of the gradient."""
        from pipesgd_hvd.compression.allreduce import padded_numel
        from pipesgd_hvd.ops.torch import TORCH_OPS

        torch, topo, size = self.torch, self.topology, self.hvd.size()
        for nbytes in CROSS_BYTES:
            rows = torch.zeros(topo.cross.size, nbytes, dtype=torch.uint8)
            self.sampled(f"cross-a2a/{nbytes}", lambda: topo.cross.alltoall_async(rows, self.uid("xa2a")).wait())
        shards = torch.zeros(topo.local.size, -(-self.numel // topo.local.size))
        self.sampled("local-a2a", lambda: topo.local.alltoall_async(shards, self.uid("la2a")).wait())
        for c in self.buffers:
            codec, rows = self.codecs[c], torch.zeros(padded_numel(self.codecs[c], self.numel, size)).view(size, -1)
            self.sampled(f"codec/{c}", lambda: codec.decode(TORCH_OPS, *codec.encode(TORCH_OPS, rows, key="k", seed=0)))

    def sampled(self, key: str, fn: Callable[[], Any], reps: int = 3) -> None:
        for _ in range(reps):
            self.barrier()
            fn()  # untimed: a fresh output's pages, a connection past slow start
            self.barrier()
            self.record(key, timed(fn))

    def width1_shares(self) -> Optional[Dict[str, List[float]]]:
        """A model-zoo launch's width-1 buckets as shares of the gradient, in launch order, for the
        timing model's overlap (``throughput_analysis.bucket_overlap``): Horovod's fused all-reduces
        over the offloaded backward at its cycle time and fusion threshold, pipesgd's own plan."""
        import os

        if not self.zoo or self.offloaded is None:
            return None
        cycle = float(os.environ.get("HOROVOD_CYCLE_TIME", "1")) / 1e3  # ms, Horovod's default 1 ms
        threshold = int(os.environ.get("HOROVOD_FUSION_THRESHOLD", str(64 * 1024 * 1024)))
        numels = [[g.numel() for g in grads] for grads in self.offloaded.grads]
        shares = {"horovod": horovod_buckets(numels, self.offloaded.backward_s, cycle, threshold), "w1": self.buckets}
        return {k: [n / self.numel for n in v] for k, v in shares.items()}

    def decide_auto(self) -> Dict[str, Any]:
        """Runs the auto optimizer until it has decided (untimed); returns what it measured and chose."""
        import dataclasses

        model, opt = self.runs.get(AUTO)
        start = time.perf_counter()
        while opt.auto_decision is None:
            self.step(model, opt)
        opt.flush()
        self.barrier()
        record = opt.auto_controller.history[-1]
        return {"step": record.step, "seconds": time.perf_counter() - start,
                "measurements": dataclasses.asdict(record.measurements),
                "decision": dataclasses.asdict(record.decision)}

    # ----------------------------------------------------------------------------------- run
    def run(self) -> None:
        args, hvd, segments = self.args, self.hvd, self.segments
        collectives = self.collectives()
        if args.quick:  # the calibration: the float32 all-reduce
            collectives = {"comm-none": collectives["comm-none"]}
        summand, acc = self.torch.randn(self.numel), self.torch.zeros(self.numel)
        launched = time.perf_counter()
        auto = self.decide_auto() if AUTO in segments else None
        if auto is not None:
            self.progress(f"auto decided in {auto['seconds']:.0f} s")
        busy0, our0 = machine_busy(), sum(self.clock.read())
        for r in range(args.rounds):
            # A different configuration goes first each round: none always meets the warm-up after
            # the previous round's collectives.
            for key in segments[r % len(segments):] + segments[: r % len(segments)]:
                self.segment(key)
            for _ in range(args.comm_reps):
                for key, fn in collectives.items():
                    self.alone(key, fn)
                self.record("add", timed(lambda: acc.add_(summand)))  # gamma: one float32 add
            if self.topology is not None:
                self.link_samples()
            self.barrier()
            elapsed = time.perf_counter() - launched
            self.progress(f"round {r + 1}/{args.rounds} done, {elapsed:.0f} s in; rounds left ~"
                          f"{elapsed / (r + 1) * (args.rounds - r - 1):.0f} s")
        busy1, our1 = machine_busy(), sum(self.clock.read())
        self.pool.shutdown()
        if self.topology is not None:
            self.topology.close()
        self.channel.close()
        mine = {"samples": self.samples, "our_cpu_s": our1 - our0, "machine_busy_s": busy1[0] - busy0[0],
                "machine_total_s": busy1[1] - busy0[1]}
        everyone = hvd.allgather_object(mine, name="bench.result")
        if hvd.rank() == 0:
            wire = dict(self.wire)
            result = {"ranks": hvd.size(), "local_size": hvd.local_size(), "cross_size": hvd.cross_size(),
                      "grad_bytes": self.numel * 4, "layers": args.layers, "buckets": self.buckets,
                      "model": getattr(args, "model", None), "width1_shares": self.width1_shares(),
                      "configs": self.configs, "per_rank": everyone, "wire_ratio": wire,
                      "auto": auto, "offloaded": self.offloaded is not None}
            print(MARKER + json.dumps(result), flush=True)


def main(argv: List[str]) -> None:
    """``argv``: the JSON file of settings the driver wrote (``benchmarks/throughput.py``, ``run_launch``)."""
    RankBench(argparse.Namespace(**json.loads(Path(argv[0]).read_text()))).run()


if __name__ == "__main__":
    main(sys.argv[1:])
