"""Reproduce, on CPU, the explanation of the first ``dsv4_check --spec`` GPU run's problems
(docs/dsv4-pure-torch.md, "First GPU run"): the same seeded weights and prompts as the run, and
vLLM's numbers read from its report (copied unchanged to docs/results/dsv4_check_gpu_run1.json).

1. no-spec vs DSpark, prompt 0: the reference's top-3 at the tokens where vLLM's no-spec run is
   not the reference's argmax and where DSpark leaves no-spec;
2. each draft step the report flags: the routing margins of the draft's MoE at each block
   position, and how far swapping the expert at the closest near-tie moves our base logprobs of
   the tokens the report names (against the differences it reports).

usage: python -m dspark_dev.training.dsv4_run1_explain REPORT_JSON   (about 30 s on 2 cores)
"""

from __future__ import annotations

import json
import re
import sys

import torch

from dspark_dev.training import dsv4_check as C

LP = re.compile(
    r"prompt (\d+) draft step \d+ \(anchor position (\d+)[^:]*: base logprob (\d+)/(\d+)"
)


def main(argv: list[str]) -> int:
    report = json.loads(open(argv[0]).read())
    _, target, draft = C.build(0, "cpu")
    prs = C.prompts(0)
    seqs: dict[int, list[int]] = {}
    for p in report["problems"]:
        m = re.match(r"prompt (\d+): DSpark tokens differ from no-spec: (\[.*\]) vs (\[.*\])", p)
        if not m:
            continue
        r, nospec, spec = int(m.group(1)), json.loads(m.group(2)), json.loads(m.group(3))
        seqs[r] = prs[r] + spec
        ref = C.reference_logprobs(target, prs[r] + nospec, "fp8_ds_mla")
        for j, (a, b) in enumerate(zip(nospec, spec, strict=True)):
            row = ref[len(prs[r]) - 1 + j]
            if a != b or a != int(row.argmax()):
                top = torch.topk(row, 3)
                print(
                    f"prompt {r} token {j}: no-spec {a}, DSpark {b}, reference top-3 "
                    f"{top.indices.tolist()} at {[round(float(v), 3) for v in top.values]}"
                )
            if a != b:
                break
    flagged: dict[tuple[int, int], dict[tuple[int, int], float]] = {}
    for p in report["problems"]:
        m = LP.match(p)
        if m:
            r, a, i, t = map(int, m.groups())
            flagged.setdefault((r, a), {})[(i, t)] = float(p.rsplit(" ", 1)[-1])
    for (r, a), diffs in sorted(flagged.items()):
        if r not in seqs:  # no divergence: the run's tokens are the reference's greedy ones
            toks, _ = C.reference_greedy(target, prs[r], C.GEN_TOKENS, "fp8_ds_mla")
            seqs[r] = prs[r] + toks
        seq = seqs[r]
        plain = draft.draft_greedy(target, seq, a, C.K_SPEC, "fp8_ds_mla")
        print(f"prompt {r} anchor {a}: routing margins per draft stage {plain.route_margins}")
        g, st, i = min(
            (g, st, i) for st, row in enumerate(plain.route_margins) for i, g in enumerate(row)
        )
        swapped = draft.draft_greedy(target, seq, a, C.K_SPEC, "fp8_ds_mla", swap=(st, i))
        print(f"  closest near-tie: stage {st}, block position {i}, margin {g:.4f}; swapped:")
        for (bi, t), d in sorted(diffs.items()):
            move = float(swapped.base_lp[bi, t] - plain.base_lp[bi, t])
            print(
                f"  base logprob {bi}/{t}: reported |diff| {d:.3f}, the swap moves ours {move:+.3f}"
            )
        if plain.conf is not None and swapped.conf is not None:
            print(f"  confidences {plain.conf.tolist()} -> {swapped.conf.tolist()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
