"""vllm-dspark-pp: DSpark speculative decoding on pipeline-parallel vLLM targets.

vLLM loads this package in every process (API server, engine core, each worker) through the
``vllm.general_plugins`` entry point and calls :func:`register`. ``register`` checks the vLLM
version, then applies every patch module in :mod:`vllm_dspark_pp.patches` exactly once per
process. Importing this package has no side effects: a failed import would be swallowed by
vLLM's loader (it logs and goes on), whereas an exception raised from ``register`` stops the
process at start-up, which is what a wrong vLLM version must do.
"""

from vllm_dspark_pp.version import PROTOCOL_VERSION, SUPPORTED_VLLM_VERSIONS, __version__

__all__ = ["register", "__version__", "PROTOCOL_VERSION", "SUPPORTED_VLLM_VERSIONS"]


def register() -> None:
    """Entry point for ``vllm.general_plugins``. Re-entrant and idempotent."""
    from vllm_dspark_pp.patches import apply_all
    from vllm_dspark_pp.stack_dumps import install_if_requested
    from vllm_dspark_pp.version import check_vllm_version

    dumps = install_if_requested()  # first: a hang in the checks or patches can be located too
    check_vllm_version()
    apply_all()  # also sets up vLLM's logging in a bare process
    if dumps:
        import os

        from vllm.logger import init_logger

        init_logger("vllm.dspark_pp").info(
            "pid %d prints its Python stacks on SIGUSR1 (VLLM_DSPARK_PP_STACKS_ON_SIGUSR1=1)",
            os.getpid(),
        )
