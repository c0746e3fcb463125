"""Automatic prefix caching on contiguous virtual memory.

Whole pages of prompt tokens are keyed by a chained hash (like vLLM's block hashes: each
page's key covers every token before it, salted per model), and their physical pages are
pinned in the cache when a request has computed them. A new request whose prompt starts
with cached pages maps those pages into its own slot (the same physical memory at a second
virtual address: no copy) and prefills only the rest; the kernels still read one
contiguous tensor. Pinned pages no slot maps are evicted, least recently used first, when
the cache runs short of memory (or at `trim()`).

```
prompt:   [ page 0 tokens ][ page 1 tokens ][ page 2 tok... ]
key:        h0 = H(salt, p0)  h1 = H(h0, p1)   (partial page: never cached)
```
The page size decides the sharing granularity: `tokens_per_page` tokens of one request
per page (fewer with the fused layout, which puts every layer of a token in each page).
"""
from __future__ import annotations

import hashlib
from array import array
from typing import Any, Sequence

from vattn.errors import InvalidConfigError, InvalidRequestError


class PrefixCache:
    """Hash -> pinned page handle, over one `vattn.KVCache`. Plain Python."""

    def __init__(self, cache: Any, salt: bytes | str = b"") -> None:
        g = cache.geometry
        if not g.whole_tokens_per_page:
            raise InvalidConfigError(
                f"prefix caching needs a page that holds whole tokens; {g.page_size} bytes is not a multiple "
                f"of a token's {g.token_bytes} bytes: pick another page_size")
        self.cache = cache
        self.tokens_per_page = g.whole_tokens_per_page
        self.salt = salt.encode() if isinstance(salt, str) else bytes(salt)
        self.entries: dict[bytes, Any] = {}  # chained page hash -> pin handle
        self.num_query_tokens = 0  # prompt tokens looked up
        self.num_hit_tokens = 0  # of those, found in the cache

    def page_hashes(self, token_ids: Sequence[int]) -> list[bytes]:
        """The chained key of every whole page of `token_ids` (a sequence of token ids:
        ints >= 0, else InvalidRequestError)."""
        ids = token_array(token_ids)
        tpp, keys, prev = self.tokens_per_page, [], self.salt
        for start in range(0, len(ids) - tpp + 1, tpp):
            h = hashlib.blake2b(prev, digest_size=16)
            h.update(ids[start:start + tpp].tobytes())
            prev = h.digest()
            keys.append(prev)
        return keys

    def map_prefix(self, reqid: int, token_ids: Sequence[int]) -> int:
        """Map the longest cached prefix of `token_ids` into `reqid` (a request that has not
        run yet). At least one token is left to compute, so the request still gets logits.
        Returns the number of tokens mapped (0: a miss)."""
        ids = token_array(token_ids)
        keys, handles = self.lookup(ids)
        self.num_query_tokens += len(ids)
        if not handles:
            return 0
        n = self.cache.map_pinned(reqid, handles)
        self.forget_evicted(keys[:len(handles)], n)
        self.num_hit_tokens += n
        return n

    def lookup(self, token_ids: Sequence[int]) -> tuple[list[bytes], list[Any]]:
        """The keys of the whole pages of `token_ids` but its last token, and the handles of
        the leading ones that are cached (they may have been evicted since)."""
        ids = token_array(token_ids)
        keys = self.page_hashes(ids[:len(ids) - 1])
        handles = []
        for key in keys:
            handle = self.entries.get(key)
            if handle is None:
                break
            handles.append(handle)
        return keys, handles

    def forget_evicted(self, keys: Sequence[bytes], num_mapped: int) -> None:
        """`map_pinned` mapped `num_mapped` tokens of the handles of `keys`: the pages after
        those were evicted meanwhile."""
        for key in keys[num_mapped // self.tokens_per_page:]:
            self.entries.pop(key, None)

    def insert(self, reqid: int, token_ids: Sequence[int]) -> None:
        """Pin the whole pages of `token_ids`, which `reqid` has written (computed) from
        its first token on, and remember them under their keys."""
        keys = self.page_hashes(token_ids)
        if not keys:
            return
        for key, handle in zip(keys, self.cache.pin(reqid, len(keys))):
            self.entries[key] = handle
        if len(self.entries) > 2 * len(self.cache.allocator.pins) + 1024:  # forget evicted pages
            live = self.cache.allocator.pins
            self.entries = {k: h for k, h in self.entries.items() if live.get(h[0]) == h[1]}

    @property
    def hit_rate(self) -> float:
        """Prompt tokens found in the cache / prompt tokens looked up."""
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0


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
