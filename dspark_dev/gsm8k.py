"""GSM8K-style accuracy + speculative-acceptance gate (issue 9).

A configuration (one YAML file, see tests/evals/gsm8k/configs/) names the data (a GSM8K JSONL
path, or ``builtin:tiny-heldout`` for the seeded held-out set of the tiny pair's corpus), the
prompting (few-shot count, max tokens), how to run the model (``llm``: keyword arguments of
``vllm.LLM``, run in a subprocess with a hard timeout; or an OpenAI-compatible server URL given at
run time, for ``vllm serve`` deployments such as PD; or, for PP > 1, one ``vllm serve`` launcher
per stage started here, which runs PP on one GPU: :func:`run_launchers`) and the thresholds. A
configuration passes when accuracy >= ``accuracy_min`` and mean acceptance length >=
``acceptance_length_min`` (each checked only when set). Acceptance comes from vLLM's spec-decode
metrics: mean acceptance length = 1 + accepted draft tokens / draft steps (the bonus token
included), per-position rate = accepted at position i / draft steps.
"""

from __future__ import annotations

import json
import os
import re
import time
import urllib.request
from dataclasses import dataclass, field

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILTIN_TINY = "builtin:tiny-heldout"
_ANSWER_RE = re.compile(r"####\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?)")


# ---------------------------------------------------------------- data and prompts


