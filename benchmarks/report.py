"""Writes one benchmark's section of docs/benchmarks.md, leaving the other sections alone.

Each benchmark owns the text between ``<!-- BEGIN key -->`` and ``<!-- END key -->``; a new key
is appended at the end. Figures in those sections come only from these scripts' runs.
"""
from __future__ import annotations

import datetime
import platform
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "benchmarks.md"
HEADER = ("# Benchmarks\n\nEvery figure below was written by a script in `benchmarks/` (named in each "
          "section) from one run on the machine it names. Speed figures are ratios of configurations run "
          "side by side in that run.\n")


def machine_line() -> str:
    import os

    return (f"{datetime.date.today().isoformat()}, {platform.machine()}, {os.cpu_count()} cores, "
            f"Python {platform.python_version()}")


def write_section(key: str, markdown: str, doc: Path = DOC) -> None:
    doc.parent.mkdir(parents=True, exist_ok=True)
    text = doc.read_text() if doc.exists() else HEADER
    block = f"<!-- BEGIN {key} -->\n{markdown.rstrip()}\n<!-- END {key} -->"
    pattern = re.compile(rf"<!-- BEGIN {re.escape(key)} -->.*?<!-- END {re.escape(key)} -->", re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    doc.write_text(text)


def table(header: list, rows: list) -> str:
    lines = ["| " + " | ".join(map(str, header)) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(map(str, r)) + " |" for r in rows]
    return "\n".join(lines)
