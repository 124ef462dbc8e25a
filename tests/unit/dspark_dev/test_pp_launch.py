"""The launcher composition of the PP tiers (dspark_dev/pp_launch.py), without starting anything:
each stage's command line and environment for the CPU tier, the one-GPU layout (every stage on
GPU 0, its own NCCL host id, sockets over loopback) and the one-GPU-per-stage layout."""

from __future__ import annotations

from pathlib import Path

import pytest

from dspark_dev import pp_launch


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


@pytest.mark.parametrize("pp", [2, 3])
def test_every_stage_is_one_launcher_of_the_same_deployment(tmp_path, pp):
    dep = pp_launch.deployment(
        "t", "/m/target", pp=pp, spec={"method": "dspark", "model": "/m/d"}, log_dir=tmp_path
    )
    assert len(dep.nodes) == pp
    masters = {_flag(n.argv, "--master-port") for n in dep.nodes}
    assert len(masters) == 1 and None not in masters
    for rank, node in enumerate(dep.nodes):
        argv = node.argv
        assert _flag(argv, "--nnodes") == str(pp) and _flag(argv, "-pp") == str(pp)
        assert _flag(argv, "--node-rank") == str(rank)
        assert _flag(argv, "--master-addr") == "127.0.0.1"
        assert ("--headless" in argv) == (rank > 0)
        assert (_flag(argv, "--port") is not None) == (rank == 0)
        assert '"method": "dspark"' in _flag(argv, "--speculative-config")
    assert dep.head.port is not None and all(n.port is None for n in dep.nodes[1:])


def test_one_gpu_layout_gives_each_stage_gpu0_and_its_own_nccl_host(tmp_path):
    dep = pp_launch.deployment(
        "pp3", "/m/t", pp=3, spec=None, log_dir=tmp_path, device="gpu", gpu_layout="shared"
    )
    envs = [n.env for n in dep.nodes]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["0", "0", "0"]
    assert len({e["NCCL_HOSTID"] for e in envs}) == 3  # NCCL: three hosts, no duplicate GPU
    assert all(e["NCCL_SOCKET_IFNAME"] == "lo" for e in envs)
    assert len({e["VLLM_CACHE_ROOT"] for e in envs}) == 3  # no compile-cache race
    assert not any(n.cpu for n in dep.nodes)  # the platform is vLLM's choice (CUDA)


def test_per_stage_layout_is_one_knob(tmp_path, monkeypatch):
    monkeypatch.setenv(pp_launch.LAYOUT_ENV, "per-stage")
    dep = pp_launch.deployment("pp2", "/m/t", pp=2, spec=None, log_dir=tmp_path, device="gpu")
    assert [n.env["CUDA_VISIBLE_DEVICES"] for n in dep.nodes] == ["0", "1"]
    assert not any("NCCL_HOSTID" in n.env for n in dep.nodes)


def test_cpu_launchers_get_no_device_settings(tmp_path):
    dep = pp_launch.deployment("c", "/m/t", pp=2, spec=None, log_dir=tmp_path)
    for n in dep.nodes:
        assert n.cpu and "CUDA_VISIBLE_DEVICES" not in n.env and "NCCL_HOSTID" not in n.env
        assert "--enforce-eager" in n.argv  # the CPU serve settings


def test_fault_cases_change_one_rank_only(tmp_path):
    dep = pp_launch.deployment(
        "f",
        "/m/t",
        pp=2,
        spec={"method": "dspark", "num_speculative_tokens": 7},
        log_dir=tmp_path,
        device="gpu",
        env={"A": "1"},
        env_per_rank={1: {"VLLM_PLUGINS": "none"}},
        spec_per_rank={1: {"method": "dspark", "num_speculative_tokens": 5}},
        base_args=["--dtype", "bfloat16"],
    )
    n0, n1 = dep.nodes
    assert n0.env["A"] == n1.env["A"] == "1"
    assert "VLLM_PLUGINS" not in n0.env and n1.env["VLLM_PLUGINS"] == "none"
    assert '"num_speculative_tokens": 7' in _flag(n0.argv, "--speculative-config")
    assert '"num_speculative_tokens": 5' in _flag(n1.argv, "--speculative-config")
    assert "--enforce-eager" not in n0.argv and _flag(n0.argv, "--dtype") == "bfloat16"


