"""docs/results/mooncake_probe_gpu.md is benchmarks/mooncake_probe_page.py's output from the
committed probe records, and the page follows its records: a planted change shows or is refused."""

from __future__ import annotations

import json

import pytest

from benchmarks import mooncake_probe_page as page


def test_the_committed_page_is_the_generators_output():
    assert page.PAGE.read_text() == page.markdown(page.load()), (
        "run: python -m benchmarks.mooncake_probe_page"
    )


def _copy(tmp_path):
    src = sorted(page.RESULTS.glob(page.PATTERN))
    assert src, "no mooncake_probe_gpu record is committed"
    for p in src:
        (tmp_path / p.name).write_text(p.read_text())
    return tmp_path / src[-1].name


def test_a_planted_rate_wrong_bytes_and_failed_transport_reach_the_page(tmp_path):
    path = _copy(tmp_path)
    rec = json.loads(path.read_text())
    run = rec["runs"][0]
    run["transports"]["nvlink_intra"]["chunks"]["gib_s_median"] = 12345.678
    run["transports"]["tcp"]["whole"]["bad_bytes"] = 77
    run["transports"]["extra"] = {"bytes": 1, "chunk_bytes": 1, "ok": False, "error": "PLANTED"}
    path.write_text(json.dumps(rec))
    text = page.markdown(page.load(tmp_path))
    assert "| 12345.678 |" in text
    assert "| 2.011 | 1.997-2.019 | 77 |" in text
    assert "| 1 | extra | - | - | - | - | - | - | PLANTED |" in text


@pytest.mark.parametrize("drop", ["commit", "gpu", "command", "transports"])
def test_a_run_without_what_the_page_needs_is_refused(tmp_path, drop):
    path = _copy(tmp_path)
    rec = json.loads(path.read_text())
    del rec["runs"][1][drop]
    path.write_text(json.dumps(rec))
    with pytest.raises(page.RecordError, match=drop):
        page.load(tmp_path)
