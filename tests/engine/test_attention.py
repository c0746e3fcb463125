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

