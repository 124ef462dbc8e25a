#!/usr/bin/env python3
"""The one-GPU PP tier's pages from its JSON records: tp_pp.md, pp_gpu.md, pd_pp_gpu.md and
dsv41_pp_gpu.md under docs/results (issues 25, 26, 40, 42).

    python -m benchmarks.tp_pp_page            # rewrite every page
    python -m benchmarks.tp_pp_page --check    # exit 1 when a committed page is stale
    python -m benchmarks.tp_pp_page --group pp [RECORD ...]   # one page, from the files given

Each group (``GROUPS``) reads the records of one GPU test from ``docs/results`` and writes one
page, a section per record, newest first; its ``kind`` names the record shape (``KINDS``: what
:func:`load` checks, what a section holds):

* ``tp_pp`` (``tp_pp*.json``, tests/gpu/test_tp_pp_one_gpu.py) and ``pp`` (``pp_gpu*.json``,
  tests/gpu/test_pp_one_gpu.py), kind ``pp``: the run (commit, date, GPU, command, knobs), a row
  per job that ran (shape, scheduling, graphs or eager, start-up seconds, tokens, the greedy
  verdict against PP=1 without speculation, the spec-decode counters and their per-position
  split against the PP=1 DSpark reference), the counters per wave, the launchers' evidence
  (handshake sizes, vLLM's rank lines, NCCL communicators, the exchange's backend, pinned
  dispatches), the abort, the NCCL stub check, the stock control when it ran, and the jobs the
  record says were not selected;
* ``pd_pp`` (``pd_pp_gpu*.json``, tests/gpu/test_pd_pp_producer.py: groups ``pd_pp``,
  ``pd_pp_<pair>``, ``pd_tp_pp``), kind ``pd_pp``: a row per PD job (shape, producer draft,
  dtype, scheduling, graphs, the greedy verdict, the decoder's counters against aggregated PP=1
  DSpark, or the first line of the job's error), the KV the decoder pulled against its prompt
  tokens with Mooncake's failed transfers and the proxy's counts, the producer's and decoder's
  rank lines, drafter and exchange evidence, the controls' and other verdicts, the jobs not
  selected or skipped;
* ``dsv41_pp`` (``dsv41_pp_gpu*.json``, tests/gpu/test_dsv41_pp.py), kind ``dsv41_pp``: a row per
  job (launchers and their exchange backends, scheduling, graphs, counters, acceptance length
  against PP=1 DSpark), the accepted tokens per position beside the reference, the stock
  control's refusal lines, every verdict.

A file of log lines extracted from a run (``what``, ``source``, ``extracted_by``, ``lines`` and
the ``record`` it belongs to; no ``jobs``) that matches a group's pattern is shown, whole, in its
record's section. Nothing on a page is typed by hand: a figure that is not in a record is not on
the page (shares, differences and acceptance lengths are computed here from the counters). A
record that lacks a field its page needs, or contradicts itself (a job listed as selected but
marked otherwise), is refused with :class:`RecordError`. tests/unit/benchmarks/test_tp_pp_page.py
checks the committed pages are this module's output.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "docs" / "results"
PAGE = RESULTS / "tp_pp.md"
PATTERN = "tp_pp*.json"
PARITY_REF = "ref"  # PP=1 without speculation: the greedy reference
DSPARK_REFS = ("pp1_async", "pp1_sync")  # PP=1 DSpark: the counters' references
LAYOUTS = {
    "shared": "every launcher on GPU 0, NCCL over loopback sockets",
    "per-stage": "launcher R on GPU R",
}


@dataclass(frozen=True)
class Group:
    """One GPU group's page: where its records are, what the page is called and says."""

    name: str
    pattern: str
    page: Path
    title: str
    intro: str
    ranks_verdict: str = ""  # kind "pp": the prefix of the per-job verdict on the launchers' logs
    kind: str = "pp"  # which record shape its test writes: a key of KINDS


GROUPS = {
    "tp_pp": Group(
        "tp_pp",
        PATTERN,
        PAGE,
        "TP x PP on one GPU: DSpark on a TP=2 x PP=2 target (issue 40)",
        "Each section is one JSON record written by tests/gpu/test_tp_pp_one_gpu.py (group `tp_pp` "
        "of tools/gpu/run_groups.sh): four `vllm serve -tp 2 -pp 2 --nnodes 4` launchers, one "
        "rank each, the trained tiny pair. PD with a TP x PP producer (group `pd_tp_pp`) is not "
        "in these records: [pd_pp_gpu.md](pd_pp_gpu.md).",
        "ranks",
    ),
    "pp": Group(
        "pp",
        "pp_gpu*.json",
        RESULTS / "pp_gpu.md",
        "PP=2 and PP=3 on one GPU: DSpark on a pipeline-parallel target (issues 25, 40)",
        "Each section is one JSON record written by tests/gpu/test_pp_one_gpu.py (group `pp` of "
        "tools/gpu/run_groups.sh): one `vllm serve -pp N --nnodes N` launcher per stage, every "
        "launcher its own NCCL host on GPU 0, the trained tiny pair; beside the served jobs, the "
        "stock-vLLM controls and a launcher started without the plugin (`fault`).",
        "nccl",
    ),
    "pd_pp": Group(
        "pd_pp",
        "pd_pp_gpu*.json",
        RESULTS / "pd_pp_gpu.md",
        "PD with a pipeline-parallel producer on one GPU, over MooncakeConnector",
        "Each section is one JSON record written by tests/gpu/test_pd_pp_producer.py (its groups "
        "in tools/gpu/run_groups.sh: `pd_pp`, `pd_pp_<pair>`, `pd_tp_pp`): a prefill-only "
        "producer (the context-KV-only drafter) as one `vllm serve` launcher per rank, a DSpark "
        "decoder and the proxy between them; the references are offline engines of the same "
        "pair. Acceptance shares, their differences and the KV shares are computed here from the "
        "records' counters. A file of log lines extracted from a run (it names its record) is "
        "shown in that record's section.",
        kind="pd_pp",
    ),
    "dsv41_pp": Group(
        "dsv41_pp",
        "dsv41_pp_gpu*.json",
        RESULTS / "dsv41_pp_gpu.md",
        "DeepSeek-V4.1 DSpark at PP=2 on one GPU (issue 42)",
        "Each section is one JSON record written by tests/gpu/test_dsv41_pp.py (group `dsv41_pp` "
        "of tools/gpu/run_groups.sh): the bundled trained V4.1 pair; the PP=1 references as "
        "offline engines, the DSpark jobs as one `vllm serve` launcher per stage, and the same "
        "launchers with the plugin left out (stock vLLM), which must refuse at start. Acceptance "
        "shares, lengths and the differences per position are computed here from the records' "
        "counters.",
        kind="dsv41_pp",
    ),
}


