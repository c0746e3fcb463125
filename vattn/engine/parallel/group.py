"""The tensor-parallel process group: joining and leaving it, the counted control
collectives, the control message every agreement is, and tearing the group down on failure.

The process group is NCCL on GPUs (rank r uses cuda:LOCAL_RANK) and gloo on CPUs; control
messages (the schedule's agreement, sampled tokens) go over a gloo group of each engine's own
in both cases (on CPUs the model's all-reduces too). A default group vattn created (from
torchrun's environment) is destroyed when the last engine using it closes; one the user
created is left alone.

Every iteration checks that the ranks' schedules are equal before any rank acts on its own:
each control message carries a digest of the rank's inputs and schedule. A rank whose
forward raises, or that sees a collective fail (a peer died or raised), tears down what
vattn owns so that the others fail at once too (`TensorParallelError`), instead of waiting
in a collective. "At once" is verified on gloo only: on NCCL a peer blocked in the model's
all-reduce waits for torch's watchdog timeout (`distributed_timeout_s`) before it raises.

The control messages of an iteration (gloo round trips; the model's all-reduces apart), in
order. Each agreement is one all-gather of an int64 row per rank, [what, digest, error,
value, slot bits] (`TensorParallel.agree`); the others are the token broadcast and, on the
rare paths, the errors' text:

```
  decode (steady state)     step's agreement (+ the digest), tokens' broadcast         2
  + each new slot / fork    one agreement each, before the step's (the first carries
                            the digest)                                                +1
  + each prefix lookup      enable_prefix_caching: a new slot's mapped tokens, hit or
                            miss (so a new slot costs 2)                               +1
  + each swap-out / -in     preemption_mode="swap": a swap-out (inside the step's
                            retries: after the step's agreement) or a swap-in (its
                            slot, like a new slot)                                     +1
  idle (nothing scheduled)  the digest alone                                           1
  a rank's step raised      step's agreement, then every rank's error (all_gather_object,
                            two round trips); the requests recompute, nothing runs     3
  slots differ (resync)     the slot's agreement, trim, the slot's agreement again     +1
                            (a new slot, fork or swap-in)
  a lookup / swap raised    its agreement, then every rank's error (all_gather_object) +2
  sampling failed (rank 0)  the errors' broadcast after the tokens' (broadcast_object,
                            two round trips)                                           +2
```
"""
from __future__ import annotations

import datetime
import logging
import os
import threading
import time
import zlib
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from vattn.engine.config import EngineConfig
from vattn.engine.loader import LoadedModel
from vattn.engine.parallel.shard import load_shard
from vattn.errors import InvalidConfigError, InvalidRequestError, TensorParallelError

logger = logging.getLogger(__name__)

# what a control message agrees on (`TensorParallel.agree`): ranks agreeing on different
# things have diverged
CHECK, ALLOC_REQID, FORK, STEP, PREFIX, SWAP_OUT, SWAP_IN = 1, 2, 3, 4, 5, 6, 7
_KIND_NAMES = {CHECK: "the schedule", ALLOC_REQID: "a new slot", FORK: "a fork", STEP: "a step",
               PREFIX: "a cached prefix", SWAP_OUT: "a swap-out", SWAP_IN: "a swap-in"}
_SLOT_BITS = 63  # slots per int64 word of a control message's slot set


class Agreement(NamedTuple):
    """Every rank's control message of one `TensorParallel.agree`."""

    errors: tuple[int, ...]  # the ranks that flagged an error
    values: tuple[int, ...]  # each rank's value, in rank order
    slots: frozenset[int]  # the union of the ranks' slot sets


# ----------------------------------------------------------------- the group ----
# The default process group vattn created (from torchrun's environment), and how many open
# engines use it: the last one to close destroys it. A group the user created is theirs.
_owned_default: Any = None
_default_owners = 0
_owners_lock = threading.Lock()


