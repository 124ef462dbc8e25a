"""The producer unit tests run on the CPU, in process. Their fixtures (the plugin, the tiny pair,
``make_vllm_config``, the one-process gloo world) are tests/support/vllm_configs.py's, shared with
tests/unit/connectors."""

from support.env import set_cpu_env_defaults

set_cpu_env_defaults()