def load_jsonl(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    for i, r in enumerate(rows):
        if "question" not in r or "answer" not in r:
            raise ValueError(f"{path}:{i + 1}: a GSM8K row needs 'question' and 'answer'")
    return rows


def builtin_rows(kind: str, n: int) -> list[dict]:
    from dspark_dev.training import corpus

    if kind == "heldout":
        probs = corpus.heldout_problems(max(n, corpus.DEFAULT_HELDOUT_SIZE))[:n]
    else:
        probs = corpus.train_problems(n)
    return [{"question": p.question, "answer": p.answer} for p in probs]


def extract_number(text: str) -> str | None:
    """The number after the first ``####`` (commas dropped), or None (an invalid answer)."""
    m = _ANSWER_RE.search(text)
    if m is None:
        return None
    s = m.group(1).replace(",", "")
    return s[:-2] if s.endswith(".0") else s


def build_prompt(question: str, shots: list[dict]) -> str:
    parts = [f"Question: {s['question']}\nAnswer: {s['answer']}\n\n" for s in shots]
    return "".join(parts) + f"Question: {question}\nAnswer:"


def _expand(value: str) -> str:
    out = os.path.expandvars(value)
    if "$" in out:
        raise SystemExit(f"unset environment variable in {value!r}")
    return out


# ---------------------------------------------------------------- configuration


@dataclass
class EvalConfig:
    name: str
    data: str
    num_questions: int = 64
    num_fewshot: int = 0
    fewshot_data: str | None = None
    max_tokens: int = 256
    stop: list[str] = field(default_factory=lambda: ["\nQuestion:"])
    llm: dict = field(default_factory=dict)
    ci: str = "manual"  # cpu | gpu | manual
    pd: bool = False
    serve: str = ""
    accuracy_min: float | None = None
    accuracy_equals: float | None = None
    acceptance_length_min: float | None = None
    timeout_s: int = 1800
    env: dict = field(default_factory=dict)
    description: str = ""
    path: str = ""

    @property
    def speculative(self) -> bool:
        return bool(self.llm.get("speculative_config"))


def load_config(path: str) -> EvalConfig:
    import yaml

    with open(path) as f:
        raw = yaml.safe_load(f)
    thr = raw.pop("thresholds", {}) or {}
    thr_keys = {"accuracy_min", "accuracy_equals", "acceptance_length_min"}
    known = set(EvalConfig.__dataclass_fields__) - thr_keys - {"path"}
    unknown = (set(raw) - known) | (set(thr) - thr_keys)
    if unknown:
        raise ValueError(f"{path}: unknown keys {sorted(unknown)}")
    return EvalConfig(**raw, **{k: thr.get(k) for k in thr_keys}, path=path)


def _resolve_llm_args(llm: dict) -> dict:
    """Paths in ``model`` / ``tokenizer`` / ``speculative_config.model`` may be repo-relative."""

    def fix(p):
        p = _expand(p)
        cand = os.path.join(REPO_ROOT, p)
        return cand if not os.path.isabs(p) and os.path.exists(cand) else p

    out = json.loads(json.dumps(llm))
    for k in ("model", "tokenizer"):
        if isinstance(out.get(k), str):
            out[k] = fix(out[k])
    sc = out.get("speculative_config")
    if isinstance(sc, dict) and isinstance(sc.get("model"), str):
        sc["model"] = fix(sc["model"])
    return out


def questions_for(cfg: EvalConfig) -> tuple[list[dict], list[dict]]:
    """(eval rows, few-shot rows)."""
    if cfg.data == BUILTIN_TINY:
        rows = builtin_rows("heldout", cfg.num_questions)
        shots = builtin_rows("train", cfg.num_fewshot) if cfg.num_fewshot else []
        return rows, shots
    rows = load_jsonl(_expand(cfg.data))
    if cfg.fewshot_data:
        shots = load_jsonl(_expand(cfg.fewshot_data))[: cfg.num_fewshot]
    else:
        shots, rows = rows[: cfg.num_fewshot], rows[cfg.num_fewshot :]
    return rows[: cfg.num_questions], shots


# ---------------------------------------------------------------- runners


def run_offline(cfg: EvalConfig, prompts: list[str]) -> dict:
    """``vllm.LLM`` in a child with a hard deadline
    (:func:`dspark_dev.engine.run_engine`)."""
    from dspark_dev.engine import child_env, run_engine

    spec = {
        "name": cfg.name,
        "llm": _resolve_llm_args(cfg.llm),
        "waves": [prompts],
        "sampling": {"max_tokens": cfg.max_tokens, "stop": cfg.stop or None, "ignore_eos": False},
        # on the CPU platform async scheduling is forced back on when asked (engine_worker)
        "async_scheduling": bool(cfg.llm.get("async_scheduling")),
    }
    env = child_env({k: str(v) for k, v in cfg.env.items()})
    run = run_engine(spec, timeout_s=cfg.timeout_s, env=env, name=f"gsm8k-{cfg.name}")
    if run.timed_out:
        raise RuntimeError(
            f"[{cfg.name}] vLLM run exceeded timeout_s={cfg.timeout_s} in phase "
            f"{run.phase!r} and was killed; raise it in {cfg.path or 'the config'} "
            f"if the machine is only slow\n{run.log_text[-4000:]}"
        )
    if not run.ok:
        raise RuntimeError(
            f"[{cfg.name}] vLLM run failed in phase {run.phase!r}: "
            f"{run.result.get('error')}\n{run.log_text[-4000:]}"
        )
    wave = run.result["waves"][0]
    return {
        "texts": wave["texts"],
        "tokens": wave["tokens"],
        "metrics": wave["metrics"],
        "config": run.result["config"],
        "load_s": run.result.get("startup_s", 0.0),
        "generate_s": run.result.get("generate_s", 0.0),
    }


def run_server(cfg: EvalConfig, prompts: list[str], url: str, concurrency: int = 16) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    from tqdm import tqdm

    base = url.rstrip("/")
    if base.endswith("/v1"):
        base = base[:-3]

    def get(path):
        with urllib.request.urlopen(base + path, timeout=60) as r:
            return r.read().decode()

    model = cfg.llm.get("served_model_name") or json.loads(get("/v1/models"))["data"][0]["id"]
    from dspark_dev.metrics import counter_delta, spec_metrics_from_prometheus

    before = spec_metrics_from_prometheus(get("/metrics"))

    def one(prompt):
        body = json.dumps(
            {
                "model": model,
                "prompt": prompt,
                "max_tokens": cfg.max_tokens,
                "temperature": 0,
                "stop": cfg.stop or None,
            }
        ).encode()
        req = urllib.request.Request(
            base + "/v1/completions", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=cfg.timeout_s) as r:
            return json.loads(r.read())["choices"][0]["text"]

    t0 = time.time()
    with ThreadPoolExecutor(concurrency) as ex:
        texts = list(tqdm(ex.map(one, prompts), total=len(prompts), desc=f"gsm8k {cfg.name}"))
    gen_s = time.time() - t0
    after = spec_metrics_from_prometheus(get("/metrics"))
    return {
        "texts": texts,
        "tokens": None,
        "metrics": counter_delta(before, after),
        "load_s": 0.0,
        "generate_s": gen_s,
    }


# ---------------------------------------------------------------- PP over vLLM's launchers

# ``llm`` keys the launcher composition passes itself (dspark_dev.pp_launch.launcher_argv)
LAUNCHER_OWN_KEYS = ("model", "pipeline_parallel_size", "speculative_config")
# a GPU stage that shares the device with another gets a fixed KV budget (pp_launch docstring)
SHARED_GPU_DEFAULTS = {"gpu_memory_utilization": 0.05, "kv_cache_memory_bytes": 1 << 30}


def llm_serve_args(llm: dict) -> list[str]:
    """``vllm serve`` flags for a config's ``llm`` keyword arguments, without the target,
    ``pipeline_parallel_size`` and ``speculative_config``. ``True`` / ``False`` become ``--name`` /
    ``--no-name`` (vLLM's boolean options take both), dicts JSON, numbers and strings their text;
    ``None`` is left out (vLLM's default). Lists have no one serve spelling and are refused."""
    argv: list[str] = []
    for key, value in llm.items():
        if key in LAUNCHER_OWN_KEYS or value is None:
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + key.replace("_", "-"))
        elif isinstance(value, dict):
            argv += [flag, json.dumps(value)]
        elif isinstance(value, (int, float, str)):
            argv += [flag, str(value)]
        else:
            raise ValueError(
                f"llm.{key} = {value!r}: no vllm serve spelling for a {type(value).__name__}; "
                "run this config offline (without --launchers)"
            )
    return argv


