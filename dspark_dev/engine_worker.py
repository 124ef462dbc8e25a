"""Child process of :func:`dspark_dev.engine.run_engine`: one ``vllm.LLM``, JSON out.

Usage (by the runner only): ``python -m dspark_dev.engine_worker SPEC.json RESULT.json``

The spec: ``llm`` (``vllm.LLM`` keyword arguments), ``waves`` (lists of prompts: text or token
ids; each wave is submitted together and drained before the next, so the decode batch sizes are
the wave sizes), ``sampling`` (``SamplingParams`` keyword arguments; greedy, ``ignore_eos``),
``abort`` (optional ``{"wave": w, "index": i, "after_tokens": n}``: abort that request once it has
``n`` tokens), ``probe`` (ask every worker whether the plugin is loaded and applied) and
``async_scheduling`` (force async scheduling back on after the CPU platform turns it off).
Requests go through ``LLM.llm_engine`` step by step; each wave's result also has
``step_lengths``: per request, its token count after every engine step that gave it tokens (the
first entry is the prefill's one token; with speculative decoding a step that adds ``m`` tokens
accepted ``m - 1`` draft tokens). The result file is rewritten at every phase
change (import, startup, probe, wave N, shutdown), so a killed child still says where it stopped.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback


def force_async_scheduling() -> None:
    """Turn async scheduling back on right after vLLM's CPU platform hook turns it off.

    ``CpuPlatform.check_and_update_config`` (vllm/platforms/cpu.py:345-347) sets
    ``scheduler_config.async_scheduling = False`` unconditionally and is the last word in
    ``VllmConfig.__post_init__`` (vllm/config/vllm.py:1979); the config built here is pickled to
    the engine core and the workers, so flipping it after the hook mirrors the GPU default. The
    mp executor supports async scheduling (the checks at vllm/config/vllm.py:1591-1606 ran before
    the hook with async_scheduling unset). The result's ``config.async_scheduling`` records the
    mode vLLM actually used.
    """
    from vllm.platforms.cpu import CpuPlatform

    orig = CpuPlatform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config):
        orig(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = True

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)


def probe_worker(worker=None) -> dict:
    """Runs inside a vLLM worker (``collective_rpc``): is the plugin loaded and applied here?"""
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
    cuda = torch.cuda.is_available()
    info["device"] = torch.cuda.get_device_name(torch.cuda.current_device()) if cuda else "no cuda"
    return info


def _config_summary(llm) -> dict:
    vc = llm.llm_engine.vllm_config
    cc = vc.compilation_config
    sc = vc.speculative_config
    return {
        "async_scheduling": bool(vc.scheduler_config.async_scheduling),
        "pipeline_parallel_size": vc.parallel_config.pipeline_parallel_size,
        "tensor_parallel_size": vc.parallel_config.tensor_parallel_size,
        "chunked_prefill": bool(vc.scheduler_config.enable_chunked_prefill),
        "enforce_eager": bool(vc.model_config.enforce_eager),
        "cudagraph_mode": getattr(cc.cudagraph_mode, "name", str(cc.cudagraph_mode)),
        "decode_cudagraph_capture_request_sizes": list(
            getattr(cc, "decode_cudagraph_capture_request_sizes", None) or []
        ),
        "cudagraph_capture_sizes": list(cc.cudagraph_capture_sizes or []),
        "dtype": str(vc.model_config.dtype),
        "spec_method": sc.method if sc else None,
        "num_speculative_tokens": sc.num_speculative_tokens if sc else 0,
        "additional_config": vc.additional_config if isinstance(vc.additional_config, dict) else {},
    }


def wave_params(base: dict, override, n: int) -> list[dict]:
    """The ``SamplingParams`` keyword arguments of each of a wave's ``n`` requests (see
    ``wave_sampling`` in the module docstring)."""
    if override is None:
        return [base] * n
    if isinstance(override, dict):
        return [{**base, **override}] * n
    if len(override) != n:
        raise ValueError(f"wave_sampling has {len(override)} entries for a wave of {n} requests")
    return [{**base, **o} for o in override]


def _run_wave(engine, wi: int, wave: list, params: list, abort: dict | None) -> dict:
    ids = []
    for i, (p, sp) in enumerate(zip(wave, params, strict=True)):
        rid = f"w{wi}-r{i}"
        engine.add_request(rid, {"prompt_token_ids": p} if isinstance(p, list) else p, sp)
        ids.append(rid)
    tokens: dict[str, list[int]] = {}
    step_lengths: dict[str, list[int]] = {r: [] for r in ids}
    texts: dict[str, str] = {}
    logprobs: dict[str, list] = {}
    finished: dict[str, str | None] = {}
    abort_id = ids[abort["index"]] if abort else None
    aborted = False
    steps = 0
    while engine.has_unfinished_requests():
        steps += 1
        for out in engine.step():
            comp = out.outputs[0] if out.outputs else None
            if comp is not None:
                tokens[out.request_id] = list(comp.token_ids)
                lengths = step_lengths[out.request_id]
                if not lengths or lengths[-1] != len(comp.token_ids):
                    lengths.append(len(comp.token_ids))
                texts[out.request_id] = comp.text
                if comp.logprobs is not None:
                    logprobs[out.request_id] = [
                        {str(t): float(v.logprob) for t, v in pos.items()} for pos in comp.logprobs
                    ]
            if out.finished:
                finished[out.request_id] = comp.finish_reason if comp is not None else None
        if abort_id and not aborted and len(tokens.get(abort_id, [])) >= abort["after_tokens"]:
            engine.abort_request([abort_id])
            aborted = True
            finished.setdefault(abort_id, "abort")
    return {
        "tokens": [tokens.get(r, []) for r in ids],
        "texts": [texts.get(r, "") for r in ids],
        "logprobs": [logprobs.get(r) for r in ids] if logprobs else None,
        "finish_reasons": [finished.get(r) for r in ids],
        "step_lengths": [step_lengths[r] for r in ids],
        "steps": steps,
        "aborted": aborted,
    }


def main(spec_path: str, result_path: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    result: dict = {"ok": False, "phase": "import", "name": spec.get("name")}
    t0 = time.monotonic()
    # before vLLM is imported: a hang while importing it can be located too
    from vllm_dspark_pp.stack_dumps import install_if_requested

    install_if_requested()

    def dump() -> None:
        result["wall_s"] = round(time.monotonic() - t0, 2)
        tmp = result_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f)
        os.replace(tmp, result_path)

    dump()
    try:
        if spec.get("async_scheduling"):
            force_async_scheduling()
        from vllm import LLM, SamplingParams

        from dspark_dev.metrics import counter_delta, spec_metrics_from_llm

        result["phase"] = "startup"
        dump()
        llm = LLM(**{"disable_log_stats": False, **spec["llm"]})
        result["config"] = _config_summary(llm)
        result["startup_s"] = round(time.monotonic() - t0, 2)
        if spec.get("probe"):
            result["phase"] = "probe"
            dump()
            result["probe"] = llm.collective_rpc(probe_worker, timeout=60)
        base = {"temperature": 0.0, "ignore_eos": True, **spec["sampling"]}
        per_wave = spec.get("wave_sampling") or [None] * len(spec["waves"])
        abort = spec.get("abort") or None
        waves = []
        before = spec_metrics_from_llm(llm)
        for wi, wave in enumerate(spec["waves"]):
            result["phase"] = f"wave {wi} ({len(wave)} requests)"
            dump()
            w_abort = abort if abort and abort.get("wave", 0) == wi else None
            params = [SamplingParams(**kw) for kw in wave_params(base, per_wave[wi], len(wave))]
            t_wave = time.monotonic()
            out = _run_wave(llm.llm_engine, wi, wave, params, w_abort)
            out["wall_s"] = round(time.monotonic() - t_wave, 2)
            after = spec_metrics_from_llm(llm)
            out["metrics"] = counter_delta(before, after)
            before = after
            waves.append(out)
        result["waves"] = waves
        result["generate_s"] = round(time.monotonic() - t0 - result["startup_s"], 2)
        result["ok"] = True
        result["phase"] = "shutdown"
        dump()
        # Never wait long on a half-shut engine: the runner kills the group anyway.
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
    os._exit(rc)  # skip interpreter teardown (atexit hooks of a half-shut engine can block)
