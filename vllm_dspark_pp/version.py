"""Version facts every rank must agree on, and the vLLM version gate."""

from __future__ import annotations

__version__ = "0.1.0"

# Bumped whenever the PP token-exchange schedule or the handshake payload changes shape.
# Ranks exchange it at start-up (see vllm_dspark_pp.protocol.handshake) and refuse to run on a
# mismatch.
PROTOCOL_VERSION = 2

# Exactly the releases the whole test suite passed on. Widen only after a full run on the new
# release: a half-patched PP rank would post a different collective sequence and hang NCCL.
SUPPORTED_VLLM_VERSIONS: tuple[str, ...] = ("0.34.0",)


class UnsupportedVLLMVersionError(RuntimeError):
    """Raised at start-up when the installed vLLM is not one this plugin was tested on."""


def installed_vllm_version() -> str:
    import vllm

    return vllm.__version__


def check_vllm_version(version: str | None = None) -> str:
    """Return the vLLM version, or raise :class:`UnsupportedVLLMVersionError`."""
    version = installed_vllm_version() if version is None else version
    if version not in SUPPORTED_VLLM_VERSIONS:
        supported = ", ".join(SUPPORTED_VLLM_VERSIONS)
        raise UnsupportedVLLMVersionError(
            f"vllm-dspark-pp {__version__} supports vLLM {supported} only, but vLLM {version} is "
            f"installed. Install the supported release (pip install "
            f"vllm=={SUPPORTED_VLLM_VERSIONS[-1]}) "
            "or uninstall vllm-dspark-pp (or leave it out of VLLM_PLUGINS). The plugin refuses to "
            "patch a release it was not tested on: pipeline-parallel ranks with different patches "
            "would post different collectives and hang."
        )
    return version
