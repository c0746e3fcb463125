"""On a GPU: the layer kinds (issue 30) and what they never ran on before (issue 33).

- Sliding-window layers give their pages back on the CUDA VMM cache, and FlashAttention's
  local attention (vattn's `torch_flash`) reads only what the window kind keeps mapped: the
  window's first key just before, at and after a page boundary, within the 256-token margin
  (`vattn.cache.WINDOW_MARGIN_TOKENS`, reasoned from FlashAttention's key blocks). An unmapped
  read is an illegal address that poisons the process: the GPU suite runs this file in a
  pytest process of its own, each test under a timeout.
- The engine with windows on CUDA: float32 tokens equal transformers' `generate` on the same
  weights (the sdpa kernel reads exactly the window), and FlashAttention's local attention in
  fp16 agrees with sdpa's on the same pages given back (a near-tie may flip one sequence).
- The recurrent-state kind (Mamba2, gated delta-net) on CUDA pages: float32 tokens equal
  `generate`'s, every state row given back after.
- The coordinator on the real driver: fork, swap out and in, holes behind the window and a
  step one kind cannot back, the data written through the virtual tensors checked after each.

Every test is marked `gpu` (skipped without CUDA); the models are tiny and seeded.
"""
from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.engine.test_model_support import HYBRIDS, hybrid_config  # noqa: E402
from tests.helpers import build_model  # noqa: E402

import vattn  # noqa: E402
from vattn.attention import AttentionMetadata, sdpa_attention, torch_flash_attention  # noqa: E402
from vattn.cache import WINDOW_MARGIN_TOKENS  # noqa: E402
from vattn.engine import LLM, SamplingParams  # noqa: E402

pytestmark = pytest.mark.gpu

KV_HEADS, HEAD_DIM = 8, 128  # fp16: 2 KiB a token a buffer, 1024 tokens a 2 MiB page
WINDOW = 512


def window_kind(cache: Any) -> Any:
    return next(k for k in cache.allocator.kinds if k.gives_back)


def _window_cache(**kw: Any) -> vattn.KVCache:
    args = dict(num_layers=2, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, max_batch_size=8, max_context_len=8192,
                dtype="float16", device="cuda", layer_windows=(WINDOW, None), prefetch=False, background=False)
    return vattn.KVCache(**{**args, **kw})


# ------------------------------------------------------------------ the kernel ----
# The window's first key (ctx - WINDOW) relative to a page boundary: behind it, on it, after it,
# around FlashAttention's 128-token key blocks and at the edge of the margin.
OFFSETS = (-1, 0, 1, 127, 128, 255, 256, 300)


@pytest.mark.parametrize("chunk", [1, 64], ids=["decode", "chunk"])
def test_flash_local_attention_reads_only_the_pages_the_window_keeps(chunk: int) -> None:
    dev, dt = torch.device("cuda"), torch.float16
    with _window_cache() as c:
        kind = window_kind(c)
        layer = 0  # the windowed layer (layer_windows=(WINDOW, None))
        tpp = c.page_size // c.geometry.token_bytes  # tokens a page of one buffer
        assert tpp % 128 == 0 and tpp >= 1024, tpp
        slots = sorted(c.alloc_reqid() for _ in OFFSETS)
        ctxs = [3 * tpp + off + WINDOW for off in OFFSETS]  # the last query's window starts at 3 * tpp + off
        assert c.step({s: n - chunk for s, n in zip(slots, ctxs)})  # the prompt, then this iteration
        assert c.step({s: n for s, n in zip(slots, ctxs)})
        for s in slots:
            assert kind.books.holes(s) >= 2, (s, kind.books.slot_pages[s])  # pages behind the window given back
        k, v = c.k_cache(layer), c.v_cache(layer)  # [B, T, H, D] over the VMM pages
        g = torch.Generator(device=dev).manual_seed(0)
        for s, n in zip(slots, ctxs):
            lo = n - chunk - WINDOW + 1  # the first key any query of the iteration sees
            k[s, lo:n] = torch.randn(n - lo, KV_HEADS, HEAD_DIM, device=dev, dtype=dt, generator=g)
            v[s, lo:n] = torch.randn(n - lo, KV_HEADS, HEAD_DIM, device=dev, dtype=dt, generator=g)
        meta = AttentionMetadata.build(slots, [n - chunk for n in ctxs], [chunk] * len(slots),
                                       c.geometry.slot_tokens, dev)
        q = torch.randn(chunk * len(slots), 2 * KV_HEADS, HEAD_DIM, device=dev, dtype=dt, generator=g)  # GQA 2:1
        out = torch_flash_attention(q, k, v, meta, HEAD_DIM ** -0.5, WINDOW)
        ref = sdpa_attention(q, k, v, meta, HEAD_DIM ** -0.5, WINDOW)  # reads exactly the window
        torch.cuda.synchronize()
        assert not out.isnan().any()
        torch.testing.assert_close(out, ref, atol=5e-3, rtol=5e-3)
        st = c.stats().kinds
        assert st[f"window={WINDOW}"].num_mapped_pages < st["full"].num_mapped_pages