def _join_default(config: EngineConfig, device: torch.device) -> bool:
    """Create the default process group if there is none; returns whether this engine is
    one of its owners (vattn created it). Lock held by the caller."""
    import torch.distributed as dist

    global _owned_default, _default_owners
    n = config.tensor_parallel_size
    if not dist.is_initialized():
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise InvalidConfigError(
                f"tensor_parallel_size={n} runs one process per rank: launch the script with "
                f"`torchrun --nproc-per-node {n} SCRIPT` (several nodes: --nnodes, see the README), or "
                "call torch.distributed.init_process_group() yourself first")
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=config.distributed_timeout_s))
        _owned_default, _default_owners = dist.group.WORLD, 0
    if _owned_default is None or dist.group.WORLD is not _owned_default:
        return False  # the user's group (or vattn's was destroyed and the user made another)
    _default_owners += 1
    return True


def _leave_default() -> None:
    """One owner of vattn's default group is done with it; the last destroys it."""
    import torch.distributed as dist

    global _owned_default, _default_owners
    with _owners_lock:
        _default_owners = max(0, _default_owners - 1)
        if _default_owners == 0 and _owned_default is not None:
            try:
                if dist.is_initialized() and dist.group.WORLD is _owned_default:
                    dist.destroy_process_group()
            finally:
                _owned_default = None


