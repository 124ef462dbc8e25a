"""patches/distributed_device_communicators_shm_broadcast.py: a remote reader of vLLM's
``MessageQueue`` (ZMQ over TCP, as the engine core reading a worker on another node) gives up
when its queue is shut down, and is otherwise unchanged (data, timeout, local readers)."""

from __future__ import annotations

import threading
import time

import pytest

from dspark_dev.mq_pair import remote_queue_pair
from vllm_dspark_pp.patches import _util, apply_all
from vllm_dspark_pp.protocol.liveness import QueueShutDown


@pytest.fixture(scope="module")
def mq_pair():
    apply_all()
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    writer, reader = remote_queue_pair()
    assert reader._is_remote_reader
    return MessageQueue, writer, reader


def test_the_patch_is_installed(mq_pair):
    mq_cls, _, _ = mq_pair
    assert _util.is_patched(mq_cls, "dequeue")


def test_remote_reader_data_and_timeout_unchanged(mq_pair):
    _, writer, reader = mq_pair
    writer.enqueue({"step": 1, "tokens": list(range(10))})
    assert reader.dequeue(timeout=10) == {"step": 1, "tokens": list(range(10))}
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        reader.dequeue(timeout=0.3)
    assert time.monotonic() - t0 >= 0.3


def test_remote_reader_gives_up_when_its_queue_is_shut_down():
    apply_all()

    writer, reader = remote_queue_pair()
    outcome: list = []

    def wait_for_reply():
        try:
            outcome.append(reader.dequeue(timeout=300))  # the executor's 300 s default
        except Exception as exc:  # noqa: BLE001 - the outcome is the test
            outcome.append(exc)

    waiter = threading.Thread(target=wait_for_reply, daemon=True)
    waiter.start()
    time.sleep(0.3)
    reader.shutdown()  # what the worker monitor's executor.shutdown() does
    waiter.join(10)  # vLLM 0.34.0's reader would sit here for the whole 300 s
    assert not waiter.is_alive(), "the remote reader kept waiting after shutdown()"
    assert isinstance(outcome[0], QueueShutDown), outcome
