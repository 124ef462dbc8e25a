"""A remote reader of vLLM's message queue gives up when its queue is shut down.

WHAT: ``MessageQueue.dequeue`` of a *remote* reader (a reader on another node, fed through a ZMQ
socket: the engine core reading the reply of a worker on another launcher, and a headless node's
workers reading the engine's requests) waits in slices of 0.5 s
(:func:`vllm_dspark_pp.protocol.liveness.sliced_wait`) and raises
:class:`~vllm_dspark_pp.protocol.liveness.QueueShutDown` once ``MessageQueue.shutdown()`` was
called, instead of one ``poll`` of the whole timeout. Messages are read by vLLM's own
``MessageQueue.recv`` (at once when one is already there). Local (shared-memory) readers are
unchanged.

WHY: in vLLM 0.34.0 a remote reader's ``dequeue`` is a single ``socket.poll(timeout)`` that
never looks at ``shutting_down``: when a worker dies, the executor's worker monitor shuts the
queues down, but the engine core stays blocked on the lost last stage's reply until
``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS`` (300 s by default) passes, and a headless node's worker
waits for the next request forever. With the PP peer watch (protocol/liveness.py) node 0's own
worker dies at once when a stage on another node is lost; this patch lets the engine core notice
within half a second. Its cost per message is measured by benchmarks/mq_remote_wait.py (results in
docs/results/mq_remote_wait.json).

UPSTREAM: none yet (a bounded, cancellable remote read in ``MessageQueue``).

RETIRE WHEN: vLLM's remote reader checks ``shutting_down`` while it waits.

TESTED BY: tests/unit/patches/test_mq_remote_wait.py (a real ZMQ remote reader shut down while
it waits; data, timeout and local readers unchanged), tests/e2e/test_process_faults.py (two
launchers, hand run: the server exits within seconds only with this patch)
"""

from __future__ import annotations

from vllm_dspark_pp.patches._on_import import when_imported
from vllm_dspark_pp.patches._util import wrap

TARGET = "vllm.distributed.device_communicators.shm_broadcast"


def _patch(module) -> None:
    from vllm_dspark_pp.protocol.liveness import sliced_wait

    mq_cls = module.MessageQueue

    def make_dequeue(orig):
        def dequeue(self, timeout=None, indefinite=False):
            if not getattr(self, "_is_remote_reader", False):
                return orig(self, timeout, indefinite)
            socket = self.remote_socket
            if not self.shutting_down:
                try:  # a message already there: vLLM's own read, no extra poll
                    return mq_cls.recv(socket, 0)
                except TimeoutError:
                    pass
            sliced_wait(
                lambda ms: bool(socket.poll(timeout=ms)),
                lambda: bool(self.shutting_down),
                timeout,
            )
            return mq_cls.recv(socket, 0)

        return dequeue

    wrap(mq_cls, "dequeue", make_dequeue)


def apply() -> None:
    when_imported(TARGET, _patch)
