"""The command line every generated results page shares: write the page, or ``--check`` it."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path


def page_main(page: Path, text: Callable[[], str], description: str, argv=None) -> int:
    """``python -m benchmarks.<x>_page [--check]``: rewrite ``page`` from ``text()``, or exit 1
    when the committed page differs from it."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--check", action="store_true", help="exit 1 when the page is stale")
    args = ap.parse_args(argv)
    out = text()
    if args.check:
        stale = not page.exists() or page.read_text() != out
        print(f"{page}: {'stale' if stale else 'up to date'}")
        return 1 if stale else 0
    page.write_text(out)
    print(f"wrote {page}")
    return 0
