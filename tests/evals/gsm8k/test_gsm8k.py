"""GSM8K gate: every YAML under configs/ parses; the scorer and the gate; CI runs the ``ci: cpu``
ones.

The ``ci: cpu`` configurations run the trained tiny pair on CPU vLLM (marker e2e). They are
skipped, with that reason, while ``models/tiny-pair`` holds no trained weights, and they fail
(not skip) while a threshold is still null, naming the file to fill.
"""

import glob
import os

import pytest

from dspark_dev import gsm8k

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = sorted(glob.glob(os.path.join(HERE, "configs", "*.yaml")))
CPU_CONFIGS = [c for c in CONFIGS if gsm8k.load_config(c).ci == "cpu"]


def test_all_configs_parse():
    names = set()
    assert CONFIGS
    for path in CONFIGS:
        cfg = gsm8k.load_config(path)
        assert cfg.name == os.path.basename(path)[: -len(".yaml")]
        assert cfg.name not in names
        names.add(cfg.name)
        assert cfg.ci in ("cpu", "gpu", "manual")
        if cfg.ci == "manual":
            assert cfg.serve, f"{path}: a real-deployment config documents its serve line"
    assert {
        "tiny-pp1-nospec",
        "tiny-pp1-dspark",
        "tiny-pp2-dspark-sync",
        "tiny-pp2-dspark-async",
    } <= names


def test_extract_number():
    assert gsm8k.extract_number("so 3 + 4 = 7.\n#### 7") == "7"
    assert gsm8k.extract_number("#### 1,234") == "1234"
    assert gsm8k.extract_number("#### -5") == "-5"
    assert gsm8k.extract_number("#### 12.0") == "12"
    assert gsm8k.extract_number("the answer is 7") is None
    assert gsm8k.extract_number("#### 8\n\nQuestion: #### 9") == "8"


def test_prompts_match_the_tiny_corpus_format():
    from dspark_dev.training import corpus

    p = corpus.heldout_problems(1)[0]
    assert gsm8k.build_prompt(p.question, []) == corpus.format_prompt(p.question)
    shot = {"question": "q1", "answer": "a1\n#### 1"}
    assert (
        gsm8k.build_prompt("q2", [shot])
        == "Question: q1\nAnswer: a1\n#### 1\n\nQuestion: q2\nAnswer:"
    )


def _fake(cfg, texts, drafts=10, accepted=25):
    rows = [{"question": f"q{i}", "answer": f"#### {i}"} for i in range(len(texts))]
    res = {
        "texts": texts,
        "metrics": {
            "num_drafts": drafts,
            "num_accepted_tokens": accepted,
            "accepted_per_pos": [9, 7, 5, 4],
        },
    }
    return gsm8k.score(cfg, rows, res)


def test_gate_passes_and_fails_readably():
    cfg = gsm8k.EvalConfig(
        name="t",
        data="x",
        accuracy_min=0.5,
        acceptance_length_min=3.0,
        llm={"speculative_config": {"method": "dspark"}},
    )
    ok = _fake(cfg, ["#### 0", "#### 1", "#### 5", "nothing"])
    assert ok["accuracy"] == 0.5 and ok["invalid_rate"] == 0.25
    assert ok["mean_acceptance_length"] == 3.5 and ok["per_position_acceptance"][0] == 0.9
    assert ok["passed"], ok["failures"]
    # a deliberately broken configuration: thresholds above the measured values
    cfg.accuracy_min, cfg.acceptance_length_min, cfg.accuracy_equals = 0.99, 4.0, 0.75
    bad = _fake(cfg, ["#### 0", "#### 1", "#### 5", "nothing"])
    assert not bad["passed"]
    text = gsm8k.format_report(bad)
    assert "FAIL" in text
    assert "accuracy 0.5000 < accuracy_min 0.99" in text
    assert "mean acceptance length 3.500 < acceptance_length_min 4.0" in text
    assert "!= accuracy_equals 0.75" in text
    # acceptance required but no speculative metrics at all
    nospec = _fake(cfg, ["#### 0"], drafts=0, accepted=0)
    assert any("no speculative decoding metrics" in f for f in nospec["failures"])