# ------------------------------------------------------------------ the engine ----
def _window_model(family: str) -> Any:
    common = dict(vocab_size=128, hidden_size=KV_HEADS * HEAD_DIM, intermediate_size=256,
                  num_attention_heads=KV_HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                  max_position_embeddings=8192, initializer_range=0.05, sliding_window=WINDOW,
                  eos_token_id=None, bos_token_id=None, pad_token_id=0)  # no EOS: every run to max_tokens
    if family == "mistral":  # every layer windowed: one kind
        return transformers.MistralConfig(num_hidden_layers=2, **common)
    return transformers.Gemma3TextConfig(num_hidden_layers=6, **common)  # 5 local to 1 global: two kinds


def _long_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 128, (n,), generator=g).tolist() for n in (2600, 1900, 700)]


def _greedy_generate(model: Any, prompts: list[list[int]], n: int) -> list[list[int]]:
    out = []
    for p in prompts:
        ids = torch.tensor([p], device="cuda")
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             pad_token_id=0)
        out.append(gen[0, len(p):].tolist())
    return out


@pytest.mark.parametrize("family", ["mistral", "gemma3"])
def test_engine_with_windows_on_cuda_gives_pages_back_and_matches_generate(family: str) -> None:
    """float32 (the sdpa kernel): tokens equal generate's; fp16: FlashAttention's local
    attention (torch_flash, CUDA graphs for decodes) against sdpa on the same pages."""
    config, prompts, n = _window_model(family), _long_prompts(), 24
    cpu_model = build_model(config)
    ref = _greedy_generate(copy.deepcopy(cpu_model).to("cuda"), prompts, n)
    params = SamplingParams(temperature=0, max_tokens=n)
    runs: dict[str, list[list[int]]] = {}
    for dtype, kernel in (("float32", None), ("float16", "sdpa"), ("float16", "torch_flash")):
        with LLM(copy.deepcopy(cpu_model), device="cuda", dtype=dtype, attention=kernel, max_batch_size=4,
                 max_num_batched_tokens=512, prefetch=False) as llm:
            assert llm.runner.kernel.name == (kernel or "sdpa")
            books = window_kind(llm.cache).books
            ids = [llm.add_request(p, params) for p in prompts]
            done, holes = {}, 0
            while llm.has_unfinished():
                for out in llm.step():
                    if out.finished:
                        done[out.request_id] = out.token_ids
                holes = max(holes, max(books.holes(s) for s in range(books.num_slots)))
            runs[f"{dtype} {kernel}"] = [done[i] for i in ids]
            assert llm.runner.kernel.name == (kernel or "sdpa"), "the kernel fell back"
            assert holes >= 1, "no page was given back behind the window"
            llm.cache.allocator.check_invariants()
    assert runs["float32 None"] == ref
    same = sum(a == b for a, b in zip(runs["float16 torch_flash"], runs["float16 sdpa"]))
    assert same >= len(prompts) - 1, (runs["float16 torch_flash"], runs["float16 sdpa"])