class RecordError(ValueError):
    """A record the page cannot be written from."""


#: what every record of every group holds
RECORD_KEYS = ("commit", "date", "gpu", "command", "jobs", "verdicts", "selected_jobs")
#: what a file of log lines extracted from a run holds (``record``: the record it belongs to)
EXTRACT_KEYS = ("what", "commit", "date", "gpu", "source", "extracted_by", "record", "lines")
EXTRACTED = "extracted files"  # where load() puts a record's extracted-lines files


def need(obj: dict, key: str, where: str):
    if not isinstance(obj, dict) or key not in obj:
        raise RecordError(f"{where}: no {key!r}")
    return obj[key]


def check_selected(name: str, rec: dict) -> None:
    """Every job says whether it was selected, and those that say so are the record's jobs among
    ``selected_jobs`` (a run of test_pd_pp_producer.py writes two records, each with its own jobs
    and the run's whole selection)."""
    jobs = rec["jobs"]
    marked = sorted(j for j, v in jobs.items() if need(v, "selected", f"{name}: job {j}"))
    want = sorted(set(rec["selected_jobs"]) & set(jobs))
    if marked != want:
        raise RecordError(
            f"{name}: selected_jobs {sorted(rec['selected_jobs'])} but the jobs marked "
            f"selected are {marked}"
        )


def check_pp(name: str, rec: dict) -> None:
    check_selected(name, rec)
    for j, v in rec["jobs"].items():
        need(v, "shape", f"{name}: job {j}")


def load(paths: list[Path], group: Group | None = None) -> list[tuple[str, dict]]:
    """``(file name, record)`` per file, newest first; checks what the group's page relies on.

    A file of log lines extracted from a run (no ``jobs``; its ``record`` names the record it
    belongs to) is checked and kept under that record's ``EXTRACTED`` key, not as a section."""
    kind = KINDS[(group or GROUPS["tp_pp"]).kind]
    records, extracts = {}, []
    for path in paths:
        rec = json.loads(Path(path).read_text())
        name = Path(path).name
        if "jobs" not in rec and "lines" in rec:
            for key in EXTRACT_KEYS:
                need(rec, key, name)
            extracts.append((name, rec))
            continue
        for key in RECORD_KEYS:
            need(rec, key, name)
        kind.check(name, rec)
        records[name] = rec
    for name, ex in extracts:
        if ex["record"] not in records:
            raise RecordError(f"{name}: its record {ex['record']} is not among the records read")
        rec = records[ex["record"]]
        records[ex["record"]] = {**rec, EXTRACTED: [*rec.get(EXTRACTED, []), (name, ex)]}
    return sorted(records.items(), key=lambda nr: (nr[1]["date"], nr[0]), reverse=True)


def _shape(shape: dict) -> str:
    return f"TP={shape['tp']} x PP={shape['pp']}" if "tp" in shape else f"PP={shape['pp']}"


def _plugin(shape: dict) -> str:
    """``on``/``off``, or what the record says when only some launchers had it."""
    p = shape["plugin"]
    return p if isinstance(p, str) else ("on" if p else "off")


def _describe(shape: dict) -> str:
    return ", ".join(
        [
            _shape(shape),
            f"{shape['scheduling']} scheduling",
            "CUDA graphs" if shape["cuda_graphs"] else "eager",
            "DSpark" if shape["speculation"] else "no speculation",
            "plugin left out (stock vLLM)"
            if shape["plugin"] is False
            else f"plugin {_plugin(shape)}",
        ]
    )


def _ok(v: dict | None) -> str:
    if v is None:
        return "no verdict"
    return {True: "pass", False: "**FAIL**", None: "recorded"}[v.get("ok")]


def _pct(c: dict) -> str:
    drafted = c["num_draft_tokens"]
    share = f"{100 * c['num_accepted_tokens'] / drafted:.2f}%" if drafted else "-"
    return f"{c['num_accepted_tokens']}/{drafted} ({share})"


def _positions(c: dict) -> str:
    return "[" + ", ".join(str(x) for x in c.get("accepted_per_pos") or []) + "]"


def dspark_ref(jobs: dict, scheduling: str) -> str | None:
    """The PP=1 DSpark job a served job's counters compare with: the one of its scheduling when it
    has counters, else the other (the test's rule)."""
    first = "pp1_async" if scheduling != "sync" else "pp1_sync"
    for name in (first, *[r for r in DSPARK_REFS if r != first]):
        if (jobs.get(name) or {}).get("counters"):
            return name
    return None


def compare_counters(got: dict, ref: dict) -> str:
    """``equal`` or what differs, computed here from the two records' counters."""
    diffs = [
        f"{k} {got[k]} vs {ref[k]}"
        for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
        if got.get(k) != ref.get(k)
    ]
    gp, rp = got.get("accepted_per_pos") or [], ref.get("accepted_per_pos") or []
    if gp != rp:
        at = [i for i in range(max(len(gp), len(rp))) if gp[i : i + 1] != rp[i : i + 1]]
        diffs.append(f"per position differs at {at}")
    return "equal" if not diffs else "; ".join(diffs)


def _greedy_cell(v: dict | None) -> str:
    if v is None:
        return "no verdict"
    detail = v.get("detail", "")
    return f"{_ok(v)}: {detail.split('no-spec: ', 1)[-1]}"


