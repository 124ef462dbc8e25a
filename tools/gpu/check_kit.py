"""Fail fast when the GPU kit is incomplete: torch and vLLM must resolve from the kit's site.

    python3 tools/gpu/check_kit.py SITE      (run_gpu_suite.sh and run_groups.sh call it)

The kit (../shared/device/) unpacks each group into SITE only once all its pieces have arrived.
When one `run` call of the bootstrap is refused or lost, a group stays missing and Python falls
back to the machine's own packages: on the H200 (2026-12-03, sixth session) a missing torch piece
made every engine die at import with "operator torchvision::nms does not exist", 30 s into a run,
which reads like a test failure. This check names the cause instead. It only looks the modules up
(no import), so it costs nothing. Exit 0 when both come from SITE, else 3 with the fix.
"""

from __future__ import annotations

import importlib.util
import os
import sys

MODULES = ("torch", "vllm")


def problems(site: str) -> list[str]:
    site = os.path.realpath(site)
    out = []
    for name in MODULES:
        spec = importlib.util.find_spec(name)
        origin = os.path.realpath(spec.origin) if spec and spec.origin else None
        if origin is None:
            out.append(f"{name}: not importable")
        elif os.path.commonpath([origin, site]) != site:
            out.append(f"{name}: resolves to {origin}, not to the kit's {site}")
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: check_kit.py SITE", file=sys.stderr)
        return 2
    found = problems(argv[0])
    if not found:
        print(f"[check-kit] torch and vllm come from the kit ({argv[0]})")
        return 0
    for p in found:
        print(f"[check-kit] FATAL: {p}")
    print(
        "[check-kit] the kit is incomplete: a bootstrap piece did not arrive. Run "
        "`bash .device/ctl/boot.sh` again: its output lists each group as 'N/M pieces'; send the "
        "missing pieces (one `run` call each, carry .device/ctl and .device/cNN), then re-run."
    )
    return 3


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