def launcher_device() -> str:
    """``gpu`` where torch sees CUDA, else ``cpu`` (vLLM's CPU platform)."""
    import torch

    return "gpu" if torch.cuda.is_available() else "cpu"


def launcher_env(cfg: EvalConfig, device: str) -> dict:
    """Every launcher's environment: on a GPU the one-GPU tier's child settings first
    (``dspark_dev.serve.GPU_CHILD_ENV``: loopback host IP, offline hub, engine deadlines), then the
    config's ``env``."""
    from dspark_dev.serve import GPU_CHILD_ENV

    base = dict(GPU_CHILD_ENV) if device == "gpu" else {}
    return {**base, **{k: str(v) for k, v in cfg.env.items()}}


def run_launchers(
    cfg: EvalConfig,
    prompts: list[str],
    *,
    log_dir: str,
    device: str | None = None,
    gpu_layout: str | None = None,
) -> dict:
    """Serve the config's target with one ``vllm serve`` launcher per PP stage
    (:func:`dspark_dev.pp_launch.deployment`: ``--nnodes N --node-rank R``, node 0 serving the
    API) and score it over HTTP (:func:`run_server`). On one GPU every stage shares GPU 0 (each
    launcher its own ``NCCL_HOSTID``); ``DSPARK_GPU_PP_LAYOUT=per-stage`` puts stage R on GPU R.
    A stage that shares the GPU gets :data:`SHARED_GPU_DEFAULTS` unless ``llm`` sets them. The
    launchers are stopped on every path; one still running afterwards is an error."""
    from dspark_dev import pp_launch

    llm = _resolve_llm_args(cfg.llm)
    pp = int(llm.get("pipeline_parallel_size") or 1)
    if pp < 2:
        raise ValueError(
            f"{cfg.path or cfg.name}: --launchers runs one PP stage per vllm serve launcher and "
            f"needs llm.pipeline_parallel_size >= 2 (it is {pp}); run this config without "
            "--launchers"
        )
    device = device or launcher_device()
    chosen = pp_launch.layout(gpu_layout) if device == "gpu" else pp_launch.SHARED
    if device == "gpu" and chosen == pp_launch.SHARED:
        llm = {**SHARED_GPU_DEFAULTS, **llm}
    dep = pp_launch.deployment(
        f"gsm8k-{cfg.name}",
        llm["model"],
        pp=pp,
        spec=llm.get("speculative_config"),
        log_dir=log_dir,
        device=device,
        gpu_layout=chosen,
        base_args=llm_serve_args(llm),
        env=launcher_env(cfg, device),
    )
    print(
        f"[gsm8k] {cfg.name}: {pp} launchers on {device}"
        + (f" ({chosen} layout)" if device == "gpu" else "")
        + f", logs in {log_dir}",
        flush=True,
    )
    try:
        dep.start()
        ready_s = dep.wait_ready(cfg.timeout_s)
        res = run_server(cfg, prompts, dep.url)
        dead = dep.dead_nodes()
        if dead:
            raise RuntimeError(f"launchers died during the evaluation: {', '.join(dead)}")
    except (RuntimeError, TimeoutError, OSError) as e:
        dep.stop()
        raise RuntimeError(f"{e}\n{dep.logs(3000)}") from e
    left = dep.stop()
    if left:
        raise RuntimeError(f"launcher processes still running after stop: pids {left}")
    res["load_s"] = ready_s
    res["config"] = {"launchers": pp, "device": device, "gpu_layout": chosen}
    return res


