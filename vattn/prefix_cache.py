"""Automatic prefix caching on contiguous virtual memory.

Blocks of prompt tokens are keyed by a chained hash (like vLLM's block hashes: each
block's key covers every token before it, salted per model), and their physical pages are
pinned in the cache when a request has computed them. A new request whose prompt starts
with cached blocks maps those pages into its own slot (the same physical memory at a
second virtual address: no copy) and prefills only the rest; the kernels still read one
contiguous tensor. Pinned pages no slot maps are evicted, least recently used first, when
the cache runs short of memory (or at `trim()`).

```
prompt:   [ block 0 tokens ][ block 1 tokens ][ block 2 tok... ]
key:        h0 = H(salt, b0)   h1 = H(h0, b1)    (partial block: never cached)
pages:    [ p0 ][ p1 ][ p2 ][ p3 ][ p4 ][ p5 ]    (here 3 pages a block)
```
A block is the cache's sharing unit (`Geometry.share_tokens` tokens in `share_pages`
pages): the fewest whole tokens that fill whole pages, lcm(page_size, token bytes) bytes.
A page that holds whole tokens is one block; where a token does not divide the page (head
dims of 80 or 96, as Phi-2 and Phi-3 have), a block spans a few pages, so that a request
that maps cached blocks computes its own tokens from a page boundary on and never writes
into a page it shares. No page size arithmetic is asked of the user; only a block longer
than the context (no prompt could ever share one) is refused, naming a fitting page size
or layout. The fused layout, which puts every layer of a token in each page, has fewer
tokens per page, and shorter blocks.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
from array import array
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Sequence

from vattn.checks import as_int
from vattn.errors import InvalidConfigError, InvalidRequestError

if TYPE_CHECKING:
    from vattn.config import Geometry
    from vattn.offload.tiers import Tiers

logger = logging.getLogger(__name__)


class Hit(NamedTuple):
    """What a lookup mapped into a request: its first `num_tokens` tokens, the first
    `device_tokens` of them from pinned pages, then a block from each tier of `lower`
    ("host" or "disk") restored, `block_tokens` tokens each."""

    num_tokens: int = 0
    device_tokens: int = 0
    lower: tuple[str, ...] = ()
    block_tokens: int = 1

    def tier_tokens(self, tier: str, upto: int | None = None) -> int:
        """Tokens of the first `upto` (all) that came from `tier` ("host" or "disk")."""
        upto = self.num_tokens if upto is None else min(upto, self.num_tokens)
        blocks = max(0, upto - self.device_tokens) // self.block_tokens
        return self.lower[:blocks].count(tier) * self.block_tokens


class PrefixCache:
    """Hash -> pinned page handles (and, for recurrent states, a kept snapshot), over one
    `vattn.KVCache`: every layer kind's part of a block. Plain Python.

    A cache with recurrent states (`KVCache(state_bytes=...)`, Mamba2 / gated delta-net
    hybrids, as vLLM's hybrid prefix caching) needs the states at a hit's end too: a block
    may keep a snapshot of every state layer's states at its end (`snapshots`, a row of the
    cache's state kind, in its budget), and a hit is the longest cached chain whose last
    block keeps one (its K/V pages are mapped, the snapshot is copied into the request's
    states). A snapshot costs the whole state however short the block, so not every block
    keeps one: a request snapshots (1) the end of its prompt's last whole block and (2) the
    end of the cached K/V chain its lookup found past its longest snapshot (where it parts
    from an earlier prompt: the boundary later prompts with that prefix share). Snapshots are
    evicted with the cache's other pages, least recently used first.

    Offload tiers (`vattn.offload`): with `offload_bytes`, a block is also copied to host
    memory when it is cached (the cache's host store, `cache.host`, shared with swapped-out
    requests under that one budget), so that evicting its pages loses nothing; with
    `offload_dir` and `offload_dir_bytes` the blocks evicted from host memory go to files
    there, kept across restarts (the salt must name the weights, and may not be empty: the engine's does). A lookup
    maps the blocks in device memory, then restores the chain's next blocks from the nearest
    tier into fresh pages of the request (`num_host_hit_tokens`, `num_disk_hit_tokens`), as far
as the request can then run (`map_prefix`'s `fits`: the scheduler plans the restore with the
step, so that it never takes the pages of a running request nor restores blocks the request
could not keep). A
    block restores its recurrent states' snapshot with it, or ends no hit; a sliding window's
    part of a block is kept only where the window had not given its pages back, and a block
    is restored only where the query after the hit reads no page it lacks. Anything that goes
    wrong (a damaged file, a failed copy, no memory) is a miss of those blocks, never wrong
    data. InvalidConfigError at start for settings that cannot work (see `check_offload`),
    UnsafeOffloadDirError for an `offload_dir` another user could write. Disk I/O runs on the
    tiers' threads: writes always; reads when the caller reads ahead with `load` (the engine's
    scheduler does), else in `map_prefix`.
    """

    def __init__(self, cache: Any, salt: bytes | str = b"", *, offload_bytes: int | None = None,
                 offload_dir: str | os.PathLike | None = None, offload_dir_bytes: int | None = None) -> None:
        if not isinstance(salt, (str, bytes, bytearray, memoryview)):  # (bytes(5) would be 5 zero bytes)
            raise InvalidConfigError(f"salt must be str or bytes naming the model's weights, got {salt!r}")
        g = cache.geometry
        check_sharing_unit(g, cache.backend.granularity)
        offload_bytes, offload_dir, offload_dir_bytes = check_offload(offload_bytes, offload_dir, offload_dir_bytes)
        if offload_dir is not None and not salt:  # files outlive the process: another model would read them
            raise InvalidConfigError(
                "offload_dir keeps blocks for later processes, keyed by the salt: give salt= naming the model's "
                "weights (vattn.LLM passes a fingerprint of them), or no offload_dir")
        self.cache = cache
        self.block_tokens = g.share_tokens  # tokens a key covers
        self.block_pages = g.share_pages  # pages a block is pinned in (a handle each)
        self.salt = salt.encode() if isinstance(salt, str) else bytes(salt)
        self.entries: dict[bytes, tuple] = {}  # chained block hash -> its pages' pin handles
        # recurrent states: block hash -> its kept snapshot's handle, least recently used first
        self.with_states = cache.states is not None
        self.snapshots: OrderedDict[bytes, tuple[int, int]] = OrderedDict()
        self.num_query_tokens = 0  # prompt tokens looked up
        self.num_hit_tokens = 0  # of those, found in the cache (in any tier)
        self.num_host_hit_tokens = 0  # of those, restored from host memory
        self.num_disk_hit_tokens = 0  # of those, restored from disk
        self.num_restore_failures = 0  # restores that failed (their tokens were computed)
        self.num_restores_held_back = 0  # lookups that restored fewer blocks than the tiers held: no room
        # reqid -> what its last map_prefix counted: (query, hit, host hit, disk hit tokens)
        self._counted: dict[int, tuple[int, int, int, int]] = {}
        self.tiers: Tiers | None = None  # (the host and disk tiers, vattn.offload)
        self.reads_ahead = False  # the caller reads disk blocks ahead (`load`): lookups read none
        if offload_bytes is not None:
            from vattn.offload import tiers  # (torch: only with the tiers)

            self.tiers = tiers.Tiers(cache, self.salt, self.with_states, offload_bytes, offload_dir, offload_dir_bytes)

    def block_hashes(self, token_ids: Sequence[int]) -> list[bytes]:
        """The chained key of every whole block of `token_ids` (a sequence of token ids:
        ints >= 0, else InvalidRequestError)."""
        ids = token_array(token_ids)
        tpp, keys, prev = self.block_tokens, [], self.salt
        for start in range(0, len(ids) - tpp + 1, tpp):
            h = hashlib.blake2b(prev, digest_size=16)
            h.update(ids[start:start + tpp].tobytes())
            prev = h.digest()
            keys.append(prev)
        return keys

    def map_prefix(self, reqid: int, token_ids: Sequence[int], fits: Callable[[int], bool] | None = None) -> int:
        """Map the longest cached prefix of `token_ids` into `reqid` (a request that has not
        run yet): the blocks in device memory, then the next ones restored from the host or
        disk tier; with recurrent states, the longest whose last block keeps a snapshot, which
        is restored into `reqid`'s states, and the snapshots this request should take are
        asked for. At least one token is left to compute, so the request still gets logits.
        `fits(n)`: whether the request can run this iteration holding `n` tokens (the
        scheduler plans it with the running requests: `KVCache.can_step`); a restore stops
        at the longest prefix that fits (a restore the request could not keep is thrash).
        Returns the number of tokens mapped (0: a miss). `uncount` takes back what this
        lookup counted, for a request that is not admitted after all."""
        ids = token_array(token_ids)
        self.num_query_tokens += len(ids)
        self._counted[reqid] = (len(ids), 0, 0, 0)  # (until its hit is counted: a lookup may raise)
        hit = self.map_hit(reqid, ids, fits)
        self.count(hit, reqid=reqid, query=len(ids))
        return hit.num_tokens

    def load(self, token_ids: Sequence[int]) -> bool:
        """Whether `token_ids`' cached chain goes on, past its blocks in device memory, with
        blocks being read from disk in the background: those the disk tier alone holds are
        asked for here (the reads run off the caller's thread; they wait in host memory for
        this request's lookup). Never blocks. True: come back later (the scheduler leaves the
        request waiting, as vLLM's WAITING_FOR_REMOTE_KVS, and admits others meanwhile);
        False: nothing to wait for (no disk tier, nothing on disk only, or the reads ended:
        `map_prefix` then finds the blocks in host memory, or misses those that failed). Once
        called, lookups read no disk block themselves: a block on disk only ends a hit (it is
        computed), so no caller's thread ever waits for a read."""
        tiers = self.tiers
        if tiers is None or tiers.io is None:
            return False
        self.reads_ahead = True
        keys, _ = self.lookup(token_ids)
        dev = 0
        while dev < len(keys) and keys[dev] in self.entries and self.pinned(self.entries[keys[dev]]):
            dev += 1
        return tiers.load(keys[dev:])

    def wait_loads(self, timeout: float) -> None:
        """Wait up to `timeout` seconds for a disk read `load` started to finish (none: no wait)."""
        if self.tiers is not None:
            self.tiers.wait_reads(timeout)

    def uncount(self, reqid: int) -> None:
        """Take back the counts of `reqid`'s last `map_prefix` (the scheduler left the request
        waiting after all: its next admission looks it up again, and a prompt counts once per
        admission). No-op when nothing was counted for it since."""
        counted = self._counted.pop(reqid, None)
        if counted is None:
            return
        query, hits, host, disk = counted
        self.num_query_tokens -= query
        self.num_hit_tokens -= hits
        self.num_host_hit_tokens -= host
        self.num_disk_hit_tokens -= disk

    def count(self, hit: Hit, upto: int | None = None, *, reqid: int | None = None, query: int = 0) -> None:
        """Count the first `upto` (all) tokens of `hit` among the hits, by tier. With `reqid`:
        the lookup of that request (`query` tokens, counted by the caller), which `uncount`
        can take back."""
        n = hit.num_tokens if upto is None else min(upto, hit.num_tokens)
        host, disk = hit.tier_tokens("host", n), hit.tier_tokens("disk", n)
        self.num_hit_tokens += n
        self.num_host_hit_tokens += host
        self.num_disk_hit_tokens += disk
        if reqid is not None:
            self._counted[reqid] = (query, n, host, disk)

    def map_hit(self, reqid: int, ids: array, fits: Callable[[int], bool] | None = None) -> Hit:
        """`map_prefix` without counting: where the tokens mapped came from."""
        keys, handles = self.lookup(ids)
        if self.tiers is not None:
            self.tiers.poll()  # disk reads that finished: host blocks now
        n = 0
        if handles:
            n = self.cache.map_pinned(reqid, handles)
            self.forget_evicted(keys[:len(handles)], n)
            if self.tiers is not None:
                self.tiers.depend(reqid, keys[:n // self.block_tokens])
        if self.with_states:
            return self._map_with_states(reqid, ids, keys, n, fits)
        if self.tiers is None:
            return Hit(n, n, (), self.block_tokens)
        dev = n // self.block_tokens
        lower = self._lower_chain(keys, dev)
        end = self._lower_end(keys, dev, lower, states=False, fits=fits)
        if end > dev:
            hit, n = self._restore(reqid, keys, dev, end, lower)
            if hit is not None:
                return hit
        return Hit(n, n, (), self.block_tokens)

    def _map_with_states(self, reqid: int, ids: array, keys: list[bytes], n: int,
                         fits: Callable[[int], bool] | None) -> Hit:
        t, cache = self.block_tokens, self.cache
        dev = n // t  # leading blocks whose K/V is mapped
        lower = self._lower_chain(keys, dev)
        chain = dev + len(lower)  # the cached K/V chain, every tier's
        hit = None
        end = self._lower_end(keys, dev, lower, states=True, fits=fits)
        if end > dev:
            hit, n = self._restore(reqid, keys, dev, end, lower)
        if hit is None:  # the longest snapshot within the blocks mapped from device memory
            end = self._longest_snapshot(keys, n // t)
            if end * t < n:
                try:
                    cache.truncate_pinned(reqid, end * t)
                except InvalidRequestError:  # a window's pages before the cut were given back
                    cache.drop_prefix(reqid)
                    end = 0
            n = end * t
            if end:
                key = keys[end - 1]
                if cache.snapshots.restore(reqid, self.snapshots[key]):
                    self.snapshots.move_to_end(key)
                else:  # no memory for the request's states: a miss
                    cache.truncate_pinned(reqid, 0)
                    n = 0
            hit = Hit(n, n, (), t)
        want = {len(ids) // t * t, chain * t} if chain * t > hit.num_tokens else {len(ids) // t * t}
        cache.snapshots.want(reqid, sorted(b for b in want if b > hit.num_tokens))
        return hit

    # ---------------------------------------------------------- the lower tiers ----
    def _lower_chain(self, keys: Sequence[bytes], dev: int) -> list[tuple[str, int]]:
        """(tier, flags) of each block after the first `dev`, while the host or disk tier
        holds them (none without tiers)."""
        chain: list[tuple[str, int]] = []
        if self.tiers is not None:
            self.tiers.release(keys[dev:])  # blocks read ahead for this lookup: host blocks now
            disk = not self.reads_ahead  # (read ahead: a block still on disk only is a miss, never read here)
            for key in keys[dev:]:
                where = self.tiers.locate(key, disk)
                if where is None:
                    break
                chain.append(where)
        return chain

    def _lower_end(self, keys: Sequence[bytes], dev: int, lower: Sequence[tuple[str, int]], states: bool,
                   fits: Callable[[int], bool] | None = None) -> int:
        """The most leading blocks a hit may end at, restoring blocks `dev` .. from `lower`:
        every K/V kind holds the pages the query after it reads (a sliding window's part of a
        block may be missing), with states the last block keeps a snapshot (in device
        memory or with the lower block), and the request can run holding them (`fits`, see
        `map_prefix`). `dev` when no such end lies past `dev`."""
        t, u = self.block_tokens, self.block_pages
        layout = self.tiers.layout if self.tiers is not None else None
        top = dev + len(lower)
        if fits is not None and top > dev and not fits(top * t):
            lo, hi = dev, top - 1  # what a request needs grows with its length: the most that fits
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if fits(mid * t) else (lo, mid - 1)
            top = lo
            self.num_restores_held_back += 1
        for end in range(top, dev, -1):
            if states:
                flags = lower[end - 1 - dev][1]
                if not (flags & layout.state_flag or self._has_snapshot(keys[end - 1])):
                    continue
            firsts = self.cache.allocator.first_reads(end * t)
            if all(lower[j - dev][1] >> k & 1 for k, first in enumerate(firsts)
                   for j in range(max(dev, first // u), end)):
                return end
        return dev

    def _restore(self, reqid: int, keys: list[bytes], dev: int, end: int,
                 lower: Sequence[tuple[str, int]]) -> tuple[Hit | None, int]:
        """Restore blocks `dev` .. `end - 1` of `keys` from the lower tiers into `reqid`, which
        holds the first `dev` from device memory: fresh pages, the blocks' data copied in, then
        pinned (the blocks are in device memory again), and with states the snapshot at the
        end. Returns (the hit, tokens held); (None, tokens held) when it could not: a block
        lost on the way or damaged (a shorter hit then, if any), no memory, a failed copy."""
        t, u, tiers, cache = self.block_tokens, self.block_pages, self.tiers, self.cache
        blocks = []
        for key in keys[dev:end]:
            block = tiers.fetch(key)
            if block is None:
                break
            blocks.append(block)
        if len(blocks) < end - dev:  # a file went missing or was bad: what was read still serves
            lower = [(where, b.flags(tiers.layout)) for (where, _), b in zip(lower, blocks)]
            end = self._lower_end(keys, dev, lower, states=self.with_states)
            if end <= dev:
                return None, dev * t
        held, fresh = cache.extend_prefix(reqid, end * t)
        if held < end * t:  # no memory
            return None, held
        try:
            tiers.restore(reqid, keys[dev:end], blocks[:end - dev], dev, fresh)
        except Exception as e:  # noqa: BLE001 - the request computes them
            self.num_restore_failures += 1
            logger.warning("vattn: restoring %d cached blocks failed (%s: %s); they are computed",
                           end - dev, type(e).__name__, str(e))  # (not e: its traceback holds views)
            cache.drop_prefix(reqid)
            return None, 0
        handles = cache.pin(reqid, end * u)
        for j in range(dev, end):
            self.entries[keys[j]] = tuple(handles[j * u:(j + 1) * u])
        if self.with_states and not self._restore_states(reqid, keys[end - 1], blocks[end - 1 - dev]):
            cache.drop_prefix(reqid)
            return None, 0
        return Hit(end * t, dev * t, tuple(where for where, _ in lower[:end - dev]), t), end * t

    def _restore_states(self, reqid: int, key: bytes, block: Any) -> bool:
        """`reqid`'s states become the snapshot at the end of `key`'s block: the one in device
        memory, or the lower tier's restored into a snapshot row (kept, as device memory's).
        False when none could be had (no row, no memory, a failed copy)."""
        cache = self.cache
        if not self._has_snapshot(key):
            if block.state is None:
                return False
            try:
                row = self.tiers.restore_state(block)
            except Exception as e:  # noqa: BLE001 - a miss
                self.num_restore_failures += 1
                logger.warning("vattn: restoring a state snapshot failed (%s: %s)", type(e).__name__, str(e))
                return False
            if row is None:
                return False
            self._drop_snapshot(key)
            self.snapshots[key] = cache.snapshots.pin(row)
        if not cache.snapshots.restore(reqid, self.snapshots[key]):
            return False
        self.snapshots.move_to_end(key)
        return True

    def _longest_snapshot(self, keys: Sequence[bytes], blocks: int) -> int:
        """The most leading blocks of `keys[:blocks]` whose last keeps a snapshot (0: none)."""
        snaps, kept = self.snapshots, self.cache.snapshots.is_pinned
        return next((i for i in range(blocks, 0, -1) if keys[i - 1] in snaps and kept(snaps[keys[i - 1]])), 0)

    def lookup(self, token_ids: Sequence[int]) -> tuple[list[bytes], list[Any]]:
        """The keys of the whole blocks of `token_ids` but its last token, and the page
        handles of the leading ones that are cached (they may have been evicted since), one
        after another."""
        ids = token_array(token_ids)
        keys = self.block_hashes(ids[:len(ids) - 1])
        handles: list[Any] = []
        for key in keys:
            block = self.entries.get(key)
            if block is None:
                break
            handles.extend(block)
        return keys, handles

    def forget_evicted(self, keys: Sequence[bytes], num_mapped: int) -> None:
        """`map_pinned` mapped `num_mapped` tokens of the handles of `keys`: the blocks after
        those lost pages to eviction meanwhile."""
        for key in keys[num_mapped // self.block_tokens:]:
            self.entries.pop(key, None)
            self._drop_snapshot(key)

    def insert(self, reqid: int, token_ids: Sequence[int]) -> None:
        """Pin the pages of the whole blocks of `token_ids`, which `reqid` has written
        (computed) from its first token on, and remember them under their keys; with
        recurrent states, keep the snapshots `reqid` took at their boundaries (and one of its
        states now, when they end on a boundary)."""
        keys = self.block_hashes(token_ids)
        if keys:
            u = self.block_pages
            handles = self.cache.pin(reqid, len(keys) * u)
            for i, key in enumerate(keys):
                self.entries[key] = tuple(handles[i * u:(i + 1) * u])
            if len(self.entries) > 2 * len(self.cache.allocator.pins) + 1024:  # forget evicted blocks
                self.entries = {k: b for k, b in self.entries.items() if self.pinned(b)}
            if self.tiers is not None:  # write-through: the host tier gets the blocks it lacks
                self.tiers.save(reqid, keys, [self._holes(handles[i * u:(i + 1) * u]) for i in range(len(keys))])
        if self.with_states:
            self._keep_snapshots(reqid, len(token_ids), keys)

    def _keep_snapshots(self, reqid: int, num_tokens: int, keys: list[bytes]) -> None:
        cache, t = self.cache, self.block_tokens
        whole = num_tokens // t * t
        taken = cache.snapshots.take(reqid, whole)
        if whole and whole == num_tokens and whole not in taken and cache.allocator.num_tokens(reqid) == whole:
            row = cache.snapshots.capture(reqid)  # its states are at the boundary now
            if row is not None:
                taken[whole] = row
        for b, row in sorted(taken.items()):
            key = keys[b // t - 1]
            if key not in self.entries or self._has_snapshot(key):  # its K/V was not pinned, or kept already
                cache.snapshots.free(row)
            else:
                self.snapshots[key] = cache.snapshots.pin(row)
                if self.tiers is not None:  # with the block's copy in the host tier
                    self.tiers.save_state(key, row)
            if key in self.snapshots:
                self.snapshots.move_to_end(key)
        for key in [k for k, h in self.snapshots.items()  # evicted, or their K/V block was
                    if not cache.snapshots.is_pinned(h) or k not in self.entries or not self.pinned(self.entries[k])]:
            self._drop_snapshot(key)

    def _holes(self, handles: Sequence[Any]) -> list[bool]:
        """Per K/V kind, whether one of a block's pin handles is a hole (a page a sliding
        window had given back): see `vattn.allocator.sharing` for their shape."""
        if len(self.cache.kv_kind_buffers) == 1:
            return [any(h[0] is None for h in handles)]
        return [any(h[0] is None for h in handles),
                *(any(h[2][k][0] is None for h in handles) for k in range(len(handles[0][2])))]

    def _has_snapshot(self, key: bytes) -> bool:
        handle = self.snapshots.get(key)
        return handle is not None and self.cache.snapshots.is_pinned(handle)

    def _drop_snapshot(self, key: bytes) -> None:
        handle = self.snapshots.pop(key, None)
        if handle is not None:
            self.cache.snapshots.free(handle)

    def pinned(self, handles: tuple) -> bool:
        """Whether every page of a block is still pinned, in every layer kind (holes behind a
        sliding window are)."""
        return self.cache.allocator.is_pinned(handles)

    @property
    def hit_rate(self) -> float:
        """Prompt tokens found in the cache / prompt tokens looked up."""
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0


def check_offload(offload_bytes: Any, offload_dir: Any, offload_dir_bytes: Any) -> tuple[Any, Any, Any]:
    """The offload settings checked (InvalidConfigError): `offload_bytes` (an int > 0, the host
    tier), `offload_dir` (a path, with `offload_dir_bytes`, an int > 0; the disk tier lies
    under the host tier, so it needs `offload_bytes` too)."""
    def count(value: Any, name: str) -> int | None:
        return None if value is None else as_int(value, name, InvalidConfigError, low=1,
                                                  what="None or a number of bytes > 0")

    offload_bytes, offload_dir_bytes = count(offload_bytes, "offload_bytes"), count(offload_dir_bytes,
                                                                                     "offload_dir_bytes")
    if offload_dir is not None:
        if not isinstance(offload_dir, (str, os.PathLike)) or not os.fspath(offload_dir):
            raise InvalidConfigError(f"offload_dir must be a directory's path, got {offload_dir!r}")
        if offload_dir_bytes is None:
            raise InvalidConfigError("offload_dir needs offload_dir_bytes: the bytes of files the disk tier may keep")
        if offload_bytes is None:
            raise InvalidConfigError(
                "offload_dir needs offload_bytes: the disk tier holds the blocks evicted from the host tier")
    elif offload_dir_bytes is not None:
        raise InvalidConfigError("offload_dir_bytes needs offload_dir, the directory of the disk tier")
    return offload_bytes, offload_dir, offload_dir_bytes


def check_sharing_unit(g: Geometry, granularity: int) -> None:
    """InvalidConfigError if the sharing unit of `g` (`Geometry.share_tokens`) is no
    shorter than the context: a prompt has fewer than max_context_len tokens and its last
    one is always computed, so no block could ever be shared. (A unit is at most one slot
    of a buffer, so no bigger a cap is needed.) The message names page sizes (multiples of
    the backend's `granularity`) and layouts whose unit fits: a smaller page, or the fused
    layout (more bytes a token, usually more factors of two), shortens it."""
    c = g.config
    if g.share_tokens < c.max_context_len:
        return
    from vattn.config import LAYOUTS  # (torch: only on this error path)

    fits, alts = [], []
    for layout in (c.layout, *(x for x in LAYOUTS if x != c.layout)):
        for page in dict.fromkeys((g.page_size, granularity)):
            alt = type(g)(dataclasses.replace(c, layout=layout, page_size=page), page)
            if alt.share_tokens < c.max_context_len and (layout, page) != (c.layout, g.page_size):
                fits.append(f"layout={layout!r}, page_size={page} ({alt.share_tokens} tokens a block)")
                alts.append({"layout": layout, "page_size": page})
    hint = ("use " + " or ".join(fits[:2])) if fits else (
        "no layout or page size of this backend makes blocks shorter: run without prefix caching, or raise "
        "max_context_len")
    err = InvalidConfigError(
        f"prefix caching shares whole tokens in blocks of {g.share_tokens} tokens here ({g.token_bytes}-byte tokens "
        f"meet {g.page_size}-byte page boundaries only every {g.share_pages} pages), not fewer than "
        f"max_context_len={c.max_context_len}: no prompt could ever share a block; {hint}")
    err.sharing_alternatives = alts  # the settings (layout, page_size) under which blocks fit: a caller may retry
    raise err


def token_array(token_ids: Any) -> array:
    """`token_ids` as an int64 array, or InvalidRequestError unless it is a sequence of
    ints >= 0 (a str, None, floats, NaN or negative ids would key pages wrongly, or fail
    deep inside). Checked at C speed: the engine passes every prompt through here."""
    if isinstance(token_ids, array) and token_ids.typecode == "q":
        ids = token_ids
    elif isinstance(token_ids, (str, bytes)) or not hasattr(token_ids, "__len__"):
        raise InvalidRequestError(f"token_ids must be a sequence of token ids (ints >= 0), got {token_ids!r}")
    else:
        try:
            ids = array("q", token_ids)
        except (TypeError, OverflowError, ValueError):
            raise InvalidRequestError(f"token_ids must be ints >= 0 below 2**63, got {token_ids!r}") from None
    if ids and min(ids) < 0:
        raise InvalidRequestError(f"token_ids must be ints >= 0, got {min(ids)} in {token_ids!r}")
    return ids
