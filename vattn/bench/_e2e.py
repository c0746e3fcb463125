"""End-to-end decode throughput: `vattn.LLM` against transformers' `generate` and its
continuous batching (`generate_batch`), same device, model, weights and requests.
Part of `vattn bench gpu` (not a command of its own).

Models (random weights made directly on the GPU in bf16; no checkpoint, no tokenizer):
- `llama-3.2-1b`: hidden 2048, 16 layers, 32 heads, 8 KV heads x 64, intermediate 8192,
  vocab 128256, tied embeddings;
- `llama-3-8b`: hidden 4096, 32 layers (`--layers-8b`), 32 heads, 8 KV heads x 128,
  intermediate 14336, vocab 128256.
For each batch size, `batch` prompts of `--prompt-len` random tokens, greedy, exactly
`--max-tokens` new tokens (no EOS: the configs have none). Each system runs the batch twice,
for 1 and for N new tokens, after a small warm-up; decode tokens/s = batch x (N - 1) /
(t_N - t_1), which takes the prefill and fixed costs out; every system also
`decode_tok_s_in_run`: B x (N - 1) over the time, inside the N-token run, from the
last first token to the last token (vattn's request metrics, the continuous-batching
manager's token timestamps, generate's streamer calls), the figure the table shows first
and the plot shows (t_N - t_1 where it is missing). vattn runs with its default
pages (the 2 MiB granularity) and prefills the whole batch in one iteration; transformers'
continuous batching is one manager per batch size (`init_continuous_batching`, started
once for the three runs), with a cache sized for the batch and without CUDA graphs (like
the other two; `--hf-cb-cuda-graphs` to allow them).

Also recorded: greedy agreement with `generate` (fraction of equal tokens, and of the common
prefix), the max abs difference of the first token's logits (vattn's engine vs one
transformers forward with SDPA), peak `torch.cuda.memory_reserved` per system, vattn's
peak mapped bytes, and that vattn's pages come back: after the requests finish the pages
stay mapped to their free slots (deferred reclamation, used bytes 0), and `close()` returns
them to the GPU (free memory rises by the bytes of the pages created).

`--compile`: one more vattn system, `vattn_compiled` (`compile=True`: the model's forward
under `torch.compile` with attention one opaque op, captured by vattn's CUDA graphs where they
apply), with its compile time (`compile`: seconds of the calls that compiled, compiles, graphs),
its tokens against eager vattn's and generate's, and its first-token logits against
transformers'. The bandwidth bound of a decode step (`bound`): the bytes a decode step must
read (the weights, less an untied input embedding of which it reads B rows, plus the K/V of the
batch at the mean decode context, prompt + N/2) over the device-to-device copy bandwidth
measured in the same run (`copy_GBps`, 2 x bytes / time of a large `copy_`); with
`--engine-overhead` every vattn system's decode step and forward are given against it.
`--compile --rounds R` (a shared machine): eager and compiled vattn open together, stepping in
turn through R runs of the batch, the ratio of each pair of decode steps (`interleaved`).

`--engine-overhead`: the engine's time outside the forward per decode iteration (`StepTimer`):
on CUDA the GPU's idle time between two decode forwards, from events on the stream (nothing
synchronized: asynchronous scheduling keeps its overlap); on the host the wall time of a step
less its forward. `--compare-async`: one more vattn system with the other `async_scheduling`
than the default (`vattn_sync` on CUDA, where the default schedules asynchronously; `vattn_async`
on the host), its tokens against vattn's (they must be equal); with `--rounds R` also the two
open together and stepping in turn (`interleaved_async`: the ratio async / sync of each pair of
decode steps, of the step, the forward and the time outside it).

`--device cpu` runs the same code with a tiny model (host backend, float32); `llama-512x8` (the
`vattn bench throughput` model: hidden 512, 8 layers, GQA 8/4, vocab 32000) keeps its shape
on the CPU too.

    vattn bench gpu   (runs this with the other GPU benchmarks)

The systems run are `_e2e_systems.py`'s, what they are measured with `_e2e_measure.py`'s.
"""
from __future__ import annotations

import argparse
import time
import traceback
from typing import Any

import torch

