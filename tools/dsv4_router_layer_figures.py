"""Print the figures of gpu-dsv4-k3.md's section on the whole DSV4 MoE layer at 256 experts from
the recorded report (group ``dsv4_router``, tests/gpu/test_dsv4_router_gpu.py).

The file is the ``DSV4 ROUTER LAYER REPORT {...}`` line of the group's log, its JSON unchanged
with the date and source added: docs/results/dsv4_router_layer_gpu.json. Usage:

    python3 tools/dsv4_router_layer_figures.py [docs/results/dsv4_router_layer_gpu.json]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _rows(x: list) -> str:
    return "none" if not x else ", ".join(str(v) for v in x)


def layer_lines(d: dict) -> list[str]:
    f, c = d["facts"], d["controls"]
    return [
        f"dsv4_router: {d['date']}; router {f['router']}, experts {f['experts_backend']}; "
        f"graph sizes {f['graph_sizes']}",
        "  real rows not bitwise equal to the unpadded batch: eager "
        f"{_rows(f['eager_rows_not_bitwise_vs_unpadded'])}; graph replay "
        f"{_rows(f['graph_rows_not_bitwise_vs_unpadded'])}; graph vs eager at the same size "
        f"{_rows(f['graph_rows_not_bitwise_vs_eager_same_size'])}",
        f"  control wrong mask (real row 6 marked padding): rows flagged {c['wrong_mask_rows']}; "
        + "; ".join(c["wrong_mask_problems"]),
        f"  control no mask: {c['no_mask_calls']} dsv4_topk call(s); "
        + "; ".join(c["no_mask_padding_problems"])
        + f"; real rows flagged {c['no_mask_real_rows_flagged']}",
        f"  control perturbed real row 2: flagged eager {c['perturbed_rows']}, after a graph "
        f"replay {f['graph_control_perturbed_rows']}",
        "  control gate off: "
        + "; ".join(c["gate_off_call_problems"])
        + f"; rows flagged against the fast path {c['gate_off_rows_flagged']}"
        + (f"; error {c['gate_off_error']}" if c.get("gate_off_error") else ""),
    ]


def main(argv: list[str]) -> int:
    path = Path(argv[1] if len(argv) > 1 else "docs/results/dsv4_router_layer_gpu.json")
    print("\n".join(layer_lines(json.loads(path.read_text()))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
