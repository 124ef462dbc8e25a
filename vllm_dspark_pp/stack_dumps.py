"""Python stack dumps of a hung engine, on request (a diagnosis aid; off unless asked for).

With ``VLLM_DSPARK_PP_STACKS_ON_SIGUSR1=1`` (formerly ``DSPARK_PP_STACKS_ON_SIGUSR1``, still read
for one release with a deprecation warning) in its environment, every process that loads the
plugin (the ``vllm.LLM`` / API-server process, the engine core, each worker) prints the Python
stack of every thread to its stderr when it receives SIGUSR1, and goes on running. The project's
runners (``dspark_dev.engine.run_engine``, the ``vllm serve`` helpers) set it for their
children and, when a case overruns its deadline, signal the whole process group before killing
it, so a hang's log ends with where each process was waiting instead of just stopping.

Each process that installs it logs ``pid N prints its Python stacks on SIGUSR1`` (from
``register()``), so a user signals exactly those (docs/bad-configs.md). Without the variable
nothing is installed and SIGUSR1 keeps its default meaning.
"""

from __future__ import annotations

import faulthandler
import signal
import sys

from vllm_dspark_pp import envs

ENV = "VLLM_DSPARK_PP_STACKS_ON_SIGUSR1"


def install_if_requested() -> bool:
    """Register the SIGUSR1 stack dump when ``ENV`` is "1" (read through
    :mod:`vllm_dspark_pp.envs`); True when it is installed."""
    if not envs.VLLM_DSPARK_PP_STACKS_ON_SIGUSR1 or not hasattr(signal, "SIGUSR1"):
        return False
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True, chain=False)
    return True
