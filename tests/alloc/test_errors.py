"""Every bad input raises its vattn error, and leaves the cache usable."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import vattn
from tests.conftest import SMALL, check, fill


def test_error_hierarchy():
    for cls in (vattn.InvalidConfigError, vattn.UnknownReqIdError, vattn.ContextLengthError,
                vattn.NoFreeSlotError, vattn.OutOfVirtualMemoryError, vattn.OutOfPhysicalMemoryError,
                vattn.MapCountLimitError, vattn.BackendError, vattn.ClosedError):
        assert issubclass(cls, vattn.VattnError)
    assert issubclass(vattn.UnknownReqIdError, vattn.InvalidRequestError)
    assert issubclass(vattn.ContextLengthError, ValueError)


@pytest.mark.parametrize("bad, match", [
    (dict(num_layers=0), "num_layers"),
    (dict(num_kv_heads=-1), "num_kv_heads"),
    (dict(head_dim=2.5), "head_dim"),
    (dict(max_batch_size=True), "max_batch_size"),
    (dict(max_context_len="8"), "max_context_len"),
    (dict(dtype="float13"), "dtype"),
    (dict(dtype=int), "dtype"),
    (dict(device="tpu"), "device"),
    (dict(device="cuda:banana"), "device"),
    (dict(layout="paged"), "layout"),
    (dict(page_size=0), "page_size"),
    (dict(page_size=6000), "multiple of the OS page size"),
    (dict(physical_memory=-5), "physical_memory"),
    (dict(physical_memory=100), "less than one page group"),
    (dict(max_batch_sizes=3), "unexpected keyword"),
    (dict(background="yes"), "background must be True or False"),
    (dict(prefetch=None), "prefetch must be True or False"),
    (dict(zero_reused_pages=1), "zero_reused_pages"),
    (dict(device="cpu:1"), "one memory"),
    (dict(head_dim=np.float32(16)), "head_dim"),
])
def test_invalid_config(bad, match):
    with pytest.raises(vattn.InvalidConfigError, match=match):
        vattn.KVCache(**{**SMALL, "device": "cpu", **bad})


def test_out_of_virtual_address_space():
    with pytest.raises(vattn.OutOfVirtualMemoryError, match="address space"):
        vattn.KVCache(num_layers=32, num_kv_heads=8, head_dim=128, max_batch_size=1 << 16,
                      max_context_len=1 << 20, dtype="float16", device="cpu")


@pytest.fixture
def cache():
    with vattn.KVCache(**SMALL, device="cpu", page_size=4096) as c:
        yield c


def test_bad_reqids(cache):
    with pytest.raises(vattn.UnknownReqIdError, match="not allocated"):
        cache.free_reqid(0)
    with pytest.raises(vattn.UnknownReqIdError, match="out of range"):
        cache.free_reqid(99)
    with pytest.raises(vattn.UnknownReqIdError):
        cache.free_reqid(-1)
    with pytest.raises(vattn.InvalidRequestError, match="int"):
        cache.free_reqid("0")
    r = cache.alloc_reqid()
    cache.free_reqid(r)
    with pytest.raises(vattn.UnknownReqIdError, match="already freed"):
        cache.free_reqid(r)  # double free
    with pytest.raises(vattn.UnknownReqIdError, match="alloc_reqid"):
        cache.step({r: 10})


def test_bad_seq_lens_change_nothing(cache):
    r = cache.alloc_reqid()
    assert cache.step({r: 100})
    fill(cache, r, 0, 100, 1)
    cache.synchronize()
    before = cache.stats()
    bad = [
        ({r: 513}, vattn.ContextLengthError, "max_context_len"),
        ({r: -1}, vattn.InvalidRequestError, "negative"),
        ({r: 1.5}, vattn.InvalidRequestError, "int"),
        ({r: True}, vattn.InvalidRequestError, "int"),
        ({"a": 3}, vattn.InvalidRequestError, "int"),
        ({3: 3}, vattn.UnknownReqIdError, "not allocated"),
        ({7: 0}, vattn.UnknownReqIdError, "out of range"),
        ({-1: 0}, vattn.UnknownReqIdError, "out of range"),
        ([100, 0], vattn.InvalidRequestError, "one per slot"),
        ("abcd", vattn.InvalidRequestError, "list"),
        (None, vattn.InvalidRequestError, "list"),
        (5, vattn.InvalidRequestError, "list"),
    ]
    for lens, err, match in bad:
        with pytest.raises(err, match=match):
            cache.step(lens)
    assert cache.stats() == before
    check(cache, r, 100, 1)
    assert cache.step({r: 101})


def test_no_free_slot(cache):
    for _ in range(4):
        cache.alloc_reqid()
    with pytest.raises(vattn.NoFreeSlotError, match="max_batch_size"):
        cache.alloc_reqid()


def test_bad_layer(cache):
    for bad in (-1, 2, "0", None):
        with pytest.raises(vattn.InvalidRequestError, match="layer"):
            cache.k_cache(bad)


def test_closed_cache_refuses_calls():
    c = vattn.KVCache(**SMALL, device="cpu", page_size=4096)
    r = c.alloc_reqid()
    c.close()
    c.close()  # idempotent
    for call in (c.alloc_reqid, lambda: c.step({r: 1}), lambda: c.free_reqid(r), lambda: c.reserve_physical(1)):
        with pytest.raises(vattn.ClosedError):
            call()


def test_cuda_without_gpu_is_a_clear_error():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(vattn.VattnError, match="CUDA"):
        vattn.KVCache(**SMALL, device="cuda")


def test_configuration_that_is_not_a_config():
    with pytest.raises(vattn.InvalidConfigError, match="CacheConfig"):
        vattn.init(2)
    with pytest.raises(vattn.InvalidConfigError, match="CacheConfig"):
        vattn.KVCache("x")


def test_numpy_and_tensor_integers_are_accepted_everywhere():
    args = {k: np.int64(v) if isinstance(v, int) else v for k, v in SMALL.items()}
    c = vattn.init(**args, device="cpu", page_size=np.int32(4096), physical_memory=np.int64(1 << 20))
    try:
        assert c.config.num_layers == 2 and type(c.config.num_layers) is int
        r = vattn.alloc_reqid()
        assert vattn.step({np.int64(r): np.int32(10)})
        for layer in (np.int64(1), torch.tensor(1)):
            assert vattn.k_cache(layer) is c.k_cache(1)
        assert c.reserve_physical(np.int64(0)) == 0
        vattn.free_reqid(np.int16(r))
    finally:
        vattn.close()


def test_negative_reserve_physical(cache):
    with pytest.raises(vattn.InvalidRequestError, match=">= 0"):
        cache.reserve_physical(-1)


def test_closed_cache_refuses_views_and_figures():
    c = vattn.KVCache(**SMALL, device="cpu", page_size=4096)
    c.close()
    for call in (lambda: c.k_cache(0), lambda: c.v_cache(1), c.stats):
        with pytest.raises(vattn.ClosedError, match="closed"):
            call()


def test_every_exception_is_defined_in_errors_py():
    """One home for the exception hierarchy (every class derived from an ...Error): other
    modules import (and re-export) them. (A server's own control-flow exception, such as
    hf_serve's Refusal, an HTTP answer, is not part of it.)"""
    import ast
    from pathlib import Path

    root = Path(vattn.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.name == "errors.py" and path.parent == root:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                    getattr(b, "id", getattr(b, "attr", "")).endswith("Error") for b in node.bases):
                found.append(f"{path.relative_to(root)}:{node.name}")
    assert not found, found


def test_every_error_class_is_listed_in_the_allocator_doc() -> None:
    """docs/allocator.md lists every class of vattn/errors.py (it once listed 10 of 20)."""
    import inspect
    import pathlib

    import vattn.errors

    doc = (pathlib.Path(__file__).parents[2] / "docs" / "allocator.md").read_text()
    classes = [name for name, c in inspect.getmembers(vattn.errors, inspect.isclass)
               if issubclass(c, vattn.errors.VattnError)]
    assert len(classes) >= 20
    assert [name for name in classes if f"`{name}`" not in doc] == []
