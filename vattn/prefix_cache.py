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
from array import array
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Sequence

from vattn.errors import InvalidConfigError, InvalidRequestError

if TYPE_CHECKING:
    from vattn.config import Geometry


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
    """

    def __init__(self, cache: Any, salt: bytes | str = b"") -> None:
        g = cache.geometry
        check_sharing_unit(g, cache.backend.granularity)
        self.cache = cache
        self.block_tokens = g.share_tokens  # tokens a key covers
        self.block_pages = g.share_pages  # pages a block is pinned in (a handle each)
        self.salt = salt.encode() if isinstance(salt, str) else bytes(salt)
        self.entries: dict[bytes, tuple] = {}  # chained block hash -> its pages' pin handles
        # recurrent states: block hash -> its kept snapshot's handle, least recently used first
        self.with_states = cache.states is not None
        self.snapshots: OrderedDict[bytes, tuple[int, int]] = OrderedDict()
        self.num_query_tokens = 0  # prompt tokens looked up
        self.num_hit_tokens = 0  # of those, found in the cache

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

    def map_prefix(self, reqid: int, token_ids: Sequence[int]) -> int:
        """Map the longest cached prefix of `token_ids` into `reqid` (a request that has not
        run yet); with recurrent states, the longest whose last block keeps a snapshot, which
        is restored into `reqid`'s states, and the snapshots this request should take are
        asked for. At least one token is left to compute, so the request still gets logits.
        Returns the number of tokens mapped (0: a miss)."""
        ids = token_array(token_ids)
        keys, handles = self.lookup(ids)
        self.num_query_tokens += len(ids)
        if not self.with_states:
            n = 0
            if handles:
                n = self.cache.map_pinned(reqid, handles)
                self.forget_evicted(keys[:len(handles)], n)
        else:
            n = self._map_with_states(reqid, ids, keys, handles)
        self.num_hit_tokens += n
        return n

    def _map_with_states(self, reqid: int, ids: array, keys: list[bytes], handles: list[Any]) -> int:
        u, t = self.block_pages, self.block_tokens
        chain = len(handles) // u  # leading blocks with cached K/V
        n = 0
        hit = self._longest_snapshot(keys, chain)
        if hit:
            n = self.cache.map_pinned(reqid, handles[:hit * u])
            self.forget_evicted(keys[:hit], n)
            if n < hit * t:  # K/V pages were evicted meanwhile: the longest snapshot within what is mapped
                hit = self._longest_snapshot(keys, n // t)
                if hit * t < n:
                    self.cache.truncate_pinned(reqid, hit * t)
                n = hit * t
            if hit:
                key = keys[hit - 1]
                if self.cache.restore_snapshot(reqid, self.snapshots[key]):
                    self.snapshots.move_to_end(key)
                else:  # evicted, or no memory for the request's states: a miss
                    self.cache.truncate_pinned(reqid, 0)
                    n = 0
        want = {len(ids) // t * t, chain * t} if chain > hit else {len(ids) // t * t}
        self.cache.want_snapshots(reqid, sorted(b for b in want if b > n))
        return n

    def _longest_snapshot(self, keys: Sequence[bytes], blocks: int) -> int:
        """The most leading blocks of `keys[:blocks]` whose last keeps a snapshot (0: none)."""
        snaps, kept = self.snapshots, self.cache.snapshot_pinned
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
        if self.with_states:
            self._keep_snapshots(reqid, len(token_ids), keys)

    def _keep_snapshots(self, reqid: int, num_tokens: int, keys: list[bytes]) -> None:
        cache, t = self.cache, self.block_tokens
        whole = num_tokens // t * t
        taken = cache.take_snapshots(reqid, whole)
        if whole and whole == num_tokens and whole not in taken and cache.allocator.num_tokens(reqid) == whole:
            row = cache.snapshot(reqid)  # its states are at the boundary now
            if row is not None:
                taken[whole] = row
        for b, row in sorted(taken.items()):
            key = keys[b // t - 1]
            if key not in self.entries or self._has_snapshot(key):  # its K/V was not pinned, or kept already
                cache.free_snapshot(row)
            else:
                self.snapshots[key] = cache.pin_snapshot(row)
            if key in self.snapshots:
                self.snapshots.move_to_end(key)
        for key in [k for k, h in self.snapshots.items()  # evicted, or their K/V block was
                    if not cache.snapshot_pinned(h) or k not in self.entries or not self.pinned(self.entries[k])]:
            self._drop_snapshot(key)

    def _has_snapshot(self, key: bytes) -> bool:
        handle = self.snapshots.get(key)
        return handle is not None and self.cache.snapshot_pinned(handle)

    def _drop_snapshot(self, key: bytes) -> None:
        handle = self.snapshots.pop(key, None)
        if handle is not None:
            self.cache.free_snapshot(handle)

    def pinned(self, handles: tuple) -> bool:
        """Whether every page of a block is still pinned, in every layer kind (holes behind a
        sliding window are)."""
        return self.cache.allocator.is_pinned(handles)

    @property
    def hit_rate(self) -> float:
        """Prompt tokens found in the cache / prompt tokens looked up."""
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0


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

    fits = []
    for layout in (c.layout, *(x for x in LAYOUTS if x != c.layout)):
        for page in dict.fromkeys((g.page_size, granularity)):
            alt = type(g)(dataclasses.replace(c, layout=layout, page_size=page), page)
            if alt.share_tokens < c.max_context_len and (layout, page) != (c.layout, g.page_size):
                fits.append(f"layout={layout!r}, page_size={page} ({alt.share_tokens} tokens a block)")
    hint = ("use " + " or ".join(fits[:2])) if fits else (
        "no layout or page size of this backend makes blocks shorter: run without prefix caching, or raise "
        "max_context_len")
    raise InvalidConfigError(
        f"prefix caching shares whole tokens in blocks of {g.share_tokens} tokens here ({g.token_bytes}-byte tokens "
        f"meet {g.page_size}-byte page boundaries only every {g.share_pages} pages), not fewer than "
        f"max_context_len={c.max_context_len}: no prompt could ever share a block; {hint}")


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
