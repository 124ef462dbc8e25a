"""Child process of gpu_harness.run_llm: one vLLM engine on CUDA, waves of prompts, JSON out.

Usage (by the harness only): python _gpu_llm_worker.py SPEC.json RESULT.json

The result file is rewritten at every phase change (import, startup, probe, wave N, shutdown) so a
killed child still says where it stopped.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback


def _probe_worker(worker=None) -> dict:
    """Runs inside the vLLM worker (collective_rpc): is the plugin loaded and applied here?"""
    import importlib.metadata as md

    import torch

    info: dict = {"pid": os.getpid(), "loaded": "vllm_dspark_pp" in sys.modules}
    try:
        eps = md.entry_points(group="vllm.general_plugins")
        info["entry_points"] = sorted(f"{e.name}={e.value}" for e in eps)
    except Exception as e:  # noqa: BLE001
        info["entry_points"] = [f"error: {e}"]
    if info["loaded"]:
        import vllm_dspark_pp
        from vllm_dspark_pp.patches import applied_patches, registry

        info["file"] = vllm_dspark_pp.__file__
        info["applied"] = applied_patches()
        info["registered"] = [p.name for p in registry()]
    info["device"] = (
        torch.cuda.get_device_name(torch.cuda.current_device()) if torch.cuda.is_available() else "no cuda"
    )
    return info


def _spec_metrics(llm) -> dict:
    names = {
        "vllm:spec_decode_num_drafts": "num_drafts",
        "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
        "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
    }
    out = {v: 0 for v in names.values()}
    per_pos: list[int] = []
    for m in llm.get_metrics():
        if m.name in names:
            out[names[m.name]] += int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            vals = [int(v) for v in m.values]
            per_pos = [a + b for a, b in zip(per_pos, vals, strict=False)] if per_pos else vals
    out["accepted_per_pos"] = per_pos
    return out


def _delta(a: dict, b: dict) -> dict:
    d = {k: b[k] - a.get(k, 0) for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    pa, pb = a.get("accepted_per_pos") or [], b.get("accepted_per_pos") or []
    pa = pa + [0] * (len(pb) - len(pa))
    d["accepted_per_pos"] = [y - x for x, y in zip(pa, pb, strict=False)]
    return d


def main(spec_path: str, result_path: str) -> int:
    spec = json.loads(open(spec_path).read())
    result: dict = {"ok": False, "phase": "import", "name": spec.get("name")}
    t0 = time.monotonic()

    def dump() -> None:
        result["wall_s"] = round(time.monotonic() - t0, 2)
        tmp = result_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f)
        os.replace(tmp, result_path)

    dump()
    try:
        from vllm import LLM, SamplingParams

        result["phase"] = "startup"
        dump()
        llm = LLM(**spec["llm"])
        vc = llm.llm_engine.vllm_config
        cc = vc.compilation_config
        sc = vc.speculative_config
        result["config"] = {
            "enforce_eager": bool(vc.model_config.enforce_eager),
            "cudagraph_mode": getattr(cc.cudagraph_mode, "name", str(cc.cudagraph_mode)),
            "decode_cudagraph_capture_request_sizes": list(
                getattr(cc, "decode_cudagraph_capture_request_sizes", None) or []
            ),
            "cudagraph_capture_sizes": list(cc.cudagraph_capture_sizes or []),
            "async_scheduling": bool(vc.scheduler_config.async_scheduling),
            "dtype": str(vc.model_config.dtype),
            "spec_method": sc.method if sc else None,
            "num_speculative_tokens": sc.num_speculative_tokens if sc else 0,
            "additional_config": vc.additional_config if isinstance(vc.additional_config, dict) else {},
        }
        result["startup_s"] = round(time.monotonic() - t0, 2)
        if spec.get("probe"):
            result["phase"] = "probe"
            dump()
            result["probe"] = llm.collective_rpc(_probe_worker, timeout=60)
        sp = dict(temperature=0.0, max_tokens=48, ignore_eos=True)
        sp.update(spec.get("sampling") or {})
        if spec.get("logprobs"):
            sp["logprobs"] = int(spec["logprobs"])
        params = SamplingParams(**sp)
        engine = llm.llm_engine
        waves_out = []
        before = _spec_metrics(llm)
        for wi, wave in enumerate(spec["waves"]):
            result["phase"] = f"wave {wi} ({len(wave)} requests)"
            dump()
            ids = []
            for i, p in enumerate(wave):
                rid = f"w{wi}-r{i}"
                engine.add_request(rid, {"prompt_token_ids": p}, params)
                ids.append(rid)
            toks: dict[str, list[int]] = {}
            lps: dict[str, list] = {}
            while engine.has_unfinished_requests():
                for out in engine.step():
                    comp = out.outputs[0] if out.outputs else None
                    if comp is None:
                        continue
                    toks[out.request_id] = list(comp.token_ids)
                    if comp.logprobs is not None:
                        lps[out.request_id] = [
                            {str(t): float(v.logprob) for t, v in pos.items()} for pos in comp.logprobs
                        ]
            after = _spec_metrics(llm)
            waves_out.append(
                {
                    "tokens": [toks.get(r, []) for r in ids],
                    "logprobs": [lps.get(r) for r in ids] if spec.get("logprobs") else None,
                    "metrics": _delta(before, after),
                }
            )
            before = after
        result["waves"] = waves_out
        result["ok"] = True
        result["phase"] = "shutdown"
        dump()
        import threading

        t = threading.Thread(target=llm.llm_engine.engine_core.shutdown, daemon=True)
        t.start()
        t.join(15)
        return 0
    except BaseException as e:  # noqa: BLE001 - everything goes to the parent
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()
        dump()
        return 1


if __name__ == "__main__":
    rc = main(sys.argv[1], sys.argv[2])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
