"""CUDA-only checks: kernels read and write the virtual tensors. Skipped without a GPU."""
from __future__ import annotations

import pytest
import torch

import vattn

pytestmark = pytest.mark.gpu

DRIVERS = ["cext", "cuda-python"]


def _cache(driver: str, **kw) -> vattn.KVCache:
    if driver == "cuda-python":
        pytest.importorskip("cuda.bindings")
    args = dict(num_layers=2, num_kv_heads=4, head_dim=64, max_batch_size=4, max_context_len=8192,
                dtype="float16", device="cuda", cuda_driver=driver)
    return vattn.KVCache(**{**args, **kw})


@pytest.mark.parametrize("driver", DRIVERS)
@pytest.mark.parametrize("layout", ["per-layer", "fused"])
def test_kernel_writes_survive_more_mapping(driver, layout):
    # 2 MiB pages hold 4096 tokens of this per-layer shape: the slots must take 3 pages' worth
    with _cache(driver, layout=layout, max_context_len=32768) as c:
        tpp = c.page_size // c.geometry.token_bytes  # tokens per page
        assert 3 * tpp <= c.config.max_context_len, (tpp, c.page_size)
        a, b = c.alloc_reqid(), c.alloc_reqid()
        assert c.step({a: tpp, b: 1})
        x = torch.randn(tpp, 4, 64, device="cuda", dtype=torch.float16)
        c.k_cache(1)[a, :tpp].copy_(x)  # a CUDA kernel writes through the virtual tensor
        c.v_cache(0)[a, :tpp] = x * 2
        assert c.step({a: 3 * tpp, b: 2 * tpp})  # pages mapped around the written one
        c.k_cache(1)[b, : 2 * tpp].fill_(3)
        torch.cuda.synchronize()
        assert torch.equal(c.k_cache(1)[a, :tpp], x)
        assert torch.equal(c.v_cache(0)[a, :tpp], x * 2)
        assert c.k_cache(1).device.type == "cuda"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ["per-layer", "fused"])
def test_flash_sdpa_on_virtual_slice_equals_contiguous(dtype, layout):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with _cache("cext", dtype=dtype, layout=layout) as c:
        r = c.alloc_reqid()
        n = 3000
        assert c.step({r: n})
        c.k_cache(0)[r, :n] = torch.randn(n, 4, 64, device="cuda", dtype=dtype)
        c.v_cache(0)[r, :n] = torch.randn(n, 4, 64, device="cuda", dtype=dtype)
        q = torch.randn(1, 4, 16, 64, device="cuda", dtype=dtype)
        k = c.k_cache(0)[r, :n].transpose(0, 1)[None]  # [1, H, n, D] view of the virtual cache
        v = c.v_cache(0)[r, :n].transpose(0, 1)[None]
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
            ref = torch.nn.functional.scaled_dot_product_attention(q, k.contiguous(), v.contiguous())
        assert torch.equal(out, ref)


def test_reclamation_waits_for_running_kernels():
    # One page group of budget per request: b's step must take a's pages while a long
    # kernel still reads them; the allocator waits on a's fence first, so the result is right.
    with _cache("cext", max_context_len=4096, physical_memory=None, prefetch=False) as c:
        g = c.geometry
        c_budget = g.pages_for(4096)
        c.allocator.max_pages = c_budget  # room for one full request
        a = c.alloc_reqid()
        assert c.step({a: 4096})
        c.k_cache(0)[a].fill_(1)
        src = c.k_cache(0)[a].reshape(4096, -1)  # [4096, 256] reads a's pages
        acc = torch.zeros(256, 256, device="cuda", dtype=torch.float16)
        for _ in range(200):  # a long queue of kernels reading the pages
            acc += src.t() @ src / 4096
        c.free_reqid(a)
        b = c.alloc_reqid()
        if b == a:
            b = c.alloc_reqid()
        res = c.step({b: 4096})  # reclaims a's pages: must wait for the queue above
        assert res and res.num_unmapped == c_budget
        torch.cuda.synchronize()
        assert torch.allclose(acc.float(), torch.full((256, 256), 200.0, device="cuda"))


@pytest.mark.parametrize("layout", ["per-layer", "fused"])
def test_torch_flash_reads_only_the_mapped_rows_of_the_vmm_cache(layout):
    # vattn's torch_flash kernel on the real VMM cache: slot 1 and every page past a slot's
    # context are unmapped (a read there faults); a decode past the first page, and a prompt.
    from vattn.attention import AttentionMetadata, sdpa_attention, torch_flash_attention

    dt = torch.bfloat16
    with _cache("cext", dtype=dt, layout=layout, max_context_len=16384, prefetch=False) as c:
        tpp = c.page_size // c.geometry.token_bytes  # tokens per page
        s0, s1, s2 = sorted(c.alloc_reqid() for _ in range(3))
        used, starts, lens = [s0, s2], [tpp + 5, 0], [1, 300]
        assert c.step({s: st + n for s, st, n in zip(used, starts, lens)})
        k, v = c.k_cache(1), c.v_cache(1)  # [B, T, 4, 64]
        for s, st, n in zip(used, starts, lens):
            k[s, :st + n] = torch.randn(st + n, 4, 64, device="cuda", dtype=dt)
            v[s, :st + n] = torch.randn(st + n, 4, 64, device="cuda", dtype=dt)
        meta = AttentionMetadata.build(used, starts, lens, c.geometry.slot_tokens, torch.device("cuda"))
        q = torch.randn(sum(lens), 8, 64, device="cuda", dtype=dt)  # GQA: 8 query heads on 4
        out = torch_flash_attention(q, k, v, meta, 64 ** -0.5, None)
        ref = sdpa_attention(q, k, v, meta, 64 ** -0.5, None)
        torch.cuda.synchronize()
        assert c.stats().mapped_bytes < 2 * c.geometry.pages_per_slot * c.geometry.group_bytes
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