def test_a_gated_config_with_a_null_threshold_fails_until_measured():
    """``ci: cpu`` / ``ci: gpu`` configs cannot pass while a needed threshold is null (the K3 and
    DeepSeek-V4 pairs' GPU configs were written before a GPU had measured them); ``ci: manual``
    ones record."""
    spec = {"speculative_config": {"method": "dspark"}}
    for ci in ("gpu", "cpu"):
        cfg = gsm8k.EvalConfig(name="t", data="x", ci=ci, llm=spec, path="cfg.yaml")
        rep = _fake(cfg, ["#### 0", "#### 1"])
        assert not rep["passed"]
        assert rep["failures"][0] == (
            "thresholds accuracy_equals, acceptance_length_min are null (not measured yet): "
            "measure them with this config and fill them in cfg.yaml (docs/results/gsm8k.md)"
        )
        cfg.accuracy_equals, cfg.acceptance_length_min = 1.0, 3.0
        assert _fake(cfg, ["#### 0", "#### 1"])["passed"]
    nospec = gsm8k.EvalConfig(name="n", data="x", ci="gpu")
    assert "accuracy_min are null" in _fake(nospec, ["#### 0"], 0, 0)["failures"][0]
    manual = gsm8k.EvalConfig(name="m", data="x", ci="manual", llm=spec, accuracy_min=0.5)
    assert _fake(manual, ["#### 0", "#### 1"])["passed"]
    # the trained tiny K3, DeepSeek-V4 and V4.1 pairs' configs (not the real dsv4-flash-* ones)
    trained = [c for c in CONFIGS if os.path.basename(c).startswith(("k3-", "dsv4-pp", "dsv41-pp"))]
    assert len(trained) == 9
    for path in trained:  # until a GPU run measures them (docs/results/gpu.md, next lease)
        cfg = gsm8k.load_config(path)
        assert cfg.ci == "gpu"
        if all(getattr(cfg, k) is None for k in gsm8k.needed_thresholds(cfg)):
            assert gsm8k.unmeasured(cfg), path


def test_each_trained_familys_dspark_arms_reproduce_its_measured_nospec_accuracy():
    """Once a family's GPU run filled its YAMLs, every DSpark arm's ``accuracy_equals`` is the
    no-speculation arm's measured ``accuracy_min`` and the PP=2 arm keeps the PP=1 arm's
    acceptance bound (docs/results/gsm8k.md): a threshold typed into one file only fails here."""
    checked = []
    for family in ("k3", "dsv4", "dsv41"):
        nospec = gsm8k.load_config(os.path.join(HERE, "configs", f"{family}-pp1-nospec.yaml"))
        pp1, pp2 = (
            gsm8k.load_config(os.path.join(HERE, "configs", f"{family}-pp{n}-dspark.yaml"))
            for n in (1, 2)
        )
        if nospec.accuracy_min is None:
            continue  # not measured yet: the test above gates it
        for arm in (pp1, pp2):
            assert arm.accuracy_equals == nospec.accuracy_min, arm.path
        assert pp2.acceptance_length_min == pp1.acceptance_length_min, pp2.path
        checked.append(family)
    assert checked == ["k3", "dsv4", "dsv41"]


#: architectures vLLM 0.34.0 has no CPU implementation of: a config serving one runs on the GPU
#: tier only (``ci: gpu`` or ``manual``), never in CI's CPU run
GPU_ONLY_ARCHITECTURES = frozenset({"DeepseekV41ForCausalLM"})


def _architectures(model: str) -> list[str]:
    import json

    cfg = os.path.join(model, "config.json")
    if not os.path.isfile(cfg):  # a hub id (the real-deployment configs): not bundled here
        return []
    with open(cfg) as f:
        return list(json.load(f).get("architectures") or [])


def test_configs_of_gpu_only_models_never_run_on_the_cpu_tier():
    """The DeepSeek-V4.1 configs (issue 42) are ``ci: gpu``: CI's CPU run (``CPU_CONFIGS``) must
    not start a model vLLM cannot run on CPU; tools/gpu/run_groups.sh gsm8k_dsv41 runs them."""
    gpu_only = []
    for path in CONFIGS:
        cfg = gsm8k.load_config(path)
        llm = gsm8k._resolve_llm_args(cfg.llm)
        if GPU_ONLY_ARCHITECTURES & set(_architectures(llm.get("model") or "")):
            gpu_only.append(cfg.name)
            assert cfg.ci != "cpu" and path not in CPU_CONFIGS, path
    assert sorted(gpu_only) == ["dsv41-pp1-dspark", "dsv41-pp1-nospec", "dsv41-pp2-dspark"]


