"""`Tiers`: what a prefix cache (`vattn.prefix_cache.PrefixCache`) keeps below device memory,
and the copies between the cache's pages and those tiers.

```
device   pinned pages (the prefix cache's entries)    map_pinned: no copy
  | write-through at insert (a block is copied once, when it is cached)
host     HostStore: blocks by key, LRU (offload_bytes), shared with swapped-out requests
  | evicted: handed to the disk writer (a bounded queue; its thread waits for the copy, writes)
disk     DiskTier: one file a block (offload_dir, offload_dir_bytes), kept across restarts
```
`Tiers` owns the cascade: the host store hands the blocks it evicts to the tiers' `DiskIO`
(its sink) and knows nothing of the disk. A hit past the device's blocks is restored from the
nearest tier: `fetch` (a block still queued for writing is taken back; a disk block is read
into host memory first), then `restore` copies each block's pages into the fresh pages
`KVCache.extend_prefix` mapped for the request, page by page (on CUDA on the copy stream; the
request's next step waits for it). The engine reads disk blocks before that, off its thread:
the scheduler asks `PrefixCache.load` at admission, which starts the reads (`load`) and keeps
the request waiting until they end (`poll` stages them in host memory, booked in the host
store's budget and never evicted, until the request's lookup `release`s them), so that its
lookup finds host blocks (and, read ahead, reads none itself); without reading ahead (the slot
API, tensor parallelism) `map_prefix` reads a block on disk only there and then.
Blocks are copied to the host tier when they are cached (write-through, as vLLM's offloading
connector and SGLang's HiCache write-through do), so a block evicted from device memory needs
no copy then: the pages an eviction takes are no longer mapped anywhere by that time, and
nothing waits for a copy under memory pressure. A block kept with holes (a sliding window had
given pages back) is replaced by a complete copy when one is cached later.
"""
from __future__ import annotations

import hashlib
import os
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Sequence

import torch

from vattn.errors import OutOfPhysicalMemoryError
from vattn.offload.disk import DiskTier
from vattn.offload.diskio import DiskIO
from vattn.offload.host import BlockLayout, HostBlock

if TYPE_CHECKING:
    from vattn.cache import KVCache

FORMAT = b"vattn-kv-offload-1"  # bump when the file format or a block's layout changes
STAGE_S = 30.0  # a block read ahead waits this long at most for its request's lookup


def block_layout(cache: KVCache, with_states: bool) -> BlockLayout:
    """The layout of one prefix block of `cache` (see `BlockLayout`)."""
    g = cache.geometry
    kinds = tuple((len(buffers), g.share_pages * cache.page_size) for buffers in cache.kv_kind_buffers)
    return BlockLayout(kinds, cache.states.row_bytes if with_states and cache.states is not None else 0)


def cache_identity(cache: KVCache, salt: bytes, layout: BlockLayout) -> bytes:
    """16 bytes naming what makes a block of `cache` valid: the salt (the model), the format,
    and the cache's layout (layer kinds and their buffers, dtype, heads, page geometry)."""
    c, g = cache.config, cache.geometry
    described = repr((c.num_layers, c.num_kv_heads, c.head_dim, str(c.dtype), c.layout, cache.page_size,
                      g.token_bytes, g.share_tokens, g.share_pages, cache.kind_names, cache.kv_kind_buffers,
                      c.state_bytes, layout))
    h = hashlib.blake2b(FORMAT, digest_size=16)
    h.update(len(salt).to_bytes(8, "little"))
    h.update(salt)
    h.update(described.encode())
    return h.digest()


