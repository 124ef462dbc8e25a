"""Child process of tests/e2e/harness.py: runs one vLLM generation case and writes JSON results.

Usage: python _worker.py SPEC.json RESULT.json  (started by harness.run_generate, never by hand).

The spec is the harness's ``cfg`` (keyword arguments for ``vllm.LLM``) plus prompts, sampling
parameters and options. Requests are driven through ``LLM.llm_engine`` step by step so a request
can be aborted mid-stream; outputs are cumulative token ids per request.
"""

from __future__ import annotations

import json
import sys
import time
import traceback


def _force_async_scheduling() -> None:
    """Turn async scheduling back on right after vLLM's CPU platform hook turns it off.

    ``CpuPlatform.check_and_update_config`` (vllm/platforms/cpu.py:345-347) sets
    ``scheduler_config.async_scheduling = False`` unconditionally. It is the last word in
    ``VllmConfig.__post_init__`` (vllm/config/vllm.py:1979), and the config built here is pickled
    to the engine core and the workers, so flipping it after the hook mirrors the GPU default.
    The mp executor supports async scheduling (the checks at vllm/config/vllm.py:1591-1606 ran
    before the hook with async_scheduling unset, so nothing else was decided on it).
    """
    from vllm.platforms.cpu import CpuPlatform

    orig = CpuPlatform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config):
        orig(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = True

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)


def _metrics(llm) -> dict:
    wanted = {
        "vllm:spec_decode_num_drafts": "num_drafts",
        "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
        "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
    }
    out: dict = {v: 0 for v in wanted.values()}
    per_pos: list[int] = []
    for m in llm.get_metrics():
        if m.name in wanted:
            out[wanted[m.name]] += int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            vals = [int(v) for v in m.values]
            per_pos = [a + b for a, b in zip(per_pos, vals, strict=True)] if per_pos else vals
    out["accepted_per_pos"] = per_pos
    return out


def _shutdown(llm, timeout_s: float = 15.0) -> None:
    """Shut the engine down, but never wait on it for long (the harness kills the group anyway)."""
    import threading

    t = threading.Thread(target=llm.llm_engine.engine_core.shutdown, daemon=True)
    t.start()
    t.join(timeout_s)


def main(spec_path: str, result_path: str) -> int:
    spec = json.loads(open(spec_path).read())
    result: dict = {"ok": False, "phase": "import"}
    t0 = time.monotonic()

    def dump() -> None:
        result["wall_s"] = round(time.monotonic() - t0, 2)
        with open(result_path, "w") as f:
            json.dump(result, f)

    try:
        if spec.get("async_scheduling"):
            _force_async_scheduling()
        from vllm import LLM, SamplingParams

        result["phase"] = "startup"
        dump()
        llm_kwargs = dict(spec["llm"])
        llm_kwargs.setdefault("disable_log_stats", False)
        llm = LLM(**llm_kwargs)
        cfg = llm.llm_engine.vllm_config
        result["config"] = {
            "async_scheduling": bool(cfg.scheduler_config.async_scheduling),
            "pipeline_parallel_size": cfg.parallel_config.pipeline_parallel_size,
            "chunked_prefill": bool(cfg.scheduler_config.enable_chunked_prefill),
            "spec_method": cfg.speculative_config.method if cfg.speculative_config else None,
            "num_speculative_tokens": (
                cfg.speculative_config.num_speculative_tokens if cfg.speculative_config else 0
            ),
        }
        result["startup_s"] = round(time.monotonic() - t0, 2)
        result["phase"] = "generate"
        dump()

        sp_kwargs = dict(temperature=0.0, max_tokens=32, ignore_eos=True)
        sp_kwargs.update(spec.get("sampling") or {})
        params = SamplingParams(**sp_kwargs)
        engine = llm.llm_engine
        abort = spec.get("abort") or {}  # {"index": i, "after_tokens": n}
        ids: list[str] = []
        for i, p in enumerate(spec["prompts"]):
            prompt = {"prompt_token_ids": p} if isinstance(p, list) else p
            engine.add_request(f"req-{i}", prompt, params)
            ids.append(f"req-{i}")
        tokens: dict[str, list[int]] = {}
        logprobs: dict[str, list] = {}
        finished: dict[str, str | None] = {}
        abort_id = ids[abort["index"]] if abort else None
        aborted = False
        steps = 0
        while engine.has_unfinished_requests():
            steps += 1
            for out in engine.step():
                rid = out.request_id
                comp = out.outputs[0] if out.outputs else None
                if comp is not None:
                    tokens[rid] = list(comp.token_ids)
                    if comp.logprobs is not None:
                        logprobs[rid] = [
                            {str(k): float(v.logprob) for k, v in pos.items()} for pos in comp.logprobs
                        ]
                if out.finished:
                    finished[rid] = comp.finish_reason if comp is not None else None
            if (
                abort_id is not None
                and not aborted
                and len(tokens.get(abort_id, [])) >= abort["after_tokens"]
            ):
                engine.abort_request([abort_id])
                aborted = True
                finished.setdefault(abort_id, "abort")
        result["tokens"] = [tokens.get(r, []) for r in ids]
        result["logprobs"] = [logprobs.get(r) for r in ids]
        result["finish_reasons"] = [finished.get(r) for r in ids]
        result["steps"] = steps
        result["aborted"] = aborted
        result["metrics"] = _metrics(llm)
        result["phase"] = "shutdown"
        result["ok"] = True
        result["generate_s"] = round(time.monotonic() - t0 - result["startup_s"], 2)
        dump()
        _shutdown(llm)
        return 0
    except BaseException as e:  # noqa: BLE001 - report everything to the parent
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()
        dump()
        return 1


if __name__ == "__main__":
    import os

    rc = main(sys.argv[1], sys.argv[2])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)  # skip interpreter teardown (atexit hooks of a half-shut engine can block)
