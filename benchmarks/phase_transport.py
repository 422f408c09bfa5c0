"""Transport for the pipeline's phases: alltoall / allgather of compressed rows (and a float32
all-reduce) on the emulated cluster, through every transport at hand, alone and beside compute.

    python -m benchmarks.phase_transport            (as root; ~10 min)
    python -m benchmarks.phase_transport --render build/phase_transport.json

Two hosts (network namespaces, ``tc tbf`` links, ``benchmarks/cluster``); per link rate one launch
under Horovod's Gloo controller and one under its MPI controller (mpirun), side by side. The ranks
(``benchmarks/phase_transport_worker.py``) time each transport's blocking calls, interleaved
round by round, alone and beside a one-thread matmul loop in the same process. Rates are given
as a share of a plain TCP exchange of the same bytes on the same link in the same launch. Writes
build/phase_transport.json and the "phase_transport" section of docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from .phase_transport_worker import MARKER, OPS

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "build" / "phase_transport.json"
NAMES = {"hvd": "Horovod ops ({ctl} controller)",
         "channel": "PipelineChannel (private Gloo group: receives posted before sends; Gloo's all-reduce)",
         "tdist-coll": "torch.distributed Gloo collectives, private group",
         "tdist-p2p": "torch.distributed Gloo send/recv, send posted first", "mpi-blocking": "mpi4py on Dup(), blocking, from a thread",
         "mpi-nonblocking": "mpi4py on Dup(), non-blocking + polled wait (comm/mpi4py.py)",
         "mpi-p2p": "mpi4py Sendrecv on Dup()", "tcp": "plain TCP exchange (reference)"}
SHORT = {"hvd": "Horovod's ops", "channel": "PipelineChannel", "tdist-coll": "Gloo collectives",
         "tdist-p2p": "Gloo send/recv, send first", "mpi-blocking": "mpi4py blocking",
         "mpi-nonblocking": "mpi4py non-blocking", "mpi-p2p": "mpi4py Sendrecv"}
OP_NAMES = {"a2a-int8": "int8 alltoall", "ag-int8": "int8 allgather", "a2a-fp16": "fp16 alltoall",
            "ag-fp16": "fp16 allgather", "ar-fp32": "float32 all-reduce"}


# ----------------------------------------------------------------------------- launching
def _tail(path: Path, stop: threading.Event) -> None:
    """Echoes the ranks' progress lines while a launch runs."""
    seen = 0
    while not stop.is_set():
        if path.exists():
            lines = path.read_text().splitlines()
            for line in lines[seen:]:
                print(f"    {line}", file=sys.stderr, flush=True)
            seen = len(lines)
        stop.wait(1.0)


