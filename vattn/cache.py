"""`KVCache`: virtual K/V tensors per layer, backed by physical pages on demand."""
from __future__ import annotations

import dataclasses
import functools
import weakref
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from vattn.allocator import HybridAllocator, MemoryStats, PageAllocator, StepResult
from vattn.checks import as_int
from vattn.config import CacheConfig, Geometry
from vattn.errors import ClosedError, InvalidConfigError, InvalidRequestError
from vattn.vmem import make_backend
from vattn.vmem.base import Backend


SWAP_CHUNK = 256 << 20  # host buffers of a swapped-out request: never one buffer over this
# Tokens kept mapped before a sliding window on CUDA: FlashAttention-2's local attention
# reads whole key blocks (64 or 128 tokens) from the one holding the window's first key.
WINDOW_MARGIN_TOKENS = 256


@dataclass
class SwapHandle:
    """A swapped-out request: its tokens in host memory, and where it was."""

    slot: int
    epoch: int
    num_tokens: int
    host: list[list[torch.Tensor]]  # per buffer, chunks of its first num_tokens tokens (uint8)
    copied_in: bool | None = None  # after swap_in: whether the data had to be copied back
    live: tuple[int, int] | None = None  # after swap_in: (reqid, its allocation) the request came back as
    # sliding-window layer kinds: per kind, the first page the slot still mapped (the host
    # copy of its buffers starts there: the pages before it were given back)
    first_pages: tuple[int, ...] | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for chunks in self.host for t in chunks)


