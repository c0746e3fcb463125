"""The engine's pieces whose results could differ between tensor-parallel ranks, agreed
before anyone acts on them: the cache's slots and steps, the prefix cache's hits, the
sampled tokens; and the rank's model runner that puts them together."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch

from vattn.engine.config import EngineConfig
from vattn.engine.model_runner import ModelRunner
from vattn.engine.parallel.group import ALLOC_REQID, FORK, PREFIX, STEP, SWAP_IN, SWAP_OUT, TensorParallel
from vattn.engine.sampler import Sampled
from vattn.errors import NoFreeSlotError, OutOfPhysicalMemoryError, RankCacheError, TensorParallelError
from vattn.prefix_cache import Hit, PrefixCache, token_array


class AgreedStep(NamedTuple):
    """A `step` outcome every rank agreed on."""

    failed: tuple[int, ...]  # the union of the ranks' failed slots
    out_of_memory: bool

    def __bool__(self) -> bool:
        return not self.failed


class AgreedSlots:
    """The scheduler's cache (`KVSlots`) under tensor parallelism: this rank's `KVCache`,
    with every result that could differ between ranks agreed before the scheduler sees it.

    - `step`: failed on any rank = failed on every rank, with the union of the failed slots
      (a rank that backed one takes its step back: `KVCache.revert_step`); raised on any
      rank = raises on every rank (`RankCacheError`, the same message). The scheduler then
      shortens or preempts the same sequences everywhere.
    - `alloc_reqid`: every rank gets the same slot. Free slots can hold different pages on
      different ranks (a step that failed on some ranks only); when the slots differ, every
      rank gives its cached pages back (`trim`: the free slots are then empty everywhere) and
      allocates again.
    - `fork`: done on every rank or on none, into the same slot (like `alloc_reqid`).
    - `swap_out`: done on every rank or on none (a rank that succeeded takes its untouched
      slot back when another failed); `swap_in`: the same slot everywhere (like
      `alloc_reqid`), each rank copying its own shard back when its old slot was taken.
    Only shortages on every rank stay NoFreeSlotError / OutOfPhysicalMemoryError (the
    scheduler waits); any other failure of a rank is a RankCacheError on every rank.
    Each agreement is one control message (`TensorParallel.agree`: it also carries the
    schedule's digest); the errors' text is fetched only when some rank flagged one.
    """

    def __init__(self, cache: Any, tp: TensorParallel) -> None:
        self.cache, self.tp = cache, tp
        self.num_resyncs = 0  # times the ranks' free slots differed and were emptied

    @property
    def num_free_reqids(self) -> int:
        return self.cache.num_free_reqids

    def alloc_reqid(self) -> int:
        return self._new_slot("alloc_reqid", ALLOC_REQID, self.cache.alloc_reqid)

    def _new_slot(self, what: str, kind: int, make: Callable[[], int]) -> int:
        """`make()` on every rank, giving the same slot everywhere; when the ranks' slots
        differ, every rank gives back its cached pages (`trim`) and tries once more."""
        slot = self._same_slot(what, kind, make)
        if slot is None:
            self.num_resyncs += 1
            try:
                self.cache.trim()
            except Exception as e:  # noqa: BLE001 - the others are already in the retry's agreement
                raise self.tp.fail(f"rank {self.tp.rank} could not give back its cached pages to agree on a slot "
                                   f"for {what} ({type(e).__name__}: {e})") from e
            slot = self._same_slot(what, kind, make)
            if slot is None:
                raise self.tp.fail(f"the ranks' caches gave different slots for {what} even with no cached pages")
        return slot

    def _same_slot(self, what: str, kind: int, make: Callable[[], int]) -> int | None:
        """The slot `make()` gave, if it is the same on every rank; else None, and nothing
        kept. Raises on every rank when it raised on any (`_raise_agreed`). One round trip
        (three when some rank raised)."""
        slot: int | None = None
        error: Exception | None = None
        try:
            slot = make()
        except Exception as e:  # noqa: BLE001 - agreed below
            error = e
        agreed = self.tp.agree(kind, error=error is not None, value=-1 if slot is None else slot)
        if not agreed.errors and len(set(agreed.values)) == 1:
            return slot
        if slot is not None:
            self.cache.free_reqid(slot)
        if agreed.errors:
            self._raise_agreed(what, error)
        return None

    def free_reqid(self, reqid: int) -> None:
        self.cache.free_reqid(reqid)

    def step(self, seq_lens: Mapping[int, int]) -> AgreedStep:
        error: Exception | None = None
        failed: tuple[int, ...] = ()
        oom = False
        try:
            res = self.cache.step(seq_lens)
            failed, oom = tuple(res.failed), bool(res.out_of_memory)
        except Exception as e:  # noqa: BLE001 - agreed below; raised on every rank
            error = e
        agreed = self.tp.agree(STEP, error=error is not None, value=int(oom), slots=failed)
        if agreed.errors:
            self._raise_agreed("step", error)
        others = [s for s in seq_lens if s in agreed.slots and s not in failed]
        if others:  # backed here, not on another rank: they move nowhere (the scheduler may step them shorter)
            self.cache.revert_step(others)
        return AgreedStep(tuple(s for s in seq_lens if s in agreed.slots), any(agreed.values))

    def fork(self, reqid: int, num_tokens: int) -> int:
        return self._new_slot("fork", FORK, lambda: self.cache.fork(reqid, num_tokens))

    def can_fork(self, reqid: int, num_tokens: int) -> bool:
        """The same on every rank: the ranks' slots hold the same pages' places (their
        sliding windows give back the same pages)."""
        return self.cache.can_fork(reqid, num_tokens)

    def _raise_agreed(self, what: str, error: Exception | None) -> None:
        raise_agreed(self.tp, what, error)

    def swap_out(self, reqid: int, num_tokens: int) -> Any:
        """`KVCache.swap_out` on every rank (each copies its own heads' K/V to host memory),
        or on none: a rank whose swap-out succeeded while another's raised takes its slot
        back (`swap_in` of its untouched slot: no copy), and every rank raises the same
        error (the scheduler then recomputes the sequence). One round trip."""
        handle, error = None, None
        try:
            handle = self.cache.swap_out(reqid, num_tokens)
        except Exception as e:  # noqa: BLE001 - agreed below
            error = e
        agreed = self.tp.agree(SWAP_OUT, error=error is not None)
        if not agreed.errors:
            return handle
        if handle is not None:
            try:
                slot = self.cache.swap_in(handle)
            except Exception as e:  # noqa: BLE001 - this rank's books no longer match the others'
                raise self.tp.fail(f"rank {self.tp.rank} could not take back slot {reqid} after another rank's "
                                   f"swap-out failed ({type(e).__name__}: {e})") from e
            if slot != reqid:
                raise self.tp.fail(f"rank {self.tp.rank} took back slot {slot} instead of {reqid} after another "
                                   "rank's swap-out failed")
        self._raise_agreed("swap_out", error)
        raise RankCacheError("the KV cache swap_out failed on another rank")  # not reached: a rank flagged one

    def swap_in(self, handle: Any) -> int:
        """`KVCache.swap_in` on every rank, giving the same slot everywhere (as `_new_slot`
        does for a new slot): a rank's old slot may be untouched (no copy) while another's
        was taken; when the slots differ, every rank gives its slot back, trims, and swaps
        in again (copying). A shortage on any rank is a shortage on every rank (the sequence
        waits). Whether a rank copied is its own business: each copies its own shard. One
        round trip (two when the slots differ)."""
        return self._new_slot("swap_in", SWAP_IN, lambda: self.cache.swap_in(handle))


def raise_agreed(tp: TensorParallel, what: str, error: Exception | None) -> None:
    """Some rank's `what` raised (`error` here, or None; the ranks' control message said
    so): raise the same error on every rank, naming each rank's failure, fetched now
    (all_gather_object: the rare path). Only shortages of slots or memory everywhere stay
    a NoFreeSlotError / OutOfPhysicalMemoryError (the scheduler waits for memory); anything
    else is a RankCacheError. Returns when no rank raised."""
    shortages = (NoFreeSlotError, OutOfPhysicalMemoryError)
    mine = None if error is None else (f"{type(error).__name__}: {error}",
                                       next((i for i, k in enumerate(shortages) if isinstance(error, k)), -1))
    errors = [(r, e) for r, e in enumerate(tp.all_gather_object(mine)) if e is not None]
    if not errors:
        return
    message = f"the KV cache {what} failed on " + "; ".join(f"rank {r}: {m}" for r, (m, _) in errors)
    kinds = {kind for _, (_, kind) in errors}
    if len(kinds) == 1 and -1 not in kinds:
        raise shortages[kinds.pop()](message)
    raise RankCacheError(message)


class AgreedPrefixCache(PrefixCache):
    """The prefix cache of one rank: every rank inserts the same prompts, but the pinned pages
    are its own, and memory pressure evicts them on each rank on its own. So how many tokens
    a new sequence maps (`map_prefix`) is agreed: each rank maps what it still has (its pinned
    pages, and blocks restored from its own offload tiers, pinned again), and every rank keeps
    the fewest (`KVCache.truncate_pinned` unmaps the rest, which stays pinned). A rank whose
    mapping raised makes it a miss on every rank (the same RankCacheError
    everywhere; the scheduler computes the whole prompt). One round trip per lookup, miss or
    hit: whether a rank has anything to map is its own. Pinning (`insert`) needs no
    agreement: a rank that pinned fewer pages maps fewer later, and the minimum holds."""

    def __init__(self, cache: Any, tp: TensorParallel, salt: bytes | str = b"", **offload: Any) -> None:
        super().__init__(cache, salt, **offload)
        self.tp = tp

    def load(self, token_ids: Any) -> bool:
        """No reading ahead: each rank's reads would end at its own time, and the ranks'
        schedules must be the same (a rank reads its disk blocks in `map_prefix`)."""
        return False

    def map_prefix(self, reqid: int, token_ids: Any) -> int:
        ids = token_array(token_ids)
        self.num_query_tokens += len(ids)
        self._counted[reqid] = (len(ids), 0, 0, 0)  # (until its hit is counted: a lookup may raise)
        hit, error = Hit(), None
        try:
            hit = self.map_hit(reqid, ids)  # the rank's own tiers: device pages, restores from host or disk
        except Exception as e:  # noqa: BLE001 - agreed below; the books hold
            error = e
        agreed = self.tp.agree(PREFIX, error=error is not None, value=hit.num_tokens)
        n = 0 if agreed.errors else min(agreed.values)
        if hit.num_tokens > n:
            try:
                self.cache.truncate_pinned(reqid, n)
            except Exception as e:  # noqa: BLE001 - this rank's slot no longer matches the others'
                raise self.tp.fail(f"rank {self.tp.rank} could not unmap the cached pages past the {n} tokens the "
                                   f"ranks agreed on ({type(e).__name__}: {e})") from e
        if agreed.errors:
            raise_agreed(self.tp, "map_prefix", error)
        self.count(hit, n, reqid=reqid, query=len(ids))  # (a request sent back before it ran: `uncount`)
        return n


class RankZeroSampler:
    """Rank 0 samples; every rank gets its tokens (and its per-request errors), on the host
    (a gloo broadcast: the ranks wait for rank 0's forward, so an iteration's host work does
    not hide under the next one's: see `EngineConfig.async_scheduling`)."""

    def __init__(self, sampler: Any, tp: TensorParallel) -> None:
        self.sampler, self.tp = sampler, tp

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sampler, name)

    def sample(self, logits: torch.Tensor, seq_ids: list, params: list, **history: Any) -> Sampled:
        """Rank 0's `Sampler.sample` (`history`: its seqs and eos_token_ids); its logprobs stay
        on rank 0, the one that reports outputs."""
        tokens = torch.full((len(seq_ids),), -1, dtype=torch.int64)
        errors: dict = {}
        logprobs: tuple = ()
        if self.tp.rank == 0:
            out = self.sampler.sample(logits, seq_ids, params, **history)
            tokens = out.tokens.to("cpu", torch.int64, copy=True)
            errors, logprobs = out.errors, out.logprobs
            for row, sid in enumerate(seq_ids):
                if sid in errors:
                    tokens[row] = -1
        self.tp.broadcast(tokens)
        if tokens.numel() and int(tokens.min()) < 0:
            errors = self.tp.broadcast_object(errors)
        return Sampled(list(seq_ids), tokens.clamp(min=0).to(logits.device), errors, logprobs)


class TPModelRunner(ModelRunner):
    """The model runner of one rank: its cache holds the rank's kv heads, its budget is the
    ranks' minimum, rank 0 samples. A forward that raises is fatal to the group (the ranks'
    collectives could no longer be paired): it raises TensorParallelError on every rank
    instead of `ModelRunner.run`'s retry of each request alone."""

    def __init__(self, model: Any, dtype: torch.dtype, device: torch.device, config: EngineConfig,
                 tp: TensorParallel) -> None:
        super().__init__(model, dtype, device, config)
        self.tp = tp
        self.sampler = RankZeroSampler(self.sampler, tp)
        try:
            tp.agree_budget(self.cache)
        except BaseException:
            self.close()
            raise

    def make_prefix_cache(self, salt: bytes, **offload: Any) -> AgreedPrefixCache:
        """The rank's prefix cache (its own offload tiers), its hits agreed with the other ranks'."""
        return AgreedPrefixCache(self.cache, self.tp, salt=salt, **offload)

    def rank_name(self) -> bytes:
        return f"rank {self.tp.rank} of {self.tp.size}".encode()

    def _launch(self, scheduled: list) -> Sampled:
        try:
            return self._run(scheduled)
        except TensorParallelError:
            raise
        except Exception as e:  # noqa: BLE001 - see the class docstring
            raise self.tp.fail(f"the model's forward failed on rank {self.tp.rank} ({type(e).__name__}: {e}); every "
                               "rank stops (a collective fails this way when another rank raised or exited: see "
                               "that rank's error)") from e
