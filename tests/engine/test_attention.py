"""The attention kernels on cache rows (CPU SDPA; CUDA kernels when a GPU is there)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from vattn.attention import AttentionMetadata, forward_context, get_forward_context, sdpa_attention  # noqa: E402
from vattn.errors import VattnError  # noqa: E402


@pytest.mark.parametrize("window", [None, 3])
def test_sdpa_attention_on_cache_rows_matches_full_causal(window: int | None) -> None:
    """A decode, a fresh prompt and a later chunk in one batch equal causal attention over
    each whole sequence; GQA (4 query heads on 2 KV heads)."""
    g = torch.Generator().manual_seed(0)
    B, T, Hq, Hkv, D = 4, 24, 4, 2, 8
    k_cache, v_cache = torch.zeros(B, T, Hkv, D), torch.zeros(B, T, Hkv, D)
    full_len = {0: 9, 2: 7, 3: 12}
    k_full = {s: torch.randn(n, Hkv, D, generator=g) for s, n in full_len.items()}
    v_full = {s: torch.randn(n, Hkv, D, generator=g) for s, n in full_len.items()}
    q_full = {s: torch.randn(n, Hq, D, generator=g) for s, n in full_len.items()}
    starts = {0: 8, 2: 0, 3: 5}  # decode, whole prompt, chunk of 7
    for s, start in starts.items():
        k_cache[s, :start], v_cache[s, :start] = k_full[s][:start], v_full[s][:start]
    slots = sorted(full_len)
    meta = AttentionMetadata.build(slots, [starts[s] for s in slots],
                                   [full_len[s] - starts[s] for s in slots], T, torch.device("cpu"))
    q = torch.cat([q_full[s][starts[s]:] for s in slots])
    k_cache[meta.slot_ids, meta.positions] = torch.cat([k_full[s][starts[s]:] for s in slots])
    v_cache[meta.slot_ids, meta.positions] = torch.cat([v_full[s][starts[s]:] for s in slots])
    out = sdpa_attention(q, k_cache, v_cache, meta, 0.3, window)
    refs = []
    for s in slots:
        n = full_len[s]
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        mask = (j <= i) & ((j > i - window) if window else True)
        o = torch.nn.functional.scaled_dot_product_attention(
            q_full[s].transpose(0, 1), k_full[s].repeat_interleave(2, 1).transpose(0, 1),
            v_full[s].repeat_interleave(2, 1).transpose(0, 1), attn_mask=mask, scale=0.3)
        refs.append(o.transpose(0, 1)[starts[s]:])
    torch.testing.assert_close(out, torch.cat(refs))


def test_forward_context_is_cleared() -> None:
    with pytest.raises(VattnError):
        get_forward_context()
    meta = AttentionMetadata.build([0], [0], [1], 8, torch.device("cpu"))
    with pytest.raises(RuntimeError):
        with forward_context(object()) as ctx:  # type: ignore[arg-type]
            assert get_forward_context() is ctx
            raise RuntimeError
    with pytest.raises(VattnError):
        get_forward_context()
    assert meta.context_lens == [1]


# -------------------------------------------------------------------- CUDA kernels ----
@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 16])
@pytest.mark.parametrize("fused", [False, True], ids=["per-layer", "fused"])
@pytest.mark.parametrize("kernel", ["torch_flash", "flash_attn"])
def test_cuda_kernels_match_sdpa_on_slot_rows(kernel: str, fused: bool, window: int | None) -> None:
    """The CUDA kernels read slot rows with a padded slot stride (and the fused layout's
    token stride) like per-request SDPA, and never touch a token past a context length:
    those hold NaN here."""
    from vattn.attention import flash_attn_attention, flash_attn_available, torch_flash_attention

    if kernel == "flash_attn" and not flash_attn_available():
        pytest.skip("flash_attn is not installed")
    fn = flash_attn_attention if kernel == "flash_attn" else torch_flash_attention
    B, T, slot_tokens, L, Hq, Hkv, D = 4, 100, 128, 3, 8, 2, 64
    dev, dt = torch.device("cuda"), torch.float16
    shape = (B, slot_tokens, L, Hkv, D) if fused else (B, slot_tokens, Hkv, D)
    k_buf = torch.full(shape, float("nan"), device=dev, dtype=dt)
    v_buf = torch.full(shape, float("nan"), device=dev, dtype=dt)
    k_cache = k_buf[:, :T, 1] if fused else k_buf[:, :T]  # [B, T, H_kv, D]
    v_cache = v_buf[:, :T, 1] if fused else v_buf[:, :T]
    slots, starts, lens = [0, 2, 3], [37, 0, 20], [1, 50, 30]  # a decode, a prompt, a chunk
    for s, start, n in zip(slots, starts, lens):
        k_cache[s, :start + n] = torch.randn(start + n, Hkv, D, device=dev, dtype=dt)
        v_cache[s, :start + n] = torch.randn(start + n, Hkv, D, device=dev, dtype=dt)
    meta = AttentionMetadata.build(slots, starts, lens, slot_tokens, dev)
    q = torch.randn(sum(lens), Hq, D, device=dev, dtype=dt)
    ref = sdpa_attention(q, k_cache, v_cache, meta, D ** -0.5, window)
    out = fn(q, k_cache, v_cache, meta, D ** -0.5, window)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, atol=5e-3, rtol=5e-3)



# ------------------------------------------------------------- FlashAttention 4 ----
# A stand-in for flash_attn.cute (FlashAttention 4's package is a namespace `flash_attn` with
# only `cute` in it): its varlen function reads the flat rows as the CUDA kernel does, from
# cu_seqlens_k for seqused_k keys, causal aligned to the end, with a left window.
_FAKE_FA4 = '''
import torch, torch.nn.functional as F
CALLS = []
def flash_attn_varlen_func(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                           seqused_k=None, softmax_scale=None, causal=False, window_size=(None, None), **kw):
    CALLS.append(dict(k_shape=tuple(k.shape), k_stride=k.stride(), data_ptr=k.data_ptr(), causal=causal,
                      window_size=window_size, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k))
    cu_q, cu_k, used = cu_seqlens_q.tolist(), cu_seqlens_k.tolist(), seqused_k.tolist()
    out = torch.empty_like(q)
    for b in range(len(used)):
        qb = q[cu_q[b]:cu_q[b + 1]].transpose(0, 1)  # [H_q, n, D]
        n, ctx = qb.shape[1], used[b]
        kb, vb = (x[cu_k[b]:cu_k[b] + ctx].transpose(0, 1) for x in (k, v))  # [H_kv, ctx, D]
        qpos, kpos = torch.arange(ctx - n, ctx)[:, None], torch.arange(ctx)[None, :]
        mask = kpos <= qpos
        if window_size[0] is not None:
            mask &= kpos >= qpos - window_size[0]
        o = F.scaled_dot_product_attention(qb[None], kb[None], vb[None], attn_mask=mask, scale=softmax_scale,
                                           enable_gqa=True)
        out[cu_q[b]:cu_q[b + 1]] = o[0].transpose(0, 1)
    return out, None
'''


@pytest.fixture
def fake_fa4(tmp_path, monkeypatch):
    """flash_attn.cute on sys.path as FlashAttention 4 installs it (no flash_attn/__init__.py)."""
    import sys

    (tmp_path / "flash_attn" / "cute").mkdir(parents=True)
    (tmp_path / "flash_attn" / "cute" / "__init__.py").write_text(_FAKE_FA4)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "flash_attn" or m.startswith("flash_attn.")]:
        monkeypatch.delitem(sys.modules, name)
    yield
    for name in [m for m in sys.modules if m == "flash_attn" or m.startswith("flash_attn.")]:
        del sys.modules[name]


def test_flash_attn_4_is_refused_clearly_when_not_installed(monkeypatch) -> None:
    import importlib.util

    from vattn import attention
    from vattn.engine.config import EngineConfig
    from vattn.errors import InvalidConfigError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("flash_attn") else real(name, *a))
    assert not attention.flash_attn_4_available()
    assert EngineConfig(attention="flash_attn_4").attention == "flash_attn_4"  # a known name
    with pytest.raises(InvalidConfigError, match="pip install flash-attn-4"):
        attention.AttentionKernel("flash_attn_4")


@pytest.mark.parametrize("window", [None, 5])
def test_flash_attn_4_reads_the_slot_rows_in_one_varlen_call(fake_fa4, window) -> None:
    """FlashAttention 4 alone installs a namespace `flash_attn` without flash-attn 2's API: the
    `flash_attn` kernel is not taken for it. `flash_attn_4` calls its varlen function once per
    layer on the flat rows of the cache itself (no copy: the same memory, the slot stride), with
    each slot's row and context length, and equals sdpa."""
    import flash_attn.cute as fa4

    from vattn import attention

    assert attention.flash_attn_4_available() and not attention.flash_attn_available()
    assert attention.select_kernel(torch.device("cuda"), torch.float16) == "torch_flash"
    g = torch.Generator().manual_seed(0)
    B, T, Hq, Hkv, D = 4, 40, 4, 2, 8
    k_cache, v_cache = torch.randn(B, T, Hkv, D, generator=g), torch.randn(B, T, Hkv, D, generator=g)
    slots, starts, lens = [0, 2, 3], [17, 0, 6], [1, 9, 7]  # a decode, a prompt, a chunk
    meta = AttentionMetadata.build(slots, starts, lens, T, torch.device("cpu"))
    q = torch.randn(sum(lens), Hq, D, generator=g)
    kern = attention.AttentionKernel("flash_attn_4")
    key, value = torch.randn(sum(lens), Hkv, D, generator=g), torch.randn(sum(lens), Hkv, D, generator=g)
    out = kern.forward(q, key, value, k_cache, v_cache, meta, 0.3, window)
    assert kern.name == "flash_attn_4" and kern.verified == {"decode", "prompt", "chunk"}  # checked against sdpa
    ref = sdpa_attention(q, k_cache, v_cache, meta, 0.3, window)
    torch.testing.assert_close(out, ref)
    call = fa4.CALLS[-1]
    assert call["data_ptr"] == k_cache.data_ptr() and call["k_stride"] == k_cache.stride()[1:]
    assert call["k_shape"] == ((B - 1) * T + T, Hkv, D) and call["causal"]
    assert call["window_size"] == ((window - 1, 0) if window else (None, None))
    assert call["max_seqlen_q"] == 9 and call["max_seqlen_k"] == 18


def test_flash_attn_4_refuses_a_layout_whose_pages_split_its_tiles(fake_fa4) -> None:
    """A 2 MiB page of the fused 8B shape holds 32 tokens: a 128-token tile after a context
    could read an unmapped page, so the kernel says so instead of reading."""
    from vattn import attention

    fused = torch.zeros(2, 64, 32, 8, 128, dtype=torch.bfloat16)[:, :, 0]  # [B, T, H, D], 64 KiB a token
    assert "use layout='per-layer'" in attention.flash_attn_4_layout_problem(fused)
    assert attention.flash_attn_4_layout_problem(torch.zeros(2, 64, 8, 128, dtype=torch.bfloat16)) is None
    meta = AttentionMetadata.build([0], [3], [1], 64, torch.device("cpu"))
    q, kv = torch.zeros(1, 8, 128, dtype=torch.bfloat16), torch.zeros(1, 8, 128, dtype=torch.bfloat16)
    with pytest.raises(VattnError, match="cannot read this cache"):
        attention.AttentionKernel("flash_attn_4").forward(q, kv, kv, fused, fused.clone(), meta, 0.1)
