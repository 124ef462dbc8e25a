"""A rendezvous store that dies mid-handshake (its host process exited) fails every waiting rank
with a HandshakeError that names the last rank, never with a raw connection error or a hang."""

from __future__ import annotations

import time

import pytest

from vllm_dspark_pp.protocol.handshake import HandshakeError, HandshakeFacts, run_handshake

FACTS = HandshakeFacts(
    protocol=1,
    plugin_version="0.1.0",
    vllm_version="0.34.0",
    pp_size=3,
    method="dspark",
    num_speculative_tokens=4,
    fixed_graph_batch=None,
)


class DeadStore:
    """Accepts writes, then every lookup fails as a TCPStore client does once its host is gone."""

    def set(self, key, value):
        self.written = key

    def check(self, keys):
        raise RuntimeError("Connection reset by peer")

    def get(self, key):
        raise RuntimeError("Connection reset by peer")


@pytest.mark.parametrize("rank", [0, 1])
def test_non_last_rank_names_the_last_rank_when_the_store_dies(rank):
    start = time.monotonic()
    with pytest.raises(HandshakeError) as info:
        run_handshake(FACTS, rank_in_group=rank, ranks=[0, 1, 2], store=DeadStore(), timeout=30)
    msg = str(info.value)
    assert "PP rank 2 (last) sent no verdict" in msg
    assert "rendezvous store failed" in msg and "Connection reset by peer" in msg
    assert time.monotonic() - start < 5, "a dead store must fail at once, not after the timeout"


def test_last_rank_fails_clearly_when_the_store_dies():
    with pytest.raises(HandshakeError, match="rendezvous store failed while PP rank 2"):
        run_handshake(FACTS, rank_in_group=2, ranks=[0, 1, 2], store=DeadStore(), timeout=30)
