from __future__ import annotations

import pytest
import torch

import vattn


def cuda_ok() -> bool:
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if cuda_ok():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


DEVICES = [
    pytest.param("cpu", id="host"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.gpu),
]


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param


SMALL = dict(num_layers=2, num_kv_heads=2, head_dim=16, max_batch_size=4, max_context_len=512, dtype="float32")


def _scale_for_cuda(args: dict) -> None:
    """Run a host-sized test on the GPU: pages grow to the granularity and tokens grow by
    the same factor (more KV heads), so tokens per page and page counts stay the same."""
    from vattn import _C

    _C.cuda_load()
    gran = _C.cuda_granularity(0)
    page = args.get("page_size") or gran
    if page < gran:
        assert gran % page == 0
        factor = gran // page
        args["page_size"] = gran
        args["num_kv_heads"] = args["num_kv_heads"] * factor
        if args.get("physical_memory"):
            args["physical_memory"] *= factor


@pytest.fixture
def make_cache(device):
    """Build caches with small defaults on the parametrized device; closed after the test."""
    made: list[vattn.KVCache] = []

    def make(**kw) -> vattn.KVCache:
        args = {**SMALL, "device": device, **kw}
        if device == "cuda":
            _scale_for_cuda(args)
        cache = vattn.KVCache(**args)
        made.append(cache)
        return cache

    yield make
    for c in made:
        c.close()


def fill(cache: vattn.KVCache, slot: int, start: int, end: int, tag: float) -> None:
    """Write a recognisable pattern for tokens [start, end) of `slot` in every layer."""
    if end <= start:
        return
    pos = torch.arange(start, end, dtype=torch.float32, device=cache.config.torch_device)
    for layer in range(cache.config.num_layers):
        val = (tag * 1000 + layer * 100 + pos % 97)[:, None, None].to(cache.config.dtype)
        cache.k_cache(layer)[slot, start:end] = val
        cache.v_cache(layer)[slot, start:end] = -val


def check(cache: vattn.KVCache, slot: int, end: int, tag: float) -> None:
    """Assert tokens [0, end) of `slot` hold the pattern `fill` wrote."""
    if end <= 0:
        return
    pos = torch.arange(0, end, dtype=torch.float32, device=cache.config.torch_device)
    for layer in range(cache.config.num_layers):
        val = (tag * 1000 + layer * 100 + pos % 97)[:, None, None].to(cache.config.dtype)
        k = cache.k_cache(layer)[slot, :end]
        v = cache.v_cache(layer)[slot, :end]
        assert torch.equal(k, val.expand_as(k)), f"K of slot {slot} layer {layer} corrupted"
        assert torch.equal(v, (-val).expand_as(v)), f"V of slot {slot} layer {layer} corrupted"
