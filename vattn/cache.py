"""`KVCache`: virtual K/V tensors per layer, backed by physical pages on demand."""
from __future__ import annotations

import dataclasses
import functools
import weakref
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from vattn.allocator import Coordinator, KindSpec, MemoryStats, StateGeometry, StateSpec, StepResult
from vattn.allocator.kinds import layer_name, layer_spec
from vattn.allocator.snapshots import Snapshots
from vattn.checks import as_int
from vattn.config import CacheConfig, Geometry
from vattn.errors import ClosedError, InvalidConfigError, InvalidRequestError
from vattn.offload.copier import Copier
from vattn.offload.host import HostStore
from vattn.vmem import make_backend
from vattn.vmem.base import Backend


SWAP_CHUNK = 256 << 20  # host buffers of a swapped-out request: never one buffer over this
# Tokens kept mapped before a sliding window on CUDA: FlashAttention-2's local attention
# reads whole key blocks (64 or 128 tokens) from the one holding the window's first key.
WINDOW_MARGIN_TOKENS = 256


@dataclass(eq=False)
class SwapHandle:
    """A swapped-out request: its tokens in host memory (the cache's host store, `KVCache.host`,
    counts them until the handle is gone), and where it was."""

    slot: int
    epoch: tuple[int, ...]  # per layer kind: its pages of the slot are untouched while this holds
    num_tokens: int
    host: list[list[torch.Tensor]]  # per buffer, chunks of its first num_tokens tokens (uint8)
    copied_in: bool | None = None  # after swap_in: whether the data had to be copied back
    live: tuple[int, int] | None = None  # after swap_in: (reqid, its allocation) the request came back as
    # per layer kind, the first page the slot still mapped (the host copy of its buffers
    # starts there: a sliding window gave back the pages before it)
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
        self.config = config = _config(config, kwargs)
        self.backend = backend if backend is not None else make_backend(config.torch_device, config.cuda_driver)
        page_size = config.page_size if config.page_size is not None else self.backend.default_page_size
        self.backend.check_page_size(page_size)
        self.geometry = g = Geometry(config, page_size)
        g.check_page_size()
        self.page_size = page_size

        # One reservation holds every buffer, one after another: K and V of every layer, then
        # the recurrent states' rows (a slot's, then the snapshots').
        self.states = StateGeometry(page_size, config.state_bytes, config.max_context_len) if config.state_bytes \
            else None
        num_rows = config.max_batch_size + config.num_snapshots
        state_bytes = num_rows * self.states.row_bytes if self.states is not None else 0
        max_bytes, unit = self._budget_bytes(g, state_bytes)
        self._range = self.backend.reserve(g.buffer_bytes * g.num_buffers + state_bytes, page_size)
        bases = [self._range.addr + b * g.buffer_bytes for b in range(g.num_buffers)]
        self._k, self._v = _kv_views(self.backend, self._range, g)
        # uint8 views of each whole buffer (and of the states'): pages are copied (fork) and cleared through them
        self._bytes = _byte_views(self.backend, self._range, g, state_bytes)
        specs = self._kind_specs(bases)
        self.allocator = Coordinator(self.backend, specs, num_slots=config.max_batch_size,
                                     max_len=config.max_context_len, max_bytes=max_bytes,
                                     background=config.background, prefetch=config.prefetch,
                                     prefetch_tokens=config.prefetch_tokens, budget=budget)
        # The memory goes when this cache and its last tensor view are gone (or at close()):
        # every view keeps the range alive, the range keeps `owner`, and the owner's finalizer
        # unmaps and releases the pages before the range frees its address space. Neither
        # the allocator nor the owner refers back to self or the range.
        owner = _MemoryOwner()
        self._range.keepalive = owner
        # Host memory below the device: prefix blocks offloaded by a prefix cache's tiers and
        # swapped-out requests, one store under one budget (vattn.offload)
        self.host = HostStore(Copier(self.backend.device))
        if self.host.copier.cuda:  # a copy may read or write through a slot's mapping: unmap after it
            for groups in self.allocator.layer.kinds:
                groups.device_sync = self.host.copier.synchronize
        # what the tiers hold, shown beside the budget (vattn top); no reference back to the store
        tiers = budget.register_tiers(functools.partial(_tier_bytes, weakref.ref(self.host))) \
            if hasattr(budget, "register_tiers") else None
        self._finalizer = weakref.finalize(owner, _close, self.allocator, self.backend, self.host, budget, tiers)

    def _budget_bytes(self, g: Geometry, state_bytes: int) -> tuple[int, int]:
        """(the bytes of page groups this cache may create, the bytes of one page of every
        buffer): all its slots can hold, capped by physical_memory (or, without it, by what
        the device has free)."""
        config = self.config
        unit = g.group_bytes + (self.page_size if state_bytes else 0)
        cap = g.pages_per_slot * config.max_batch_size * g.group_bytes + state_bytes
        if config.physical_memory is not None:
            if config.physical_memory < unit:
                raise InvalidConfigError(
                    f"physical_memory={config.physical_memory} is less than one page group "
                    f"({unit // self.page_size} buffers x {self.page_size} bytes = {unit} bytes)")
            return min(cap, config.physical_memory // unit * unit), unit
        free = self.backend.free_memory()
        if free is not None:  # leave room for the model's own tensors
            return min(cap, max(1, int(self.backend.default_memory_fraction * free) // unit) * unit), unit
        return cap, unit

    def _kind_specs(self, bases: list[int]) -> list[KindSpec]:
        """The spec of every layer kind (the K/V kinds', then the states'), on the buffers at
        `bases`; sets `kind_buffers`, `kind_names` and `kv_kind_buffers`."""
        config, g = self.config, self.geometry
        kinds = config.layer_kinds()
        # per kind: its buffers (K of its layers, then V), in the order its page groups hold them
        # (K and V of a layer in one buffer where their widths differ: its layers' buffers only)
        self.kind_buffers = [list(range(g.num_buffers)) if config.layout != "per-layer"
                             else [*layers] if g.buffers_per_layer == 1
                             else [*layers, *(config.num_layers + i for i in layers)] for _, layers in kinds]
        self.kind_names = [layer_name(entry) for entry, _ in kinds]
        if self.states is not None:
            self.kind_buffers.append([g.num_buffers])
            self.kind_names.append("state")
        self._kind_of = {b: k for k, buffers in enumerate(self.kind_buffers) for b in buffers}  # buffer -> kind
        specs = [self._kind_spec(name, entry, layers, bases, buffers)
                 for name, (entry, layers), buffers in zip(self.kind_names, kinds, self.kind_buffers)]
        if self.states is not None:
            specs.append(StateSpec("state", self.states, [self._range.addr + g.num_buffers * g.buffer_bytes],
                                   num_snapshots=config.num_snapshots,
                                   copy_pages=functools.partial(_copy_pages, weakref.ref(self), [g.num_buffers])))
        self.kv_kind_buffers = self.kind_buffers[:len(kinds)]  # the K/V kinds' (a pin handle's kinds, in order)
        return specs

    def _kind_spec(self, name: str, entry: Any, layers: tuple[int, ...], bases: list[int],
                   buffers: list[int]) -> KindSpec:
        """The spec of the layer kind `entry` names (`CacheConfig.layer_windows`: None, a
        window, a `LayerKind`) whose K/V buffers are `buffers` (the cache's whole geometry
        when it is the only one)."""
        c, g, ref = self.config, self.geometry, weakref.ref(self)
        if len(self.config.layer_kinds()) > 1:
            g = Geometry(dataclasses.replace(c, num_layers=len(layers), layer_windows=None, state_bytes=0,
                                             num_snapshots=0), self.page_size)
        base = KindSpec(name, g, [bases[b] for b in buffers],
                        zero_pages=functools.partial(_zero_pages, ref, buffers) if c.zero_reused_pages else None,
                        copy_pages=functools.partial(_copy_pages, ref, buffers))
        return layer_spec(entry, base, self._window_margin())

    def _window_margin(self) -> int:
        """Tokens kept mapped before a sliding window: the kernels read from a block boundary
        before it on CUDA (FlashAttention's local attention starts at the key block holding
        the window's first key); the CPU kernels read exactly the window."""
        return WINDOW_MARGIN_TOKENS if self.backend.device.type == "cuda" else 0

    # -------------------------------------------------------------- the paper's API ----
    def k_cache(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s K tensor, `[max_batch_size, max_context_len, num_kv_heads, head_dim]`."""
        return self._k[self._layer(layer)]

    def v_cache(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s V tensor, `[max_batch_size, max_context_len, num_kv_heads, head_dim]`
        (`v_head_dim` wide where the config gives one: a view into the K buffer's rows)."""
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
        lists the reqids it could not back in `failed` (oldest requests are served first);
        those keep exactly the lengths and pages they had, in every layer kind (the step is
        planned for every kind before any maps): preempt (free_reqid) and call again, or
        step them again to any length. With `background`, the pages the next iteration will
        need are mapped on a worker thread afterwards. On CUDA the current stream first waits
        for the restores of a prefix into these requests (copied on the host store's copy stream).
        """
        if self.host.copier.restores:
            self.host.copier.wait_slots(seq_lens if isinstance(seq_lens, Mapping) else
                                        [s for s, n in enumerate(seq_lens) if n])
        return self.allocator.step(seq_lens)

    def can_step(self, seq_lens: Sequence[int] | Mapping[int, int]) -> bool:
        """Whether `step(seq_lens)` would back every request now, decided from the books
        without mapping anything (see `Coordinator.can_step`)."""
        return self.allocator.can_step(seq_lens)

    def revert_step(self, reqids: Sequence[int]) -> None:
        """The iteration the last `step` backed will not run for `reqids` (another
        tensor-parallel rank could not back them): their lengths go back to what they were
        before it, as if that step had failed them here too."""
        self.allocator.revert_step(reqids)

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
        """Whether `fork(reqid, num_tokens)` would find everything the child reads: False once
        a sliding-window layer of `reqid` gave back pages within the window before
        `num_tokens` (the parent moved on), or when its recurrent states have seen another
        number of tokens; the child then computes its prompt instead."""
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

    def extend_prefix(self, reqid: int, num_tokens: int) -> tuple[int, list[tuple[int, int]]]:
        """Back the first `num_tokens` tokens (whole sharing units) of `reqid`, which has not
        run yet, with fresh pages after what `map_pinned` mapped into it, for data copied in
        from a lower tier (the prefix cache's restore; `page_views` reaches them). A
        sliding-window kind gets only the pages the query at `num_tokens` reads (those before
        become holes). Returns (tokens `reqid` holds now, per K/V kind (first page, pages)
        mapped fresh). When memory is short nothing is mapped and `reqid` keeps what it held,
        or holds 0 tokens where a window kind had to give pages back."""
        return self.allocator.extend_prefix(reqid, num_tokens)

    def drop_prefix(self, reqid: int) -> None:
        """Unmap what `map_pinned` and `extend_prefix` mapped into `reqid` before its first
        step, and the snapshot it was to restore: it computes every token (a failed restore)."""
        self.allocator.drop_prefix(reqid)

    def page_views(self, kind: int, reqid: int, first_page: int, num_pages: int) -> list[torch.Tensor]:
        """Pages `first_page` .. `first_page + num_pages - 1` of slot `reqid` in each buffer of
        K/V kind `kind` (the kinds of `kv_kind_buffers`): one `[num_pages * page_size]` uint8
        view per buffer, in its order. The pages must be mapped."""
        g = self.geometry
        start = g.page_offset(as_int(reqid, "reqid", InvalidRequestError), first_page)
        end = start + num_pages * self.page_size
        return [self._bytes[b][start:end] for b in self.kv_kind_buffers[kind]]

    def swap_out(self, reqid: int, num_tokens: int) -> SwapHandle:
        """Preempt `reqid` by swapping: copy its first `num_tokens` tokens (K and V of every
        layer, and its recurrent states) to host memory (pinned on CUDA, in chunks of at
        most 256 MiB), then free its slot. The slot keeps its pages (deferred reclamation):
        `swap_in` takes it back with no copy at all while nobody else took the slot or its
        pages. Recurrent states are right at the slot's length only, and a sliding window's
        pages behind it are given back: InvalidRequestError for fewer tokens than they need."""
        num_tokens = as_int(num_tokens, "num_tokens", InvalidRequestError)
        held = self.allocator.num_tokens(reqid)
        slot = as_int(reqid, "reqid", InvalidRequestError)  # valid: num_tokens checked it
        if not 0 < num_tokens <= held:
            raise InvalidRequestError(f"num_tokens={num_tokens} must be in [1, {held}]: the tokens reqid {slot} has")
        self.allocator.check_swap_out(slot, num_tokens)
        pin = self.backend.device.type == "cuda"
        firsts = self.allocator.first_pages(slot)
        # a sliding-window kind: only its live pages (those behind the window are unmapped)
        rows = [self._row(b, slot, num_tokens, firsts[self._kind_of[b]]) for b in range(len(self._bytes))]
        nbytes = sum(hi - lo for lo, hi in rows)
        self.host.take(nbytes)  # the host store's budget (offload_bytes): OutOfPhysicalMemoryError when full
        try:
            host = []
            for buf, (lo, hi) in zip(self._bytes, rows):  # the slot's row is contiguous in every buffer
                chunks = []
                for off in range(lo, hi, SWAP_CHUNK):
                    n = min(SWAP_CHUNK, hi - off)
                    dst = self.host.copier.empty(n)
                    dst.copy_(buf[off:off + n], non_blocking=pin)
                    chunks.append(dst)
                host.append(chunks)
            slot, epochs = self.allocator.park(slot)
        except BaseException:
            self.host.give(nbytes)
            raise
        handle = SwapHandle(slot, epochs, num_tokens, host, first_pages=tuple(firsts))
        weakref.finalize(handle, self.host.give, nbytes)  # its bytes go back to the store with it
        return handle

    def _row(self, buffer: int, slot: int, num_tokens: int, first_page: int) -> tuple[int, int]:
        """[start, end) bytes of `buffer`'s byte view that hold `slot`'s first `num_tokens`
        tokens from page `first_page` on (a state row: the whole row)."""
        if self.states is not None and buffer == self.geometry.num_buffers:
            return slot * self.states.row_bytes, (slot + 1) * self.states.row_bytes
        g = self.geometry
        start = g.page_offset(slot, 0)
        lo = start + first_page * g.page_size
        return lo, max(lo, start + num_tokens * g.token_bytes)  # (swap_out refuses a count behind the window)

    def swap_in(self, handle: SwapHandle) -> int:
        """Bring a swapped-out request back; returns its (new) reqid. No copy when its old
        slot is untouched; otherwise pages are mapped and its tokens copied back (only in
        the layer kinds whose pages were taken). Raises NoFreeSlotError or
        OutOfPhysicalMemoryError (nothing changed: try again later).
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
        slot, copies = self.allocator.resume(handle.slot, handle.epoch, handle.num_tokens, firsts)
        copy = any(copies)
        if copy:
            pin = self.backend.device.type == "cuda"
            for b, (buf, chunks) in enumerate(zip(self._bytes, handle.host)):
                kind = self._kind_of[b]
                if not copies[kind]:  # this kind's pages were untouched
                    continue
                off, _ = self._row(b, slot, handle.num_tokens, firsts[kind])
                for src in chunks:
                    buf[off:off + src.numel()].copy_(src, non_blocking=pin)
                    off += src.numel()
        handle.copied_in, handle.live = copy, (slot, self.allocator.allocation(slot))
        return slot

    # --------------------------------------------------- recurrent states, snapshots ----
    def state_rows(self) -> torch.Tensor:
        """`[max_batch_size + num_snapshots, row_bytes]` uint8: every slot's recurrent states
        (row s: slot s, mapped once it was stepped), then the snapshots' rows. The model's
        state layers carve their views out of a row (`vattn.engine.states`)."""
        if self.states is None:
            raise InvalidRequestError("this cache keeps no recurrent states; give state_bytes")
        if not self._bytes:
            raise ClosedError("this cache was closed; create a new one with vattn.init()")
        return self._bytes[-1].view(-1, self.states.row_bytes)

    @property
    def snapshots(self) -> Snapshots:
        """The recurrent states' snapshots (`vattn.allocator.snapshots.Snapshots`: `want`,
        `planned`, `take`, `capture`, `new_row`, `pin`, `is_pinned`, `free`, `restore`), rows
        of `state_rows()` after the slots'; InvalidRequestError without recurrent states."""
        return self.allocator.snapshots

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
        """Memory figures: mapped, used, free pages, tokens that fit, fragmentation; and the
        bytes the offload tiers hold (`host_bytes`: the host store's prefix blocks and
        swapped-out requests; `disk_bytes`: its disk tier's files)."""
        st = self.allocator.stats()
        host = self.host
        if host.nbytes or host.sink is not None:
            st = dataclasses.replace(st, host_bytes=host.nbytes, disk_bytes=host.sink.disk_bytes if host.sink else 0)
        return st

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


def _config(config: CacheConfig | None, kwargs: dict[str, Any]) -> CacheConfig:
    """`KVCache`'s configuration: `config`, or one made of `vattn.init`'s keyword arguments."""
    if config is None:
        try:
            return CacheConfig(**kwargs)
        except TypeError as e:
            raise InvalidConfigError(f"{e}; see help(vattn.init) for the arguments") from None
    if not isinstance(config, CacheConfig):
        raise InvalidConfigError(
            f"the cache's configuration must be a vattn.CacheConfig, got {config!r}; or pass the sizes as "
            "keywords: vattn.init(num_layers=..., num_kv_heads=..., head_dim=..., max_batch_size=..., "
            "max_context_len=...)")
    if kwargs:
        raise InvalidConfigError("give either a CacheConfig or keyword arguments, not both")
    return config


def _kv_views(backend: Backend, rng: Any, g: Geometry) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every layer's K and V view `[max_batch_size, max_context_len, num_kv_heads, head_dim]`
    (V `v_head_dim` wide where it differs) of the reservation `rng`."""
    c = g.config
    vd = c.v_head_dim or c.head_dim
    hd = c.num_kv_heads * (c.head_dim + (c.v_head_dim or 0))  # elements of a layer's token in a buffer
    esz = g.elem_size
    tok = hd * g.layers_per_buffer  # elements per token in one buffer
    ks, vs = [], []
    for layer in range(c.num_layers):
        if c.layout == "per-layer":
            kb, vb, off = layer, c.num_layers + layer, 0
        else:  # fused: [B, slot_tokens, num_layers, H, D], layer is a strided view
            kb, vb, off = 0, 1, layer * hd * esz
        voff = off
        if c.v_head_dim is not None:  # one buffer: a token's row its K ([H, head_dim]), then its V
            vb, voff = kb, off + c.num_kv_heads * c.head_dim * esz
        for buf, o, d, out in ((kb, off, c.head_dim, ks), (vb, voff, vd, vs)):
            shape = (c.max_batch_size, c.max_context_len, c.num_kv_heads, d)
            out.append(backend.tensor(rng, buf * g.buffer_bytes + o, shape, (g.slot_tokens * tok, tok, d, 1), c.dtype))
    return ks, vs


def _byte_views(backend: Backend, rng: Any, g: Geometry, state_bytes: int) -> list[torch.Tensor]:
    """One `[buffer_bytes]` uint8 view of each buffer, and `[state_bytes]` of the states' rows
    when there are any (page copies and clears)."""
    views = [backend.tensor(rng, b * g.buffer_bytes, (g.buffer_bytes,), (1,), torch.uint8)
             for b in range(g.num_buffers)]
    if state_bytes:
        views.append(backend.tensor(rng, g.num_buffers * g.buffer_bytes, (state_bytes,), (1,), torch.uint8))
    return views


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


def _close(allocator: Coordinator, backend: Any, host: HostStore, budget: Any = None, tiers: int | None = None
           ) -> None:
    try:
        try:
            host.copier.synchronize()
            host.close()  # its blocks to the disk tier, where there is one (written within a bound)
        finally:
            if tiers is not None:
                budget.unregister(tiers)
            allocator.close()
    finally:
        backend.close()


def _tier_bytes(host: weakref.ref) -> tuple[int, int]:
    """(host bytes, disk bytes) a cache's offload store holds (0, 0 once it is gone)."""
    store = host()
    if store is None:
        return 0, 0
    return store.nbytes, store.sink.disk_bytes if store.sink is not None else 0
