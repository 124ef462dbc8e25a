#!/usr/bin/env python3
"""The GPU tables of docs/results/gsm8k.md from the GSM8K gate's recorded reports.

    python -m benchmarks.gsm8k_page                   # rewrite the generated part of gsm8k.md
    python -m benchmarks.gsm8k_page --check           # exit 1 when the committed page is stale
    python -m benchmarks.gsm8k_page --add DIR --out docs/results/gsm8k_gpu_<name>.json \\
        --commit <sha> --date "<YYYY-MM-DD HH:MM UTC>" --gpu "<card>" --command "<command>"

``--add`` turns the reports a GPU run wrote (``$OUT/gsm8k/<config>.json`` from
``tools/gpu/run_groups.sh $OUT gsm8k_<family>``) into one record: each report re-scored against
the thresholds now in its YAML (tests/evals/gsm8k/configs/<config>.yaml), the count of
completions identical to the family's no-speculation arm, and the completions and token ids left
out (the record stays small). The page part between :data:`BEGIN` and :data:`END` is written from
every ``docs/results/gsm8k_gpu*.json``: one table per record, "pass" judged against the YAML
thresholds of today (so a changed threshold changes the page, and ``--check`` notices). Records
written before ``--add`` existed hold only the reports (no ``meta``); the page says so. A report
without a field the table needs is refused with :class:`RecordError`.
tests/unit/benchmarks/test_gsm8k_page.py checks the committed page is this module's output.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dspark_dev import gsm8k

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "docs" / "results"
PAGE = RESULTS / "gsm8k.md"
CONFIGS = REPO / "tests" / "evals" / "gsm8k" / "configs"
PATTERN = "gsm8k_gpu*.json"
BEGIN = "<!-- gsm8k-gpu-tables: written by `python -m benchmarks.gsm8k_page`; do not edit -->"
END = "<!-- end gsm8k-gpu-tables -->"
REPORT_KEYS = (
    "name",
    "num_questions",
    "accuracy",
    "invalid_rate",
    "mean_acceptance_length",
    "per_position_acceptance",
    "num_drafts",
    "generate_s",
)
META_KEYS = ("commit", "date", "gpu", "command")


class RecordError(ValueError):
    """A record the page cannot be written from."""


def _config_path(name: str, configs: Path) -> Path:
    path = configs / f"{name}.yaml"
    if not path.is_file():
        raise RecordError(f"report {name!r}: no config {path}")
    return path


def rescore(report: dict, configs: Path = CONFIGS) -> dict:
    """``report`` with the thresholds of its YAML today and the verdict they give."""
    cfg = gsm8k.load_config(str(_config_path(report["name"], configs)))
    out = dict(report)
    out["accuracy_min"] = cfg.accuracy_min
    out["accuracy_equals"] = cfg.accuracy_equals
    out["acceptance_length_min"] = cfg.acceptance_length_min
    out["failures"] = gsm8k.unmeasured(cfg) + gsm8k.check(out)
    out["passed"] = not out["failures"]
    return out


def _family_nospec(name: str) -> str:
    """``dsv41-pp2-dspark`` -> ``dsv41-pp1-nospec``: the arm every DSpark arm must reproduce."""
    return name.split("-", 1)[0] + "-pp1-nospec"


def build_record(
    reports: list[dict], meta: dict, configs: Path = CONFIGS
) -> dict:  # the ``--add`` step
    missing = [k for k in META_KEYS if not meta.get(k)]
    if missing:
        raise RecordError(f"--add needs {', '.join(missing)}")
    by_name = {r["name"]: r for r in reports}
    out = {}
    for name, rep in sorted(by_name.items()):
        for key in REPORT_KEYS:
            if key not in rep:
                raise RecordError(f"report {name!r} has no {key!r}")
        slim = {k: v for k, v in rep.items() if k not in ("completions", "tokens")}
        base = by_name.get(_family_nospec(name))
        if rep.get("speculative") and base and rep.get("completions") and base.get("completions"):
            same = sum(a == b for a, b in zip(rep["completions"], base["completions"], strict=True))
            slim["completions_identical_to_nospec"] = [same, len(rep["completions"])]
        out[name] = rescore(slim, configs)
    return {"meta": dict(meta), "reports": out}


def _reports_of(name: str, rec: dict) -> tuple[dict | None, dict]:
    if "reports" in rec:
        meta = rec.get("meta") or {}
        gone = [k for k in META_KEYS if k not in meta]
        if gone:
            raise RecordError(f"{name}: meta has no {', '.join(gone)}")
        return meta, rec["reports"]
    return None, rec  # a record from before ``--add``: the reports only


def _row(rep: dict) -> str:
    acc_len = rep["mean_acceptance_length"]
    per = " ".join(f"{x:.2f}" for x in rep["per_position_acceptance"]) or "-"
    same = rep.get("completions_identical_to_nospec")
    return (
        f"| {rep['name']} | {rep['accuracy']:.4f} ({round(rep['accuracy'] * rep['num_questions'])}"
        f"/{rep['num_questions']}) | {rep['invalid_rate']:.4f} | "
        f"{'-' if acc_len is None else f'{acc_len:.3f}'} | {per} | {rep['num_drafts']} | "
        f"{f'{same[0]}/{same[1]}' if same else '-'} | {rep['generate_s']} | "
        f"{'yes' if rep['passed'] else 'NO: ' + '; '.join(rep['failures'])} |"
    )


def tables(results: Path = RESULTS, configs: Path = CONFIGS) -> str:
    lines = [BEGIN, ""]
    for path in sorted(results.glob(PATTERN)):
        meta, reports = _reports_of(path.name, json.loads(path.read_text()))
        if meta:
            lines.append(
                f"Record [{path.name}]({path.name}): commit {meta['commit']}, {meta['date']}, "
                f"{meta['gpu']}; `{meta['command']}`."
            )
        else:
            lines.append(
                f"Record [{path.name}]({path.name}) (reports only: commit, date and GPU are in "
                "the prose above)."
            )
        lines += [
            "",
            "| config | accuracy | invalid | mean acceptance length | per-position acceptance | "
            "draft steps | completions = no-spec | generate s | pass (today's YAML) |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for name, rep in sorted(reports.items()):
            for key in REPORT_KEYS:
                if key not in rep:
                    raise RecordError(f"{path.name}: report {name!r} has no {key!r}")
            lines.append(_row(rescore(rep, configs)))
        lines.append("")
    lines.append(END)
    return "\n".join(lines)


def page(text: str, results: Path = RESULTS, configs: Path = CONFIGS) -> str:
    """``text`` (gsm8k.md) with its generated part rewritten."""
    if text.count(BEGIN) != 1 or text.count(END) != 1:
        raise RecordError(f"{PAGE.name} must hold the markers once each: {BEGIN!r} ... {END!r}")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return head + tables(results, configs) + tail


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when gsm8k.md is stale")
    ap.add_argument("--add", metavar="DIR", help="a GPU run's $OUT/gsm8k folder of reports")
    ap.add_argument("--out", help="the record --add writes (docs/results/gsm8k_gpu_<name>.json)")
    for key in META_KEYS:
        ap.add_argument(f"--{key}", help=f"the run's {key} (with --add)")
    args = ap.parse_args(argv)
    if args.add:
        if not args.out:
            ap.error("--add needs --out")
        reports = [json.loads(p.read_text()) for p in sorted(Path(args.add).glob("*.json"))]
        if not reports:
            ap.error(f"no reports in {args.add}")
        rec = build_record(reports, {k: getattr(args, k) for k in META_KEYS})
        Path(args.out).write_text(json.dumps(rec, indent=2) + "\n")
        print(f"wrote {args.out} ({len(rec['reports'])} reports)")
        return 0
    text = PAGE.read_text()
    new = page(text)
    if args.check:
        if new != text:
            print(f"{PAGE} is stale: run python -m benchmarks.gsm8k_page", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(new)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
