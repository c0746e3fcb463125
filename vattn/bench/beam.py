"""Beam search: `vattn.LLM.beam_search` against transformers' `generate(num_beams=W)` on the same
model and prompt.

A small Llama (random weights, seeded; `--hidden`, `--layers`) and one prompt of `--prompt-tokens`
tokens; each width searches `--max-tokens` tokens (no EOS: every beam runs to the end, as
`ignore_eos`). Per width: tokens/s (beam tokens generated, `W x max_tokens`, over the wall time of
the search, prefill included; the median of `--repeats` runs), the KV memory at the end of the
search (vattn: the most physical bytes the live tokens held after a step, a shared page counted once,
`BeamSearchStats.peak_kv_bytes`; transformers: the bytes of the K/V tensors of its cache, W rows of
the whole sequence each), and the forks' pages shared and copied. transformers runs at the widths
in `--hf-widths` (16 by default: the target's reference). The best sequence of both is checked
equal (`failures` otherwise).
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

NAME = "beam"
HELP = "beam search: tok/s and KV bytes of vattn.LLM.beam_search vs transformers' generate(num_beams=W)"
NEEDS_GPU = False


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--widths", type=int, nargs="+", default=[4, 16], help="beam widths of vattn")
    p.add_argument("--hf-widths", type=int, nargs="+", default=[16], help="beam widths of transformers")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per engine and width (the median counts)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--page-size", type=int, default=4096, help="vattn's page size in bytes")
    p.add_argument("--seed", type=int, default=0)


def model_config(args: argparse.Namespace) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=512, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                       num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=args.prompt_tokens + args.max_tokens + 64, initializer_range=0.2,
                       eos_token_id=None, bos_token_id=None, pad_token_id=None)


def _timed(fn: Any, repeats: int) -> tuple[float, Any]:
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def _hf_cache_bytes(cache: Any) -> int:
    total = 0
    for layer in getattr(cache, "layers", []):
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def run(args: argparse.Namespace) -> dict:
    from transformers import AutoModelForCausalLM

    from vattn.engine import LLM, BeamSearchParams

    config = model_config(args)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config).eval().to(args.device)
    prompt = torch.randint(0, 512, (args.prompt_tokens,), generator=torch.Generator().manual_seed(args.seed)).tolist()
    rows: list[dict] = []
    failures: list[str] = []
    best: dict[tuple[str, int], list[int]] = {}
    max_w = max(args.widths)
    with LLM(model_config(args), seed=args.seed, device=args.device, dtype="float32", page_size=args.page_size,
             max_batch_size=max_w, max_context_len=args.prompt_tokens + args.max_tokens + 64) as llm:
        llm.eos_token_ids = ()
        for w in args.widths:
            params = BeamSearchParams(beam_width=w, max_tokens=args.max_tokens, ignore_eos=True)
            llm.beam_search(prompt, params)  # warm-up
            secs, out = _timed(lambda: llm.beam_search(prompt, params)[0], args.repeats)
            s = out.stats
            best[("vattn", w)] = out.sequences[0].output_token_ids
            rows.append({"engine": "vattn", "width": w, "seconds": secs, "tokens_per_s": w * args.max_tokens / secs,
                         "kv_bytes": s.peak_kv_bytes, "forks": s.num_forks, "pages_shared": s.pages_shared,
                         "pages_copied": s.pages_copied, "score": out.sequences[0].score})
    ids = torch.tensor([prompt], device=args.device)
    for w in args.hf_widths:
        def search(w: int = w) -> Any:
            with torch.inference_mode():
                return model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=w, do_sample=False,
                                      max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens,
                                      return_dict_in_generate=True, output_scores=True, pad_token_id=0)
        search()
        secs, out = _timed(search, args.repeats)
        best[("hf", w)] = out.sequences[0, len(prompt):].tolist()
        rows.append({"engine": "transformers", "width": w, "seconds": secs,
                     "tokens_per_s": w * args.max_tokens / secs, "kv_bytes": _hf_cache_bytes(out.cache),
                     "score": float(out.sequences_scores[0])})
    for w in args.hf_widths:
        if ("vattn", w) in best and best[("vattn", w)] != best[("hf", w)]:
            failures.append(f"width {w}: vattn's best sequence differs from transformers'")
    ratios = {}
    ref = next((r for r in rows if r["engine"] == "transformers" and r["width"] == 16), None)
    if ref is not None:
        for r in rows:
            if r["engine"] == "vattn":
                ratios[f"vattn_w{r['width']}_tok_s_vs_hf_w16"] = r["tokens_per_s"] / ref["tokens_per_s"]
                if r["width"] == 16 and ref["kv_bytes"]:
                    ratios["vattn_w16_kv_bytes_vs_hf_w16"] = r["kv_bytes"] / ref["kv_bytes"]
    return {"device": args.device, "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
            "model": {"hidden": args.hidden, "layers": args.layers, "vocab": 512},
            "page_size": args.page_size, "rows": rows, "ratios": ratios, "failures": failures}


def table(result: dict) -> tuple[list[str], list[list]]:
    headers = ["engine", "width", "s", "tok/s", "KV MiB", "forks", "pages shared", "pages copied"]
    body = [[r["engine"], r["width"], f"{r['seconds']:.3f}", f"{r['tokens_per_s']:.0f}",
             f"{r['kv_bytes'] / 2**20:.2f}", r.get("forks", ""), r.get("pages_shared", ""), r.get("pages_copied", "")]
            for r in result["rows"]]
    for k, v in result.get("ratios", {}).items():
        body.append([k, "", "", "", f"{v:.3f}", "", "", ""])
    return headers, body


def plot(result: dict) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    labels = [f"{r['engine']}\nW={r['width']}" for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    a.bar(labels, [r["tokens_per_s"] for r in rows], color=["C0" if r["engine"] == "vattn" else "C1" for r in rows])
    a.set_ylabel("beam tokens / s")
    a.set_title(f"beam search, {result['prompt_tokens']}-token prompt")
    b.bar(labels, [r["kv_bytes"] / 2**20 for r in rows], color=["C0" if r["engine"] == "vattn" else "C1" for r in rows])
    b.set_ylabel("KV MiB at the end")
    b.set_title("KV memory")
    return fig