@pytest.mark.parametrize("family", list(HYBRIDS))
def test_state_models_on_cuda_match_generate(family: str) -> None:
    """The recurrent states in CUDA VMM pages (the allocator's state kind): requests in
    chunks beside decodes, float32 tokens equal generate's on the same weights, every state
    row given back after."""
    from tests.engine.test_model_support import states_given_back
    from tests.helpers import prompts

    config = hybrid_config(family)
    cpu_model = build_model(config)
    ps, n = prompts(), 12
    ref = _greedy_generate(copy.deepcopy(cpu_model).to("cuda"), ps, n)
    with LLM(copy.deepcopy(cpu_model), device="cuda", dtype="float32", max_batch_size=4, max_num_seqs=3,
             max_num_batched_tokens=16) as llm:
        assert llm.cache.backend.device.type == "cuda"
        outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        assert states_given_back(llm)
    assert [o.token_ids for o in outs] == ref


# ------------------------------------------------------------- the coordinator ----
def _fill(c: vattn.KVCache, slot: int, lo: int, hi: int, tag: float) -> None:
    for layer in range(c.config.num_layers):
        val = (torch.arange(lo, hi, device="cuda", dtype=torch.float32) % 97 + tag)[:, None, None]
        c.k_cache(layer)[slot, lo:hi] = val.half()
        c.v_cache(layer)[slot, lo:hi] = -val.half()


def _check(c: vattn.KVCache, slot: int, lo: int, hi: int, tag: float) -> None:
    for layer in range(c.config.num_layers):
        val = (torch.arange(lo, hi, device="cuda", dtype=torch.float32) % 97 + tag)[:, None, None].half()
        assert torch.equal(c.k_cache(layer)[slot, lo:hi], val.expand(-1, KV_HEADS, HEAD_DIM)), (slot, layer)
        assert torch.equal(c.v_cache(layer)[slot, lo:hi], (-val).expand(-1, KV_HEADS, HEAD_DIM)), (slot, layer)


def test_coordinator_on_the_driver_fork_swap_holes_and_a_failed_step() -> None:
    with _window_cache() as c:
        tpp = c.page_size // c.geometry.token_bytes
        kind = window_kind(c)
        r = c.alloc_reqid()
        n = 3 * tpp + 10
        # grows across pages: those behind the window go back once no query of a step reads them (the
        # step to n computes queries from 2 * tpp on, which read page 1: the one after it gives it back)
        for m in (tpp, 2 * tpp, n - 1, n):
            assert c.step({r: m})
        assert kind.books.holes(r) >= 2
        live = n - WINDOW - WINDOW_MARGIN_TOKENS  # rows every kind still maps
        _fill(c, r, live, n, 1.0)
        child = c.fork(r, n)
        _check(c, child, live, n, 1.0)
        handle = c.swap_out(child, n)
        other = c.alloc_reqid()
        assert c.step({other: 2 * tpp})
        _fill(c, other, 0, 2 * tpp, 2.0)
        back = c.swap_in(handle)
        assert c.step({r: n + 1, back: n + 1})
        torch.cuda.synchronize()
        _check(c, r, live, n, 1.0)
        _check(c, back, live, n, 1.0)
        _check(c, other, 0, 2 * tpp, 2.0)
        c.allocator.check_invariants()
        # a step that cannot be backed in every kind changes no kind: lengths and pages stay
        c.trim()  # no spare page: the budget becomes exactly what is created
        c.allocator.set_max_pages(-(-c.allocator.layer.created_bytes // c.allocator.unit_bytes))
        before = {s: (c.allocator.kinds[0].books.slot_pages[s][:], kind.books.slot_pages[s][:]) for s in (r, back)}
        res = c.step({r: n + 4 * tpp, back: n + 2})
        assert not res and r in res.failed, res
        assert kind.books.slot_pages[r] == before[r][1] and c.allocator.kinds[0].books.slot_pages[r] == before[r][0]
        c.allocator.check_invariants()
        torch.cuda.synchronize()
        _check(c, r, live, n, 1.0)
