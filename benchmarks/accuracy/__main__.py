"""``python -m benchmarks.accuracy``: the accuracy study (``make accuracy``; docs/accuracy.md).

Launches ``--worker`` once per task and world size under ``horovodrun -np N -H localhost:N --mpi``
(``--ranks``, 2 and 4 by default: each rank keeps the task's batch, as a Horovod user's ranks do),
forwards its progress lines to stderr, then writes the record (``docs/accuracy.json``), the page
and the plot. Trials: ``--tasks``, ``--configs``, ``--seeds``, ``--steps`` (about that many
updates per run), ``--lr`` (skips the grid; ``--lr-source`` says where it comes from), ``--no-doc``
(record to ``--record`` only), ``--from-record`` (the page from saved records, no training; several
are merged, the later one's runs of a task and world size replacing the earlier's).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from .summary import summarise
from .tasks import CONFIGS, TASKS
from .worker import parse, work

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
DOC, RECORD, PLOT = DOCS / "accuracy.md", DOCS / "accuracy.json", DOCS / "img" / "accuracy.png"
TAG = re.compile(r"\[\d+(,\d+)?\]<std(out|err)>:")   # mpirun's rank tags, anywhere in a line


def launch(task: str, args: argparse.Namespace, lr: Optional[float], source: Optional[str], ranks: int = 2) -> Dict[str, Any]:
    bindir = Path(sys.executable).parent   # the venv's bin, its python symlink unresolved
    cmd = [str(bindir / "horovodrun"), "-np", str(ranks), "-H", f"localhost:{ranks}", "--mpi", str(bindir / "python"),
           "-m", "benchmarks.accuracy", "--worker", "--task", task]
    out = Path(tempfile.mkdtemp()) / f"{task}.json"
    cmd += ["--out", str(out)] + (["--configs", *args.configs] if args.configs else [])
    for flag, value in (("--seeds", args.seeds), ("--steps", args.steps), ("--lr", lr), ("--lr-source", source)):
        cmd += [f"{flag}={value}"] if value is not None else []   # "=": a value may start with "--"
    # Horovod's loop wakes every cycle on the cores compute needs; the pipeline does not use it (README)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1",
               HOROVOD_CYCLE_TIME=os.environ.get("HOROVOD_CYCLE_TIME", "20"))
    start, tail = time.perf_counter(), []
    with subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:  # type: ignore[union-attr]
            line = TAG.sub("", line.rstrip("\n"))
            tail = (tail + [line])[-40:]
            if line.startswith(task):
                print("  " + line, file=sys.stderr, flush=True)
    if proc.returncode or not out.exists():
        raise RuntimeError(f"no result from {' '.join(cmd)} (rc {proc.returncode}):\n" + "\n".join(tail))
    print(f"{task}, {ranks} ranks: {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    found = json.loads(out.read_text())
    shutil.rmtree(out.parent)
    return found


def main(argv: Optional[List[str]] = None) -> None:
    if argv is None and "--worker" in sys.argv:
        work(parse(sys.argv[1:]))
        return
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--tasks", nargs="+", choices=list(TASKS), default=list(TASKS))
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), help="instead of each task's own")
    parser.add_argument("--seeds", type=int, help="instead of each task's own")
    parser.add_argument("--steps", type=int, help="about this many updates per run (trials)")
    parser.add_argument("--lr", type=float, help="this rate for every task, no grid")
    parser.add_argument("--lr-source", help="where --lr comes from (the record and the page say it)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="world sizes (default: 2 and 4)")
    parser.add_argument("--record", type=Path, default=RECORD)
    parser.add_argument("--no-doc", action="store_true", help="write the record only")
    parser.add_argument("--from-record", type=Path, nargs="+", help="write the page from these records; no training")
    args = parser.parse_args(argv)
    from .report import write

    if args.from_record:
        record = merge([json.loads(path.read_text()) for path in args.from_record])
    else:
        start, tasks = time.perf_counter(), []
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip() or "unknown"
        args.record.parent.mkdir(parents=True, exist_ok=True)
        for ranks, name in [(r, t) for r in args.ranks for t in TASKS if t in args.tasks]:
            # a task's lr_from source runs before it; more ranks keep the rate the first size tuned
            source = next((t for t in tasks if t["task"] == TASKS[name].lr_from and t["ranks"] == ranks), None)
            first = next((t for t in tasks if t["task"] == name and t["ranks"] == args.ranks[0]), None)
            if args.lr is not None:
                tasks.append(launch(name, args, args.lr, args.lr_source or "--lr", ranks))
            elif first is not None and first["lr_grid"]:
                tasks.append(launch(name, args, first["lr"], f"the {args.ranks[0]}-rank grid", ranks))
            else:
                tasks.append(launch(name, args, source and source["lr"], source and f"`{source['task']}`'s grid",
                                    ranks))
            # after every task, so that a failure hours in keeps what was measured (--from-record)
            record = {"machine": f"{datetime.date.today().isoformat()}, {platform.machine()}, {os.cpu_count()} "
                                 f"cores, Python {platform.python_version()}", "commit": commit,
                      "elapsed": time.perf_counter() - start, "tasks": tasks, "summary": summarise(tasks)}
            args.record.write_text(json.dumps(record, indent=1) + "\n")
    if not args.no_doc:
        write(record, DOC, PLOT)
        print(f"wrote {DOC.relative_to(ROOT)} and {PLOT.relative_to(ROOT)}", file=sys.stderr)


def merge(records: List[Dict[str, Any]]) -> Dict[str, Any]:
    """One record from several (invocations of the study on parts of it): a later record's task at
    a world size replaces an earlier one's; commits and machines are listed."""
    tasks: Dict[Any, Dict[str, Any]] = {}
    for record in records:
        for task in record["tasks"]:
            tasks[(task["task"], task.get("ranks", 2))] = task
    merged = list(tasks.values())
    return {"machine": "; ".join(dict.fromkeys(r["machine"] for r in records)),
            "commit": ", ".join(dict.fromkeys(r["commit"] for r in records)),
            "elapsed": sum(r["elapsed"] for r in records), "tasks": merged, "summary": summarise(merged)}


if __name__ == "__main__":
    main()
