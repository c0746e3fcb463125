"""Speculative decoding by n-gram prompt lookup: batch-1 decode tokens/s of `vattn.LLM` with and
without `speculative_config={"method": "ngram", ...}`, against transformers' `generate` with and
without `prompt_lookup_num_tokens=k`, on the same model and prompts.

Two workloads, both greedy:
- `grounded`: an input-grounded one. The model is a small Llama (random init, seeded) trained here
  for `--train-steps` steps (a few hundred: a couple of minutes on the host, cached under
  `--cache-dir`) to copy its input: `[BOS] doc [SEP] doc`, docs of `--doc-tokens` Zipf-distributed
  tokens (exponent 1.1 over a 509-token vocabulary: text-like, so short n-grams recur and the
  earliest match is now and then the wrong one). It learns to quote its input (its copy accuracy on
  fresh docs is reported; with docs of one length it can copy by position, which is what a few
  hundred steps teach it). Prompts are `[BOS] doc [SEP]` with fresh docs, each asking for the arXiv
  summarization trace's output length (scaled by `--scale`, at most the doc): the model quotes its
  input, as an extractive summary does.
- `no-repetition`: the same architecture untrained (random weights, the same seed,
  `initializer_range` `--random-init`: large enough that its greedy output does not fall into a
  loop): its output on the same prompts is not in its input, so drafts are rarely proposed or accepted; the
  target is that speculation then costs at most 5 % (it turns itself down: no match, no draft;
  drafts rejected, shorter drafts and then a pause).
Decode tokens/s = (N - 1) / (T(N) - T(1)): the time of a generation of N tokens less that of
one token (the prefill), for every engine alike. Greedy tokens of vattn with speculation are
checked equal to vattn without it and to transformers' (`failures` otherwise).
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from vattn.bench._common import TRACE, agreement, progress

NAME = "spec"
HELP = "speculative decoding (n-gram prompt lookup): batch-1 decode tok/s vs none and transformers' prompt lookup"
NEEDS_GPU = False

VOCAB, BOS, SEP = 512, 1, 2
WORKLOADS = ("grounded", "no-repetition")
ENGINES = ("vattn", "vattn+ngram", "hf", "hf+lookup")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--prompts", type=int, default=8, help="prompts per workload (each run at batch 1)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each prompt per engine (the median counts)")
    p.add_argument("--k", type=int, default=8, help="num_speculative_tokens (and transformers' prompt_lookup_num_tokens)")
    p.add_argument("--lookup-max", type=int, default=3, help="prompt_lookup_max")
    p.add_argument("--lookup-min", type=int, default=1, help="prompt_lookup_min")
    p.add_argument("--hf-ngram", type=int, default=3, help="transformers' max_matching_ngram_size")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--train-steps", type=int, default=300)
    p.add_argument("--doc-tokens", type=int, default=128, help="tokens of every doc (the prompt, less BOS and SEP)")
    p.add_argument("--scale", type=int, default=2, help="the trace's output lengths divided by this (at most a doc)")
    p.add_argument("--random-init", type=float, default=0.2,
                   help="initializer_range of the untrained model of the no-repetition workload")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "vattn", "bench_spec"),
                   help="where the trained copy model is kept between runs")
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)


# ------------------------------------------------------------------- the model ----
def model_config(args: argparse.Namespace, initializer_range: float = 0.02) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                       num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=4,
                       max_position_embeddings=1024, bos_token_id=BOS, eos_token_id=None, pad_token_id=0,
                       tie_word_embeddings=False, initializer_range=initializer_range)


def zipf_docs(n: int, length: int, g: torch.Generator) -> torch.Tensor:
    """`[n, length]` tokens in [3, VOCAB): Zipf(1.1) ranks over a fixed random permutation."""
    ranks = torch.arange(1, VOCAB - 2, dtype=torch.float64)
    probs = ranks ** -1.1
    perm = torch.randperm(VOCAB - 3, generator=torch.Generator().manual_seed(12345)) + 3
    draws = torch.multinomial(probs, n * length, replacement=True, generator=g)
    return perm[draws].reshape(n, length)


def copy_batch(batch: int, g: torch.Generator, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    doc = zipf_docs(batch, length, g)
    x = torch.cat([torch.full((batch, 1), BOS), doc, torch.full((batch, 1), SEP), doc], 1)
    labels = x.clone()
    labels[:, :length + 2] = -100
    return x, labels


def trained_model(args: argparse.Namespace) -> tuple[Any, dict]:
    """The copy model: trained here (seeded) or loaded from `--cache-dir`; and its training facts."""
    from transformers import AutoModelForCausalLM

    config = model_config(args)
    key = hashlib.sha256(json.dumps([config.to_json_string(), args.train_steps, args.seed, args.doc_tokens,
                                     "v2"]).encode()).hexdigest()[:16]
    path = Path(args.cache_dir) / key
    if (path / "config.json").is_file():
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()
        return model, json.loads((path / "training.json").read_text())
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    g = torch.Generator().manual_seed(args.seed + 1)
    t0 = time.perf_counter()
    loss = float("nan")
    for _ in progress(range(args.train_steps), desc="training the copy model", unit="step"):
        x, y = copy_batch(16, g, args.doc_tokens)
        out = model(input_ids=x, labels=y)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        loss = out.loss.item()
    model.eval()
    with torch.no_grad():  # copy accuracy on fresh docs, teacher-forced
        x, y = copy_batch(32, torch.Generator().manual_seed(args.seed + 2), args.doc_tokens)
        pred = model(input_ids=x).logits[:, :-1].argmax(-1)
        mask = y[:, 1:] != -100
        acc = (pred[mask] == y[:, 1:][mask]).float().mean().item()
    facts = dict(train_steps=args.train_steps, train_s=round(time.perf_counter() - t0, 1), final_loss=loss,
                 copy_accuracy=acc, batch=16, doc_tokens=args.doc_tokens, lr=3e-3)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    (path / "training.json").write_text(json.dumps(facts))
    return model, facts


def random_model(args: argparse.Namespace) -> Any:
    from vattn.engine.loader import seeded_model

    return seeded_model(model_config(args, initializer_range=args.random_init), args.seed).eval()


def workload(args: argparse.Namespace) -> list[tuple[list[int], int]]:
    """(prompt, max_tokens) pairs: a doc of `--doc-tokens` each, output lengths from the trace (scaled)."""
    import csv

    rows = []
    with open(TRACE) as f:
        for row in csv.DictReader(f):
            rows.append(int(row["num_decode_tokens"]))
            if len(rows) >= args.prompts:
                break
    g = torch.Generator().manual_seed(args.seed + 3)
    out = []
    for decode in rows:
        doc = zipf_docs(1, args.doc_tokens, g)[0].tolist()
        out.append(([BOS] + doc + [SEP], max(16, min(args.doc_tokens, decode // args.scale))))
    return out


# ------------------------------------------------------------------- timing ----
def measure(model: Any, prompts: list[tuple[list[int], int]], args: argparse.Namespace) -> dict:
    """Per engine: decode tok/s over the prompts (each at batch 1), tokens, acceptance. The engines
    take turns prompt by prompt and repeat by repeat (a shared host's noise falls on all of them
    alike); each (engine, prompt) counts its median time."""
    from vattn import LLM, SamplingParams

    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": args.lookup_max,
            "prompt_lookup_min": args.lookup_min}
    kw = dict(device=args.device, max_batch_size=2, max_context_len=1024)
    hf_model = copy.deepcopy(model).to(args.device).eval()  # (an LLM runs its model with vattn's attention)
    llms = {"vattn": LLM(copy.deepcopy(model), **kw), "vattn+ngram": LLM(model, speculative_config=spec, **kw)}
    lookup = dict(prompt_lookup_num_tokens=args.k, max_matching_ngram_size=args.hf_ngram)

    def vattn_run(llm: Any) -> Any:
        def go(prompt: list[int], m: int) -> list[int]:
            return llm.generate([prompt], SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))[0].token_ids
        return go

    def hf_run(extra: dict) -> Any:
        def go(prompt: list[int], m: int) -> list[int]:
            ids = torch.tensor([prompt], device=args.device)
            with torch.no_grad():
                out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=m, min_new_tokens=m,
                                        do_sample=False, pad_token_id=0, **extra)
            return out[0, len(prompt):].tolist()
        return go

    runners = {"vattn": vattn_run(llms["vattn"]), "vattn+ngram": vattn_run(llms["vattn+ngram"]),
               "hf": hf_run({}), "hf+lookup": hf_run(lookup)}
    times: dict[tuple[str, int, int], list[float]] = {}
    outs: dict[str, list[list[int]]] = {e: [] for e in runners}
    try:
        for go in runners.values():  # warm-up
            go(prompts[0][0], 8)
        for i, (prompt, n) in enumerate(prompts):
            for e, go in runners.items():
                outs[e].append(go(prompt, n))
        for _ in progress(range(args.repeats), desc="timing", unit="round"):
            for i, (prompt, n) in enumerate(prompts):
                for e, go in runners.items():
                    for m in (n, 1):
                        t0 = time.perf_counter()
                        go(prompt, m)
                        times.setdefault((e, i, m), []).append(time.perf_counter() - t0)
        result: dict[str, Any] = {}
        for e in runners:
            decode_s = sum(statistics.median(times[(e, i, n)]) - statistics.median(times[(e, i, 1)])
                           for i, (_, n) in enumerate(prompts))
            result[e] = dict(decode_tok_s=sum(n - 1 for _, n in prompts) / decode_s, tokens=outs[e])
        stats = llms["vattn+ngram"].spec_decode_stats()
        result["vattn+ngram"].update(acceptance_rate=stats.acceptance_rate, num_drafts=stats.num_drafts,
                                     num_draft_tokens=stats.num_draft_tokens,
                                     num_accepted_tokens=stats.num_accepted_tokens,
                                     mean_acceptance_length=stats.mean_acceptance_length)
        return result
    finally:
        for llm in llms.values():
            llm.close()


def run(args: argparse.Namespace) -> dict:
    torch.manual_seed(args.seed)
    prompts = workload(args)
    out: dict[str, Any] = {"device": args.device, "k": args.k, "workloads": {}, "failures": []}
    for wl in args.workloads:
        if wl == "grounded":
            model, facts = trained_model(args)
            out["training"] = facts
        else:
            model = random_model(args)
        res = measure(model, prompts, args)
        base = res["vattn"]["tokens"]
        checks = {"vattn+ngram vs vattn": agreement(res["vattn+ngram"]["tokens"], base),
                  "vattn vs hf": agreement(base, res["hf"]["tokens"]),
                  "hf+lookup vs hf": agreement(res["hf+lookup"]["tokens"], res["hf"]["tokens"])}
        for what, a in list(checks.items())[:2]:
            if not a["equal"]:
                out["failures"].append(f"{wl}: greedy tokens differ ({what}): {a}")
        copied = agreement(base, [p[1:1 + len(t)] for (p, _), t in zip(prompts, base)])
        speed = {e: res[e]["decode_tok_s"] for e in ENGINES}
        out["workloads"][wl] = dict(
            decode_tok_s=speed, agreement=checks, output_is_input_copy=copied["token_match"],
            speedup_vs_vattn=speed["vattn+ngram"] / speed["vattn"],
            speedup_vs_hf_lookup=speed["vattn+ngram"] / speed["hf+lookup"],
            hf_lookup_speedup=speed["hf+lookup"] / speed["hf"],
            spec=dict((k, v) for k, v in res["vattn+ngram"].items() if k not in ("tokens", "decode_tok_s")),
            prompt_tokens=[len(p) for p, _ in prompts], max_tokens=[n for _, n in prompts])
    return out


def table(result: dict) -> tuple[list[str], list[list]]:
    headers = ["workload", *[f"{e} tok/s" for e in ENGINES], "ngram/vattn", "ngram/hf+lookup", "acceptance",
               "copy"]
    rows = []
    for wl, r in result["workloads"].items():
        s = r["decode_tok_s"]
        rows.append([wl, *[round(s[e], 1) for e in ENGINES], f"{r['speedup_vs_vattn']:.2f}x",
                     f"{r['speedup_vs_hf_lookup']:.2f}x", f"{r['spec'].get('acceptance_rate', 0):.0%}",
                     f"{r['output_is_input_copy']:.0%}"])
    return headers, rows


def plot(result: dict) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    wls = list(result["workloads"])
    fig, axes = plt.subplots(1, len(wls), figsize=(5.5 * len(wls), 4), squeeze=False)
    for ax, wl in zip(axes[0], wls):
        r = result["workloads"][wl]
        vals = [r["decode_tok_s"][e] for e in ENGINES]
        bars = ax.bar(ENGINES, vals, color=["#888", "#1f77b4", "#bbb", "#ff7f0e"])
        for b, v in zip(bars, vals):
            ax.text(b.get_x() + b.get_width() / 2, v, f"{v:.0f}", ha="center", va="bottom", fontsize=8)
        ax.set_title(f"{wl}: ngram {r['speedup_vs_vattn']:.2f}x vattn, {r['speedup_vs_hf_lookup']:.2f}x hf lookup\n"
                     f"acceptance {r['spec'].get('acceptance_rate', 0):.0%}, k={result['k']}", fontsize=9)
        ax.set_ylabel("batch-1 decode tokens/s")
        ax.tick_params(axis="x", labelsize=8)
    return fig