def test_bad_layout_and_pp1_are_refused_with_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv(pp_launch.LAYOUT_ENV, "two-per-gpu")
    with pytest.raises(ValueError, match="shared, per-stage"):
        pp_launch.deployment("x", "/m/t", pp=2, spec=None, log_dir=tmp_path, device="gpu")
    with pytest.raises(ValueError, match="pp >= 2"):
        pp_launch.deployment("x", "/m/t", pp=1, spec=None, log_dir=tmp_path)


def test_each_launchers_own_cache_starts_with_the_model_infos_and_nothing_else(
    tmp_path, monkeypatch
):
    """The launchers' own cache roots get a copy of this environment's model-info cache (vLLM
    would otherwise inspect both architectures in a fresh process per launcher) but none of its
    compile caches; without a model-info cache, nothing is copied."""
    root = tmp_path / "vllm_cache"
    (root / "modelinfos").mkdir(parents=True)
    (root / "modelinfos" / "m-Qwen3ForCausalLM.json").write_text('{"hash": "h"}')
    (root / "torch_compile_cache").mkdir()
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(root))
    assert pp_launch.model_info_cache() == root / "modelinfos"
    dep = pp_launch.deployment("c", "/m/t", pp=2, spec=None, log_dir=tmp_path / "logs")
    for n in dep.nodes:
        own = Path(n.env["VLLM_CACHE_ROOT"])
        assert own != root and sorted(p.name for p in own.iterdir()) == ["modelinfos"]
        assert (own / "modelinfos" / "m-Qwen3ForCausalLM.json").read_text() == '{"hash": "h"}'
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "empty"))
    dep = pp_launch.deployment("e", "/m/t", pp=2, spec=None, log_dir=tmp_path / "logs")
    assert not any(Path(n.env["VLLM_CACHE_ROOT"]).exists() for n in dep.nodes)
    monkeypatch.delenv("VLLM_CACHE_ROOT")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert pp_launch.model_info_cache() == tmp_path / "xdg" / "vllm" / "modelinfos"


# --------------------------------------------------------------------------- TP x PP (issue 40)


def _tp2pp2(tmp_path, **kw):
    return pp_launch.deployment(
        "tp", "/m/t", pp=2, tp=2, spec={"method": "dspark", "model": "/m/d"}, log_dir=tmp_path,
        **kw,
    )  # fmt: skip


@pytest.mark.parametrize("device, gpu_layout", [("cpu", None), ("gpu", "shared"),
                                                ("gpu", "per-stage")])  # fmt: skip
