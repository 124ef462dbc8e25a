#!/usr/bin/env python3
"""Short pass/fail/skip table of a pytest run, from its junit XML (or, if that is missing, its log).

Usage: python3 -m dspark_dev.gpu_summary --junit OUT/gpu_junit.xml [--log OUT/gpu_suite.log]
                                      [--wall SECONDS] [--out OUT/gpu_summary.txt]

Prints one row per test (outcome, seconds, name, the first line of the skip reason or failure),
then the totals. Exit status: 0 when nothing failed or errored and at least one test passed,
1 otherwise (a run in which everything skipped is not a pass), 2 when there is nothing to read.
Stdlib only (runs on the GPU machine before anything else is installed).
"""

from __future__ import annotations

import argparse
import re
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

ORDER = ("FAILED", "ERROR", "PASSED", "SKIPPED")


@dataclass
class Row:
    outcome: str
    name: str
    seconds: float | None
    note: str = ""


def _first_line(text: str | None, limit: int = 110) -> str:
    for line in (text or "").splitlines():
        line = line.strip()
        if line:
            return line if len(line) <= limit else line[: limit - 3] + "..."
    return ""


def rows_from_junit(path: Path) -> list[Row]:
    root = ET.parse(path).getroot()
    rows = []
    for case in root.iter("testcase"):
        cls = case.get("classname", "")
        name = f"{cls.split('.')[-1]}::{case.get('name', '?')}" if cls else case.get("name", "?")
        secs = float(case.get("time") or 0.0)
        outcome, note = "PASSED", ""
        for child in case:
            tag = child.tag
            if tag in ("failure", "error"):
                outcome = "FAILED" if tag == "failure" else "ERROR"
                note = _first_line(child.get("message")) or _first_line(child.text)
                break
            if tag == "skipped":
                outcome = "SKIPPED"
                note = _first_line(child.get("message")) or _first_line(child.text)
                # pytest writes "reason" messages as "file:line: reason"; keep the reason
                note = re.sub(r"^.*?:\d+: ", "", note)
        rows.append(Row(outcome, name, secs, note))
    return rows


_LOG_LINE = re.compile(
    r"^(\S+::\S+)\s+(PASSED|FAILED|SKIPPED|ERROR)\b|^(PASSED|FAILED|SKIPPED|ERROR)\s+(\S+::\S+)"
)


def rows_from_log(path: Path) -> list[Row]:
    """Fallback when pytest died before writing junit: the ``-v``/``-rA`` lines of the log."""
    seen: dict[str, Row] = {}
    for line in path.read_text(errors="replace").splitlines():
        m = _LOG_LINE.match(line.strip())
        if not m:
            continue
        name = m.group(1) or m.group(4)
        outcome = m.group(2) or m.group(3)
        rest = line.split(" - ", 1)[1] if " - " in line else ""
        seen[name] = Row(outcome, name.split("/")[-1], None, _first_line(rest))
    return list(seen.values())


def table(rows: list[Row], wall: float | None = None, source: str = "") -> str:
    counts = {k: sum(r.outcome == k for r in rows) for k in ORDER}
    w = max([len(r.name) for r in rows] + [4])
    w = min(w, 78)
    lines = [f"{'outcome':<8} {'secs':>6}  {'test':<{w}}  note", "-" * (8 + 1 + 6 + 2 + w + 2 + 4)]
    for r in sorted(rows, key=lambda r: ORDER.index(r.outcome) if r.outcome in ORDER else 9):
        secs = f"{r.seconds:6.1f}" if r.seconds is not None else "     ?"
        name = r.name if len(r.name) <= w else "..." + r.name[-(w - 3) :]
        lines.append(f"{r.outcome:<8} {secs}  {name:<{w}}  {r.note}")
    total = " ".join(f"{k.lower()} {counts[k]}" for k in ORDER)
    extra = f", wall {wall:.0f} s" if wall is not None else ""
    lines.append(f"TOTAL {len(rows)} tests: {total}{extra}{source}")
    return "\n".join(lines)


def verdict(rows: list[Row]) -> int:
    if not rows:
        return 2
    bad = any(r.outcome in ("FAILED", "ERROR") for r in rows)
    passed = any(r.outcome == "PASSED" for r in rows)
    return 0 if passed and not bad else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--junit", type=Path)
    ap.add_argument("--log", type=Path)
    ap.add_argument("--wall", type=float, default=None)
    ap.add_argument("--out", type=Path, default=None, help="also write the table here")
    a = ap.parse_args(argv)
    rows, source = [], ""
    if a.junit and a.junit.exists() and a.junit.stat().st_size > 0:
        try:
            rows = rows_from_junit(a.junit)
            source = f" (from {a.junit.name})"
        except ET.ParseError as e:
            print(f"summarize: junit unreadable ({e}); falling back to the log", file=sys.stderr)
    if not rows and a.log and a.log.exists():
        rows = rows_from_log(a.log)
        source = f" (from the log {a.log.name}: pytest wrote no junit, so it was probably killed)"
    if not rows:
        print("summarize: no test results found (no junit, no result lines in the log)")
        return 2
    text = table(rows, a.wall, source)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")
    return verdict(rows)


if __name__ == "__main__":
    raise SystemExit(main())