# ---------------------------------------------------------------- scoring and gating


def score(cfg: EvalConfig, rows: list[dict], res: dict) -> dict:
    preds = [extract_number(t) for t in res["texts"]]
    golds = [extract_number(r["answer"]) for r in rows]
    correct = sum(p is not None and p == g for p, g in zip(preds, golds, strict=True))
    invalid = sum(p is None for p in preds)
    m = res["metrics"]
    drafts = m.get("num_drafts", 0)
    report = {
        "name": cfg.name,
        "num_questions": len(rows),
        "accuracy": correct / max(1, len(rows)),
        "invalid_rate": invalid / max(1, len(rows)),
        "speculative": cfg.speculative,
        "mean_acceptance_length": (1 + m["num_accepted_tokens"] / drafts) if drafts else None,
        "per_position_acceptance": [a / drafts for a in m.get("accepted_per_pos", [])]
        if drafts
        else [],
        "num_drafts": drafts,
        "load_s": round(res.get("load_s", 0.0), 1),
        "generate_s": round(res.get("generate_s", 0.0), 1),
        "accuracy_min": cfg.accuracy_min,
        "accuracy_equals": cfg.accuracy_equals,
        "acceptance_length_min": cfg.acceptance_length_min,
    }
    report["failures"] = unmeasured(cfg) + check(report)
    report["passed"] = not report["failures"]
    return report


def needed_thresholds(cfg: EvalConfig) -> tuple[str, ...]:
    """The thresholds a gated config must set: ``accuracy_min`` without speculation;
    ``accuracy_equals`` (the no-spec accuracy, reproduced exactly) and ``acceptance_length_min``
    with it."""
    return ("accuracy_equals", "acceptance_length_min") if cfg.speculative else ("accuracy_min",)


def unmeasured(cfg: EvalConfig) -> list[str]:
    """A gated config (``ci: cpu`` or ``ci: gpu``) whose needed thresholds are still null fails,
    naming the file to fill: a new config is written before its numbers can be measured (e.g. a
    GPU pair on a machine without one), and a null must not gate as a pass. ``ci: manual``
    configs may leave thresholds null (recorded, not gated)."""
    if cfg.ci == "manual":
        return []
    null = [k for k in needed_thresholds(cfg) if getattr(cfg, k) is None]
    if not null:
        return []
    return [
        f"thresholds {', '.join(null)} are null (not measured yet): measure them with this "
        f"config and fill them in {cfg.path or cfg.name} (docs/results/gsm8k.md)"
    ]


