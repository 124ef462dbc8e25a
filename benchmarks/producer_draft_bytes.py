"""Draft parameter bytes on a DSpark producer: full drafter vs context-KV-only drafter.

Analytic (``vllm_dspark_pp.producer.memory.draft_param_bytes``; its count is checked against the
modules vLLM actually builds for the tiny pair in
tests/unit/producer/test_context_kv_qwen3.py::test_draft_param_bytes_matches_the_built_modules).
``--markdown`` adds what each drafter holds after loading by ``plan``'s rule
(``memory.draft_load_bytes``, embedding and LM head shared with the target): the full drafter
with vLLM's fused K/V copy, the context-KV-only drafter without (checked against the built
module: tests/unit/producer/test_context_kv_qwen3.py, test_context_only_drafter_holds_one_kv_copy).

Shape: Qwen3-8B DSpark as given in issue 3 (hidden 4096, intermediate 12288, 32 query / 8 KV
heads, head_dim 128, vocab 151936, 5 draft layers), bf16. Not published in that list, so shown
as parameters: the Markov rank (only the full drafter has a Markov head; rows for several
ranks) and the number of target layers feeding ``fc`` (vLLM's fallback when the config names
none is one per draft layer, i.e. 5).

Usage: python -m benchmarks.producer_draft_bytes [--markdown]
"""

from __future__ import annotations

import argparse

from vllm_dspark_pp.producer.memory import draft_load_bytes, draft_param_bytes

QWEN3_8B_DSPARK = {
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "num_hidden_layers": 5,
}

GIB = 2**30


def rows(markov_ranks=(0, 64, 256)):
    out = []
    for r in markov_ranks:
        cfg = dict(QWEN3_8B_DSPARK, markov_rank=r)
        full = draft_param_bytes(cfg, "kv_both", dtype_bytes=2)
        ctx = draft_param_bytes(cfg, "kv_producer", dtype_bytes=2)
        out.append((r, full, ctx))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    table = rows()
    comp = table[0][1]["components"]
    if args.markdown:
        print(
            "| markov rank | full drafter (own embed + LM head) | full, embed/LM head shared "
            "with target | context-KV-only | saved vs shared-full |"
        )
        print("|---:|---:|---:|---:|---:|")
        for r, full, ctx in table:
            shared_full = full["full_bytes_excluding_shared"]
            print(
                f"| {r} | {full['full_bytes'] / GIB:.3f} GiB | {shared_full / GIB:.3f} GiB | "
                f"{ctx['context_only_bytes'] / GIB:.3f} GiB | "
                f"{(shared_full - ctx['context_only_bytes']) / GIB:.3f} GiB "
                f"({100 * (1 - ctx['context_only_bytes'] / shared_full):.1f}%) |"
            )
        print()
        print("| component (rank 0) | bytes | context-only keeps it |")
        print("|---|---:|:---:|")
        keep = set(table[0][2]["context_only_components"])
        for k, v in comp.items():
            print(f"| {k} | {v:,} | {'yes' if k in keep else 'no'} |")
        print()
        print(
            "| markov rank | held after loading: full drafter (incl. fused K/V copy) | fused K/V "
            "copy | context-KV-only drafter (no copy) |"
        )
        print("|---:|---:|---:|---:|")
        for r, _, _ in table:
            held = draft_load_bytes(
                dict(QWEN3_8B_DSPARK, markov_rank=r), 2, own_embed=False, own_head=False
            )
            print(
                f"| {r} | {held['full']:,} B | {held['fused_kv_copy']:,} B | "
                f"{held['context_only']:,} B |"
            )
    else:
        for r, full, ctx in table:
            print(
                f"markov_rank={r}: full={full['full_bytes']:,} B "
                f"(shared embed/LM head: {full['full_bytes_excluding_shared']:,} B), "
                f"context-only={ctx['context_only_bytes']:,} B"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