# The ``ci: cpu`` configurations are scored from the shared session engine runs
# (tests/support/engines.py), the same runs the PP parity tests check: one engine per
# configuration. Key: (pipeline_parallel_size, speculative, async_scheduling) of the YAML's llm.
RUN_FOR = {
    (1, False, False): "pair_reference",
    (1, True, False): "pair_pp1",
    (2, True, False): "pair_pp2_sync",
    (2, True, True): "pair_pp2_async",
}


def _run_key(cfg) -> tuple[int, bool, bool]:
    llm = cfg.llm
    return (
        int(llm.get("pipeline_parallel_size", 1)),
        cfg.speculative,
        bool(llm.get("async_scheduling")),
    )


def test_cpu_configs_match_the_shared_runs():
    """Each ``ci: cpu`` config describes exactly a shared run: same model, drafter, k, questions."""
    from support import engines, tiny_pair

    assert {_run_key(gsm8k.load_config(c)) for c in CPU_CONFIGS} == set(RUN_FOR)
    for path in CPU_CONFIGS:
        cfg = gsm8k.load_config(path)
        llm = gsm8k._resolve_llm_args(cfg.llm)
        assert os.path.realpath(llm["model"]) == os.path.realpath(tiny_pair.TARGET), path
        if cfg.speculative:
            sc = llm["speculative_config"]
            assert os.path.realpath(sc["model"]) == os.path.realpath(tiny_pair.DRAFT), path
            assert sc["num_speculative_tokens"] == tiny_pair.num_speculative_tokens(), path
        assert cfg.data == gsm8k.BUILTIN_TINY and cfg.num_fewshot == 0, path
        assert cfg.num_questions == engines.PAIR_NUM_PROMPTS, path
        # the shared runs stop at EOS before PAIR_MAX_TOKENS (asserted there), below max_tokens
        assert cfg.max_tokens >= engines.PAIR_MAX_TOKENS, path


def test_gate_prompts_are_the_shared_runs_prompts():
    """The gate's text prompts tokenize to exactly the shared runs' token ids."""
    from support import engines, tiny_pair
    from tokenizers import Tokenizer

    cfg = gsm8k.load_config(CPU_CONFIGS[0])
    rows, shots = gsm8k.questions_for(cfg)
    tok = Tokenizer.from_file(str(tiny_pair.TOKENIZER))
    ids = [tok.encode(gsm8k.build_prompt(r["question"], shots)).ids for r in rows]
    assert ids == engines.pair_prompts()


