"""Fixtures of the CPU end-to-end tier (see docs/testing.md).

``e2e_timeout_s``: the hard per-case wall-clock limit (``DSPARK_E2E_TIMEOUT_S``, default 180 s;
a case takes 15-60 s on an idle 2-core machine, the margin is for loaded CI hosts).
"""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def e2e_timeout_s() -> float:
    return float(os.environ.get("DSPARK_E2E_TIMEOUT_S", "180"))
