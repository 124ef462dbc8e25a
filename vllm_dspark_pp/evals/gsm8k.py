"""GSM8K-style accuracy + speculative-acceptance gate (issue 9).

A configuration (one YAML file, see tests/evals/gsm8k/configs/) names the data (a GSM8K JSONL
path, or ``builtin:tiny-heldout`` for the seeded held-out set of the tiny pair's corpus), the
prompting (few-shot count, max tokens), how to run the model (``llm``: keyword arguments of
``vllm.LLM``, run in a subprocess with a hard timeout; or an OpenAI-compatible server URL given at
run time, for ``vllm serve`` deployments such as PD) and the thresholds. A configuration passes
when accuracy >= ``accuracy_min`` and mean acceptance length >= ``acceptance_length_min`` (each
checked only when set). Acceptance comes from vLLM's spec-decode metrics: mean acceptance length =
1 + accepted draft tokens / draft steps (the bonus token included), per-position rate = accepted
at position i / draft steps.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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
    from vllm_dspark_pp.training import corpus

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


# ---------------------------------------------------------------- metrics


def spec_metrics_from_llm(llm) -> dict:
    out = {"num_drafts": 0, "num_accepted_tokens": 0, "accepted_per_pos": []}
    for m in llm.get_metrics():
        if m.name == "vllm:spec_decode_num_drafts":
            out["num_drafts"] += m.value
        elif m.name == "vllm:spec_decode_num_accepted_tokens":
            out["num_accepted_tokens"] += m.value
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            prev = out["accepted_per_pos"] or [0] * len(m.values)
            out["accepted_per_pos"] = [a + b for a, b in zip(prev, m.values, strict=False)]
    return out


def spec_metrics_from_prometheus(text: str) -> dict:
    out = {"num_drafts": 0.0, "num_accepted_tokens": 0.0, "accepted_per_pos": []}
    per_pos: dict[int, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        if name == "vllm:spec_decode_num_drafts_total":
            out["num_drafts"] += float(value)
        elif name == "vllm:spec_decode_num_accepted_tokens_total":
            out["num_accepted_tokens"] += float(value)
        elif name == "vllm:spec_decode_num_accepted_tokens_per_pos_total":
            m = re.search(r'position="(\d+)"', name_labels)
            if m:
                per_pos[int(m.group(1))] = per_pos.get(int(m.group(1)), 0.0) + float(value)
    if per_pos:
        out["accepted_per_pos"] = [per_pos.get(i, 0.0) for i in range(max(per_pos) + 1)]
    return out


def _delta(after: dict, before: dict) -> dict:
    n = max(len(after["accepted_per_pos"]), len(before["accepted_per_pos"]))
    pa = after["accepted_per_pos"] + [0] * (n - len(after["accepted_per_pos"]))
    pb = before["accepted_per_pos"] + [0] * (n - len(before["accepted_per_pos"]))
    return {"num_drafts": after["num_drafts"] - before["num_drafts"],
            "num_accepted_tokens": after["num_accepted_tokens"] - before["num_accepted_tokens"],
            "accepted_per_pos": [a - b for a, b in zip(pa, pb, strict=True)]}


# ---------------------------------------------------------------- runners


def _offline_worker(spec_path: str, out_path: str) -> int:
    """Subprocess body: generate with vllm.LLM and dump completions + metrics."""
    with open(spec_path) as f:
        spec = json.load(f)
    from vllm import LLM, SamplingParams

    t0 = time.time()
    llm = LLM(**spec["llm"], disable_log_stats=False)
    load_s = time.time() - t0
    sp = SamplingParams(temperature=0, max_tokens=spec["max_tokens"], stop=spec["stop"] or None)
    t0 = time.time()
    outs = llm.generate(spec["prompts"], sp, use_tqdm=True)
    gen_s = time.time() - t0
    res = {"texts": [o.outputs[0].text for o in outs], "tokens": [list(o.outputs[0].token_ids) for o in outs],
           "metrics": spec_metrics_from_llm(llm), "load_s": load_s, "generate_s": gen_s}
    with open(out_path, "w") as f:
        json.dump(res, f)
    return 0


def run_offline(cfg: EvalConfig, prompts: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as td:
        spec_path, out_path = os.path.join(td, "spec.json"), os.path.join(td, "out.json")
        with open(spec_path, "w") as f:
            json.dump({"llm": _resolve_llm_args(cfg.llm), "prompts": prompts, "max_tokens": cfg.max_tokens,
                       "stop": cfg.stop}, f)
        env = {**os.environ, **{k: str(v) for k, v in cfg.env.items()},
               "PYTHONPATH": REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
        cmd = [sys.executable, "-m", "vllm_dspark_pp.evals.gsm8k", "--_worker", spec_path, out_path]
        from vllm_dspark_pp.proc import run_with_timeout

        try:  # vLLM's log and progress bar pass through; the whole process group dies on timeout
            rc, _, _ = run_with_timeout(cmd, env=env, timeout=cfg.timeout_s)
        except subprocess.TimeoutExpired as e:
            raise RuntimeError(f"[{cfg.name}] vLLM run exceeded timeout_s={cfg.timeout_s} and was killed; raise "
                               f"it in {cfg.path or 'the config'} if the machine is only slow") from e
        if rc != 0:
            raise RuntimeError(f"[{cfg.name}] vLLM run failed (exit {rc}); its log is above")
        with open(out_path) as f:
            return json.load(f)


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
    before = spec_metrics_from_prometheus(get("/metrics"))

    def one(prompt):
        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": cfg.max_tokens, "temperature": 0,
                           "stop": cfg.stop or None}).encode()
        req = urllib.request.Request(base + "/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=cfg.timeout_s) as r:
            return json.loads(r.read())["choices"][0]["text"]

    t0 = time.time()
    with ThreadPoolExecutor(concurrency) as ex:
        texts = list(tqdm(ex.map(one, prompts), total=len(prompts), desc=f"gsm8k {cfg.name}"))
    gen_s = time.time() - t0
    after = spec_metrics_from_prometheus(get("/metrics"))
    return {"texts": texts, "tokens": None, "metrics": _delta(after, before), "load_s": 0.0, "generate_s": gen_s}


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
        "per_position_acceptance": [a / drafts for a in m.get("accepted_per_pos", [])] if drafts else [],
        "num_drafts": drafts,
        "load_s": round(res.get("load_s", 0.0), 1),
        "generate_s": round(res.get("generate_s", 0.0), 1),
        "accuracy_min": cfg.accuracy_min,
        "accuracy_equals": cfg.accuracy_equals,
        "acceptance_length_min": cfg.acceptance_length_min,
    }
    report["failures"] = check(report)
    report["passed"] = not report["failures"]
    return report


def check(report: dict) -> list[str]:
    fails = []
    if report["accuracy_min"] is not None and report["accuracy"] < report["accuracy_min"]:
        fails.append(f"accuracy {report['accuracy']:.4f} < accuracy_min {report['accuracy_min']}")
    eq = report.get("accuracy_equals")
    if eq is not None and abs(report["accuracy"] - eq) > 1e-9:
        fails.append(f"accuracy {report['accuracy']:.4f} != accuracy_equals {eq} (greedy speculative decoding "
                     "must reproduce the non-speculative accuracy exactly)")
    amin = report["acceptance_length_min"]
    if amin is not None:
        acc = report["mean_acceptance_length"]
        if acc is None:
            fails.append(f"no speculative decoding metrics (mean acceptance length n/a) but acceptance_length_min {amin}")
        elif acc < amin:
            fails.append(f"mean acceptance length {acc:.3f} < acceptance_length_min {amin}")
    return fails


def format_report(r: dict) -> str:
    acc_len = "n/a" if r["mean_acceptance_length"] is None else f"{r['mean_acceptance_length']:.3f}"
    per = ", ".join(f"{x:.3f}" for x in r["per_position_acceptance"]) or "n/a"
    lines = [
        f"GSM8K [{r['name']}]: {'PASS' if r['passed'] else 'FAIL'}",
        f"  accuracy {r['accuracy']:.4f} (min {r['accuracy_min']})   invalid {r['invalid_rate']:.4f}   "
        f"questions {r['num_questions']}",
        f"  mean acceptance length {acc_len} (min {r['acceptance_length_min']})   draft steps {r['num_drafts']}",
        f"  per-position acceptance [{per}]",
        f"  wall: load {r['load_s']} s, generate {r['generate_s']} s",
    ]
    lines += [f"  FAILED: {f}" for f in r["failures"]]
    return "\n".join(lines)


def evaluate(cfg: EvalConfig, server_url: str | None = None, limit: int | None = None) -> dict:
    rows, shots = questions_for(cfg)
    if limit:
        rows = rows[:limit]
    prompts = [build_prompt(r["question"], shots) for r in rows]
    res = run_server(cfg, prompts, server_url) if server_url else run_offline(cfg, prompts)
    report = score(cfg, rows, res)
    report["completions"] = res["texts"]
    report["tokens"] = res.get("tokens")
    return report


RESULTS_HEADER = (
    "| config | accuracy | invalid | mean acceptance length | per-position acceptance | generate s | pass |\n"
    "|---|---|---|---|---|---|---|\n"
)


def results_row(r: dict) -> str:
    acc_len = "-" if r["mean_acceptance_length"] is None else f"{r['mean_acceptance_length']:.3f}"
    per = " ".join(f"{x:.2f}" for x in r["per_position_acceptance"]) or "-"
    return (f"| {r['name']} | {r['accuracy']:.4f} | {r['invalid_rate']:.4f} | {acc_len} | {per} | "
            f"{r['generate_s']} | {'yes' if r['passed'] else 'NO'} |\n")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--_worker":
        sys.exit(_offline_worker(sys.argv[2], sys.argv[3]))
    raise SystemExit("use `vllm-dspark-pp eval gsm8k`")