from ._common import agreement, progress
from vattn.integrations.hf_cb import memory_problem

from ._e2e_measure import GB, copy_bandwidth, decode_bound, logits_diff
from ._e2e_systems import interleaved, run_hf_cb, run_hf_generate, run_vattn
from ._models import build_model, llama_config

NAME = "e2e"
HELP = "end-to-end decode throughput: vattn.LLM vs transformers generate and generate_batch"
NEEDS_GPU = True

ASYNC_SYSTEMS = ("vattn_sync", "vattn_async")  # --compare-async: vattn with the other async_scheduling
GPU_KERNELS = ("flash_attn", "torch_flash")  # vattn's CUDA kernels; "sdpa" on CUDA means the kernel fell back
MODELS = {
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, tie_word_embeddings=True),
    "llama-3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
}
# keeps its shape on the CPU (the others are TINY there): vattn bench throughput's model
HOST_MODELS = {"llama-512x8": dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8,
                                   num_key_value_heads=4, head_dim=64, tie_word_embeddings=False)}
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, tie_word_embeddings=False)


def model_config(name: str, args: argparse.Namespace) -> Any:
    cuda = args.device.startswith("cuda")
    if name in HOST_MODELS:
        return llama_config(vocab_size=32000, max_position_embeddings=4096, **HOST_MODELS[name])
    shape = dict(MODELS[name]) if cuda else dict(TINY)
    if cuda and name == "llama-3-8b" and args.layers_8b:
        shape["num_hidden_layers"] = args.layers_8b
    return llama_config(vocab_size=128256 if cuda else 512, max_position_embeddings=8192 if cuda else 1024, **shape)


def run_batch(name: str, model: Any, B: int, args: argparse.Namespace, dtype: torch.dtype,
              hf_cb: bool = True, copy_Bps: float | None = None) -> dict:
    gen = torch.Generator().manual_seed(B)
    prompts = torch.randint(1, model.config.vocab_size, (B, args.prompt_len), generator=gen).tolist()
    N = args.max_tokens
    res: dict[str, Any] = dict(model=name, batch=B, prompt_len=args.prompt_len, max_tokens=N, systems={}, errors={})
    runners = [("vattn", lambda: run_vattn(model, prompts, args, dtype))]
    if args.compare_eager:
        runners.append(("vattn_eager", lambda: run_vattn(model, prompts, args, dtype, False, "vattn_eager")))
    if args.compile:
        runners.append(("vattn_compiled", lambda: run_vattn(model, prompts, args, dtype, None, "vattn_compiled",
                                                            args.compile_mode)))
    if args.compare_async:  # the other side of the default (asynchronous on CUDA, synchronous on the host)
        other = "vattn_sync" if args.device.startswith("cuda") else "vattn_async"
        runners.append((other, lambda: run_vattn(model, prompts, args, dtype, system=other,
                                                 async_scheduling=other == "vattn_async")))
    if not args.skip_hf:
        runners.append(("hf_generate", lambda: run_hf_generate(model, prompts, args)))
    if hf_cb and not args.skip_hf_cb and not args.skip_hf:
        runners.append(("hf_continuous_batching", lambda: run_hf_cb(model, prompts, args)))
    tokens, logits = {}, {}
    for system, fn in runners:
        try:
            r = fn()
        except Exception as e:
            traceback.print_exc()
            res["errors"][system] = f"{type(e).__name__}: {e}"
            continue
        finally:
            if args.device.startswith("cuda"):  # a system's leftovers (a manager in a cycle) go before the next
                import gc

                gc.collect()
                torch.cuda.empty_cache()
        tokens[system] = r.pop("tokens")
        if "first_logits" in r:
            logits[system] = r.pop("first_logits")
        res["systems"][system] = _throughput(r, B, N)
        in_run = r["decode_tok_s_in_run"]
        print(f"  {name} B={B} {system:24s} decode {r['decode_tok_s']:9.1f} tok/s"
              + (f" ({in_run:.1f} in-run)" if in_run else "") + f"  (t1 {r['t1_s']:.2f} s, tN {r['tN_s']:.2f} s)",
              flush=True)
    res.update(_compare(tokens, logits))
    if copy_Bps:
        res["bound"] = decode_bound(model, B, args.prompt_len + N / 2, copy_Bps, res["systems"])
    rounds = {"interleaved": args.compile and {"vattn": {}, "vattn_compiled": dict(compile=args.compile_mode)},
              "interleaved_async": args.compare_async and {"vattn_sync": dict(async_scheduling=False),
                                                           "vattn_async": dict(async_scheduling=True)}}
    for key, variants in rounds.items():
        if variants and args.rounds:
            try:
                res[key] = interleaved(model, prompts, args, dtype, variants)
            except Exception as e:
                traceback.print_exc()
                res["errors"][key] = f"{type(e).__name__}: {e}"
    res["tokens_sample"] = {s: t[0][:16] for s, t in tokens.items()}
    return res