def run_launch(cluster: Any, controller: str, rounds: int, timeout: float) -> Dict[str, Any]:
    from .cluster import gloo, launch

    progress = ROOT / "build" / f"phase_transport.{controller}.progress"
    progress.parent.mkdir(exist_ok=True)
    progress.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "benchmarks.phase_transport_worker", "--controller", controller,
           "--rounds", str(rounds), "--label", f"{cluster.rate} {controller}"]
    env = {"OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": str(ROOT),
           "PSGD_PROGRESS": str(progress)}
    stop = threading.Event()
    tail = threading.Thread(target=_tail, args=(progress, stop), daemon=True)
    tail.start()
    start = time.perf_counter()
    try:
        proc = (gloo if controller == "gloo" else launch).run(cluster, cmd, env=env, timeout=timeout)
    finally:
        stop.set()
        tail.join()
    for line in proc.stdout.splitlines():
        if MARKER in line:
            result = json.loads(line.split(MARKER, 1)[1])
            result["rate"], result["seconds"] = cluster.rate, time.perf_counter() - start
            return result
    raise RuntimeError(f"no result from the {controller} launch at {cluster.rate} (rc {proc.returncode}):\n"
                       f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")


# ------------------------------------------------------------------------------ analysis
def summarize(launch: Dict[str, Any]) -> Dict[str, Dict[str, float]]:
    """Per "transport|op|condition": median seconds of the slowest rank, median CPU seconds of a
    rank, and the share of its compute rate a rank kept (beside compute only)."""
    ranks = launch["per_rank"]
    rates = [sum(n for _, n in r["baseline"]) / sum(s for s, _ in r["baseline"]) for r in ranks]
    out: Dict[str, Dict[str, float]] = {}
    for key in ranks[0]["samples"]:
        per_rank = [r["samples"][key] for r in ranks]
        slowest = [max(s[i][0] for s in per_rank) for i in range(len(per_rank[0]))]
        cpu = [statistics.mean(s[i][1] for s in per_rank) for i in range(len(per_rank[0]))]
        kept = [statistics.mean(s[i][2] / s[i][0] / rate for s, rate in zip(per_rank, rates))
                for i in range(len(per_rank[0]))]
        out[key] = {"s": statistics.median(slowest), "cpu": statistics.median(cpu), "kept": statistics.median(kept)}
    return out


def share(summary: Dict[str, Dict[str, float]], transport: str, op: str, cond: str) -> Optional[float]:
    """The transport's rate as a share of the plain TCP exchange alone (same bytes, same launch)."""
    mine = summary.get(f"{transport}|{op}|{cond}")
    return summary[f"tcp|{op}|alone"]["s"] / mine["s"] if mine else None


def _pct(v: Optional[float]) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def rate_table(launches: List[Dict[str, Any]]) -> Tuple[str, List[list]]:
    from .report import table

    rows = []
    for launch in launches:
        summary, ctl = summarize(launch), launch["controller"]
        for t in launch["transports"]:
            cells = [f"{_pct(share(summary, t, op, 'alone'))} / {_pct(share(summary, t, op, 'beside'))}" for op in OPS]
            kept = statistics.median(summary[f"{t}|{op}|beside"]["kept"] for op in OPS)
            cpu = sum(summary[f"{t}|{op}|alone"]["cpu"] for op in ("a2a-int8", "ag-int8")) * 1e3
            rows.append([NAMES[t].format(ctl=ctl.upper()), f"{ctl}", *cells, _pct(kept), f"{cpu:.0f}"])
    header = ["transport", "launch", *[OP_NAMES[o] + " (alone / beside compute)" for o in OPS],
              "compute kept beside it", "CPU ms, int8 alltoall + allgather alone"]
    return table(header, rows), rows


def ms_line(launches: List[Dict[str, Any]]) -> str:
    parts = []
    for launch in launches:
        s = summarize(launch)
        ref = ", ".join(f"{OP_NAMES[o]} {1e3 * s[f'tcp|{o}|alone']['s']:.0f}" for o in OPS)
        parts.append(f"{launch['controller']} launch: {ref}")
    return "; ".join(parts)


PHASES = ("a2a-int8", "ag-int8", "a2a-fp16", "ag-fp16")


def verdicts(by_rate: Dict[str, List[Dict[str, Any]]]) -> str:
    """Which transport was fastest for the compressed phases (int8 and fp16 alltoall + allgather)
    beside compute, per rate and launch, from the medians."""
    lines = []
    for rate, launches in by_rate.items():
        for launch in launches:
            s = summarize(launch)
            totals = {t: sum(s[f"{t}|{op}|beside"]["s"] for op in PHASES) for t in launch["transports"] if t != "tcp"}
            best = min(totals, key=totals.get)
            hvd = totals["hvd"]
            lines.append(f"- {rate}, {launch['controller']} launch: {SHORT[best]}, {1e3 * totals[best]:.0f} ms for the four; "
                         f"Horovod's ops {1e3 * hvd:.0f} ms ({hvd / totals[best]:.2f}x)"
                         + (f"; PipelineChannel {1e3 * totals['channel']:.0f} ms" if best != "channel" else ""))
    return "\n".join(lines)


def ranges(launches: List[Dict[str, Any]]) -> str:
    """Min-max over launches of a transport's cells: the compressed phases, and the float32 all-reduce."""

    def span(transport: str, ops: Tuple[str, ...], cond: str, controller: Optional[str] = None) -> str:
        values = [share(summarize(l), transport, op, cond) for l in launches for op in ops
                  if controller in (None, l["controller"])]
        values = [v for v in values if v is not None]
        return f"{100 * min(values):.0f}-{100 * max(values):.0f}%"

    rows = [("PipelineChannel", "channel", None), ("Horovod's ops, Gloo controller", "hvd", "gloo"),
            ("Horovod's ops, MPI controller", "hvd", "mpi"), ("Gloo's own collectives", "tdist-coll", None),
            ("Gloo send/recv, send posted first", "tdist-p2p", None),
            ("mpi4py non-blocking (comm/mpi4py.py)", "mpi-nonblocking", "mpi")]
    return "\n".join(f"- {label}: compressed phases {span(t, PHASES, 'alone', c)} alone, {span(t, PHASES, 'beside', c)} "
                     f"beside compute; float32 all-reduce {span(t, ('ar-fp32',), 'alone', c)} / "
                     f"{span(t, ('ar-fp32',), 'beside', c)}" for label, t, c in rows)


def render(record: Dict[str, Any]) -> str:
    by_rate: Dict[str, List[Dict[str, Any]]] = {}
    for launch in record["launches"]:
        by_rate.setdefault(launch["rate"], []).append(launch)
    first = record["launches"][0]
    sections = []
    for rate, launches in by_rate.items():
        tab, _ = rate_table(launches)
        sections.append(f"**{rate} links.** Plain TCP exchange alone, ms: {ms_line(launches)}.\n\n{tab}")
    body = "\n\n".join(sections)
    return f"""## Transport for the pipeline's phases (`benchmarks/phase_transport.py`)

{record['machine']}; {record['minutes']:.1f} min for {len(record['launches'])} launches. 2 hosts (network
namespaces, `tc tbf rate R burst 512kb`), one rank per host, one launch per link rate under Horovod's Gloo
controller (our rendezvous, `benchmarks/cluster/gloo.py`) and one under its MPI controller (mpirun,
`benchmarks/cluster/launch.py`). Payloads are those of the compressed all-reduce of the throughput
benchmark's 16.8 MB float32 gradient on 2 ranks: an int8 row is {first['row_bytes']['int8']} B, an fp16 row
{first['row_bytes']['fp16']} B (alltoall: each rank sends one row to the other; allgather: each sends its
row), and the float32 all-reduce of all {first['grad_bytes']} B. Each call is blocking, issued from the main
thread (as the engine's comm thread issues them); "beside compute" means a second thread of the same
process runs a one-thread torch matmul loop meanwhile. Transports, operations and the two conditions are
interleaved round by round, {first['rounds']} rounds after a warm-up round; every sample starts after a
barrier over a socket of the benchmark's own. A cell is the transport's rate as a share of a plain TCP
exchange of the same bytes on the same link, alone, in the same launch (median time of the slowest rank;
over 100% is possible: the tbf burst lets the first 512 kB out at once, and the reference is a Python
socket loop). *Compute kept*: the matmul rate during the call over its rate alone (median over the five
operations). The 2 cores were shared with other jobs: compare within a launch.

{body}

Share of the plain TCP exchange over all {len(record['launches'])} launches (each cell's median; min-max):

{ranges(record['launches'])}

Fastest transport for the compressed phases beside compute (the four alltoall/allgather cells, medians summed):

{verdicts(by_rate)}

**Why Gloo's alltoall (and Horovod's under its Gloo controller) reach only about half of the wire.** Gloo's TCP pair (`gloo/transport/tcp/pair.cc`) sends a message only once the receiver has
announced the matching receive (`NOTIFY_RECV_READY`), and it queues that announcement, like any write,
behind the data the pair is still writing (`sendAsyncMode`: "if an earlier operation hasn't finished
transmitting, add this operation to the transmit queue"). When one rank's send starts before it has
posted its receive (the other rank's announcement arrived first), its own announcement waits until
all of its data is out: the two directions of the exchange take turns, and the per-rank samples
alternate between one and two transfer times. The "send posted first" row shows it with plain
send/recv; PipelineChannel posts every receive before any send and reaches the wire. Gloo's ring
all-reduce was not affected in these runs. Horovod's alltoall and allgather under its MPI controller
(MPI_Alltoallv / MPI_Allgatherv) show the same halving; their cause was not traced here. Horovod's
grouped ops were not measured: a bucket's phase is one tensor, and grouping fuses the negotiation of
several tensors, not the transfer underneath. *Compute kept* swings with the other jobs on the 2
cores (values over 100% and the lowest ones come from single launches); read it across rows of one launch.
"""


# ----------------------------------------------------------------------------------- main
def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rates", default="155mbit,620mbit,1gbit")
    parser.add_argument("--controllers", default="gloo,mpi")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--launch-timeout", type=float, default=900)
    parser.add_argument("--max-quiet-wait", type=float, default=30, help="seconds to wait for other jobs to calm down")
    parser.add_argument("--render", type=Path, help="rewrite the section from a saved record, run nothing")
    parser.add_argument("--no-doc", action="store_true", help="print the section, leave docs/benchmarks.md alone")
    args = parser.parse_args(argv)
    from .report import machine_line, write_section

    if args.render:
        record = json.loads(args.render.read_text())
    else:
        from .cluster.netns import Cluster, leftover_namespaces
        from .throughput import wait_for_quiet

        rates = args.rates.split(",")
        record = {"machine": machine_line(), "launches": []}
        wall = time.perf_counter()
        with Cluster(2, rate=rates[0]) as cluster:
            for rate in rates:
                cluster.reshape(rate)
                for controller in args.controllers.split(","):
                    waited, busy = wait_for_quiet(args.max_quiet_wait)
                    print(f"  {rate}, {controller} controller (waited {waited:.0f} s for a quieter machine, "
                          f"{busy:.1f} cores busy) ...", file=sys.stderr, flush=True)
                    record["launches"].append(run_launch(cluster, controller, args.rounds, args.launch_timeout))
                    record["minutes"] = (time.perf_counter() - wall) / 60
                    RECORD.parent.mkdir(exist_ok=True)
                    RECORD.write_text(json.dumps(record))
        left = leftover_namespaces(cluster.prefix)
        if left:
            raise RuntimeError(f"tear-down left namespaces behind: {left}")
    doc = render(record)
    print(doc)
    if not args.no_doc:
        write_section("phase_transport", doc)
        print("wrote docs/benchmarks.md section 'phase_transport'", file=sys.stderr)


if __name__ == "__main__":
    main()