class Tiers:
    """The host and disk tiers of one prefix cache over `cache` (see the module docstring).
    `offload_bytes`: the host tier's budget (the cache's host store, swapped-out requests
    included); `offload_dir`, `offload_dir_bytes`: the disk tier. InvalidConfigError at start
    for what cannot work."""

    def __init__(self, cache: KVCache, salt: bytes, with_states: bool, offload_bytes: int,
                 offload_dir: str | os.PathLike | None = None, offload_dir_bytes: int | None = None) -> None:
        self.cache = cache
        self.store = cache.host
        self.copier = cache.host.copier
        self.layout = layout = block_layout(cache, with_states)
        self.block_pages = cache.geometry.share_pages
        self.disk: DiskTier | None = None
        self.io: DiskIO | None = None  # the disk tier's reader and writer threads
        if offload_dir is not None:
            self.disk = DiskTier(offload_dir, offload_dir_bytes, cache_identity(cache, salt, layout), layout,
                                 self.copier)
            self.io = DiskIO(self.disk)
        self.store.configure(offload_bytes, layout, self.io)
        self.recent: dict[bytes, Any] = {}  # CUDA: blocks restored whose copies may be in flight -> their event
        self.staged: OrderedDict[bytes, tuple[HostBlock, float]] = OrderedDict()  # read ahead -> (block, since)
        self.failed: OrderedDict[bytes, float] = OrderedDict()  # reads ahead that missed -> when (not retried)

    def locate(self, key: bytes, disk: bool = True) -> tuple[str, int] | None:
        """(tier, flags) of the block under `key` in the host tier (or queued for the disk;
        "disk" for one read ahead), else the disk tier (unless not `disk`); None: no tier
        holds it."""
        block = self.store.peek(key)
        if block is not None:  # (one read ahead from disk for this request is the disk's hit)
            return "disk" if block.from_disk else "host", block.flags(self.layout)
        if self.io is not None:
            staged = self.staged.get(key)
            if staged is not None:
                return "disk", staged[0].flags(self.layout)
            block = self.io.pending_block(key)
            if block is not None:
                return "host", block.flags(self.layout)
            flags = self.disk.locate(key) if disk else None
            if flags is not None:
                return "disk", flags
        return None

    def fetch(self, key: bytes) -> HostBlock | None:
        """The block under `key` in host memory: the host tier's, one read ahead (it joins the
        host tier now), one queued for the disk (taken back), or read from disk here (kept in
        host memory then); None when no tier holds it, or its file was bad."""
        block = self.store.get(key)
        if block is None and self.io is not None:
            block = self._unstage(key)
            if block is None:
                block = self.io.pending_block(key)
            if block is None:
                block = self.disk.get(key)  # (not when the caller reads ahead: see `load`)
            if block is not None:
                self.store.put(key, block)
        return block

    # ---------------------------------------------------------- reading ahead ----
    def load(self, keys: Sequence[bytes]) -> bool:
        """Whether blocks of the chain `keys` (a prompt's blocks after those in device memory)
        are being read from disk: the leading ones the disk alone holds are asked for here
        (O(1) a block; the reader thread reads them), as many as the host tier has room for.
        A block read waits in host memory for its request (`staged`: booked in the host
        tier's budget like a swapped-out request's copy, never evicted) until a lookup takes
        it, or STAGE_S. True: come back later (reads in flight, or no room yet while other
        requests' reads hold it); False: nothing to wait for."""
        io = self.io
        if io is None:
            return False
        self.poll()
        store = self.store
        free = (store.limit - store.leased) // self.layout.nbytes(self.layout.full_flags) - len(io.loading)
        wanted, busy, mine, full = [], False, 0, False
        for key in keys:
            if key in self.staged or key in io.loading:
                mine += 1
                busy = busy or key in io.loading
                continue
            if store.peek(key) is not None or io.pending_block(key) is not None:
                continue
            if key in self.failed or self.disk.locate(key) is None:  # (a read that failed is not retried soon)
                break
            if len(wanted) >= free:
                full = True
                break
            wanted.append(key)
        if wanted:
            io.load(wanted)
        # no room for any: wait for the requests whose blocks hold it (they are admitted first)
        others = len(self.staged) + len(io.loading) - mine
        return busy or bool(wanted) or (full and not mine and others > 0)

    def release(self, keys: Sequence[bytes]) -> None:
        """A lookup of the chain `keys` is done: its blocks still staged join the host tier."""
        if self.staged:
            for key in keys:
                block = self._unstage(key)
                if block is not None:
                    self.store.put(key, block)

    def poll(self) -> None:
        """Take the disk reads that finished into host memory, staged for their requests
        (dropped where the host tier has no room: a miss), and let go of those staged longer
        than STAGE_S (their request went away); a read that missed is not tried again for
        STAGE_S. The engine's thread."""
        io, now = self.io, time.monotonic()
        if io is not None and io.done:
            for key, block in io.completed():
                if block is None:
                    self.failed[key] = now
                if block is None or key in self.staged or self.store.peek(key) is not None:
                    continue
                try:
                    self.store.take(block.nbytes)
                except OutOfPhysicalMemoryError:
                    continue
                self.staged[key] = (block, now)
        while self.staged:
            key, (block, since) = next(iter(self.staged.items()))
            if now - since < STAGE_S:
                break
            self._unstage(key)
        while self.failed and now - next(iter(self.failed.values())) >= STAGE_S:
            self.failed.popitem(last=False)

    def _unstage(self, key: bytes) -> HostBlock | None:
        entry = self.staged.pop(key, None)
        if entry is None:
            return None
        self.store.give(entry[0].nbytes)
        return entry[0]

    def wait_reads(self, timeout: float) -> None:
        """Wait up to `timeout` seconds for a disk read to finish (no read: no wait)."""
        if self.io is not None:
            self.io.wait_reads(timeout)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until the blocks queued for the disk were written and the reads asked for
        were taken into the host tier, at most `timeout` seconds (tests, benchmarks). True
        when nothing is left."""
        if self.io is None:
            return True
        deadline = time.monotonic() + timeout
        while self.io.loading and time.monotonic() < deadline:
            self.io.wait_reads(0.01)
            self.poll()
        return self.io.flush(max(0.0, deadline - time.monotonic())) and not self.io.loading

    # ----------------------------------------------------------------- saving ----
    def save(self, reqid: int, keys: Sequence[bytes], holes: Sequence[Sequence[bool]]) -> int:
        """Copy the blocks of `keys` (the first blocks of `reqid`, pinned) that the host tier
        lacks into it; `holes[i][k]`: block i has a page of K/V kind k that a sliding
        window gave back (that kind's part is not kept; a block of holes only is kept empty,
        so that a chain runs on through it to blocks whose window pages are there). Returns
        the blocks copied."""
        store, u, io = self.store, self.block_pages, self.io
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        new: list[tuple[bytes, HostBlock]] = []
        for i, key in enumerate(keys):
            kept = self.layout.kind_flags(holes[i])
            held = store.get(key)  # (now recently used)
            if held is None and io is not None:
                held = io.pending_block(key)  # queued for the disk: taken back, no copy
                if held is not None and held.flags(self.layout) | kept == held.flags(self.layout):
                    store.put(key, held)
            if held is not None and held.flags(self.layout) | kept == held.flags(self.layout):
                continue  # held already, with every part this copy would hold
            parts: list[torch.Tensor | None] = []
            for k, (buffers, nbytes) in enumerate(self.layout.kinds):
                if holes[i][k]:
                    parts.append(None)
                    continue
                host = self.copier.empty(buffers * nbytes).view(buffers, nbytes)
                pairs += zip(self.cache.page_views(k, reqid, i * u, u), host)
                parts.append(host)
            # a copy with more parts than the one held (saved with holes): it replaces it, the
            # snapshot of the states at its end kept (the same tokens)
            new.append((key, HostBlock(parts, held.state if held is not None else None)))
        if not new:
            return 0
        ready = self.copier.to_host(pairs)
        disk = self.disk
        for key, block in new:
            block.ready = ready
            block.on_disk = disk is not None and disk.holds(key, block.flags(self.layout))
            store.put(key, block)
        return len(new)

    def save_state(self, key: bytes, row: int) -> bool:
        """Copy snapshot `row` (the states at the end of `key`'s block) into the host tier's
        block of `key`, if it holds that block without them."""
        block = self.store.get(key)
        if block is None or block.state is not None or not self.layout.state_bytes:
            return False
        host = self.copier.empty(self.layout.state_bytes)
        ready = self.copier.to_host([(self.cache.state_rows()[row], host)], in_order=True)  # a row is reused in place
        return self.store.add_state(key, host, ready)

    # -------------------------------------------------------------- restoring ----
    def restore(self, reqid: int, keys: Sequence[bytes], blocks: Sequence[HostBlock], first_block: int,
                fresh: Sequence[tuple[int, int]]) -> None:
        """Copy `blocks` (the blocks of `keys`: blocks first_block, first_block + 1, ... of
        `reqid`) into the pages `KVCache.extend_prefix` mapped fresh (`fresh`: per K/V kind,
        (first page, pages)), a run of pages of a block at a time. Raises when a needed part
        is not held (the caller checked it is)."""
        u = self.block_pages
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        for k, (start, count) in enumerate(fresh):
            page = self.layout.kinds[k][1] // u
            p = start
            while p < start + count:
                j, q = divmod(p, u)
                n = min(start + count, (j + 1) * u) - p  # the run of pages within block j
                block = blocks[j - first_block]
                part = block.kinds[k]
                if part is None:
                    raise ValueError(f"block {j} holds no pages of layer kind {k}")
                self.copier.wait(block.ready)  # (a block saved moments ago: its copy in host memory first)
                for src, dst in zip(part, self.cache.page_views(k, reqid, p, n)):
                    pairs.append((src[q * page:(q + n) * page], dst))
                p += n
        self.copier.to_device(reqid, pairs)
        for block in blocks:
            block.from_disk = False  # (restored: a later hit on it is the host tier's)
        event = self.copier.restores.get(reqid)
        if event is not None:  # CUDA: another request that maps these pages (pinned next) waits for them too
            self.recent.update(dict.fromkeys(keys, event))

    def depend(self, reqid: int, keys: Sequence[bytes]) -> None:
        """`reqid` maps the pinned pages of `keys`: on CUDA, its next step also waits for
        the restores of those blocks still in flight (restored for another request)."""
        if not self.recent:
            return
        self.recent = {k: e for k, e in self.recent.items() if not e.query()}
        if any(k in self.recent for k in keys):  # (one stream: its latest event covers every earlier copy)
            self.copier.restores[reqid] = self.copier.last_event

    def restore_state(self, block: HostBlock) -> int | None:
        """A snapshot row holding `block`'s states (copied from host memory), or None when no
        row or memory is left. The caller keeps it (`snapshots.pin`) or frees it."""
        cache = self.cache
        row = cache.snapshots.new_row()
        if row is None:
            return None
        try:
            self.copier.wait(block.ready)
            self.copier.to_device(None, [(block.state, cache.state_rows()[row])])
        except BaseException:
            cache.snapshots.free(row)
            raise
        return row

    # ---------------------------------------------------------------- figures ----
    @property
    def host_bytes(self) -> int:
        """Bytes the host tier holds (prefix blocks and swapped-out requests)."""
        return self.store.nbytes

    @property
    def disk_bytes(self) -> int:
        return self.disk.nbytes if self.disk is not None else 0


__all__ = ["FORMAT", "Tiers", "block_layout", "cache_identity"]
