#!/usr/bin/env python3
"""docs/results/k3_pp.md from the Kimi-K3 PP=2 GPU records (issue 41).

    python -m benchmarks.k3_pp_page            # rewrite docs/results/k3_pp.md
    python -m benchmarks.k3_pp_page --check    # exit 1 when the committed page is stale

Reads ``docs/results/k3_pp_fix_gpu.json`` (the runs that found and checked the fix: a ``runs``
list, each with commit, date, GPU, command, the change it ran with, pytest verdicts and the lines
it printed), the diagnosis records ``k3_pp_diagnosis_gpu*.json`` (one run each) and the records
tests/gpu/test_dsv4_k3_pp.py wrote itself (``GROUP_PATTERNS``: the PP=2 jobs, the TP=2 x PP=2
job), and writes one section per run, oldest first: what changed, the command, a verdict per test
and the printed lines, unchanged (a job's error also by the exception lines that the cut leaves
out). Nothing on the page is typed by hand except the headings; a record without a field the page
needs is refused with :class:`RecordError`. tests/unit/benchmarks/test_k3_pp_page.py checks that the
committed page is this module's output.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from benchmarks.pages import page_main

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "docs" / "results"
PAGE = RESULTS / "k3_pp.md"
FIX = "k3_pp_fix_gpu.json"
DIAGNOSES = "k3_pp_diagnosis_gpu*.json"
#: records written by tests/gpu/test_dsv4_k3_pp.py itself (group ``dsv4k3_pp``): per-job counters
#: and verdicts, a job that failed with its error
GROUP_RECORDS = "k3_pp_trained_gpu*.json"
GROUP_PATTERNS = (GROUP_RECORDS, "k3_tp2pp2_gpu*.json")  # the TP=2 x PP=2 job's records
GROUP_KEYS = ("commit", "date", "gpu", "command", "weights", "k", "selected_jobs", "jobs")
RUN_KEYS = ("commit", "date", "gpu", "command", "results")
CUT = 300  # characters of a printed line on the page
_EXCEPTION = re.compile(r"\b\w+(Error|Exception): ")


class RecordError(ValueError):
    """A record the page cannot be written from."""


def _runs_of(name: str, rec: dict) -> list[dict]:
    runs = rec.get("runs", [rec])
    if not isinstance(runs, list) or not runs:
        raise RecordError(f"{name}: no runs")
    for i, run in enumerate(runs):
        for key in RUN_KEYS:
            if key not in run:
                raise RecordError(f"{name}: run {i + 1} has no {key!r}")
        bad = {t: v for t, v in run["results"].items() if v not in ("PASSED", "FAILED")}
        if bad:
            raise RecordError(f"{name}: run {i + 1}: verdicts other than PASSED/FAILED: {bad}")
    return runs


def _group_run(name: str, rec: dict) -> dict:
    """A ``dsv4k3_pp`` group record as a run of the page: one verdict per job (PASSED where its
    check held, FAILED where it did not or the job raised), its check or error as the lines."""
    for key in GROUP_KEYS:
        if key not in rec:
            raise RecordError(f"{name}: no {key!r}")
    verdicts = rec.get("verdicts", {})
    results, lines = {}, []
    for job in rec["selected_jobs"].split(","):
        got = rec["jobs"].get(job, {})
        if "error" in got:
            results[job] = "FAILED"
            lines.append(f"{job}: {got['error']}")
            cut = got["error"][: CUT - len(job) - 2]
            lines += [
                f"{job}, further in its error: {x.strip()}"
                for x in got["error"].splitlines()[1:]
                if _EXCEPTION.search(x) and x not in cut
            ]
        elif job in verdicts:
            results[job] = "PASSED" if verdicts[job]["ok"] else "FAILED"
            lines.append(f"{job}: {verdicts[job]['detail']}")
        elif "counters" in got:
            lines.append(f"{job}: counters {json.dumps(got['counters'])}")
    return {
        **{k: rec[k] for k in ("commit", "date", "gpu", "command")},
        "run": f"({rec['weights']} weights, k={rec['k']})",
        "change": f"jobs {rec['selected_jobs']}",
        "results": results,
        "lines": lines,
    }


def load(results: Path = RESULTS) -> list[tuple[str, dict]]:
    """``(file name, run)`` for every run of the diagnosis records, then of the fix record, then
    of the group records."""
    out = []
    for path in sorted(results.glob(DIAGNOSES)) + [results / FIX]:
        rec = json.loads(path.read_text())
        out += [(path.name, run) for run in _runs_of(path.name, rec)]
    for pattern in GROUP_PATTERNS:
        for path in sorted(results.glob(pattern)):
            out.append((path.name, _group_run(path.name, json.loads(path.read_text()))))
    return out


def _test_name(node: str) -> str:
    return node.split("::", 1)[-1]


def _lines(run: dict) -> list[str]:
    lines = run.get("lines", [])
    if isinstance(lines, dict):  # the diagnosis records: launcher log -> its lines
        return [f"{log}: {x}" for log, xs in lines.items() for x in xs]
    return list(lines)


def section(name: str, run: dict) -> list[str]:
    title = f"Run {run['run']}" if "run" in run else "Diagnosis"
    out = [f"## {title}: {run['date']}, {run['gpu']}, commit {run['commit']} ({name})", ""]
    if run.get("change"):
        out += [f"Ran with: {run['change']}.", ""]
    out += ["```", run["command"], "```", "", "| test | verdict |", "|---|---|"]
    out += [f"| `{_test_name(t)}` | {v} |" for t, v in sorted(run["results"].items())]
    lines = _lines(run)
    if lines:
        out += ["", f"Printed (unchanged, cut at {CUT} characters):", "", "```"]
        out += [x[:CUT] for x in lines]
        out += ["```"]
    return out + [""]


def markdown(runs: list[tuple[str, dict]]) -> str:
    head = [
        f"<!-- generated by benchmarks/k3_pp_page.py from {FIX}, {DIAGNOSES}, "
        f"{', '.join(GROUP_PATTERNS)}; do not edit -->",
        "# Kimi-K3 at PP=2 on one GPU: the runs (issue 41)",
        "",
        "Each section is one GPU call: the change it ran with, its command, pytest's verdict per "
        "test and the lines the tests printed. The cause and the fix: "
        "[../k3-pp-race.md](../k3-pp-race.md).",
        "",
    ]
    body = [line for name, run in runs for line in section(name, run)]
    return "\n".join(head + body).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    return page_main(PAGE, lambda: markdown(load()), __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    sys.exit(main())
