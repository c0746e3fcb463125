"""The elastic pool: elastic physical memory under a server's own paged KV cache.

- `elastic`: `ElasticPool` and `PoolConfig`, the block tensors reserved once and the pages
  mapped under them on demand (torch, a vmem backend, the `Budget`).
- `books`: its books (`BlockBooks`, `PoolStats`): blocks in use, the pages backing them.
  Plain Python, on the page layer (`vattn.pages`), as the cache's books are (`vattn.allocator`).
- `placement`: where the next block goes (`FreeBlocks`, the warm and cold free blocks the
  books own) and where blocks lie on pages (`BlockPages`). Plain Python.

`from vattn.pool import ElasticPool, PoolConfig` is the public import. The names load on
first use (PEP 562), so importing the books (which runs this file first) does not import
torch through the pool.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from vattn._lazy import lazy_exports

if TYPE_CHECKING:
    from vattn.errors import UnknownBlockError
    from vattn.pool.books import BlockBooks, PoolStats
    from vattn.pool.elastic import SYNC_MODES, ElasticPool, PoolConfig

__all__ = ["ElasticPool", "PoolConfig", "PoolStats", "UnknownBlockError", "SYNC_MODES", "BlockBooks"]

_EXPORTS = {
    "ElasticPool": "vattn.pool.elastic", "PoolConfig": "vattn.pool.elastic", "SYNC_MODES": "vattn.pool.elastic",
    "PoolStats": "vattn.pool.books", "BlockBooks": "vattn.pool.books",
    "UnknownBlockError": "vattn.errors",  # raised by the pool; an error of the package root like the others
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