def job_rows(rec: dict) -> list[str]:
    jobs, verdicts = rec["jobs"], rec["verdicts"]
    lines = [
        "| job | shape | scheduling | graphs | plugin | speculation | start-up s | tokens | "
        "greedy vs `ref` (PP=1 no-spec) | accepted / drafted | drafts | accepted per position | "
        "counters vs PP=1 DSpark |",
        "|---|---|---|---|---|---|---:|---:|---|---:|---:|---|---|",
    ]
    for name, job in jobs.items():
        if not job["selected"]:
            continue
        s = job["shape"]
        ready = job.get("ready_s", job.get("startup_s"))
        c = job.get("counters")
        if name == PARITY_REF:
            greedy = "the reference"
        elif name in DSPARK_REFS:
            greedy = "not compared (a counters reference)"
        elif s["plugin"] is False:
            greedy = "the stock control, below"
        elif name in verdicts:
            greedy = f"not served; its own check, below: {_ok(verdicts[name])}"
        elif f"tap_control[{name}]" in verdicts:
            greedy = f"a control, below (tap partials): {_ok(verdicts[f'tap_control[{name}]'])}"
        else:
            greedy = _greedy_cell(verdicts.get(f"greedy[{name}]"))
        if "error" in job:
            greedy = f"**no result**: {job['error'][:160]}"
        if c is None:
            counters = accepted = drafts = per_pos = "-"
        else:
            accepted, drafts, per_pos = _pct(c), str(c["num_drafts"]), _positions(c)
            if name in DSPARK_REFS:
                counters = "the reference"
            else:
                ref = dspark_ref(jobs, s["scheduling"])
                counters = "no reference" if ref is None else (
                    f"{compare_counters(c, jobs[ref]['counters'])} (`{ref}`); test: "
                    f"{_ok(verdicts.get(f'acceptance[{name}]'))}"
                )  # fmt: skip
        graphs = "CUDA graphs" if s["cuda_graphs"] else "eager"
        lines.append(
            f"| `{name}` | {_shape(s)} | {s['scheduling']} | {graphs} | "
            f"{_plugin(s)} | "
            f"{'DSpark' if s['speculation'] else 'none'} | {'-' if ready is None else ready} | "
            f"{job.get('num_tokens', '-')} | {greedy} | {accepted} | {drafts} | {per_pos} | "
            f"{counters} |"
        )
    return lines