class KVCache:
    """A vAttention KV cache: one virtual K and one virtual V tensor per layer.

    ```
    cache = vattn.init(num_layers=2, num_kv_heads=4, head_dim=64, max_batch_size=8,
                       max_context_len=4096, dtype="float16", device="cpu", page_size=64 << 10)
    r = cache.alloc_reqid()
    assert cache.step({r: 100})        # pages for 100 tokens of request r are mapped
    cache.k_cache(0)[r, :100] = k      # [B, L, H, D] view: write and read with any torch op
    cache.free_reqid(r)                # r keeps its pages for the next request
    ```
    Tensors are `[max_batch_size, max_context_len, num_kv_heads, head_dim]` views of
    reserved address space: a request's row is contiguous in virtual memory; only pages
    below its length are backed, and reading past them faults. Use as a context manager
    or call `close()` to release all memory; tensors must not be used after that.
    """

    def __init__(self, config: CacheConfig | None = None, *, backend: Backend | None = None,
                 budget: Any = None, **kwargs: Any) -> None:
        """`config` or `vattn.init`'s keyword arguments. `backend`: a ready `vattn.vmem.Backend`
        to use instead of the one `config.device` names (tests, custom memory). `budget`: a
        `vattn.Budget` shared with other caches and elastic pools: pages are created only
        within it, and memory one gives back (free requests' cached pages) another can take."""
        if config is None:
            try:
                config = CacheConfig(**kwargs)
            except TypeError as e:
                raise InvalidConfigError(f"{e}; see help(vattn.init) for the arguments") from None
        elif not isinstance(config, CacheConfig):
            raise InvalidConfigError(
                f"the cache's configuration must be a vattn.CacheConfig, got {config!r}; or pass the sizes as "
                "keywords: vattn.init(num_layers=..., num_kv_heads=..., head_dim=..., max_batch_size=..., "
                "max_context_len=...)")
        elif kwargs:
            raise InvalidConfigError("give either a CacheConfig or keyword arguments, not both")
        self.config = config
        self.backend = backend if backend is not None else make_backend(config.torch_device, config.cuda_driver)
        page_size = config.page_size if config.page_size is not None else self.backend.default_page_size
        self.backend.check_page_size(page_size)
        self.geometry = g = Geometry(config, page_size)
        g.check_page_size()
        self.page_size = page_size

        max_pages = g.pages_per_slot * config.max_batch_size
        if config.physical_memory is not None:
            if config.physical_memory < g.group_bytes:
                raise InvalidConfigError(
                    f"physical_memory={config.physical_memory} is less than one page group "
                    f"({g.num_buffers} buffers x {page_size} bytes = {g.group_bytes} bytes)")
            max_pages = min(max_pages, config.physical_memory // g.group_bytes)
        elif (free := self.backend.free_memory()) is not None:  # leave room for the model's own tensors
            max_pages = min(max_pages, max(1, int(self.backend.default_memory_fraction * free) // g.group_bytes))

        # One reservation holds every buffer, one after another.
        self._range = self.backend.reserve(g.buffer_bytes * g.num_buffers, page_size)
        bases = [self._range.addr + b * g.buffer_bytes for b in range(g.num_buffers)]
        self._k, self._v = self._make_views()
        # uint8 views of each whole buffer: pages are copied (fork) and cleared through them
        self._bytes = self._byte_views()
        kinds = config.layer_kinds()
        # per kind: its buffers (K of its layers, then V), in the order its page groups hold them
        self.kind_buffers = [[*layers, *(config.num_layers + i for i in layers)] for _, layers in kinds]
        self.kind_names = ["full" if w is None else f"window={w}" for w, _ in kinds]
        self._kind_of = {b: k for k, buffers in enumerate(self.kind_buffers) for b in buffers}  # buffer -> kind
        if len(kinds) == 1:  # every layer alike (full attention, or one window: Mistral)
            window = kinds[0][0]
            self.allocator: PageAllocator | HybridAllocator = self._kind_allocator(
                g, bases, list(range(g.num_buffers)), max_pages,
                None if window is None else window + self._window_margin(), budget)
        else:
            self.allocator = self._hybrid(kinds, bases, max_pages, budget)
        # The memory goes when this cache and its last tensor view are gone (or at close()):
        # every view keeps the range alive, the range keeps `owner`, and the owner's finalizer
        # unmaps and releases the pages before the range frees its address space. Neither
        # the allocator nor the owner refers back to self or the range.
        owner = _MemoryOwner()
        self._range.keepalive = owner
        self._finalizer = weakref.finalize(owner, _close, self.allocator, self.backend)

    def _kind_allocator(self, g: Geometry, bases: list[int], buffers: list[int], max_pages: int,
                        window: int | None, budget: Any) -> PageAllocator:
        """The page allocator of the layer kind whose K/V buffers are `buffers`."""
        c, ref = self.config, weakref.ref(self)
        return PageAllocator(g, self.backend, [bases[b] for b in buffers], max_pages=max_pages,
                             background=c.background, prefetch=c.prefetch, prefetch_tokens=c.prefetch_tokens,
                             zero_pages=functools.partial(_zero_pages, ref, buffers) if c.zero_reused_pages else None,
                             copy_pages=functools.partial(_copy_pages, ref, buffers), budget=budget, window=window)

    def _hybrid(self, kinds: list[tuple[int | None, tuple[int, ...]]], bases: list[int], max_pages: int,
                budget: Any) -> HybridAllocator:
        """One allocator per layer kind (full attention, each window size), on one budget: the
        cache's own (its physical memory) unless the caller gave one."""
        from vattn.budget import Budget

        c, g = self.config, self.geometry
        own = None
        if budget is None:
            budget = own = Budget(max_pages * g.group_bytes)
        margin = self._window_margin()
        parts = []
        for (window, layers), buffers, name in zip(kinds, self.kind_buffers, self.kind_names):
            gk = Geometry(dataclasses.replace(c, num_layers=len(layers), layer_windows=None), self.page_size)
            cap = gk.pages_per_slot * c.max_batch_size
            if own is None and c.physical_memory is not None:
                cap = max(1, min(cap, c.physical_memory // gk.group_bytes))
            parts.append((name, self._kind_allocator(gk, bases, buffers, cap,
                                                     None if window is None else window + margin, budget)))
        return HybridAllocator(parts, budget=own, whole_group_bytes=g.group_bytes)

    def _window_margin(self) -> int:
        """Tokens kept mapped before a sliding window: the kernels read from a block boundary
        before it on CUDA (FlashAttention's local attention starts at the key block holding
        the window's first key); the CPU kernels read exactly the window."""
        return WINDOW_MARGIN_TOKENS if self.backend.device.type == "cuda" else 0

    def _byte_views(self) -> list[torch.Tensor]:
        """One `[buffer_bytes]` uint8 view of each buffer (page copies and clears)."""
        g = self.geometry
        return [self.backend.tensor(self._range, b * g.buffer_bytes, (g.buffer_bytes,), (1,), torch.uint8)
                for b in range(g.num_buffers)]

    def _make_views(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        g, c = self.geometry, self.config
        hd = c.num_kv_heads * c.head_dim
        esz = g.elem_size
        shape = (c.max_batch_size, c.max_context_len, c.num_kv_heads, c.head_dim)
        tok = hd * g.layers_per_buffer  # elements per token in one buffer
        strides = (g.slot_tokens * tok, tok, c.head_dim, 1)
        ks, vs = [], []
        for layer in range(c.num_layers):
            if c.layout == "per-layer":
                kb, vb, off = layer, c.num_layers + layer, 0
            else:  # fused: [B, slot_tokens, num_layers, H, D], layer is a strided view
                kb, vb, off = 0, 1, layer * hd * esz
            for buf, out in ((kb, ks), (vb, vs)):
                out.append(self.backend.tensor(self._range, buf * g.buffer_bytes + off, shape, strides, c.dtype))
        return ks, vs

    # -------------------------------------------------------------- the paper's API ----
    def k_cache(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s K tensor, `[max_batch_size, max_context_len, num_kv_heads, head_dim]`."""
        return self._k[self._layer(layer)]

    def v_cache(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s V tensor, `[max_batch_size, max_context_len, num_kv_heads, head_dim]`."""
        return self._v[self._layer(layer)]

    def _layer(self, layer: int) -> int:
        index = as_int(layer, "layer", InvalidRequestError, low=0, high=self.config.num_layers - 1)
        if not self._k:
            raise ClosedError("this cache was closed; create a new one with vattn.init()")
        return index


    def alloc_reqid(self) -> int:
        """A free slot for a new request: the one with most pages still mapped (deferred
        reclamation). Raises NoFreeSlotError when all max_batch_size slots are in use."""
        return self.allocator.alloc_reqid()

    def free_reqid(self, reqid: int) -> None:
        """Return a slot. Its pages stay mapped for the next request that gets it."""
        self.allocator.free_reqid(reqid)

    def step(self, seq_lens: Sequence[int] | Mapping[int, int]) -> StepResult:
        """Back every active request with pages for its length in the coming iteration.

        `seq_lens`: a list with one length per slot (0 = inactive) or a dict reqid -> length.
        Returns a StepResult, truthy when every request is backed. When pages run short it
        lists the reqids it could not back in `failed` (oldest requests are served first)
        and changes nothing else: preempt (free_reqid) and call again. With `background`,
        the pages the next iteration will need are mapped on a worker thread afterwards.
        """
        return self.allocator.step(seq_lens)

    def fork(self, reqid: int, num_tokens: int) -> int:
        """A new request whose first `num_tokens` tokens are `reqid`'s, without copying them:
        its slot maps the same physical pages for every whole page of those tokens
        (copy-on-write by construction: only the partly filled last page is copied, so
        each request writes from `num_tokens` on into pages of its own). Returns the new
        reqid; free it with `free_reqid` like any other. A shared page is unmapped only
        when every slot that maps it let go. `num_tokens` must not exceed the longest
        length `reqid` was stepped to. Raises NoFreeSlotError or OutOfPhysicalMemoryError."""
        return self.allocator.fork(reqid, num_tokens)

    def can_fork(self, reqid: int, num_tokens: int) -> bool:
        """Whether `fork(reqid, num_tokens)` would find every page the child reads: False once
        a sliding-window layer of `reqid` gave back pages within the window before
        `num_tokens` (the parent moved on); the child then computes its prompt instead."""
        return self.allocator.can_fork(reqid, num_tokens)

    def pin(self, reqid: int, num_pages: int) -> list:
        """Keep the first `num_pages` whole pages of `reqid` after it ends (the prefix
        cache's pages): a pinned page stays in physical memory, unmapped once no slot maps
        it, until memory runs short (least recently used first) or `trim()`. Returns one
        opaque handle per page, for `map_pinned`."""
        return self.allocator.pin(reqid, num_pages)

    def map_pinned(self, reqid: int, handles: Sequence) -> int:
        """Map pinned pages (handles from `pin`) as the first pages of `reqid` before its
        first step: no copy, and their tokens need no prefill. Stops at the first handle
        that was evicted, and maps whole sharing units only (`geometry.share_pages` pages
        of `geometry.share_tokens` tokens: one page where a page holds whole tokens), so
        that `reqid` never writes into a page it shares. Returns the number of tokens now
        in the slot."""
        return self.allocator.map_pinned(reqid, handles)

    def truncate_pinned(self, reqid: int, num_tokens: int) -> int:
        """Keep only the first `num_tokens` tokens (whole sharing units) of what `map_pinned` mapped
        into `reqid` before its first step; the later pages are unmapped from it and stay
        pinned. Tensor-parallel ranks use it to keep the prefix every rank could map.
        Returns the pages unmapped."""
        return self.allocator.truncate_pinned(reqid, num_tokens)

    def swap_out(self, reqid: int, num_tokens: int) -> SwapHandle:
        """Preempt `reqid` by swapping: copy its first `num_tokens` tokens (K and V of every
        layer) to host memory (pinned on CUDA, in chunks of at most 256 MiB), then free its
        slot. The slot keeps its pages (deferred reclamation): `swap_in` takes it back with
        no copy at all while nobody else took the slot or its pages."""
        g = self.geometry
        num_tokens = as_int(num_tokens, "num_tokens", InvalidRequestError)
        held = self.allocator.num_tokens(reqid)
        slot = as_int(reqid, "reqid", InvalidRequestError)  # valid: num_tokens checked it
        if not 0 < num_tokens <= held:
            raise InvalidRequestError(f"num_tokens={num_tokens} must be in [1, {held}]: the tokens reqid {slot} has")
        nbytes, start = num_tokens * g.token_bytes, g.page_offset(slot, 0)
        pin = self.backend.device.type == "cuda"
        firsts = self._first_pages(slot)
        host = []
        for b, buf in enumerate(self._bytes):  # the slot's row is contiguous in every buffer
            chunks = []
            # a sliding-window kind: only its live pages (those behind the window are unmapped)
            for off in range(firsts[self._kind_of[b]] * g.page_size, nbytes, SWAP_CHUNK):
                n = min(SWAP_CHUNK, nbytes - off)
                dst = torch.empty(n, dtype=torch.uint8, pin_memory=pin)
                dst.copy_(buf[start + off:start + off + n], non_blocking=pin)
                chunks.append(dst)
            host.append(chunks)
        slot, epoch = self.allocator.park(slot)
        return SwapHandle(slot, epoch, num_tokens, host, first_pages=tuple(firsts))

    def _first_pages(self, slot: int) -> list[int]:
        """Per layer kind, the first page `slot` maps (0 but behind a sliding window)."""
        if isinstance(self.allocator, HybridAllocator):
            return self.allocator.first_pages(slot)
        books = self.allocator.books
        with books.lock:
            return [books.holes(slot)]

    def swap_in(self, handle: SwapHandle) -> int:
        """Bring a swapped-out request back; returns its (new) reqid. No copy when its old
        slot is untouched; otherwise pages are mapped and its tokens copied back. Raises
        NoFreeSlotError or OutOfPhysicalMemoryError (nothing changed: try again later).
        A handle comes back once while its request lives: InvalidRequestError if the reqid
        an earlier swap_in gave it is still that request (free it first: then the handle may
        be swapped in again, as the scheduler does for a request preempted before it ran)."""
        if not isinstance(handle, SwapHandle):
            raise InvalidRequestError(f"swap_in takes the SwapHandle swap_out returned, got {handle!r}")
        if handle.live is not None and self.allocator.allocation(handle.live[0]) == handle.live[1]:
            raise InvalidRequestError(
                f"this SwapHandle was swapped in already and its request is live as reqid {handle.live[0]}: a second "
                f"swap_in would run it twice; free_reqid({handle.live[0]}) first, or swap_out that reqid again")
        firsts = handle.first_pages or (0,) * len(self.kind_buffers)
        if isinstance(self.allocator, HybridAllocator):
            slot, copies = self.allocator.resume(handle.slot, handle.epoch, handle.num_tokens, firsts)
        else:
            slot, copy = self.allocator.resume(handle.slot, handle.epoch, handle.num_tokens, first_page=firsts[0])
            copies = (copy,)
        copy = any(copies)
        if copy:
            start, pin = self.geometry.page_offset(slot, 0), self.backend.device.type == "cuda"
            for b, (buf, chunks) in enumerate(zip(self._bytes, handle.host)):
                kind = self._kind_of[b]
                if not copies[kind]:  # this kind's pages were untouched
                    continue
                off = start + firsts[kind] * self.geometry.page_size
                for src in chunks:
                    buf[off:off + src.numel()].copy_(src, non_blocking=pin)
                    off += src.numel()
        handle.copied_in, handle.live = copy, (slot, self.allocator.allocation(slot))
        return slot

    def trim(self) -> int:
        """Unmap and release now every physical page no live token needs (pages of free
        slots and pages pre-mapped past a request's length): memory goes back to the
        device or host. Returns the page groups released."""
        return self.allocator.trim()

    # ---------------------------------------------------------------------- memory ----
    def reserve_physical(self, nbytes: int) -> int:
        """Create physical pages ahead of time until `nbytes` exist; returns page groups created."""
        return self.allocator.reserve_physical(nbytes)

    def stats(self) -> MemoryStats:
        """Memory figures: mapped, used, free pages, tokens that fit, fragmentation."""
        return self.allocator.stats()

    def synchronize(self) -> None:
        """Wait for the background pre-mapping started by the last step."""
        self.allocator.synchronize()

    @property
    def num_free_reqids(self) -> int:
        return self.allocator.num_free_slots

    def close(self) -> None:
        """Release all physical and virtual memory. Idempotent."""
        self._finalizer()
        self._k, self._v, self._bytes = [], [], []
        self._range = None  # the address space goes when the last tensor view goes

    def __enter__(self) -> KVCache:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        c = self.config
        return (f"KVCache(layers={c.num_layers}, kv_heads={c.num_kv_heads}, head_dim={c.head_dim}, "
                f"batch={c.max_batch_size}, context={c.max_context_len}, dtype={c.dtype}, "
                f"device={c.device}, page_size={self.page_size}, layout={c.layout})")


# The allocator reaches the byte views through a weak reference: it must hold nothing that
# keeps the cache's memory alive (views -> range -> owner -> the finalizer that closes it).
def _copy_pages(ref: weakref.ref, buffers: list[int], pairs: list[tuple[int, int]]) -> None:
    """Copy the page at each src offset to its dst offset in every buffer of a layer kind (fork)."""
    cache = ref()
    page = cache.page_size
    for buf in (cache._bytes[b] for b in buffers):  # [buffer_bytes] uint8 each
        for src, dst in pairs:
            buf[dst:dst + page].copy_(buf[src:src + page])


class _MemoryOwner:
    """Stands for a cache's physical memory: its finalizer closes the allocator."""


def _zero_pages(ref: weakref.ref, buffers: list[int], offsets: list[int]) -> None:
    """Clear the pages at `offsets` (bytes into every buffer of a layer kind): zero_reused_pages."""
    cache = ref()
    page = cache.page_size
    views = [cache._bytes[b] for b in buffers]  # [buffer_bytes] uint8 each
    cache.backend.zero(views, [off // page for off in offsets], page)


def _close(allocator: PageAllocator, backend: Any) -> None:
    try:
        allocator.close()
    finally:
        backend.close()