def test_offline_runner_builds_the_engine_job_and_reads_its_result(monkeypatch):
    """gsm8k.run_offline through the shared runner (dspark_dev.engine), with the runner
    faked: the job it asks for and how it reads the answer (the real runner runs in the e2e
    tier)."""
    from dspark_dev import engine

    seen = {}

    def fake_run_engine(spec, *, timeout_s, env, name="engine", own_cache=False):
        seen.update(spec=spec, timeout_s=timeout_s, env=env)
        wave = {"texts": ["#### 1"], "tokens": [[5, 6]], "metrics": {"num_drafts": 1}}
        result = {
            "ok": True,
            "waves": [wave],
            "config": {"async_scheduling": True},
            "startup_s": 1.0,
            "generate_s": 2.0,
        }
        return engine.EngineRun(result, "", False, 0, 3.0, 123)

    monkeypatch.setattr(engine, "run_engine", fake_run_engine)
    cfg = gsm8k.load_config(os.path.join(HERE, "configs", "tiny-pp2-dspark-async.yaml"))
    out = gsm8k.run_offline(cfg, ["Question: q\nAnswer:"])
    assert seen["spec"]["async_scheduling"] is True  # really async on the CPU platform too
    assert seen["spec"]["waves"] == [["Question: q\nAnswer:"]]
    assert seen["spec"]["sampling"]["max_tokens"] == cfg.max_tokens
    assert seen["spec"]["sampling"]["stop"] == cfg.stop
    assert seen["timeout_s"] == cfg.timeout_s and seen["env"]["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert out["texts"] == ["#### 1"] and out["config"] == {"async_scheduling": True}


@pytest.mark.e2e
@pytest.mark.parametrize("path", CPU_CONFIGS, ids=[os.path.basename(c)[:-5] for c in CPU_CONFIGS])
def test_cpu_config(path, request, pair_reference):
    """The gate on a shared run: thresholds from the YAML, completions token-identical to the
    non-speculative run, and the scheduling mode vLLM used equal to the config's."""
    cfg = gsm8k.load_config(path)
    unset = [
        k
        for k in ("accuracy_min", "accuracy_equals", "acceptance_length_min")
        if getattr(cfg, k) is None
    ]
    needed = (
        {"accuracy_min"} if not cfg.speculative else {"accuracy_equals", "acceptance_length_min"}
    )
    missing = needed & set(unset)
    assert not missing, (
        f"{path}: thresholds {sorted(missing)} are null; measure and set them "
        f"(docs/results/gsm8k.md)"
    )
    key = _run_key(cfg)
    run = request.getfixturevalue(RUN_FOR[key])
    assert run.config["pipeline_parallel_size"] == key[0]
    assert run.config["async_scheduling"] is key[2], "vLLM did not use the config's scheduling mode"
    assert run.tokens == pair_reference.tokens, (
        f"{cfg.name}: completions differ from the non-speculative run"
    )
    texts = run.texts
    assert not any(s in t for t in texts for s in cfg.stop), (
        "a stop string would have cut a completion"
    )
    rows, _ = gsm8k.questions_for(cfg)
    report = gsm8k.score(
        cfg,
        rows,
        {
            "texts": texts,
            "metrics": run.metrics,
            "load_s": run.startup_s,
            "generate_s": run.waves[0]["wall_s"],  # the greedy wave (a seeded wave may follow)
        },
    )
    report["config"] = run.config
    print(gsm8k.format_report(report), "\nvLLM used:", run.config)
    assert report["passed"], gsm8k.format_report(report)


PP_CONFIGS = [
    c for c in CONFIGS if int(gsm8k.load_config(c).llm.get("pipeline_parallel_size") or 1) > 1
]


def _serve_parser():
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser())


def _parse_launcher(parser, argv):
    """vLLM's own ``vllm serve`` parser on a launcher's command line (without the executable
    and the ``serve`` word)."""
    return parser.parse_args(argv[argv.index("serve") + 1 :])


def test_launcher_command_lines_parse_back_to_every_pp_configs_llm_arguments():
    """``eval gsm8k --launchers``: for every PP > 1 config, the command line of each stage's
    launcher, read by vLLM 0.34.0's own serve parser, gives back the config's target, PP size,
    speculative config and every other ``llm`` argument, and node 1 is headless with the same
    master address. A flag vLLM does not know, or a wrong boolean spelling, fails here."""
    from dspark_dev import pp_launch

    assert PP_CONFIGS, "no PP > 1 GSM8K config"
    parser = _serve_parser()
    for path in PP_CONFIGS:
        cfg = gsm8k.load_config(path)
        llm = gsm8k._resolve_llm_args(cfg.llm)
        pp = llm["pipeline_parallel_size"]
        for rank in range(pp):
            argv = pp_launch.launcher_argv(
                llm["model"],
                pp=pp,
                rank=rank,
                master_port=29511,
                api_port=8011 if rank == 0 else None,
                spec=llm.get("speculative_config"),
                base_args=gsm8k.llm_serve_args(llm),
            )
            args = _parse_launcher(parser, argv)
            assert args.model_tag == llm["model"], path
            assert (args.nnodes, args.node_rank, args.headless) == (pp, rank, rank > 0), path
            for key, want in llm.items():
                if key != "model":  # serve takes the target as its positional model_tag
                    assert getattr(args, key) == want, f"{path}: llm.{key}"


