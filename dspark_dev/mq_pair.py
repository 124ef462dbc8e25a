"""A connected pair of vLLM ``MessageQueue`` ends whose one reader is "on another node" (it reads
over the queue's zmq socket, not shared memory): what the remote-reader patch changes. Shared by
benchmarks/mq_remote_wait.py and tests/unit/patches/test_mq_remote_wait.py."""

from __future__ import annotations

import threading


def remote_queue_pair(join_s: float = 30.0):
    """(writer, reader), both ready; call it after the patches are applied."""
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    writer = MessageQueue(1, 0, connect_ip="127.0.0.1")
    reader = MessageQueue.create_from_handle(writer.export_handle(), rank=1)
    ready = threading.Thread(target=writer.wait_until_ready, daemon=True)
    ready.start()
    reader.wait_until_ready()
    ready.join(join_s)
    return writer, reader