def wave_rows(rec: dict) -> list[str]:
    waves = rec.get("waves") or []
    served = [(n, j) for n, j in rec["jobs"].items() if j["selected"] and j.get("per_wave")]
    if not served:
        return []
    lines = [
        "",
        "Counters per wave (read from the node-0 server's `/metrics` before and after each wave):",
        "",
        "| job | wave | prompts | drafts | accepted / drafted | accepted per position |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for name, job in served:
        for i, w in enumerate(job["per_wave"]):
            prompts = waves[i] if i < len(waves) else "?"
            lines.append(
                f"| `{name}` | {i + 1} | {prompts} | {w['num_drafts']} | {_pct(w)} | "
                f"{_positions(w)} |"
            )
    return lines


def _per_launcher(items: list, fmt) -> str:
    return "; ".join(f"{r}: {fmt(x)}" for r, x in enumerate(items))


def _rank_line(lines: list) -> str:
    return ", ".join(f"rank {r} of {w}, PP {p}, TP {t}" for r, w, p, t in lines) or "none"


def _comms(comms: list) -> str:
    return ", ".join(f"{n} ranks / {nodes} nodes" for n, nodes in comms) or "none"


def _digests(per_rank: dict | None) -> str:
    """What the ranks' drafts digest lines say: agreement after the last count every rank
    logged, the disagreements, or that the record predates the knob (2026-12-05)."""
    if per_rank is None:
        return "not in this record (it predates the knob)"
    if not per_rank:
        return "no rank logged one"
    common = sorted(set.intersection(*(set(v) for v in per_rank.values())), key=int)
    if not common:
        return f"{len(per_rank)} ranks logged lines, but no count is common to all of them"
    differ = [c for c in common if len({v[c] for v in per_rank.values()}) > 1]
    if differ:
        return f"**{len(per_rank)} ranks disagree** after {', '.join(map(str, differ))} draft posts"
    return f"{len(per_rank)} ranks agree after {common[-1]} draft posts ({len(common)} lines each)"


def evidence_rows(rec: dict, group: Group) -> list[str]:
    served = [(n, j) for n, j in rec["jobs"].items() if j["selected"] and j.get("evidence")]
    if not served:
        return []
    has_fixed = "fixed_graph_batch" in json.dumps(rec)
    lines = [
        "",
        "### The launchers' logs",
        "",
        "Read from every launcher's log by the test (launcher R holds global rank R). Handshake: "
        "the N of each `PP handshake: N ranks agree` line; rank lines: vLLM's `rank R in world "
        "size W is assigned as ... PP rank P ... TP rank T`; NCCL: the `nRanks N nNodes M` init "
        "lines (`NCCL_DEBUG=INFO`); exchange: the backend of the plugin's `DSpark PP exchange: "
        "... over B` line; pinned: the counts of `pinned dispatches so far` lines.",
        "",
    ]
    for name, job in served:
        ev = job["evidence"]
        pinned = ev.get("pinned")
        pinned_txt = f"`{pinned}`" + (
            "" if has_fixed or pinned else " (the record configures no fixed graph batch)"
        )
        verdict = _ok(rec["verdicts"].get(f"{group.ranks_verdict}[{name}]"))
        socket = "yes" if ev["nccl_socket"] else "no"
        lines += [
            f"`{name}` ({_shape(job['shape'])}); test verdict {verdict}:",
            "",
            f"* handshake lines: {len(ev['handshake_sizes'])}, sizes `{ev['handshake_sizes']}`",
            f"* vLLM's rank lines per launcher: {_per_launcher(ev['ranks'], _rank_line)}",
            "* NCCL communicator sizes per launcher (distinct pairs): "
            + _per_launcher(ev["nccl_comms_per_log"], _comms),
            "* exchange backend per launcher: "
            + _per_launcher(ev["exchange_backends"], lambda b: ", ".join(b) or "none"),
            f"* NCCL socket transport (`NET/Socket`) logged: {socket}",
            f"* pinned dispatch counts: {pinned_txt}",
            f"* drafts digest (`VLLM_DSPARK_PP_DRAFT_DIGEST`): {_digests(ev.get('draft_digests'))}",
            f"* every launcher alive after serving: {'yes' if job.get('alive_after') else 'no'};"
            f" processes left behind: {job.get('leftover_pids') or 'none'}",
            "",
        ]
    return lines[:-1]


def _row_bytes(per_stage: dict) -> str:
    if not per_stage:
        return "none"
    return "; ".join(
        f"stage {st}: " + ", ".join(f"`{k}` {b} B" for k, b in sorted(keys.items()))
        for st, keys in sorted(per_stage.items())
    )


def tap_rows(rec: dict) -> list[str]:
    """Issue 44 item 4 (protocol/tap_partials.py): per job whose launchers logged a tap-partials
    mode, the mode, the keys each stage sent the next one and those it sent on the side channel
    (bytes per token row at its first send), with the test's verdicts on them; the control
    (``tap_control[...]``) must keep the greedy output and fail the acceptance check."""
    jobs, verdicts = rec["jobs"], rec["verdicts"]
    served = [
        (n, j) for n, j in jobs.items()
        if j["selected"] and (j.get("evidence") or {}).get("tap_mode") is not None
        and (j["evidence"]["tap_mode"] or j["evidence"].get("tap_sent"))
    ]  # fmt: skip
    if not served:
        return []
    lines = [
        "",
        "### Tap partials (issue 44 item 4)",
        "",
        "From the launchers' logs: the `DSpark tap partials` mode line, and per stage the keys "
        "(bytes per token row) it sent the next stage and on the side channel at its first send. "
        "Raw taps relay one `aux_hidden_states_*` per tap; the partial replaces them with one "
        "`dspark_tap_partial` row.",
        "",
        "| job | mode | sent to the next stage | side channel | test verdict |",
        "|---|---|---|---|---|",
    ]
    for name, job in served:
        ev = job["evidence"]
        checks = [
            f"{kind}: {_ok(verdicts[f'{kind}[{name}]'])}"
            for kind in ("tap_partials", "tap_control")
            if f"{kind}[{name}]" in verdicts
        ]
        mode = ", ".join(f"`{m}`" for m in ev["tap_mode"]) or "no mode line"
        lines.append(
            f"| `{name}` | {mode} | {_row_bytes(ev.get('tap_sent') or {})} | "
            f"{_row_bytes(ev.get('tap_side') or {})} | {'; '.join(checks) or 'none'} |"
        )
    for name, _job in served:
        v = verdicts.get(f"tap_control[{name}]")
        if v is not None:
            lines += ["", f"Control `{name}`, test verdict {_ok(v)}: `{_one_line(v['detail'])}`"]
    return lines


def abort_rows(rec: dict) -> list[str]:
    v = rec["verdicts"].get("abort")
    done = [(n, j) for n, j in rec["jobs"].items() if j["selected"] and "abort" in j]
    if not done and v is None:
        return []
    lines = ["", "### Abort mid-stream", ""]
    for name, job in done:
        ab = job["abort"]
        lines.append(
            f"* `{name}`: the client left after {ab['chunks_read']} streamed chunks; "
            f"{ab['running']:g} requests running {ab['running_after_s']} s later"
        )
    if v is not None:
        lines.append(f"* test verdict {_ok(v)}: `{v['detail']}`")
    return lines


def other_checks(rec: dict) -> list[str]:
    verdicts = rec["verdicts"]
    lines = []
    v = verdicts.get("nccl_stubs")
    if v is not None:
        lines += ["", "### The kit's NCCL stubs", "", f"Test verdict {_ok(v)}: `{v['detail']}`."]
    stock = {k: v for k, v in verdicts.items() if k.startswith("stock[")}
    if stock:
        lines += ["", "### Stock vLLM control (plugin left out)", ""]
        lines += [f"* `{k[6:-1]}`: {v['detail']}" for k, v in stock.items()]
    rest = {k: v for k, v in verdicts.items() if "[" not in k and k not in ("abort", "nccl_stubs")}
    if rest:
        lines += ["", "### Other checks", ""]
        lines += [f"* `{k}`: test verdict {_ok(v)}: `{v['detail']}`" for k, v in rest.items()]
    return lines


def not_run(rec: dict) -> list[str]:
    lines = ["", "### Not run", ""]
    idle = [(n, j) for n, j in rec["jobs"].items() if not j["selected"]]
    failed = [(n, j) for n, j in rec["jobs"].items() if j["selected"] and "error" in j]
    lines.append(
        f"Jobs of the test this record did not select ({len(idle)}; `selected: false`):"
        if idle
        else "Every job of the test was selected."
    )
    if idle:
        lines.append("")
        lines += [f"* `{n}`: {_describe(j['shape'])}" for n, j in idle]
    if failed:
        lines += ["", "Selected but without a result:", ""]
        lines += [f"* `{n}`: {j['error'][:300]}" for n, j in failed]
    if rec.get("layout") == "shared":
        lines += ["", "Several GPUs: not in this record (every rank shared GPU 0)."]
    return lines


def run_head(name: str, rec: dict, layout: str) -> list[str]:
    """A section's heading and the run: commit, GPU and layout, command, knobs."""
    knobs = ", ".join(f"`{k}={v}`" for k, v in sorted((rec.get("knobs") or {}).items()))
    return [
        "",
        f"## {rec['date']}: [{name}]({name})",
        "",
        f"* commit `{rec['commit']}`; sources sha256 `{rec.get('source_sha256', '-')}`",
        f"* GPU: {rec['gpu']}; layout `{layout}` ({LAYOUTS.get(layout, 'unknown layout')})",
        f"* command (on the GPU machine): `{rec['command']}`",
        f"* knobs (the run's `DSPARK_GPU_*` variables): {knobs or 'none'}",
    ]


def check_count(verdicts: dict) -> list[str]:
    """How many checks the record holds, passed and failed, and the failed ones by name."""
    oks = [v.get("ok") for v in verdicts.values()]
    lines = [
        f"* checks: {len(oks)} recorded, {oks.count(True)} passed, {oks.count(False)} failed"
        + (f", {oks.count(None)} recorded without a verdict" if None in oks else "")
    ]
    bad = [k for k, v in verdicts.items() if v.get("ok") is False]
    if bad:
        lines.append(f"* **failed checks**: {', '.join(f'`{k}`' for k in bad)}")
    return lines


def extracted_rows(rec: dict) -> list[str]:
    """The extracted-lines files that name this record: what, where from, how, the lines."""
    lines = []
    for name, ex in rec.get(EXTRACTED, []):
        lines += [
            "",
            f"### Lines extracted from this run's logs: [{name}]({name})",
            "",
            f"{ex['what']} (commit `{ex['commit']}`, {ex['date']}, {ex['gpu']}); from "
            f"{ex['source']}, by `{ex['extracted_by']}`:",
            "",
            "```",
            *ex["lines"],
            "```",
        ]
    return lines


def section(name: str, rec: dict, group: Group) -> list[str]:
    spec = rec.get("spec") or {}
    graphs = (rec.get("graph_config") or {}).get("decode_cudagraph_capture_request_sizes")
    lines = run_head(name, rec, rec.get("layout", "?"))
    lines += [
        f"* speculation: {spec.get('method', '?')}, k = {spec.get('num_speculative_tokens', '?')},"
        f" draft `{spec.get('model', '?')}`; waves of {', '.join(map(str, rec.get('waves', [])))}"
        f" prompts, at most {rec.get('max_tokens', '?')} tokens each; decode CUDA graphs for "
        f"{graphs} requests",
    ]
    lines += check_count(rec["verdicts"])
    lost = [n for n, j in rec["jobs"].items() if j["selected"] and "error" in j]
    if lost:  # their tests failed before any verdict was recorded
        lines.append(
            "* **selected jobs without a result** (their checks failed with them, below): "
            + ", ".join(f"`{n}`" for n in lost)
        )
    lines += ["", "### Jobs", ""] + job_rows(rec)
    lines += [
        "",
        "start-up s: a served job's `ready_s` (launch to every launcher ready), a PP=1 engine's "
        "`startup_s`. Counters are the node-0 server's spec-decode counters summed over the "
        "waves (an engine's own for PP=1).",
    ]
    lines += wave_rows(rec)
    rest = evidence_rows(rec, group) + tap_rows(rec) + abort_rows(rec) + other_checks(rec)
    return lines + rest + not_run(rec) + extracted_rows(rec)


# --- kind "pd_pp": tests/gpu/test_pd_pp_producer.py (PD with a PP or TP x PP producer) ---------

#: the offline engines the PD jobs are compared with (test_pd_pp_producer.py's ``pd_jobs``)
PD_REFS = {
    "pair_baseline": "aggregated PP=1, no speculation: the greedy reference",
    "pair_spec": "aggregated PP=1 DSpark: the acceptance reference",
}
PD_ACCEPTANCE_REF = "pair_spec"
PD_DRAFTS = {"real": "the pair's", "nan": "NaN-norm (control)", "subtle": "aux taps exchanged"}
PD_SERVED = ("decoder_spec", "prefill_spec", "decoder_kv", "proxy", "producer_evidence")
PD_SHAPE = ("label", "producer_draft", "dtype", "scheduling")
PD_RUN = {"k": "k = {}", "num_prompts": "{} prompts", "max_tokens": "at most {} tokens each"}
COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_pos")
_SOURCE = re.compile(r'source="(\w+)"')


def check_counters(c: dict, where: str) -> None:
    for key in COUNTERS:
        need(c, key, where)


def check_pd(name: str, rec: dict) -> None:
    need(rec, "pair", name)
    check_selected(name, rec)
    for j, v in rec["jobs"].items():
        where = f"{name}: job {j}"
        if j in PD_REFS:
            if v["selected"] and "error" not in v and j == PD_ACCEPTANCE_REF:
                check_counters(need(v, "counters", where), where)
            continue
        shape = need(v, "shape", where)
        for key in PD_SHAPE:
            need(shape, key, f"{where}: shape")
        if "cuda_graphs" not in shape:
            for key in ("producer_cuda_graphs", "decoder_cuda_graphs"):
                need(shape, key, f"{where}: shape")
        if v["selected"] and "error" not in v and "skipped" not in v:
            for key in PD_SERVED:
                need(v, key, where)
            check_counters(v["decoder_spec"], f"{where}: decoder_spec")
            check_counters(v["prefill_spec"], f"{where}: prefill_spec")


def _sync_note(rec: dict) -> str:
    """A PD record's synchronous jobs ran with ``--no-async-scheduling`` in place of the common
    arguments' ``--async-scheduling`` (test_pd_pp_producer.py ``_sync``)."""
    sync = [j for j, v in rec["jobs"].items()
            if v.get("selected") and v.get("shape", {}).get("scheduling") == "sync"]  # fmt: skip
    if not sync:
        return ""
    names = ", ".join(f"`{j}`" for j in sync)
    return f"; {names}: `--no-async-scheduling` in place of `--async-scheduling`"


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|")


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else "(empty)"


def _one_line(text: str) -> str:
    return "; ".join(x.strip() for x in text.splitlines() if x.strip())


def _share(c: dict) -> float | None:
    drafted = c["num_draft_tokens"]
    return 100 * c["num_accepted_tokens"] / drafted if drafted else None


def _points(got: dict, ref: dict) -> str:
    """The acceptance of ``got`` against ``ref`` in percentage points."""
    a, b = _share(got), _share(ref)
    return "-" if a is None or b is None else f"{a - b:+.2f} points"


def _yes(flag: object) -> str:
    """``yes``/``no`` for a boolean, anything else as the record has it."""
    return ("yes" if flag else "no") if isinstance(flag, bool) else str(flag)


def _graphs(shape: dict) -> str:
    if "cuda_graphs" in shape:
        return _yes(shape["cuda_graphs"])
    return f"{_yes(shape['producer_cuda_graphs'])} / {_yes(shape['decoder_cuda_graphs'])}"


def _pd_verdict_keys(name: str, verdicts: dict) -> list[str]:
    """The per-job checks shown beside the launchers' evidence (greedy and acceptance are in the
    jobs table)."""
    keys = [k for k in verdicts if k.endswith(f"[{name}]")]
    return [k for k in keys if k.split("[", 1)[0] not in ("greedy", "acceptance")]


def pd_job_rows(rec: dict) -> list[str]:
    jobs, verdicts = rec["jobs"], rec["verdicts"]
    ref = (jobs.get(PD_ACCEPTANCE_REF) or {}).get("counters")
    lines = [
        "| job | shape | producer draft | dtype | scheduling | CUDA graphs (producer / decoder) | "
        "tokens | greedy: test verdict | decoder accepted / drafted | drafts | "
        f"accepted per position | counters vs aggregated (`{PD_ACCEPTANCE_REF}`) |",
        "|---|---|---|---|---|---|---:|---|---:|---:|---|---|",
    ]
    for name, job in jobs.items():
        if not job["selected"]:
            continue
        c = job.get("counters") if name in PD_REFS else job.get("decoder_spec")
        if name in PD_REFS:
            shape, draft, dtype, sched, graphs = PD_REFS[name], "-", "-", "-", "-"
            greedy = "the reference" if name != PD_ACCEPTANCE_REF else "-"
        else:
            s = job["shape"]
            shape, dtype, sched, graphs = s["label"], s["dtype"], s["scheduling"], _graphs(s)
            draft = PD_DRAFTS.get(s["producer_draft"], s["producer_draft"])
            v = verdicts.get(f"greedy[{name}]")
            greedy = "no verdict" if v is None else f"{_ok(v)}: {_one_line(v['detail'])}"
            if v is None and s["producer_draft"] != "real":
                greedy = "in its control's check, below"
        if "error" in job:
            greedy, c = f"**no result**: {_first_line(job['error'])}", None
        elif "skipped" in job:
            greedy, c = f"skipped: {job['skipped']}", None
        if c is None:
            accepted = drafts = per_pos = vs = "-"
        else:
            accepted, drafts, per_pos = _pct(c), str(c["num_drafts"]), _positions(c)
            if name == PD_ACCEPTANCE_REF:
                vs = "the reference"
            elif ref is None:
                vs = "no reference"
            else:
                vs = f"{compare_counters(c, ref)}; {_points(c, ref)}"
                v = verdicts.get(f"acceptance[{name}]")
                vs += "" if v is None else f"; test: {_ok(v)}"
        cells = [f"`{name}`", shape, draft, dtype, sched, graphs, job.get("num_tokens", "-")]
        cells += [greedy, accepted, drafts, per_pos, vs]
        lines.append("| " + " | ".join(_cell(x) for x in cells) + " |")
    return lines


def _by_source(kv: dict) -> dict[str, float]:
    """vLLM's ``prompt_tokens_by_source_total`` summed per source over its labels."""
    out: dict[str, float] = {}
    for key, value in kv.items():
        m = _SOURCE.search(key)
        if key.startswith("vllm:prompt_tokens_by_source_total") and m:
            out[m.group(1)] = out.get(m.group(1), 0) + value
    return out


def _n(x: float | None) -> str:
    return "-" if x is None else f"{x:g}"


def _served_pd(rec: dict) -> list[tuple[str, dict]]:
    return [
        (n, j)
        for n, j in rec["jobs"].items()
        if n not in PD_REFS and j["selected"] and "error" not in j and "skipped" not in j
    ]


def kv_rows(rec: dict) -> list[str]:
    served = _served_pd(rec)
    if not served:
        return []
    lines = [
        "",
        "### KV pulled by the decoder, and the proxy",
        "",
        "From the decoder's `/metrics`: prompt tokens by source (`external_kv_transfer`: pulled "
        "from the producer over Mooncake; `local_compute`: computed by the decoder itself), the "
        "external prefix cache, Mooncake's failed transfers and receives; from the proxy: its "
        "requests and hops.",
        "",
        "| job | KV pulled / prompt tokens | computed by the decoder | external prefix cache hits "
        "/ queries | failed transfers | failed receives | proxy: requests, prefill ok, decode ok "
        "| proxy errors | hops recorded / dropped |",
        "|---|---:|---:|---:|---:|---:|---|---|---|",
    ]
    for name, job in served:
        kv, px = job["decoder_kv"], job["proxy"]
        src = _by_source(kv)
        prompt = kv.get("vllm:prompt_tokens_total")
        pulled = src.get("external_kv_transfer")
        share = f" ({100 * pulled / prompt:.1f}%)" if pulled is not None and prompt else ""
        hits = kv.get("vllm:external_prefix_cache_hits_total")
        queries = kv.get("vllm:external_prefix_cache_queries_total")
        cells = [
            f"`{name}`",
            f"{_n(pulled)} / {_n(prompt)}{share}",
            _n(src.get("local_compute")),
            f"{_n(hits)} / {_n(queries)}",
            _n(kv.get("vllm:mooncake_num_failed_transfers_total")),
            _n(kv.get("vllm:mooncake_num_failed_recvs_total")),
            f"{px.get('requests', '-')}, {px.get('prefill_ok', '-')}, {px.get('decode_ok', '-')}",
            "none" if not px.get("errors") else _one_line("; ".join(map(str, px["errors"]))),
            f"{px.get('hops_recorded', '-')} / {px.get('hops_dropped', '-')}",
        ]
        lines.append("| " + " | ".join(_cell(x) for x in cells) + " |")
    return lines


def producer_rows(rec: dict) -> list[str]:
    served = _served_pd(rec)
    if not served:
        return []
    lines = [
        "",
        "### The producer's and the decoder's launchers",
        "",
        "Read from every launcher's log by the test (producer launcher R holds the producer's "
        "global rank R). Rank lines: vLLM's `rank R in world size W is assigned as ... PP rank P "
        "... TP rank T`; drafter: the plugin's `Built the context-KV-only DSpark drafter` line; "
        "exchange: the backend of the plugin's `DSpark PP exchange: ... over B` line; handshake: "
        "the N of each `PP handshake: N ranks agree` line; the producer's own spec-decode "
        "counters (a prefill-only producer drafts nothing).",
        "",
    ]
    for name, job in served:
        ev, pre = job["producer_evidence"], job["prefill_spec"]
        checks = ", ".join(
            f"`{k.split('[', 1)[0]}` {_ok(rec['verdicts'][k])}"
            for k in _pd_verdict_keys(name, rec["verdicts"])
        )
        markers = job.get("prefill_log_markers") or {}
        lines += [
            f"`{name}` ({job['shape']['label']}); test verdicts: {checks or 'none'}:",
            "",
            "* producer rank lines per launcher: "
            + _per_launcher(ev.get("producer_ranks", []), _rank_line),
            "* context-KV-only drafter built, per producer launcher: "
            + _per_launcher(ev.get("producer_built_drafter", []), _yes),
            "* exchange backend per producer launcher: "
            + _per_launcher(ev.get("producer_exchange", []), lambda b: ", ".join(b) or "none"),
            f"* handshake sizes: `{ev.get('handshake_sizes')}`",
            "* decoder rank lines per launcher: "
            + _per_launcher(ev.get("decoder_ranks", []), _rank_line),
            "* the producer's log: "
            + ("; ".join(f"`{m}` {'found' if ok else '**missing**'}" for m, ok in markers.items())
               or "no markers recorded"),
            f"* the producer's spec-decode counters: {pre['num_drafts']} drafts, "
            f"{pre['num_draft_tokens']} drafted tokens",
            f"* timings: {job.get('timings', '-')}",
            "",
        ]  # fmt: skip
    return lines[:-1]


def pd_other_checks(rec: dict) -> list[str]:
    """Every verdict not shown beside its job: the controls', the NCCL stubs'."""
    shown = {f"{k}[{n}]" for n in rec["jobs"] for k in ("greedy", "acceptance")}
    shown |= {k for n, _ in _served_pd(rec) for k in _pd_verdict_keys(n, rec["verdicts"])}
    rest = {k: v for k, v in rec["verdicts"].items() if k not in shown}
    if not rest:
        return []
    lines = ["", "### Controls and other checks", ""]
    return lines + [
        f"* `{k}`: test verdict {_ok(v)}: {_one_line(v.get('detail', ''))}" for k, v in rest.items()
    ]


def pd_not_run(rec: dict) -> list[str]:
    jobs = rec["jobs"]
    idle = [(n, j) for n, j in jobs.items() if not j["selected"]]
    skipped = [(n, j) for n, j in jobs.items() if j["selected"] and "skipped" in j]
    failed = [(n, j) for n, j in jobs.items() if j["selected"] and "error" in j]
    lines = ["", "### Not run", ""]
    lines.append(
        f"Jobs of the test this record did not select ({len(idle)}; `selected: false`):"
        if idle
        else "Every job of the test was selected."
    )
    if idle:
        lines.append("")
        for n, j in idle:
            s = j.get("shape")
            what = PD_REFS.get(n) if s is None else (
                f"{s['label']}, {PD_DRAFTS.get(s['producer_draft'], s['producer_draft'])} draft"
            )  # fmt: skip
            lines.append(f"* `{n}`: {what}")
    if skipped:
        lines += ["", "Selected but skipped by the test:", ""]
        lines += [f"* `{n}`: {j['skipped']}" for n, j in skipped]
    if failed:
        lines += ["", "Selected but without a result (the error's first line):", ""]
        lines += [f"* `{n}`: {_first_line(j['error'])}" for n, j in failed]
    return lines


def pd_section(name: str, rec: dict, group: Group) -> list[str]:
    layouts = sorted({j["shape"].get("layout", "?") for j in rec["jobs"].values() if "shape" in j})
    lines = run_head(name, rec, ", ".join(layouts) or "?")
    issue = f"issue {rec['issue']}" + (f" item {rec['item']}" if "item" in rec else "")
    pair = f"pair `{rec['pair']}`"
    if "target" in rec:
        pair += f": target `{rec['target']}`, draft `{rec.get('draft', '?')}`"
    run = [fmt.format(rec[k]) for k, fmt in PD_RUN.items() if k in rec]
    missing = [f"`{k}`" for k in PD_RUN if k not in rec]
    lines += [
        f"* {issue}; {pair}; " + ", ".join(run)
        + (f" ({', '.join(missing)}: not in this record)" if missing else ""),
        "* engine arguments common to every engine: "
        + (f"`{' '.join(rec['common_args'])}`" if rec.get("common_args") else "not in this record")
        + _sync_note(rec),
    ]  # fmt: skip
    lines += check_count(rec["verdicts"])
    lines += ["", "### Jobs", ""] + pd_job_rows(rec)
    lines += [
        "",
        "Decoder counters: the decoder's spec-decode counters over the run; the aggregated "
        "reference's are its engine's own. Points: the decoder's acceptance minus the "
        "reference's.",
    ]
    lines += kv_rows(rec) + producer_rows(rec) + pd_other_checks(rec) + pd_not_run(rec)
    return lines + extracted_rows(rec)


# --- kind "dsv41_pp": tests/gpu/test_dsv41_pp.py (DeepSeek-V4.1 DSpark at PP=2) ---------------

#: the offline PP=1 engines the served jobs are compared with (test_dsv41_pp.py's jobs)
DSV41_REFS = {
    "base": "PP=1, no speculation: the greedy reference",
    "pp1": "PP=1 DSpark: the counters' reference",
}
DSV41_DSPARK_REF = "pp1"


def check_dsv41(name: str, rec: dict) -> None:
    jobs = rec["jobs"]
    if sorted(jobs) != sorted(rec["selected_jobs"]):
        raise RecordError(
            f"{name}: selected_jobs {sorted(rec['selected_jobs'])} but jobs {sorted(jobs)}"
        )
    for j, v in jobs.items():
        where = f"{name}: job {j}"
        if "error" in v:
            continue
        if "outcome" in v:
            need(v, "line", where)
            continue
        need(v, "num_tokens", where)
        check_counters(need(v, "counters", where), f"{where}: counters")
        if j not in DSV41_REFS:
            for key in ("eager", "tp", "args", "backends"):
                need(v, key, where)


def _acceptance_length(c: dict) -> str:
    return f"{1 + c['num_accepted_tokens'] / c['num_drafts']:.3f}" if c["num_drafts"] else "-"


def _dsv41_served(rec: dict) -> list[tuple[str, dict]]:
    return [(n, j) for n, j in rec["jobs"].items() if "counters" in j and "error" not in j]


def dsv41_job_rows(rec: dict) -> list[str]:
    jobs, verdicts = rec["jobs"], rec["verdicts"]
    ref = (jobs.get(DSV41_DSPARK_REF) or {}).get("counters")
    lines = [
        "| job | what | launchers: exchange backend each | TP | scheduling | graphs | start-up s | "
        "handshake logged / processes left | tokens | test verdict: greedy vs `base` | "
        "accepted / drafted | drafts | acceptance length | counters vs "
        f"`{DSV41_DSPARK_REF}` (PP=1 DSpark) |",
        "|---|---|---|---:|---|---|---:|---|---:|---|---:|---:|---:|---|",
    ]
    for name, job in jobs.items():
        v = verdicts.get(name)
        greedy = "no verdict" if v is None else f"{_ok(v)}: {v['detail'].split('; ', 1)[0]}"
        c = job.get("counters")
        if name in DSV41_REFS:
            what, launchers, tp, sched, graphs, proc = DSV41_REFS[name], "-", "-", "-", "-", "-"
            ready = job.get("startup_s", "-")
            greedy = "the reference" if name == "base" else greedy
        elif "outcome" in job:
            what, launchers, tp, sched, graphs, ready, proc = ("stock vLLM, below",) + ("-",) * 6
            greedy, c = f"{job['outcome']}: {_ok(verdicts.get('stock_refuses'))}, below", None
        else:
            what = "DSpark, one `vllm serve` launcher per stage"
            launchers = f"{len(job.get('backends', []))}: {', '.join(job.get('backends', []))}"
            tp = job.get("tp", "-")
            sched = "sync" if "--no-async-scheduling" in job.get("args", []) else "async"
            graphs = "eager" if job.get("eager") else "CUDA graphs"
            ready = job.get("ready_s", "-")
            proc = f"{_yes(job.get('handshake', '-'))} / {job.get('leftover_pids') or 'none'}"
        if "error" in job:
            greedy, c = f"**no result**: {_first_line(job['error'])}", None
        if c is None or (name in DSV41_REFS and not c["num_drafts"]):
            accepted = drafts = length = vs = "-"
        else:
            accepted, drafts, length = _pct(c), str(c["num_drafts"]), _acceptance_length(c)
            if name == DSV41_DSPARK_REF:
                vs = "the reference"
            elif name == "base":
                vs = "-"
            elif ref is None:
                vs = "no reference"
            else:
                vs = f"{compare_counters(c, ref)}; {_points(c, ref)}"
        cells = [f"`{name}`", what, launchers, tp, sched, graphs, ready, proc]
        cells += [job.get("num_tokens", "-"), greedy, accepted, drafts, length, vs]
        lines.append("| " + " | ".join(_cell(x) for x in cells) + " |")
    return lines


def position_rows(rec: dict) -> list[str]:
    """Accepted tokens per draft position, each DSpark job beside the reference (its difference
    in brackets where it differs)."""
    jobs = rec["jobs"]
    ref = (jobs.get(DSV41_DSPARK_REF) or {}).get("counters")
    served = [(n, j["counters"]) for n, j in _dsv41_served(rec) if j["counters"]["num_drafts"]]
    if ref is None or not served:
        return []
    rpos = ref["accepted_per_pos"]

    def cell(c: dict, i: int) -> str:
        pos = c["accepted_per_pos"]
        if i >= len(pos):
            return "-"
        diff = pos[i] - rpos[i] if i < len(rpos) else None
        return str(pos[i]) + ("" if not diff else f" ({diff:+d})")

    width = max(len(c["accepted_per_pos"]) for _, c in served)
    head = [
        "position",
        *[f"`{n}`" + (" (reference)" if n == DSV41_DSPARK_REF else "") for n, _ in served],
    ]
    lines = [
        "",
        f"Accepted tokens per draft position, against `{DSV41_DSPARK_REF}` (the difference in "
        "brackets where it differs):",
        "",
        "| " + " | ".join(head) + " |",
        "|---:|" + "---:|" * len(served),
    ]
    for i in range(width):
        lines.append(f"| {i + 1} | " + " | ".join(cell(c, i) for _, c in served) + " |")
    total = [f"{c['num_accepted_tokens']} / {c['num_drafts']}" for _, c in served]
    return lines + ["| accepted / drafts | " + " | ".join(total) + " |"]


def stock_rows(rec: dict) -> list[str]:
    stock = [(n, j) for n, j in rec["jobs"].items() if "outcome" in j]
    lines = []
    for name, job in stock:
        v = rec["verdicts"].get("stock_refuses")
        lines += [
            "",
            "### Stock vLLM control (plugin left out)",
            "",
            f"`{name}`" + (f", `{job['mirrors']}`'s launchers" if "mirrors" in job else "")
            + f": outcome **{job['outcome']}**; test verdict `stock_refuses`: {_ok(v)}",
            "",
            f"* the line: `{job['line']}`",
            f"* launchers that exited: {'; '.join(job.get('exited') or []) or 'none recorded'}",
            f"* processes left behind: {job.get('leftover_pids') or 'none'}",
        ]  # fmt: skip
        if job.get("evidence"):
            lines += ["", "Every launcher's refusal line:", "", "```", *job["evidence"], "```"]
    return lines


def dsv41_verdicts(rec: dict) -> list[str]:
    """Every check's verdict with the test's own words."""
    if not rec["verdicts"]:
        return []
    lines = ["", "### Test verdicts", ""]
    return lines + [
        f"* `{k}`: {_ok(v)}: {_one_line(v.get('detail', ''))}" for k, v in rec["verdicts"].items()
    ]


def dsv41_section(name: str, rec: dict, group: Group) -> list[str]:
    lines = run_head(name, rec, rec.get("layout", "?"))
    lines += [
        f"* issue {rec.get('issue', '-')}; pair `{rec.get('pair', '?')}`; k = {rec.get('k', '?')};"
        f" at most {rec.get('max_tokens', '?')} tokens each",
        "* engine arguments of every job: "
        + (f"`{' '.join(rec['base_args'])}`" if rec.get("base_args") else "not in this record"),
    ]
    lines += check_count(rec["verdicts"])
    lines += ["", "### Jobs", ""] + dsv41_job_rows(rec)
    lines += [
        "",
        "start-up s: a served job's `ready_s` (launch to every launcher ready), a PP=1 engine's "
        "`startup_s`. Acceptance length: 1 + accepted / drafts. Points: the job's acceptance "
        "minus the reference's.",
    ]
    lines += position_rows(rec) + stock_rows(rec) + dsv41_verdicts(rec)
    failed = [(n, j) for n, j in rec["jobs"].items() if "error" in j]
    if failed:
        lines += ["", "### Selected but without a result (the error's first line)", ""]
        lines += [f"* `{n}`: {_first_line(j['error'])}" for n, j in failed]
    return lines + extracted_rows(rec)


@dataclass(frozen=True)
class Kind:
    """A record shape: what load() checks beyond RECORD_KEYS, and the section it makes."""

    check: Callable[[str, dict], None]
    section: Callable[[str, dict, Group], list[str]]


KINDS = {
    "pp": Kind(check_pp, section),
    "pd_pp": Kind(check_pd, pd_section),
    "dsv41_pp": Kind(check_dsv41, dsv41_section),
}


def markdown(records: list[tuple[str, dict]], group: Group = GROUPS["tp_pp"]) -> str:
    names = [n for name, rec in records for n in (name, *[e for e, _ in rec.get(EXTRACTED, [])])]
    files = ", ".join(f"docs/results/{n}" for n in names)
    lines = [
        f"<!-- generated by benchmarks/tp_pp_page.py from {files}; do not edit by hand -->",
        f"# {group.title}",
        "",
        group.intro + " This page is generated (`python -m benchmarks.tp_pp_page`; "
        "tests/unit/benchmarks/test_tp_pp_page.py checks it is current).",
    ]
    for name, rec in records:
        lines += KINDS[group.kind].section(name, rec, group)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("records", nargs="*", type=Path, help="default: the group's records")
    ap.add_argument("--group", choices=sorted(GROUPS), help="one page only (default: every page)")
    ap.add_argument("--out", type=Path, help="with --group: where to write (default: its page)")
    ap.add_argument("--check", action="store_true", help="exit 1 when a page differs")
    args = ap.parse_args(argv)
    if (args.records or args.out) and not args.group:
        ap.error("records and --out need --group")
    rc = 0
    for group in [GROUPS[args.group]] if args.group else GROUPS.values():
        paths = args.records or sorted(RESULTS.glob(group.pattern))
        out = args.out or group.page
        if not paths:
            print(f"no records ({RESULTS / group.pattern})", file=sys.stderr)
            return 2
        text = markdown(load(paths, group), group)
        if args.check:
            current = out.read_text() if out.is_file() else ""
            if current != text:
                print(f"{out} is stale: run python -m benchmarks.tp_pp_page", file=sys.stderr)
                rc = 1
            continue
        out.write_text(text)
        print(f"wrote {out}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
