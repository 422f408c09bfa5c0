"""Import time of the entry modules, each in a fresh interpreter, next to Horovod's own modules,
and which frameworks each one pulls in. Writes the "imports" section of docs/benchmarks.md.

    python -m benchmarks.import_time [--repeats 5]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from typing import Dict, List, Optional

MODULES = ["pipesgd_hvd.torch", "horovod.torch", "pipesgd_hvd.keras", "horovod.tensorflow.keras",
           "pipesgd_hvd.tensorflow"]
PROBE = ("import json, sys, time; t = time.perf_counter(); import {module}; dt = time.perf_counter() - t; "
         "print(json.dumps({{'seconds': dt, 'torch': 'torch' in sys.modules, "
         "'tensorflow': 'tensorflow' in sys.modules}}))")


def measure(module: str) -> Dict[str, object]:
    """One fresh interpreter importing ``module``: seconds and the frameworks it loaded."""
    out = subprocess.run([sys.executable, "-c", PROBE.format(module=module)], capture_output=True, text=True,
                         check=True, env={"TF_CPP_MIN_LOG_LEVEL": "3", "PATH": "/usr/bin:/bin"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: Optional[List[str]] = None) -> None:
    from benchmarks.report import machine_line, table, write_section

    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    rows = []
    for _ in range(args.repeats):  # interleaved, so drift on the machine hits every module alike
        for module in MODULES:
            rows.append((module, measure(module)))
    result = []
    for module in MODULES:
        runs = [r for m, r in rows if m == module]
        result.append([f"`import {module}`", f"{statistics.median(r['seconds'] for r in runs):.2f}",
                       "yes" if runs[0]["torch"] else "no", "yes" if runs[0]["tensorflow"] else "no"])
    text = (f"## Import time (`benchmarks/import_time.py`)\n\n{machine_line()}. Each import in a fresh "
            f"interpreter, median of {args.repeats}, interleaved. `pipesgd_hvd.torch` does not load TensorFlow "
            "and `pipesgd_hvd.keras` does not load PyTorch (tests/test_imports.py keeps it so).\n\n"
            + table(["import", "seconds", "loads torch", "loads tensorflow"], result))
    write_section("imports", text)
    print(text)


if __name__ == "__main__":
    main()
