"""The one spec-decode metrics reader: from ``LLM.get_metrics()`` or from a ``/metrics`` page.

Both give the same shape (:data:`EMPTY`): ``num_drafts``, ``num_draft_tokens``,
``num_accepted_tokens`` (ints) and ``accepted_per_pos`` (accepted tokens per draft position).
The page is parsed with ``prometheus_client``'s text parser (a vLLM dependency).
"""

from __future__ import annotations

SPEC_NAMES = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
}
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
EMPTY = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "accepted_per_pos": []}


def _add_per_pos(acc: list[int], vals: list[int]) -> list[int]:
    n = max(len(acc), len(vals))
    acc = acc + [0] * (n - len(acc))
    vals = vals + [0] * (n - len(vals))
    return [a + b for a, b in zip(acc, vals, strict=True)]


def spec_metrics_from_llm(llm) -> dict:
    """Spec-decode counters of an offline ``vllm.LLM`` (``disable_log_stats=False``), summed
    over engines."""
    out = {**EMPTY, "accepted_per_pos": []}
    for m in llm.get_metrics():
        if m.name in SPEC_NAMES:
            out[SPEC_NAMES[m.name]] += int(m.value)
        elif m.name == PER_POS:
            out["accepted_per_pos"] = _add_per_pos(
                out["accepted_per_pos"], [int(v) for v in m.values]
            )
    return out


def parse_prometheus(text: str) -> dict[str, float]:
    """Every sample of a Prometheus text page, keyed ``name`` (summed over its label sets) and
    ``name{k="v",...}`` (one label set). ``*_created`` timestamps are left out."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.endswith("_created"):
                continue
            out[s.name] = out.get(s.name, 0.0) + s.value
            if s.labels:
                labels = ",".join(f'{k}="{v}"' for k, v in s.labels.items())
                out[f"{s.name}{{{labels}}}"] = s.value
    return out


def spec_metrics_from_prometheus(page: str | dict[str, float]) -> dict:
    """Spec-decode counters of a ``/metrics`` page (text, or :func:`parse_prometheus`'s dict)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {**EMPTY, "accepted_per_pos": []}
    if isinstance(page, dict):  # re-serialize the keyed samples we need
        text = "\n".join(f"{k} {v}" for k, v in page.items() if "{" in k or k.endswith("_total"))
    else:
        text = page
    per_pos: dict[int, int] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            base = s.name.removesuffix("_total")
            if base in SPEC_NAMES and s.name.endswith("_total"):
                if isinstance(page, dict) and s.labels:
                    continue  # the dict holds the unlabelled sum as well
                out[SPEC_NAMES[base]] += int(s.value)
            elif base == PER_POS and "position" in s.labels:
                pos = int(s.labels["position"])
                per_pos[pos] = per_pos.get(pos, 0) + int(s.value)
    out["accepted_per_pos"] = (
        [per_pos.get(i, 0) for i in range(max(per_pos) + 1)] if per_pos else []
    )
    return out


def counter_delta(before: dict, after: dict) -> dict:
    """``after - before`` for counters (numbers and per-position lists)."""
    out = {}
    for k, v in after.items():
        if isinstance(v, list):
            b = list(before.get(k) or [])
            b += [0] * (len(v) - len(b))
            out[k] = [y - x for x, y in zip(b, v, strict=False)]
        else:
            out[k] = v - before.get(k, 0)
    return out


def counter_sum(a: dict, b: dict) -> dict:
    """``a + b`` for spec-decode counters (numbers and per-position lists)."""
    out = dict(a)
    for k, v in b.items():
        if isinstance(v, list):
            out[k] = _add_per_pos(list(a.get(k) or []), [int(x) for x in v])
        else:
            out[k] = a.get(k, 0) + int(v)
    return out
