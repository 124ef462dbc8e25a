"""Worker shutdown stops the PP peer watch; a failed executor says why the engine stops.

WHAT: (1) ``WorkerProc.shutdown`` first stops this worker's PP peer watch
(:func:`vllm_dspark_pp.protocol.liveness.stop_all`: a goodbye to every peer, then vLLM's own
shutdown), so the peers do not take an orderly shutdown for a lost stage.
(2) ``MultiprocExecutor.shutdown`` of an executor whose worker monitor found a dead worker logs,
once, which local workers ended and how, naming a worker that ended with status 70 as one that
lost a peer rank (its ``DSpark PP: lost PP rank R ...`` line names that rank: stage, and TP rank
when TP > 1) before vLLM's own shutdown runs.

WHY: without (1) every normal shutdown of a PP deployment would log a false "lost PP rank" and
end the peers with status 70. Without (2) node 0 only logs ``Worker proc VllmWorker-0 died
unexpectedly (exit code: 70)``: the local worker, not the stage on the other node that was lost.

UPSTREAM: none (plugin feature: protocol/liveness.py).

RETIRE WHEN: vLLM's multiprocessing executor watches the workers of every node itself.

TESTED BY: tests/unit/protocol/test_liveness.py (the stopping message and the goodbye through
the patched methods), tests/e2e/test_process_faults.py (two launchers, hand run)
"""

from __future__ import annotations

from vllm_dspark_pp.patches._on_import import when_imported
from vllm_dspark_pp.patches._util import wrap

TARGET = "vllm.v1.executor.multiproc_executor"


def _patch(module) -> None:
    from vllm_dspark_pp.protocol import liveness

    def make_worker_shutdown(orig):
        def shutdown(self, *args, **kwargs):
            liveness.stop_all()
            return orig(self, *args, **kwargs)

        return shutdown

    def make_executor_shutdown(orig):
        def shutdown(self, *args, **kwargs):
            if getattr(self, "is_failed", False) and not getattr(self, "shutting_down", False):
                liveness.log_executor_stopping(getattr(self, "workers", None) or [])
            return orig(self, *args, **kwargs)

        return shutdown

    wrap(module.WorkerProc, "shutdown", make_worker_shutdown)
    wrap(module.MultiprocExecutor, "shutdown", make_executor_shutdown)


def apply() -> None:
    when_imported(TARGET, _patch)