def check(report: dict) -> list[str]:
    fails = []
    if report["accuracy_min"] is not None and report["accuracy"] < report["accuracy_min"]:
        fails.append(f"accuracy {report['accuracy']:.4f} < accuracy_min {report['accuracy_min']}")
    eq = report.get("accuracy_equals")
    if eq is not None and abs(report["accuracy"] - eq) > 1e-9:
        fails.append(
            f"accuracy {report['accuracy']:.4f} != accuracy_equals {eq} (greedy speculative "
            f"decoding "
            "must reproduce the non-speculative accuracy exactly)"
        )
    amin = report["acceptance_length_min"]
    if amin is not None:
        acc = report["mean_acceptance_length"]
        if acc is None:
            fails.append(
                f"no speculative decoding metrics (mean acceptance length n/a) but "
                f"acceptance_length_min {amin}"
            )
        elif acc < amin:
            fails.append(f"mean acceptance length {acc:.3f} < acceptance_length_min {amin}")
    return fails


def format_report(r: dict) -> str:
    acc_len = "n/a" if r["mean_acceptance_length"] is None else f"{r['mean_acceptance_length']:.3f}"
    per = ", ".join(f"{x:.3f}" for x in r["per_position_acceptance"]) or "n/a"
    lines = [
        f"GSM8K [{r['name']}]: {'PASS' if r['passed'] else 'FAIL'}",
        f"  accuracy {r['accuracy']:.4f} (min {r['accuracy_min']})   invalid "
        f"{r['invalid_rate']:.4f}   "
        f"questions {r['num_questions']}",
        f"  mean acceptance length {acc_len} (min {r['acceptance_length_min']})   draft steps "
        f"{r['num_drafts']}",
        f"  per-position acceptance [{per}]",
        f"  wall: load {r['load_s']} s, generate {r['generate_s']} s",
    ]
    lines += [f"  FAILED: {f}" for f in r["failures"]]
    return "\n".join(lines)


def evaluate(
    cfg: EvalConfig,
    server_url: str | None = None,
    limit: int | None = None,
    launchers_log_dir: str | None = None,
) -> dict:
    """Score one config: against ``server_url``, or over one ``vllm serve`` launcher per PP stage
    when ``launchers_log_dir`` is given (:func:`run_launchers`), else offline."""
    rows, shots = questions_for(cfg)
    if limit:
        rows = rows[:limit]
    prompts = [build_prompt(r["question"], shots) for r in rows]
    if server_url and launchers_log_dir:
        raise ValueError("give either a server URL or launchers, not both")
    if server_url:
        res = run_server(cfg, prompts, server_url)
    elif launchers_log_dir:
        res = run_launchers(cfg, prompts, log_dir=launchers_log_dir)
    else:
        res = run_offline(cfg, prompts)
    report = score(cfg, rows, res)
    report["completions"] = res["texts"]
    report["tokens"] = res.get("tokens")
    report["config"] = res.get("config")  # what vLLM resolved (async_scheduling, PP size, ...)
    return report


RESULTS_HEADER = (
    "| config | accuracy | invalid | mean acceptance length | per-position acceptance | generate "
    "s | pass |\n"
    "|---|---|---|---|---|---|---|\n"
)


def results_row(r: dict) -> str:
    acc_len = "-" if r["mean_acceptance_length"] is None else f"{r['mean_acceptance_length']:.3f}"
    per = " ".join(f"{x:.2f}" for x in r["per_position_acceptance"]) or "-"
    return (
        f"| {r['name']} | {r['accuracy']:.4f} | {r['invalid_rate']:.4f} | {acc_len} | {per} | "
        f"{r['generate_s']} | {'yes' if r['passed'] else 'NO'} |\n"
    )