class TensorParallel:
    """This process's place in the tensor-parallel group, and the collectives the engine uses.

    `start(config)` joins the default process group, creating it from torchrun's environment
    when it does not exist yet (vattn then destroys it when the last engine using it closes;
    a group the user created is left alone). Each engine has a gloo group of its own for the
    control messages (and, on gloo, the model's all-reduces), destroyed at `close()` / `fail()`."""

    def __init__(self, size: int, timeout_s: float, device: torch.device, owns_group: bool) -> None:
        import torch.distributed as dist

        self.size, self.timeout_s, self.device, self.owns_group = size, timeout_s, device, owns_group
        self.rank = dist.get_rank()
        self.local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", size))
        # control messages are small CPU tensors: a gloo group of this engine's own, so that
        # fail() can tear it down without touching a default group someone else uses
        self.cpu_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        # the model's all-reduces: the default group on NCCL; on gloo the engine's own group
        self.model_group = self.cpu_group if dist.get_backend() == "gloo" else None
        self.broken: str | None = None  # why the group cannot be used any more
        self._released = False
        self._inputs = 0  # a running digest of every request and abort, in call order
        self._digest = 0  # of this iteration's inputs and schedule: every control message carries it
        self._checked = True  # whether a control message carried it yet (`check_schedule`)
        self.num_slots = 0  # the cache's slots, agreed at start (`agree_budget`): a message's slot set
        self.num_control_round_trips = 0  # control collectives made (an *_object one is two round trips)
        self.control_seconds = 0.0  # wall time in them

    @classmethod
    def start(cls, config: EngineConfig) -> TensorParallel:
        import torch.distributed as dist

        n = config.tensor_parallel_size
        device = config.torch_device()
        if not dist.is_available():
            raise InvalidConfigError("tensor_parallel_size > 1 needs torch.distributed, which this torch build lacks")
        with _owners_lock:
            owns = _join_default(config, device)
        try:
            if dist.get_world_size() != n:
                raise InvalidConfigError(
                    f"tensor_parallel_size={n} but the process group has {dist.get_world_size()} ranks; launch "
                    f"with `torchrun --nproc-per-node {n}` (or nodes x processes = {n})")
            if device.type == "cuda":
                device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))
                torch.cuda.set_device(device)
            return cls(n, config.distributed_timeout_s, device, owns)
        except BaseException:
            if owns:
                _leave_default()
            raise

    # ------------------------------------------------------------- collectives ----
    def _collective(self, what: str, fn: Callable[[], Any], round_trips: int = 1) -> Any:
        """Every control collective goes through here: counted (`num_control_round_trips`,
        `control_seconds`: the wall time in them, waits for the other ranks included)."""
        if self.broken is not None:
            raise TensorParallelError(f"the tensor-parallel group failed earlier ({self.broken}); close this LLM")
        self.num_control_round_trips += round_trips
        t = time.perf_counter()
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - gloo / NCCL errors are plain RuntimeErrors
            raise self.fail(f"{what} failed on rank {self.rank}: another rank raised or exited, or it timed "
                            f"out after {self.timeout_s:g} s ({type(e).__name__}: {e})") from e
        finally:
            self.control_seconds += time.perf_counter() - t

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        """Every rank's `values` (the same length on every rank), in rank order: one round trip."""
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.int64)
        out = [torch.empty_like(t) for _ in range(self.size)]
        self._collective("an all-gather", lambda: dist.all_gather(out, t, group=self.cpu_group))
        return [x.tolist() for x in out]

    def all_gather_object(self, obj: Any) -> list[Any]:
        import torch.distributed as dist

        out: list[Any] = [None] * self.size
        self._collective("an all-gather", lambda: dist.all_gather_object(out, obj, group=self.cpu_group), 2)
        return out

    def broadcast(self, t: torch.Tensor) -> None:
        """Rank 0's `t` (a CPU tensor) into every rank's, in place."""
        import torch.distributed as dist

        self._collective("a broadcast", lambda: dist.broadcast(t, src=0, group=self.cpu_group))

    def broadcast_object(self, obj: Any) -> Any:
        import torch.distributed as dist

        box = [obj]
        self._collective("a broadcast", lambda: dist.broadcast_object_list(box, src=0, group=self.cpu_group), 2)
        return box[0]

    def all_reduce_(self, t: torch.Tensor) -> None:
        """Sum `t` over the ranks in place on the model's group (NCCL on GPUs); a failure
        raises from the forward, and the runner turns it into a TensorParallelError."""
        import torch.distributed as dist

        if self.broken is not None:
            raise TensorParallelError(f"the tensor-parallel group failed earlier ({self.broken})")
        dist.all_reduce(t, group=self.model_group)

    def fail(self, message: str) -> TensorParallelError:
        """Mark the group unusable and tear down what vattn owns (this engine's gloo group,
        and the default group if vattn created it and no other engine uses it), so that
        ranks waiting in a collective with this one get an error now rather than at the
        timeout. Verified on gloo; on NCCL a peer blocked in the model's all-reduce waits for
        the watchdog (`distributed_timeout_s`). Returns the error to raise."""
        if self.broken is None:
            self.broken = message
            logger.error("vattn: tensor parallelism: %s", message)
            self._release()
        return TensorParallelError(message)

    def close(self) -> None:
        """Destroy this engine's gloo group, and the default group if vattn created it and
        this is the last engine using it. Idempotent."""
        self.broken = self.broken or "closed"
        self._release()

    def _release(self) -> None:
        import torch.distributed as dist

        if self._released:
            return
        self._released = True
        # destroy_process_group only unregisters the group: its connections close when the last
        # reference goes, and a peer blocked in a collective with this rank waits for them (or
        # for the timeout) while this engine object lives on. So the engine lets go of it too;
        # every collective checks `broken` (set before) first, so nothing reads these again.
        group, self.cpu_group = getattr(self, "cpu_group", None), None
        if getattr(self, "model_group", None) is group:
            self.model_group = None
        try:
            if group is not None and dist.is_initialized():  # else it went with the default group
                dist.destroy_process_group(group)
        except Exception:  # noqa: BLE001 - tearing down a failed group may fail too
            logger.debug("vattn: destroying the engine's gloo group failed", exc_info=True)
        finally:
            del group
            if self.owns_group:
                try:
                    _leave_default()
                except Exception:  # noqa: BLE001 - idem
                    logger.debug("vattn: destroying the default process group failed", exc_info=True)

    # ------------------------------------------------------ one schedule for all ----
    def note_request(self, request_id: int, token_ids: list[int], params: Any) -> None:
        """Fold a new request into the digest of this rank's inputs."""
        self._inputs = zlib.crc32(repr((request_id, token_ids, params)).encode(), self._inputs)

    def note_abort(self, request_ids: list[int]) -> None:
        self._inputs = zlib.crc32(repr(("abort", request_ids)).encode(), self._inputs)

    def begin_iteration(self, scheduler: Any) -> None:
        """Before an iteration: the digest of this rank's requests (every add and abort) and
        schedule (the sequences in their slots, the queue), which every control message of
        the iteration carries (`agree`): its first is also its check that every rank has had
        the same requests and holds the same sequences in the same slots."""
        state = (self._inputs, [(s.seq_id, s.slot, s.num_computed_tokens, s.num_tokens) for s in scheduler.running],
                 [s.seq_id for s in scheduler.waiting])
        self._digest, self._checked = zlib.crc32(repr(state).encode()), False

    def check_schedule(self) -> None:
        """After scheduling, before the forward: if no control message carried the digest
        yet (nothing was scheduled, so nothing agreed), one with the digest alone. Every
        rank thus makes one control message at least per iteration, and its first is
        paired with the others' first: a rank with work and one without meet there."""
        if not self._checked:
            self.agree(CHECK)

    def agree(self, kind: int, *, error: bool = False, value: int = 0, slots: Any = ()) -> Agreement:
        """One round trip: every rank's control message [kind, digest, error, value, slot
        bits] (`slots`: slot numbers below `num_slots`), all-gathered. Every message has the
        same length, so that a rank that diverged still meets the others' message (not a
        collective of another shape) and sees their digests: ranks whose kinds or digests
        differ raise TensorParallelError, every one of them (and the group is torn down).
        Fetching the errors' messages is the caller's (`AgreedSlots._raise_agreed`), when
        some rank flagged one."""
        words = [0] * -(-self.num_slots // _SLOT_BITS)
        for s in slots:
            words[s // _SLOT_BITS] |= 1 << (s % _SLOT_BITS)
        rows = self.all_gather_ints([kind, self._digest, int(error), value, *words])
        if any(row[:2] != rows[0][:2] for row in rows):
            digests = [row[1] for row in rows]
            kinds = [_KIND_NAMES.get(row[0], row[0]) for row in rows]
            raise self.fail(
                f"the ranks' schedules differ (digests {digests}, agreeing on {kinds}): every rank must make the same "
                "add_request / generate / abort_request / step calls with the same prompts and parameters, in the "
                "same order")
        self._checked = True
        union = [0] * len(words)
        for row in rows:
            union = [a | b for a, b in zip(union, row[4:])]
        return Agreement(tuple(r for r, row in enumerate(rows) if row[2]), tuple(row[3] for row in rows),
                         frozenset(i * _SLOT_BITS + b for i, w in enumerate(union) if w
                                   for b in range(w.bit_length()) if w >> b & 1))

    def agree_budget(self, cache: Any) -> None:
        """Every rank's cache gets the smallest physical budget of all ranks (page groups are
        the same size on every rank, and so is the number of slots: the control messages'
        length). On the host without physical_memory, ranks on one machine share its memory:
        the default budget is divided by the ranks per node."""
        alloc = cache.allocator
        rows = self.all_gather_ints([cache.geometry.group_bytes, cache.config.max_batch_size, alloc.max_pages])
        group_bytes, slots = [row[0] for row in rows], [row[1] for row in rows]
        if len(set(group_bytes)) > 1:
            raise self.fail(f"the ranks' page groups differ in size ({group_bytes} bytes): give every rank the "
                            "same page_size, layout and dtype")
        if len(set(slots)) > 1:
            raise self.fail(f"the ranks' caches have different max_batch_size ({slots}): give every rank the same")
        self.num_slots = slots[0]
        pages = min(row[2] for row in rows)
        if cache.config.physical_memory is None and cache.config.torch_device.type == "cpu":
            pages = max(1, pages // self.local_world_size)
        try:
            alloc.set_max_pages(pages)
        except InvalidRequestError as e:  # this rank already created more: not expected here
            raise self.fail(f"rank {self.rank} cannot lower its KV budget to the agreed {pages} page groups ({e})") \
                from e

    # -------------------------------------------------------------- the model ----
    def load_model(self, model: Any, config: EngineConfig) -> LoadedModel:
        """This rank's shard of `model` (a checkpoint directory, a config or a loaded model)."""
        return load_shard(model, config, self.rank, self.size, self.device, self)