def test_launcher_flags_spell_booleans_both_ways_and_refuse_what_serve_cannot_take():
    parser = _serve_parser()
    argv = ["vllm", "serve", "m", *gsm8k.llm_serve_args({"enforce_eager": False, "seed": 3})]
    args = _parse_launcher(parser, argv)
    assert args.enforce_eager is False and args.seed == 3
    assert gsm8k.llm_serve_args({"enable_prefix_caching": None}) == []
    with pytest.raises(ValueError, match="run this config offline"):
        gsm8k.llm_serve_args({"cuda_graph_sizes": [1, 2]})
    with pytest.raises(SystemExit):  # the control: a name vLLM's serve does not have
        _parse_launcher(parser, ["vllm", "serve", "m", *gsm8k.llm_serve_args({"no_such": 1})])


def test_launchers_refuse_a_pp1_config_before_starting_anything(monkeypatch):
    from dspark_dev import pp_launch

    def no_deployment(*a, **k):
        raise AssertionError("a launcher was built for a PP=1 config")

    monkeypatch.setattr(pp_launch, "deployment", no_deployment)
    cfg = gsm8k.load_config(os.path.join(HERE, "configs", "tiny-pp1-dspark.yaml"))
    with pytest.raises(ValueError, match="pipeline_parallel_size >= 2"):
        gsm8k.run_launchers(cfg, ["q"], log_dir="/nonexistent", device="cpu")
    # CPU launchers: only the config's env (dspark_dev.serve.Server adds the CPU settings)
    assert gsm8k.launcher_env(cfg, "cpu") == {k: str(v) for k, v in cfg.env.items()}


def test_launchers_share_one_gpu_with_a_fixed_kv_budget_per_stage(monkeypatch, tmp_path):
    """On GPU in the shared layout each stage gets its own NCCL host id and, unless the config
    sets them, a fixed KV budget and a small memory share (the profile would count the other
    stage's memory); the per-stage layout leaves the memory to vLLM. Engines faked: the composed
    deployment is inspected, not started."""
    from dspark_dev import pp_launch

    built = {}

    class Stop(Exception):
        pass

    def fake_deployment(name, target, **kw):
        built.update(kw, target=target)
        raise Stop

    monkeypatch.setattr(pp_launch, "deployment", fake_deployment)
    cfg = gsm8k.load_config(os.path.join(HERE, "configs", "k3-pp2-dspark.yaml"))
    cfg.env = {"PLANTED_BY_TEST": "1"}  # a config's env reaches every launcher
    for layout_name, want_mem in (("shared", True), ("per-stage", False)):
        built.clear()
        monkeypatch.setenv(pp_launch.LAYOUT_ENV, layout_name)
        with pytest.raises(Stop):
            gsm8k.run_launchers(cfg, ["q"], log_dir=str(tmp_path), device="gpu")
        base = built["base_args"]
        assert ("--kv-cache-memory-bytes" in base) is want_mem, layout_name
        assert ("--gpu-memory-utilization" in base) is want_mem, layout_name
        assert built["gpu_layout"] == layout_name and built["pp"] == 2
        assert built["env"]["PLANTED_BY_TEST"] == "1"  # the config's env, every launcher
        assert built["env"]["VLLM_HOST_IP"] == "127.0.0.1"  # the GPU tier's child settings
        assert built["spec"]["num_speculative_tokens"] == 7
    assert pp_launch.stage_env(1, device="gpu", gpu_layout="shared", tag="x")["NCCL_HOSTID"]


@pytest.mark.skipif(
    os.environ.get("DSPARK_GSM8K_LAUNCHERS") != "1",
    reason="opt-in (about 3 min on 2 cores): DSPARK_GSM8K_LAUNCHERS=1",
)
def test_launchers_reproduce_the_offline_pp2_gate_on_cpu(tmp_path):
    """``eval gsm8k --launchers`` for real on the CPU platform: the PP=2 sync config served by two
    launchers passes its gate (accuracy equal to no speculation, the acceptance threshold) and no
    launcher process is left. Hand-run record: docs/results/gsm8k.md."""
    cfg = gsm8k.load_config(os.path.join(HERE, "configs", "tiny-pp2-dspark-sync.yaml"))
    report = gsm8k.evaluate(cfg, launchers_log_dir=str(tmp_path))
    print(gsm8k.format_report(report))
    assert report["config"]["launchers"] == 2
    assert report["num_drafts"] > 0
    assert report["passed"], gsm8k.format_report(report)
