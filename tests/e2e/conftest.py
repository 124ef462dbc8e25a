"""Fixtures of the CPU end-to-end tier (see docs/testing.md).

``e2e_timeout_s``: the hard per-case wall-clock limit (``DSPARK_E2E_TIMEOUT_S``, default 300 s;
a case takes well under a minute on an idle 2-core machine; measured 90-160 s on a host loaded 10x, hence the margin).
"""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def e2e_timeout_s() -> float:
    return float(os.environ.get("DSPARK_E2E_TIMEOUT_S", "300"))