def test_tp2_pp2_is_four_launchers_one_rank_each(tmp_path, device, gpu_layout):
    dep = _tp2pp2(tmp_path, device=device, gpu_layout=gpu_layout)
    assert len(dep.nodes) == 4 and (dep.tp, dep.stages) == (2, 2)
    masters = {_flag(n.argv, "--master-port") for n in dep.nodes}
    assert len(masters) == 1 and None not in masters
    for rank, node in enumerate(dep.nodes):
        argv = node.argv
        # world size 4 over 4 nodes: vLLM puts one rank on each launcher
        assert (_flag(argv, "-tp"), _flag(argv, "-pp")) == ("2", "2")
        assert _flag(argv, "--nnodes") == "4" and _flag(argv, "--node-rank") == str(rank)
        assert ("--headless" in argv) == (rank > 0)
        assert (_flag(argv, "--port") is not None) == (rank == 0)
        assert '"method": "dspark"' in _flag(argv, "--speculative-config")
        # launcher R holds global rank R = pp_rank * tp + tp_rank
        stage, tp_rank = pp_launch.rank_place(rank, tp=2)
        assert (stage, tp_rank) == (rank // 2, rank % 2)
        assert f"PP stage {stage}, TP rank {tp_rank}" in node.name
    assert dep.head.port is not None and all(n.port is None for n in dep.nodes[1:])


def test_tp2_pp2_cpu_launchers_get_no_device_settings_nor_the_all_reduce_flag(tmp_path):
    dep = _tp2pp2(tmp_path)
    for n in dep.nodes:
        assert n.cpu and "CUDA_VISIBLE_DEVICES" not in n.env and "NCCL_HOSTID" not in n.env
        assert "--disable-custom-all-reduce" not in n.argv
        assert "--enforce-eager" in n.argv  # the CPU serve settings
    assert len({n.env["VLLM_CACHE_ROOT"] for n in dep.nodes}) == 4


def test_tp2_pp2_shared_gpu_layout_one_nccl_host_per_rank_and_no_custom_all_reduce(tmp_path):
    dep = _tp2pp2(tmp_path, device="gpu", gpu_layout="shared")
    envs = [n.env for n in dep.nodes]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["0"] * 4
    assert [e["NCCL_HOSTID"] for e in envs] == [f"tp-rank{r}" for r in range(4)]
    assert all(e["NCCL_SOCKET_IFNAME"] == "lo" for e in envs)
    assert len({e["VLLM_CACHE_ROOT"] for e in envs}) == 4
    for n in dep.nodes:
        assert n.argv.count("--disable-custom-all-reduce") == 1 and not n.cpu


def test_tp2_pp2_per_stage_layout_puts_rank_r_on_gpu_r(tmp_path, monkeypatch):
    monkeypatch.setenv(pp_launch.LAYOUT_ENV, "per-stage")
    dep = _tp2pp2(tmp_path, device="gpu")
    assert [n.env["CUDA_VISIBLE_DEVICES"] for n in dep.nodes] == ["0", "1", "2", "3"]
    assert not any("NCCL_HOSTID" in n.env for n in dep.nodes)
    # each launcher still sees one device, so the TP all-reduce flag stays
    assert all("--disable-custom-all-reduce" in n.argv for n in dep.nodes)


def test_pp_only_deployments_keep_their_command_lines(tmp_path):
    """tp=1 (every existing caller): no -tp, no all-reduce flag, --nnodes = pp."""
    dep = pp_launch.deployment("p", "/m/t", pp=2, spec=None, log_dir=tmp_path, device="gpu")
    for n in dep.nodes:
        assert "-tp" not in n.argv and "--disable-custom-all-reduce" not in n.argv
        assert _flag(n.argv, "--nnodes") == "2"
    assert [n.env["NCCL_HOSTID"] for n in dep.nodes] == ["p-rank0", "p-rank1"]
    assert dep.stages == 2 and dep.tp == 1


def test_tp2_pp1_is_two_launchers_and_bad_shapes_are_refused(tmp_path):
    dep = pp_launch.deployment("t", "/m/t", pp=1, tp=2, spec=None, log_dir=tmp_path, device="gpu")
    assert [_flag(n.argv, "--nnodes") for n in dep.nodes] == ["2", "2"]
    assert [(_flag(n.argv, "-tp"), _flag(n.argv, "-pp")) for n in dep.nodes] == [("2", "1")] * 2
    with pytest.raises(ValueError, match="rank 4 outside 0..3"):
        pp_launch.launcher_argv("/m/t", pp=2, tp=2, rank=4, master_port=1, api_port=None, spec=None)
    with pytest.raises(ValueError, match="got tp=0 pp=2"):
        pp_launch.deployment("x", "/m/t", pp=2, tp=0, spec=None, log_dir=tmp_path)


def test_handshake_sizes_read_either_line_form():
    logs = [
        "INFO x PP handshake: 2 ranks agree (protocol 2, vLLM 0.34.0, method dspark, k=7)\n",
        "nothing\n",
        "INFO y PP handshake: 4 ranks agree (TP=2 x PP=2)\n",
    ]
    assert pp_launch.handshake_sizes(logs) == [2, 4]
    assert pp_launch.handshake_sizes(["no handshake"]) == []


def test_rank_assignments_name_each_launchers_rank():
    line = (
        "(Worker pid=9) INFO 12-05 10:00:00 [parallel_state.py:2394] rank {r} in world size 4 is "
        "assigned as DP rank 0, PP rank {p}, PCP rank 0, TP rank {t}, ETP rank 0, EP rank N/A, "
        "EPLB rank N/A\n"
    )
    logs = [line.format(r=r, p=r // 2, t=r % 2) for r in range(4)] + ["no worker line"]
    got = pp_launch.rank_assignments(logs)
    assert got == [[(0, 4, 0, 0)], [(1, 4, 0, 1)], [(2, 4, 1, 0)], [(3, 4, 1, 1)], []]


# PD engines of several ranks (dspark_dev/pd_launch.py engine_launchers, issue 40 item 2): the
# producer's TP x PP launchers, then the decoder's, one rank each


def test_pd_tp2pp2_producer_then_tp2_decoder_one_rank_per_launcher_on_gpu0():
    from dspark_dev.pd_launch import engine_launchers, shape_label

    prod = engine_launchers(tp=2, pp=2, device="gpu", gpu_layout="shared", tag="pd",
                            master_port=111)  # fmt: skip
    dec = engine_launchers(tp=2, pp=1, device="gpu", gpu_layout="shared", tag="pd",
                           master_port=222, first_index=4)  # fmt: skip
    assert len(prod) == 4 and len(dec) == 2
    for rank, (args, _env) in enumerate(prod):
        assert (_flag(args, "-tp"), _flag(args, "-pp")) == ("2", "2")
        assert _flag(args, "--nnodes") == "4" and _flag(args, "--node-rank") == str(rank)
        assert _flag(args, "--master-port") == "111" and _flag(args, "--master-addr")
        assert ("--headless" in args) == (rank > 0)
        assert args.count("--disable-custom-all-reduce") == 1
    for rank, (args, _env) in enumerate(dec):
        # the decoder's own 2-rank world (vLLM: world_size / nnodes = 1 rank per launcher)
        assert (_flag(args, "-tp"), _flag(args, "-pp")) == ("2", "1")
        assert _flag(args, "--nnodes") == "2" and _flag(args, "--node-rank") == str(rank)
        assert _flag(args, "--master-port") == "222"
        assert ("--headless" in args) == (rank > 0)
        assert "--disable-custom-all-reduce" in args
    envs = [e for _, e in prod + dec]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["0"] * 6
    # six NCCL hosts: no "Duplicate GPU" inside either world
    assert [e["NCCL_HOSTID"] for e in envs] == [f"pd-rank{i}" for i in range(6)]
    assert shape_label(2, 2, 2) == "producer TP2xPP2 -> decoder TP2"
    assert shape_label(2, 2, 1) == "producer TP2xPP2 -> decoder TP1"
    assert shape_label(1, 2, 1) == "producer TP1xPP2 -> decoder TP1"


def test_pd_per_stage_layout_puts_the_decoder_on_the_gpus_after_the_producer(monkeypatch):
    from dspark_dev.pd_launch import engine_launchers

    monkeypatch.setenv(pp_launch.LAYOUT_ENV, "per-stage")
    prod = engine_launchers(tp=2, pp=2, device="gpu")
    dec = engine_launchers(tp=2, pp=1, device="gpu", first_index=4)
    assert [e["CUDA_VISIBLE_DEVICES"] for _, e in prod + dec] == ["0", "1", "2", "3", "4", "5"]
    assert len({_flag(a, "--master-port") for a, _ in prod}) == 1
    assert {_flag(a, "--master-port") for a, _ in prod} != {
        _flag(a, "--master-port") for a, _ in dec
    }


def test_pd_single_rank_engine_is_one_plain_launcher_and_pp_only_keeps_its_command_line():
    """TP=1 PP=1 (a decoder at TP1): no multi-node flags; TP=1 x PP=2 (group pd_pp's producer):
    the command line that group ran before, without ``-tp`` or the all-reduce flag."""
    from dspark_dev.pd_launch import engine_launchers

    [(args, env)] = engine_launchers(tp=1, pp=1, device="gpu", gpu_layout="shared", first_index=4)
    assert args == [] and env["NCCL_HOSTID"] == "pd-rank4"
    prod = engine_launchers(tp=1, pp=2, device="gpu", gpu_layout="shared", master_port=7)
    assert [a for a, _ in prod] == [
        ["-pp", "2", "--nnodes", "2", "--node-rank", str(r), "--master-addr", "127.0.0.1",
         "--master-port", "7", *(["--headless"] if r else [])]
        for r in range(2)
    ]  # fmt: skip
    cpu = engine_launchers(tp=2, pp=2, device="cpu", master_port=7)
    assert all(e == {} and "--disable-custom-all-reduce" not in a for a, e in cpu)
    with pytest.raises(ValueError, match="got tp=0 pp=1"):
        engine_launchers(tp=0, pp=1, device="gpu")
