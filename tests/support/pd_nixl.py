"""DSpark prefill/decode over NixlConnector on one GPU (issue 18): servers, passes, evidence.

One call of :func:`run_nixl_pd` per model pair starts, all at once, a DSpark **decoder**
(``kv_consumer``, prefix caching off) and the prefillers the cases need, then runs, in order:

1. ``aggregated``: the prompts straight to the decoder (no remote prefill): the aggregated DSpark
   reference, same process, same kernels, same KV layout as the PD pass;
2. ``pd``: prefill on the DSpark **prefill-only producer** (``kv_producer``, same
   ``--speculative-config``: the plugin builds the context-KV-only drafter), decode on the decoder,
   through dspark_dev/pd_proxy.py (its NIXL-compatible keys: the prefiller's returned
   ``kv_transfer_params`` go to the decoder);
3. ``control`` (optional): the same through a second decoder that accepts any NIXL hash
   (``enforce_handshake_compat: false``) from a producer whose draft has corrupted context
   weights (fc / k_proj / v_proj / norms), so the decoder receives wrong draft context KV;
4. ``decoder_only`` (optional): DSpark on the decoder only (prefiller without speculation):
   vLLM issue #48221; the request must fail and the decoder's log says why (the first decoder
   keeps vLLM's compatibility-hash check; the control decoder, without it, reaches the layer
   check). The exact lines are kept.

Every server has a hard deadline and is killed with its process group; the logs of all servers
go into one artifact file. NIXL/UCX environment: ``VLLM_NIXL_SIDE_CHANNEL_HOST=127.0.0.1``, a
side-channel port per server, ``UCX_TLS`` (``DSPARK_NIXL_UCX_TLS``, default
``cuda_ipc,cuda_copy,tcp``: same-GPU peers over CUDA IPC, control over TCP) and
``UCX_NET_DEVICES`` (``DSPARK_NIXL_UCX_NET_DEVICES``, default ``lo``: loopback only; empty =
unset).

``PYTHONPATH=tests python -m support.pd_nixl --summary RESULT.json`` prints the summary table of a
run.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from dspark_dev.metrics import counter_delta, parse_prometheus
from dspark_dev.metrics import spec_metrics_from_prometheus as spec_counters
from dspark_dev.pd_launch import (  # noqa: F401 - re-exported
    PREFILL_MARKERS,  # what a prefill-only producer logs
    nixl_env,
    nixl_kv_config,
    ucx_env,
)
from dspark_dev.pd_proxy import PDProxy
from dspark_dev.serve import (
    Server,
    greedy_completion_body,
    http_json,
    http_text,
)

#: What the decoder logs when our patch paired the peer's layers (draft layers included).
PAIRED = re.compile(r"NIXL KV layers match engine (\S+): (\d+) target \+ (\d+) draft layers")
#: Decoder/prefiller log lines that explain a NIXL failure.
FAILURE_LINES = re.compile(
    r"(NIXL transfer failure|compatibility hash mismatch|First difference at position|"
    r"does not hold the KV layers|KV layers must match|UCX\s+ERROR|NIXL_ERR|nixl.*(?:error|Error)|"
    r"RuntimeError: |AssertionError: |NotImplementedError: )"
)
CORRUPT_KEYS = ("fc.", "hidden_norm.", "k_proj.", "v_proj.", "k_norm.")


def nixl_server(
    name: str,
    model: str,
    common_args: list[str],
    spec: dict | None,
    kv: dict,
    extra_args: list[str] = (),
) -> Server:
    """A ``vllm serve`` with a NIXL connector, its own side-channel port and UCX settings."""
    args = [*common_args]
    if spec:
        args += ["--speculative-config", json.dumps(spec)]
    args += ["--kv-transfer-config", json.dumps(kv), *extra_args]
    return Server.vllm(name, model, args, env=nixl_env())


def corrupt_draft(draft_dir: str, out_dir: str, seed: int = 7) -> str:
    """A copy of ``draft_dir`` whose context weights (what a prefill-only producer uses to write
    the draft's context KV) are replaced by seeded noise of the same mean and spread."""
    import torch
    from safetensors.torch import load_file, save_file

    out = Path(out_dir) / "corrupted-draft"
    shutil.copytree(draft_dir, out, dirs_exist_ok=True)
    weights = load_file(str(out / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    changed = []
    for key, t in weights.items():
        if any(k in key for k in CORRUPT_KEYS):
            f = t.float()
            noise = torch.randn(f.shape, generator=g) * (f.std() if f.numel() > 1 else 1.0)
            weights[key] = (noise + f.mean()).to(t.dtype).contiguous()
            changed.append(key)
    if not changed:
        raise AssertionError(f"no context weights found to corrupt in {draft_dir}")
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return str(out)


def _metrics(server: Server) -> dict[str, float]:
    return parse_prometheus(http_text(server.url + "/metrics"))


def _kv_view(m: dict[str, float]) -> dict[str, float]:
    keep = (
        "vllm:external_prefix_cache_hits_total",
        "vllm:external_prefix_cache_queries_total",
        "vllm:prompt_tokens_total",
    )
    out = {k: m.get(k, 0.0) for k in keep}
    out.update({k: v for k, v in m.items() if "nixl" in k.lower() and "{" not in k})
    return out


def _complete(
    url: str, model: str, ids: list[int], max_tokens: int, ignore_eos: bool, timeout: float
) -> dict:
    body = greedy_completion_body(model, ids, max_tokens, ignore_eos)
    try:
        out = http_json(url + "/v1/completions", body, timeout=timeout)
    except Exception as e:  # noqa: BLE001 - a failed request is a result here
        detail = getattr(e, "read", lambda: b"")()
        return {"error": f"{type(e).__name__}: {e} {detail[:600]!r}"}
    choice = out["choices"][0]
    if choice.get("token_ids") is None:
        return {"error": f"no token_ids in answer: {str(out)[:400]}"}
    return {"tokens": list(choice["token_ids"]), "finish_reason": choice.get("finish_reason")}


def _pass(target_url: str, model: str, prompts, max_tokens, ignore_eos, timeout, server: Server):
    """Send the prompts concurrently to ``target_url``; spec/KV counter deltas of ``server``."""
    before = _metrics(server)
    with ThreadPoolExecutor(max_workers=max(1, len(prompts))) as ex:
        answers = list(
            ex.map(
                lambda ids: _complete(target_url, model, ids, max_tokens, ignore_eos, timeout),
                prompts,
            )
        )
    time.sleep(1.5)  # counters are published with the next stats interval
    after = _metrics(server)
    kv_b, kv_a = _kv_view(before), _kv_view(after)
    return {
        "tokens": [a.get("tokens") for a in answers],
        "errors": [a["error"] for a in answers if "error" in a],
        "finish_reasons": [a.get("finish_reason") for a in answers],
        "spec": counter_delta(spec_counters(before), spec_counters(after)),
        "kv": {k: v - kv_b.get(k, 0.0) for k, v in kv_a.items()},
    }


def failure_lines(text: str, limit: int = 40) -> list[str]:
    out = []
    for line in text.splitlines():
        if FAILURE_LINES.search(line):
            out.append(line.strip()[:1500])
    return out[-limit:]


def run_nixl_pd(
    label: str,
    model: str,
    spec: dict,
    prompts: list[list[int]],
    *,
    common_args: list[str],
    deadline: float,
    max_tokens: int,
    ignore_eos: bool,
    control_draft: str | None = None,
    decoder_only_case: bool = False,
    request_timeout_s: float = 45.0,
    logs: dict[str, str] | None = None,
) -> dict:
    """Run the cases of one model pair (see the module docstring); never raises for a failed
    case: the result says what failed and where. ``logs`` receives every server's log text."""
    ids = {k: f"dspark-nixl-{label}-{k}-{uuid.uuid4().hex[:6]}" for k in ("ctx", "plain", "bad")}
    dec_args = ["--no-enable-prefix-caching"]
    servers: dict[str, Server] = {
        "decoder": nixl_server(
            f"{label}-decoder", model, common_args, spec, nixl_kv_config("kv_consumer"), dec_args
        ),
        "producer": nixl_server(
            f"{label}-producer", model, common_args, spec, nixl_kv_config("kv_producer", ids["ctx"])
        ),
    }
    if decoder_only_case:
        servers["plain_producer"] = nixl_server(
            f"{label}-plain-producer",
            model,
            common_args,
            None,
            nixl_kv_config("kv_producer", ids["plain"]),
        )
    if control_draft or decoder_only_case:
        servers["lax_decoder"] = nixl_server(
            f"{label}-lax-decoder",
            model,
            common_args,
            spec,
            nixl_kv_config("kv_consumer", enforce_compat=False),
            dec_args,
        )
    if control_draft:
        servers["bad_producer"] = nixl_server(
            f"{label}-bad-producer",
            model,
            common_args,
            {**spec, "model": control_draft},
            nixl_kv_config("kv_producer", ids["bad"]),
        )
    res: dict = {
        "label": label,
        "model": model,
        "spec": spec,
        "ucx_env": ucx_env(),
        "engine_ids": ids,
        "step": "start",
        "t": {},
    }
    t0 = time.monotonic()
    try:
        for s in servers.values():
            s.start()
        res["step"] = "wait for /health"
        with ThreadPoolExecutor(max_workers=len(servers)) as ex:
            list(ex.map(lambda s: s.wait_ready(deadline - time.monotonic()), servers.values()))
        res["t"]["ready_s"] = round(time.monotonic() - t0, 1)
        print(
            f"[nixl {label}] {len(servers)} servers ready after {res['t']['ready_s']} s", flush=True
        )
        dec = servers["decoder"]

        def proxy(pre: str, decoder: str, eid: str) -> PDProxy:
            # NIXL needs no bootstrap: the prefiller's kv_transfer_params name its side channel.
            return PDProxy(
                servers[pre].url,
                servers[decoder].url,
                "nixl:no-bootstrap",
                eid,
                timeout_s=request_timeout_s,
            )

        res["step"] = "aggregated pass (decoder, no remote prefill)"
        res["aggregated"] = _pass(
            dec.url, model, prompts, max_tokens, ignore_eos, 2 * request_timeout_s, dec
        )
        res["step"] = "PD pass (prefill-only producer -> decoder)"
        p_before = _metrics(servers["producer"])
        with proxy("producer", "decoder", ids["ctx"]) as px:
            res["pd"] = _pass(
                px.url, model, prompts, max_tokens, ignore_eos, 2 * request_timeout_s + 10, dec
            )
            res["pd"]["proxy"] = dict(px.stats)
        res["pd"]["producer_spec"] = counter_delta(
            spec_counters(p_before), spec_counters(_metrics(servers["producer"]))
        )
        if control_draft:
            res["step"] = "control pass (corrupted-draft producer -> lax decoder)"
            with proxy("bad_producer", "lax_decoder", ids["bad"]) as px:
                res["control"] = _pass(
                    px.url,
                    model,
                    prompts,
                    max_tokens,
                    ignore_eos,
                    2 * request_timeout_s + 10,
                    servers["lax_decoder"],
                )
        if decoder_only_case:
            res["step"] = "decoder-only DSpark (plain producer -> decoders)"
            res["decoder_only"] = {}
            for decoder in ("decoder", "lax_decoder"):
                with proxy("plain_producer", decoder, ids["plain"]) as px:
                    out = _complete(px.url, model, prompts[0], 8, True, request_timeout_s + 10)
                time.sleep(1.0)
                res["decoder_only"][decoder] = {
                    "answer": out,
                    "log_lines": failure_lines(servers[decoder].log_text()),
                }
        res["step"] = "done"
    except Exception as e:  # noqa: BLE001 - reported, the tests decide
        res["error"] = f"{type(e).__name__}: {e}"[:4000]
    finally:
        res["t"]["total_s"] = round(time.monotonic() - t0, 1)
        for name, s in servers.items():
            s.stop()
            text = s.log_text()
            res.setdefault("logs", {})[name] = {
                "prefill_markers": {m: m in text for m in PREFILL_MARKERS},
                "paired": [m.groups() for m in PAIRED.finditer(text)],
                "failure_lines": failure_lines(text),
            }
            if logs is not None:
                logs[f"{label}/{name}"] = text
        print(
            f"[nixl {label}] finished at step {res['step']!r} after {res['t']['total_s']} s"
            + (f": {res['error'][:300]}" if "error" in res else ""),
            flush=True,
        )
    return res


def write_artifacts(
    out_dir: str | None, results: dict, logs: dict[str, str], per_log: int = 400_000
) -> None:
    """One JSON and one combined server log (the GPU machine returns at most 8 files)."""
    if not out_dir:
        return
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    (d / "nixl_result.json").write_text(json.dumps(results, indent=1, default=str))
    with open(d / "nixl_servers.log", "w") as f:
        for name, text in logs.items():
            f.write(f"\n===== {name} (last {per_log} chars) =====\n{text[-per_log:]}\n")


def summary(results: dict) -> str:
    """The table printed last: one row per pair and pass."""
    from dspark_dev.parity import acceptance_rate

    rows = [
        f"{'pair':<8} {'pass':<14} {'ok':<4} {'accept%':>8} {'drafts':>7} {'ext hits':>9}  note"
    ]
    for label, r in results.items():
        if not isinstance(r, dict):
            continue
        if "error" in r:
            first = r["error"].splitlines()[0][:120]
            cause = [ln for log in r.get("logs", {}).values() for ln in log["failure_lines"]]
            rows.append(
                f"{label:<8} {'(run)':<14} {'NO':<4} {'':>8} {'':>7} {'':>9}  "
                f"failed at {r.get('step')!r}: {first}"
                + (f" | last log line: {cause[-1][-200:]}" if cause else "")
            )
        for p in ("aggregated", "pd", "control"):
            x = r.get(p)
            if not x:
                continue
            rate = acceptance_rate(x["spec"])
            hits = x["kv"].get("vllm:external_prefix_cache_hits_total", 0)
            rows.append(
                f"{label:<8} {p:<14} {'yes' if not x['errors'] else 'NO':<4} {rate:>8.1f} "
                f"{x['spec'].get('num_drafts', 0):>7} {hits:>9.0f}  "
                + (f"{len(x['errors'])} errors: {x['errors'][0][:80]}" if x["errors"] else "")
            )
        for dname, x in (r.get("decoder_only") or {}).items():
            line = next(
                (
                    ln
                    for ln in x["log_lines"]
                    if "hash mismatch" in ln or "First difference" in ln or "does not hold" in ln
                ),
                "",
            )
            rows.append(
                f"{label:<8} {'dec-only/' + dname[:5]:<14} "
                f"{'fail' if 'error' in x['answer'] else 'ran':<4} {'':>8} {'':>7} "
                f"{'':>9}  {line[-160:]}"
            )
    return "\n".join(rows)


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "--summary":
        try:
            results = json.loads(Path(argv[1]).read_text())
        except (OSError, ValueError) as e:
            print(f"NIXL PD: no result file ({e}): the run did not get that far")
            return 1
        print("===== NIXL PD summary =====")
        print(summary(results))
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
