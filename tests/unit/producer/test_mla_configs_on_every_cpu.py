"""Guard (issue 24): the tiny MLA targets' configs of the CPU tests are valid, and for Kimi-K3 the
same, on every x86-64 CPU vLLM's CPU platform supports, not only on the CPU CI happens to run on.

vLLM's CPU platform decides parts of an MLA target's config from the processor's features
(support/mla_cpu_config.py says where). Here ``torch.cpu``'s feature queries, which vLLM reads to
decide, answer as each supported kind of x86-64 CPU (``CPUS``: Intel with AMX, AMD Zen 4 with
AVX-512-BF16 and no AMX, AVX-512 without BF16, AVX2 only) and the configurations are built under
those answers, whatever the machine running the test.
``test_k3_config_without_the_helper_depends_on_amx`` shows that those answers do reach vLLM's
decision (and why the helper exists): on an AMX machine the guard still fails if the K3
configurations stop being built CPU-independently.
"""

from __future__ import annotations

import pytest
from support.mla_cpu_config import (
    CPUS,
    cpu_answers,
    decided_by_the_cpu,
    k3_engine_args,
    k3_engine_config,
)

from dspark_dev import tiny_mla_targets
from dspark_dev.tiny_dsv4_cpu import engine_config as dsv4_engine_config


@pytest.fixture(scope="module")
def k3_pair(tmp_path_factory):
    """As test_tiny_mla_targets_startup.py makes it."""
    return tiny_mla_targets.make_tiny_k3_pair(tmp_path_factory.mktemp("k3-every-cpu"), gpu=True)


@pytest.fixture(scope="module")
def k3_split_pair(tmp_path_factory):
    """As test_k3_kv_group_split.py makes it."""
    return tiny_mla_targets.make_tiny_k3_pair(tmp_path_factory.mktemp("k3-split-every-cpu"))


@pytest.fixture(scope="module")
def dsv4_pair(tmp_path_factory):
    return tiny_mla_targets.make_tiny_dsv4_pair(tmp_path_factory.mktemp("dsv4-every-cpu"))


# What a GPU deployment of the tiny K3 target has: prefix caching and chunked prefill on, the
# KDA state cached per attention block (mamba "align" mode), float32 SSM state.
K3_GPU_SETTINGS = {
    "enable_prefix_caching": True,
    "enable_chunked_prefill": True,
    "block_size": 64,
    "mamba_block_size": 64,
    "mamba_cache_mode": "align",
    "mamba_ssm_cache_dtype": "float32",
}


def _k3_configs(pair, split_pair):
    """The K3 configurations the CPU tests build: the start-up checks' (no connector) and the
    group split's context-KV-only producer (MooncakeConnector)."""
    from vllm.config import KVTransferConfig

    mooncake = KVTransferConfig(kv_connector="MooncakeConnector", kv_role="kv_producer")
    return {
        "start-up": k3_engine_config(pair, speculative_config=pair.speculative_config(4)),
        "split-mooncake-producer": k3_engine_config(
            split_pair,
            speculative_config=split_pair.speculative_config(),
            kv_transfer_config=mooncake,
            max_num_seqs=4,
        ),
    }


@pytest.mark.parametrize("cpu", list(CPUS))
def test_k3_configs_are_the_gpu_settings_on_every_cpu(k3_pair, k3_split_pair, cpu):
    with cpu_answers(**CPUS[cpu]):
        configs = _k3_configs(k3_pair, k3_split_pair)
    for name, cfg in configs.items():
        got = decided_by_the_cpu(cfg)
        assert {k: got[k] for k in K3_GPU_SETTINGS} == K3_GPU_SETTINGS, (cpu, name, got)


def test_k3_config_without_the_helper_depends_on_amx(k3_pair):
    """vLLM 0.34.0 as it decides by itself: the same arguments give the GPU settings with AMX and
    are refused without (platforms/cpu.py:532-546, then config/vllm.py:3583-3594). If vLLM stops
    reading the AMX answer this fails, and the guard above must learn what it reads now."""
    args = {"speculative_config": k3_pair.speculative_config(4)}
    with cpu_answers(**CPUS["intel-amx"]):
        cfg = k3_engine_args(k3_pair, **args).create_engine_config()
    got = decided_by_the_cpu(cfg)
    assert {k: got[k] for k in K3_GPU_SETTINGS} == K3_GPU_SETTINGS, got
    with cpu_answers(**CPUS["amd-zen4-avx512"]), pytest.raises(Exception) as err:
        k3_engine_args(k3_pair, **args).create_engine_config()
    assert "--mamba-block-size can only be set with --enable-prefix-caching" in str(err.value)


@pytest.mark.parametrize("cpu", list(CPUS))
def test_dsv4_config_is_valid_on_every_cpu(dsv4_pair, cpu):
    """DeepSeek-V4 (MLA, not hybrid) stays valid either way; its CPU block size is 256 on every CPU
    (platforms/cpu.py:298-308), which its state-cache tests rely on."""
    with cpu_answers(**CPUS[cpu]):
        cfg = dsv4_engine_config(dsv4_pair, speculative_config=dsv4_pair.speculative_config(4))
    assert cfg.cache_config.block_size == 256


@pytest.mark.parametrize("cpu", list(CPUS))
def test_plan_of_a_k3_deployment_is_accepted_on_every_cpu(k3_pair, cpu):
    """`vllm-dspark-pp plan` judges the GPU deployment: vLLM's CPU platform refusing prefix caching
    for a hybrid MLA target without AMX is noted, not a rejection (plan.CPU_MLA_PREFIX_CACHING)."""
    from vllm_dspark_pp.deployment_plan import CPU_MLA_PREFIX_CACHING, make_plan

    with cpu_answers(**CPUS[cpu]):
        plan = make_plan(
            k3_pair.target,
            k3_pair.speculative_config(4),
            pipeline_parallel_size=2,
            extra_engine_args={"max_model_len": 256},
        )
    assert plan.accepted, plan.messages
    assert [s.drafts for s in plan.stages] == [False, True]
    assert (CPU_MLA_PREFIX_CACHING in plan.not_checked) is (not CPUS[cpu]["amx"])
