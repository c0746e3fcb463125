from __future__ import annotations

import gc
import os
import time
from pathlib import Path

import pytest
import torch

# Many tiny kernels: torch's second intra-op thread often stalls 4-24 ms waking up on small
# machines (CI has 2 CPUs), which made the suite 3-5x slower and taught us nothing.
torch.set_num_threads(1)

import vattn
from vattn.prefix_cache import PrefixCache
from tests import fake_cuda as fake_cuda_lib

# The repository: subprocess tests run from it and put it on PYTHONPATH (`tests.*` imports).
REPO = Path(__file__).resolve().parent.parent


class FakeClock:
    """A stand-in for `time.monotonic` that moves only when told: idle policies
    (`vattn.idle.IdleTrim.clock`) are tested by moving it, never by sleeping. It starts at
    `time.monotonic()`, so it can replace the clock of a policy that already read the real one."""

    def __init__(self, now: float | None = None) -> None:
        self.now = time.monotonic() if now is None else now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def vattn_mappings() -> tuple[int, int]:
    """(number of memfd mappings of vattn pages, open memfds of vattn pages) of this process
    (the host backend's pages)."""
    with open("/proc/self/maps") as f:
        maps = sum("vattn-pages" in line for line in f)
    fds = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds += "vattn-pages" in os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return maps, fds


def cuda_ok() -> bool:
    return torch.cuda.is_available()


def hf_cb_problem() -> str:
    """Why transformers' continuous batching cannot run on vattn here ("" when it can): a
    transformers release `hf_cb` does not support, or 5.17-5.20 on a host without psutil."""
    from vattn.integrations import hf_cb

    try:
        hf_cb.check_transformers()
        return hf_cb.memory_problem() or ""
    except vattn.InvalidConfigError as e:  # pragma: no cover - another transformers
        return str(e)


def pytest_collection_modifyitems(config, items):
    if cuda_ok():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # (not `"gpu" in item.keywords`: a folder named gpu is one)
            item.add_marker(skip)


# "fakecuda": the CUDA backend (C extension path) on tests/fake_cuda's strict fake driver,
# host memory behind it, so the CUDA code runs and its data is checked on any machine.
DEVICES = [
    pytest.param("cpu", id="host"),
    pytest.param("fakecuda", id="fakecuda"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.gpu),
]


@pytest.fixture(scope="session")
def fake_cuda_session() -> fake_cuda_lib.FakeCuda:
    fake = fake_cuda_lib.load()
    if fake is None:
        pytest.skip("the fake CUDA driver needs a C compiler (cc)")
    return fake


@pytest.fixture
def fake_cuda(fake_cuda_session) -> fake_cuda_lib.FakeCuda:
    """The fake driver, reset; after the test nothing may be left live and no rule broken."""
    fake_cuda_session.reset()
    fake_cuda_session.set_current(None)  # as on a new thread
    before = fake_cuda_session.live()  # (0, 0, 0) unless an earlier test leaked (and failed for it)
    yield fake_cuda_session
    try:
        if fake_cuda_session.live() != before:
            gc.collect()  # a range goes with its last tensor view, which a cycle may hold
        fake_cuda_session.assert_clean(before)
    finally:
        fake_cuda_session.reset()
        fake_cuda_session.set_current(None)


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    if request.param == "fakecuda":
        request.getfixturevalue("fake_cuda")
    return request.param


SMALL = dict(num_layers=2, num_kv_heads=2, head_dim=16, max_batch_size=4, max_context_len=512, dtype="float32")


def _scale_to_granularity(args: dict, gran: int) -> None:
    """Run a host-sized test on CUDA: pages grow to the granularity and tokens grow by the
    same factor (more KV heads), so tokens per page and page counts stay the same."""
    page = args.get("page_size") or gran
    if page < gran:
        assert gran % page == 0
        factor = gran // page
        args["page_size"] = gran
        args["num_kv_heads"] = args["num_kv_heads"] * factor
        if args.get("physical_memory"):
            args["physical_memory"] *= factor


def new_cache(device: str, **kw) -> vattn.KVCache:
    """A cache with SMALL defaults on `device`: "cpu" (host), "fakecuda" or "cuda"."""
    args = {**SMALL, **kw}
    if device == "cpu":
        return vattn.KVCache(**args, device="cpu")
    if device == "fakecuda":
        backend = fake_cuda_lib.load().backend()
        _scale_to_granularity(args, backend.granularity)
        return vattn.KVCache(**args, backend=backend, device="cpu")
    from vattn import _C

    _scale_to_granularity(args, _C.cuda_load().granularity(0))
    return vattn.KVCache(**args, device="cuda")


@pytest.fixture
def make_cache(device):
    """Build caches with small defaults on the parametrized device; closed after the test."""
    made: list[vattn.KVCache] = []

    def make(**kw) -> vattn.KVCache:
        cache = new_cache(device, **kw)
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


def cached(cache: vattn.KVCache, pc: PrefixCache, prompt: list[int], tag: float, flush: bool = True) -> None:
    """A request computes `prompt` (its K/V: `fill`'s pattern `tag`), caches it in the prefix
    cache `pc` and ends; `flush`: then wait for the offload tiers' writes (the disk writes run on
    the writer thread)."""
    r = cache.alloc_reqid()
    n = pc.map_prefix(r, prompt)
    assert cache.step({r: len(prompt)})
    fill(cache, r, n, len(prompt), tag)
    pc.insert(r, prompt)
    cache.free_reqid(r)
    if flush and pc.tiers is not None:
        assert pc.tiers.flush()


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


@pytest.fixture
def second_user():
    """`run(script)` as another local user (uid 65534: `tests.helpers.as_nobody`); skips where
    this process cannot switch users."""
    import subprocess

    from tests.helpers import NOBODY, as_nobody

    if os.geteuid() != 0:
        pytest.skip(f"planting files as another user needs root (this is uid {os.geteuid()})")
    try:
        as_nobody("true")
    except (OSError, subprocess.SubprocessError) as e:
        pytest.skip(f"cannot run as uid {NOBODY} here: {e}")
    return as_nobody