# ------------------------------------------------------------------------- bench ----
def _throughput(r: dict[str, Any], B: int, N: int) -> dict[str, Any]:
    """A system's result `r` with its tokens/s: decode from t_N - t_1 and, where it was timed,
    inside the N-token run; total over the N-token run."""
    dt = r["tN_s"] - r["t1_s"]
    r["decode_tok_s"] = B * (N - 1) / dt if dt > 0 else float("nan")
    w = r.get("decode_window_s")  # the same, timed inside the N-token run (vattn, continuous batching)
    r["decode_tok_s_in_run"] = B * (N - 1) / w if w else None
    r["total_tok_s"] = B * N / r["tN_s"]
    return r


def _compare(tokens: dict[str, Any], logits: dict[str, Any]) -> dict[str, Any]:
    """The systems' greedy tokens and first-token logits against vattn's and generate's."""
    res: dict[str, Any] = {}
    for other in ("vattn_eager", "vattn_compiled", *ASYNC_SYSTEMS):
        if "vattn" in tokens and other in tokens:
            res[f"vattn_vs_{other}"] = agreement(tokens["vattn"], tokens[other])
    for other in ("vattn_eager", "vattn_compiled", *ASYNC_SYSTEMS):  # the first step's logits: numerics or a bug?
        if "vattn" in logits and other in logits:
            res[f"first_token_logits_{other}_vs_vattn"] = logits_diff(logits[other], logits["vattn"])
    if "hf_generate" in tokens:
        for system in ("vattn", "vattn_eager", "vattn_compiled", *ASYNC_SYSTEMS, "hf_continuous_batching"):
            if system in tokens:
                res[f"{system}_vs_hf_generate"] = agreement(tokens[system], tokens["hf_generate"])
        for system in ("vattn", "vattn_compiled"):
            if system in logits and "hf_generate" in logits:
                suffix = "" if system == "vattn" else "_compiled"
                res[f"first_token_logits_vattn{suffix}_vs_hf"] = logits_diff(logits[system], logits["hf_generate"])
    return res


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--device", default="cuda", help="cuda (the benchmark) or cpu (a tiny run of the same code)")
    ap.add_argument("--quick", action="store_true", help="fewer new tokens (the GPU suite)")
    ap.add_argument("--models", nargs="*", default=list(MODELS), choices=[*MODELS, *HOST_MODELS])
    ap.add_argument("--batches", type=int, nargs="*", default=None)
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=None, help="new tokens per request (N)")
    ap.add_argument("--layers-8b", type=int, default=None, help="fewer layers for the 8B shape (memory or time)")
    ap.add_argument("--layout", default="per-layer", choices=["per-layer", "fused"])
    ap.add_argument("--page-size", type=int, default=None, help="bytes; default the backend's")
    ap.add_argument("--skip-hf-cb", action="store_true", help="leave out transformers' generate_batch")
    ap.add_argument("--hf-cb-cuda-graphs", action="store_true", help="let generate_batch use CUDA graphs (+ warm-up)")
    ap.add_argument("--compare-eager", action="store_true",
                    help="also run vattn with cuda_graphs=False (system vattn_eager) beside its default")
    ap.add_argument("--compile", action="store_true",
                    help="also run vattn with compile=True (system vattn_compiled; with CUDA graphs where they apply)")
    ap.add_argument("--compile-mode", default=True, help="what vattn_compiled passes as compile= (default True)")
    ap.add_argument("--compare-async", action="store_true",
                    help="also run vattn with the other async_scheduling than the default (system vattn_sync on CUDA, "
                         "vattn_async on the host)")
    ap.add_argument("--rounds", type=int, default=0,
                    help="with --compile (--compare-async): eager and compiled (synchronous and asynchronous) vattn open "
                         "together, stepping in turn through this many runs")
    ap.add_argument("--skip-hf", action="store_true", help="leave out transformers' generate (and generate_batch)")
    ap.add_argument("--engine-overhead", action="store_true",
                    help="one more N-token vattn run, timing each iteration's step against its forward")
    ap.add_argument("--budget-s", type=float, default=None, help="start no new (model, batch) after this many seconds")
    ap.add_argument("--file-name", default="e2e", help="the result's file name before _<device>.json (default e2e)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    cuda = args.device.startswith("cuda")
    if cuda:
        args.batches = args.batches or [1, 8, 32, 128]
        args.prompt_len = args.prompt_len or 128
        args.max_tokens = args.max_tokens or (32 if args.quick else 128)
        dtype = torch.bfloat16
    else:
        args.batches = args.batches or [1, 3]
        args.prompt_len = args.prompt_len or 12
        args.max_tokens = args.max_tokens or 16  # t_N - t_1 of a few tokens of a tiny model drowns in the host's noise
        args.page_size = args.page_size or (16 << 10)
        dtype = torch.float32
    start = time.perf_counter()
    results: list[dict] = []
    skipped: list[str] = []
    cb_problem = None if args.skip_hf_cb or args.skip_hf else memory_problem()
    if cb_problem:  # transformers' own limit on this machine, not a failure of the benchmark
        skipped.append(f"hf_continuous_batching: {cb_problem}")
    models_info: dict[str, Any] = {}
    copy_Bps = copy_bandwidth(args.device)  # the bound's denominator, measured in this run
    print(f"device-to-device copy: {copy_Bps / 1e9:.1f} GB/s", flush=True)
    for name in args.models:
        if args.budget_s is not None and time.perf_counter() - start > args.budget_s:
            skipped.append(f"{name}: time budget spent")
            continue
        config = model_config(name, args)
        if args.compile:  # dynamo's recompile limit counts the graphs of every model of the process
            torch._dynamo.reset()
        t0 = time.perf_counter()
        try:
            model = build_model(config, args.device, dtype)
        except Exception as e:
            traceback.print_exc()
            results.append(dict(model=name, errors={"build": f"{type(e).__name__}: {e}"}, systems={}))
            continue
        models_info[name] = dict(layers=config.num_hidden_layers, hidden=config.hidden_size,
                                 parameters=sum(p.numel() for p in model.parameters()), build_s=time.perf_counter() - t0,
                                 weights_GiB=sum(p.numel() * p.element_size() for p in model.parameters()) / GB)
        for B in progress(args.batches, desc=name, unit="batch"):
            if args.budget_s is not None and time.perf_counter() - start > args.budget_s:
                skipped.append(f"{name} batch {B}: time budget spent")
                continue
            results.append(run_batch(name, model, B, args, dtype, hf_cb=not cb_problem, copy_Bps=copy_Bps))
        del model
        if cuda:
            torch.cuda.empty_cache()
    failures = [f for r in results for f in _failures(r, cuda)]
    return dict(file_name=args.file_name, dtype=str(dtype).removeprefix("torch."), prompt_len=args.prompt_len,
                max_tokens=args.max_tokens,
                copy_GBps=copy_Bps / 1e9, models=models_info, results=results, skipped=skipped, failures=failures)


def _failures(r: dict[str, Any], cuda: bool) -> list[str]:
    """What went wrong for one (model, batch): errors, pages not returned on close, a kernel that
    fell back, tokens that depend on the scheduling, a compile that was turned off."""
    failures = []
    c = r["systems"].get("vattn", {}).get("after_close")
    if c and not c["pages_returned"]:
        failures.append(f"{r['model']} B={r['batch']}: pages not returned on close")
    for system, e in r["errors"].items():
        failures.append(f"{r['model']} B={r.get('batch')} {system}: {e}")
    for system in ("vattn", "vattn_compiled"):
        kern = r["systems"].get(system, {}).get("kernel")
        if cuda and kern is not None and kern not in GPU_KERNELS:  # its figures are SDPA's, not the varlen kernel's
            failures.append(f"{r['model']} B={r['batch']} {system}: the attention kernel fell back to {kern!r} "
                            "(see the RuntimeWarning in the log)")
    for other in ASYNC_SYSTEMS:  # greedy tokens do not depend on the scheduling
        a = r.get(f"vattn_vs_{other}")
        if a and not a["equal"]:
            failures.append(f"{r['model']} B={r['batch']} {other}: tokens differ from vattn's "
                            f"({a['sequences_equal']}/{a['sequences']} sequences equal)")
    off = r["systems"].get("vattn_compiled", {}).get("compile", {}).get("disabled")
    if off:  # its figures are eager ones
        failures.append(f"{r['model']} B={r['batch']} vattn_compiled: compiling was turned off: {off}")
    return failures


def table(result: dict[str, Any]) -> tuple[list[str], list[list]]:
    """One row per (model, batch, system): decode tokens/s, memory, agreement with generate."""
    rows = []
    for r in result["results"]:
        for system, s in r["systems"].items():
            agree = r.get(f"{system}_vs_hf_generate", {})
            rows.append([r["model"], r["batch"], system, s.get("decode_tok_s_in_run") or "-", s["decode_tok_s"],
                         s["total_tok_s"],
                         s.get("peak_reserved_GiB") if s.get("peak_reserved_GiB") is not None else "-",
                         s.get("peak_mapped_GiB", "-"), agree.get("token_match", "-")])
        _print_details(r)
    for s in result["skipped"]:
        print("skipped", s)
    for f in result["failures"]:
        print("ERROR", f)
    print(f"\ndecode throughput: prompt {result['prompt_len']}, {result['max_tokens']} new tokens, greedy")
    return (["model", "B", "system", "decode tok/s (in run)", "decode tok/s (t_N - t_1)", "total tok/s", "peak reserved GiB", "vattn mapped GiB",
             "token match vs generate"], rows)


def _print_details(r: dict[str, Any]) -> None:
    """What the table leaves out, for one (model, batch): compile, engine overhead and CUDA
    graphs per system, tokens and logits against vattn's and transformers', the interleaved
    steps, the bandwidth bound."""
    for system, s in r["systems"].items():
        eo, cg, cc = s.get("engine_overhead"), s.get("cuda_graphs"), s.get("compile")
        if cc:
            print(f"{r['model']} B={r['batch']} {system}: compile ({cc['mode']}) {cc['compile_s']:.2f} s, "
                  f"{cc['compiles']} compile(s), {cc['graphs']} graph(s)" + (f", OFF: {cc['disabled']}"
                                                                          if cc["disabled"] else ""))
        if eo:
            print(f"{r['model']} B={r['batch']} {system} (async_scheduling={s.get('async_scheduling')}, "
                  f"{eo.get('method')}): decode step {eo['step_ms_median']:.3f} ms (median), "
                  f"outside the forward {eo['outside_ms_median']:.3f} ms = {100 * eo['outside_share']:.2f} % "
                  f"of the decode steps' time ({eo['iterations']} iterations); of it, ms: schedule "
                  f"{eo.get('schedule_ms_median', 0):.3f} (with cache.step "
                  f"{eo.get('cache_step_ms_median', 0):.3f}), "
                  f"sample {eo.get('sample_ms_median', 0):.3f}, outputs {eo.get('outputs_ms_median', 0):.3f}")
        if cg:
            print(f"{r['model']} B={r['batch']} {system}: CUDA graphs: {cg['replays']} replays, sizes "
                  f"{cg['captured_sizes']}, capture s {cg['capture_s']}" + (f", OFF: {cg['disabled']}"
                                                                           if cg["disabled"] else ""))
    for other in ("vattn_eager", "vattn_compiled", *ASYNC_SYSTEMS):
        a = r.get(f"vattn_vs_{other}")
        if a:
            print(f"{r['model']} B={r['batch']}: vattn tokens vs {other}: match {a['token_match']:.3f}, "
                  f"common prefix {a['prefix_match']:.3f}, {a['sequences_equal']}/{a['sequences']} sequences equal")
        lg = r.get(f"first_token_logits_{other}_vs_vattn")
        if lg:
            print(f"{r['model']} B={r['batch']}: first-token logits max |{other} - vattn| {lg['max_abs_diff']:.4g} "
                  f"(|logits| <= {lg['logits_abs_max']:.3g}), argmax equal {lg['argmax_equal']:.3f}, "
                  f"top-2 gap median {lg['top2_gap_median']:.4g}, near ties {lg['near_ties']:.3f}")
    for system in ("vattn", "vattn_compiled"):
        lg = r.get("first_token_logits_vattn_vs_hf" if system == "vattn" else "first_token_logits_vattn_compiled_vs_hf")
        if lg:
            print(f"{r['model']} B={r['batch']}: first-token logits max |{system} - hf| {lg['max_abs_diff']:.4g} "
                  f"(|logits| <= {lg['logits_abs_max']:.3g}), argmax equal {lg['argmax_equal']:.3f}")
    for key in ("interleaved", "interleaved_async"):
        il = r.get(key)
        if il:
            b, o = il["baseline"], il["other"]
            print(f"{r['model']} B={r['batch']}: interleaved ({il['rounds']} rounds, {il['steps']} pairs of decode "
                  f"steps): {o} / {b}, median of the pairs: step {il['step_ratio_median']:.3f}, forward "
                  f"{il['forward_ratio_median']:.3f}, outside the forward {il['outside_ratio_median']:.3f}; "
                  f"medians, ms: step {il['step_ms'][b]:.3f} / {il['step_ms'][o]:.3f}, outside the forward "
                  f"{il['outside_ms'][b]:.3f} / {il['outside_ms'][o]:.3f}")
    bound = r.get("bound")
    if bound:
        print(f"{r['model']} B={r['batch']}: bandwidth bound {bound['bound_ms']:.3f} ms a decode step (weights "
              f"{bound['weights_GiB']:.3f} GiB + K/V {bound['kv_GiB']:.3f} GiB at copy bandwidth)" + "".join(
                  f"; {system} step {b['step_over_bound']:.2f}x, forward {b['forward_over_bound']:.2f}x"
                  for system, b in bound.items() if isinstance(b, dict)))


def decode_tok_s(system: dict[str, Any]) -> float:
    """The decode figure to show: timed inside the N-token run when it was (first tokens to last
    token: no prefill, no start or stop of the system), else B x (N - 1) / (t_N - t_1)."""
    return system.get("decode_tok_s_in_run") or system["decode_tok_s"]


def plot(result: dict[str, Any]) -> Any:
    return _plot(result["results"])


def _plot(results: list[dict]) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in results})
    if not models:
        return None
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.2), squeeze=False)
    for ax, name in zip(axes[0], models):
        rs = [r for r in results if r["model"] == name]
        for system, marker in (("vattn", "o"), ("vattn_eager", "x"), ("vattn_compiled", "D"), ("vattn_sync", "v"),
                               ("vattn_async", "P"), ("hf_generate", "s"), ("hf_continuous_batching", "^")):
            pts = [(r["batch"], decode_tok_s(r["systems"][system])) for r in rs if system in r["systems"]]
            if pts:
                ax.plot(*zip(*pts), marker=marker, label=system)
        ax.set(xscale="log", yscale="log", xlabel="batch",
               ylabel="decode tokens/s (in the N-token run; else from t_N - t_1)", title=name)
        ax.legend()
    return fig


if __name__ == "__main__":  # this part alone: python -m vattn.bench._e2e [options] [--out DIR]
    import sys

    from vattn.bench import execute, module_args

    _out = argparse.ArgumentParser(add_help=False)
    _out.add_argument("--out", default=None)
    _known, _rest = _out.parse_known_args()
    _payload = execute(sys.modules[__name__], NAME, module_args(sys.modules[__name__], _rest, out=_known.out))
    sys.exit(1 if _payload["result"].get("failures") else 0)
