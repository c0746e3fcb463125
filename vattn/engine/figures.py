"""What an engine reports: the figures `LLM` gives (`EngineFigures`, a base of `LLM`: memory,
prefix caching, speculative decoding, beam search, preemptions) and `PrefixCacheStats`.
Each reads the engine's parts (its cache, prefix cache, scheduler and counters), under the
engine's lock where a step could change them meanwhile."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vattn.engine.beam_search import BeamSearchStats
from vattn.engine.spec_decode import SpecDecodeStats


@dataclass(frozen=True)
class PrefixCacheStats:
    """Prefix caching figures. Every sequence that gets a new slot (a new request, or one
    recomputing after a preemption) is looked up; forked samples are not."""

    num_query_tokens: int  # tokens of the sequences looked up
    num_hit_tokens: int  # of those, mapped from cached pages instead of computed (every tier's)
    num_pinned_pages: int  # page groups the cache keeps now
    block_tokens: int  # tokens a cached block covers: the sharing granularity (`Geometry.share_tokens`)
    # the offload tiers (offload_bytes, offload_dir): hits restored from each (inside num_hit_tokens),
    # and the bytes each holds now (the host tier's include swapped-out requests)
    num_host_hit_tokens: int = 0
    num_disk_hit_tokens: int = 0
    host_bytes: int = 0
    disk_bytes: int = 0

    @property
    def num_device_hit_tokens(self) -> int:
        """Hits mapped from pages in device memory (no copy)."""
        return self.num_hit_tokens - self.num_host_hit_tokens - self.num_disk_hit_tokens

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0


class EngineFigures:
    """The figures of `LLM` (which sets the attributes read here: `runner`, `scheduler`,
    `prefix_cache`, `_spec_counters`, `_beam_stats`, `_in_flight`, `_lock`, `_closed`)."""

    runner: Any
    scheduler: Any
    prefix_cache: Any
    _spec_counters: Any
    _beam_stats: BeamSearchStats
    _in_flight: Any
    _lock: Any
    _closed: bool

    def memory_stats(self):
        """The cache's `MemoryStats` (mapped, used, fragmentation, ...; `host_bytes` and
        `disk_bytes`: what the offload tiers hold)."""
        return self.runner.cache.stats()

    def prefix_cache_stats(self) -> PrefixCacheStats | None:
        """How much the prefix cache saved (None without enable_prefix_caching)."""
        pc = self.prefix_cache
        if pc is None:
            return None
        with self._lock:
            pinned = self.runner.cache.stats().num_pinned_pages if not self._closed else 0
            host = self.runner.cache.host
            return PrefixCacheStats(pc.num_query_tokens, pc.num_hit_tokens, pinned, pc.block_tokens,
                                    pc.num_host_hit_tokens, pc.num_disk_hit_tokens, host.nbytes,
                                    host.sink.disk_bytes if host.sink is not None else 0)

    def spec_decode_stats(self) -> SpecDecodeStats | None:
        """Speculative decoding's figures: draft tokens proposed and accepted, in total and per
        request, and the acceptance rate (None without speculative_config)."""
        if self._spec_counters is None:
            return None
        with self._lock:
            return self._spec_counters.stats()

    @property
    def async_scheduling(self) -> bool:
        """Whether the engine schedules asynchronously (`EngineConfig.async_scheduling`, see `step`)."""
        return self._in_flight.depth > 0

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    @property
    def cache(self):
        """The engine's `vattn.KVCache`."""
        return self.runner.cache

    def _record_beam_stats(self, stats: BeamSearchStats) -> None:
        self._beam_stats = self._beam_stats + stats

    def beam_search_stats(self) -> BeamSearchStats:
        """The forks of every beam search so far: page groups shared, copied, and what copying
        every forked beam would have cost (`pages_if_copied`)."""
        return self._beam_stats
