"""The new GPU paths in one short engine run, for compute-sanitizer's memcheck (the GPU suite's
last stage): a sliding-window model whose pages behind the window are given back while
FlashAttention's local attention (`torch_flash`) reads the rest, and a Mamba2 hybrid whose
recurrent states live in vattn pages. Each run's tokens are checked against the sdpa kernel's
(windows, fp16: at most one sequence may part at a near-tie) or generate's (states, float32).

    compute-sanitizer --tool memcheck python benchmarks/gpu_sanitize.py [--device cuda]

`--device cpu` runs the same code on the host backend (float32, the sdpa kernel): a check of
the script itself. Prints one line per part and exits 1 if a part failed.
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's vattn and tests

import torch  # noqa: E402
import transformers  # noqa: E402

from vattn.engine import LLM, SamplingParams  # noqa: E402


def _tokens(llm: LLM, prompts: list[list[int]], n: int) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))]


def windows(device: str) -> str:
    """Mistral, 8 KV heads x 128 (1024 tokens a 2 MiB page), a 256-token window, a 2100-token prompt (a page
    lies wholly behind the window and its 256-token margin only past 1536 tokens)."""
    cuda = device == "cuda"
    config = transformers.MistralConfig(vocab_size=128, hidden_size=1024, intermediate_size=256, num_hidden_layers=2,
                                        num_attention_heads=8, num_key_value_heads=8, head_dim=128,
                                        max_position_embeddings=4096, sliding_window=256, initializer_range=0.05,
                                        eos_token_id=None, bos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in ((2100, 700) if cuda else (300, 140))]
    page = None if cuda else 64 << 10
    runs, holes = {}, 0
    for kernel in (("sdpa", "torch_flash") if cuda else ("sdpa",)):
        with LLM(copy.deepcopy(model), device=device, dtype="float16" if cuda else "float32", attention=kernel,
                 max_batch_size=2, max_num_batched_tokens=256, page_size=page, prefetch=False) as llm:
            runs[kernel] = _tokens(llm, prompts, 8)
            books = next(k.books for k in llm.cache.allocator.kinds if k.gives_back)
            holes = max(holes, max(books.holes(s) for s in range(books.num_slots)))
            assert llm.runner.kernel.name == kernel, f"{kernel} fell back to {llm.runner.kernel.name}"
    assert holes > 0, "no page was given back behind the window"
    same = sum(a == b for a, b in zip(*runs.values())) if len(runs) > 1 else len(prompts)
    assert same >= len(prompts) - 1, runs
    return f"pages given back behind the window (a slot's holes: up to {holes}), {same}/{len(prompts)} equal"


def states(device: str) -> str:
    """Bamba (Mamba2 layers around an attention layer), float32, against generate."""
    from tests.engine.test_model_support import hybrid_config

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hybrid_config("bamba")).eval()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (40, 17)]
    ref_model = copy.deepcopy(model).to(device)
    ref = []
    for p in prompts:
        ids = torch.tensor([p], device=device)
        out = ref_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                                 pad_token_id=0)
        ref.append(out[0, len(p):].tolist())
    with LLM(copy.deepcopy(model), device=device, dtype="float32", max_batch_size=2, max_num_batched_tokens=16,
             page_size=None if device == "cuda" else 4096) as llm:
        got = _tokens(llm, prompts, 6)
    assert got == ref, (got, ref)
    return "tokens equal generate's"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = ap.parse_args()
    failed = 0
    for part in (windows, states):
        t0 = time.perf_counter()
        try:
            said = part(args.device)
            print(f"{part.__name__}: ok in {time.perf_counter() - t0:.1f} s: {said}", flush=True)
        except Exception as e:  # report and go on with the next part
            failed += 1
            print(f"{part.__name__}: FAILED in {time.perf_counter() - t0:.1f} s: {type(e).__name__}: {e}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
