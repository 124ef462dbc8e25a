"""tools/gpu/mooncake_probe.py on CPU: its pure parts, and a transport that cannot start (no CUDA
here) is recorded as a failure with its error, in time, with no process left behind."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[4]
_spec = importlib.util.spec_from_file_location(
    "mooncake_probe", REPO / "tools/gpu/mooncake_probe.py"
)
probe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(probe)


def test_the_pattern_never_matches_a_zeroed_buffer_and_changes_between_writes():
    values = [probe.pattern_value(r) for r in range(300)]
    assert 0 not in values and all(1 <= v <= 255 for v in values)
    assert all(a != b for a, b in zip(values, values[1:], strict=False))


def test_summary_is_gib_per_second():
    got = probe.summary([0.5, 0.25, 1.0], 2**30)
    assert got == {"writes": 3, "gib_s_median": 2.0, "gib_s_min": 1.0, "gib_s_max": 4.0}
    assert probe.summary([], 1) == {"writes": 0}


def test_a_transport_that_cannot_start_is_a_recorded_failure(tmp_path):
    out = tmp_path / "probe.json"
    script = REPO / "tools/gpu/mooncake_probe.py"
    args = ["--out", str(out), "--mib", "1", "--transports", "tcp", "--timeout-s", "60"]
    t0 = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1, done.stderr[-2000:]
    rec = json.loads(out.read_text())["transports"]["tcp"]
    assert rec["ok"] is False and rec["error"].startswith("RuntimeError: receiver: ")
    assert rec["seconds"] < 60 and time.monotonic() - t0 < 90
    assert "mooncake_probe tcp: " in done.stdout
    record = json.loads(out.read_text())
    assert record["command"] == "python3 tools/gpu/mooncake_probe.py " + " ".join(args)
    assert {"commit", "date", "gpu", "test"} <= set(record)
