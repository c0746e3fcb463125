"""Tensor parallelism on `torch.distributed`: each rank holds its attention heads' share of
the weights and of the KV cache, and all ranks follow one schedule.

Launch one process per GPU with `torchrun` (it sets RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT); every process runs the same script:

```
torchrun --nproc-per-node 2 my_script.py       # my_script: LLM(model, tensor_parallel_size=2)
```

The process group is NCCL on GPUs (rank r uses cuda:LOCAL_RANK) and gloo on CPUs; control
messages (the schedule's agreement, sampled tokens) go over a gloo group of each engine's own
in both cases (on CPUs the model's all-reduces too). A default group vattn created (from
torchrun's environment) is destroyed when the last engine using it closes; one the user
created is left alone.

Sharding (Megatron-style, rank r of N, plain tensors: no DTensor):

```
  q/k/v_proj   colwise  rank r keeps query heads [r*H/N, (r+1)*H/N) and kv heads likewise;
                        with fewer kv heads than ranks, kv head r*H_kv//N (replicated, as vLLM)
  o_proj       rowwise  the input columns of its heads; output all-reduced, bias added once
  gate/up_proj colwise  intermediate features [r*I/N, (r+1)*I/N)
  down_proj    rowwise  all-reduced
  embeddings, norms, lm_head: replicated
```

Which module splits how comes from the model's own transformers plan
(`config.base_model_tp_plan`: "colwise" / "rowwise"), or the Llama names above when it has
none. The model each rank builds is the model's own class from a config with H/N heads,
H_kv/N (at least 1) kv heads and I/N intermediate features, so the attention hook and the
cache (`num_kv_heads` = the local count) need nothing special. A checkpoint directory is
read slice by slice (safetensors): each rank reads only its shard.

One schedule: every rank runs the same deterministic scheduler on the same inputs (SPMD:
every process makes the same add_request / generate / abort_request / step calls), and
what could differ between ranks is agreed before anyone acts on it (`AgreedSlots`): the
physical budget (the minimum over ranks), each `step`'s outcome (failed on one rank =
failed on all, the union of the failed requests, before the scheduler preempts), each new
slot, fork and swap-in (the same slot on every rank), each swap-out (on every rank or on
none), and with prefix caching each lookup's mapped tokens (the fewest any rank could map:
each rank evicts its own pinned pages; `AgreedPrefixCache`). Every iteration checks that
the ranks' schedules are equal before any rank acts on its own: each control message
carries a digest of the rank's inputs and schedule. Rank 0 samples and broadcasts the
tokens. A rank whose forward raises, or that sees a collective fail (a peer
died or raised), tears down what vattn owns so that the others fail at once too
(`TensorParallelError`), instead of waiting in a collective. "At once" is verified on gloo
only: on NCCL a peer blocked in the model's all-reduce waits for torch's watchdog timeout
(`distributed_timeout_s`) before it raises.

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

import copy
import datetime
import json
import logging
import os
import threading
import time
import zlib
from collections.abc import Callable, Mapping
from fnmatch import fnmatchcase
from typing import Any, NamedTuple

import torch

from vattn.engine.config import EngineConfig
from vattn.engine.model_runner import LoadedModel, ModelRunner, RunOutput, load_model, load_tokenizer, run_dtype
from vattn.errors import (  # TensorParallelError and RankCacheError are this module's (re-exported)
    InvalidConfigError, InvalidRequestError, NoFreeSlotError, OutOfPhysicalMemoryError, RankCacheError,
    TensorParallelError)
from vattn.prefix_cache import PrefixCache

logger = logging.getLogger(__name__)

# transformers' own plan for Llama-like models: what a model without `base_model_tp_plan` gets
DEFAULT_PLAN = {
    "layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise",
}


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
        from transformers import AutoConfig, GenerationConfig

        if isinstance(model, (str, os.PathLike)) and os.path.isdir(model):
            path = os.fspath(model)
            try:
                hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
            except (OSError, ValueError, KeyError) as e:
                raise InvalidConfigError(f"cannot read the model config in {path!r}: {e}") from None
            source = _SafetensorsSource.open(path)
            if source is not None:
                dtype = run_dtype(getattr(hf_config, "dtype", None), config, self.device)
                shard = shard_model(hf_config, source, self.rank, self.size, dtype, self)
                try:
                    shard.generation_config = GenerationConfig.from_pretrained(path, local_files_only=True)
                except OSError:  # no generation_config.json: the one built from the config stays
                    pass
                return LoadedModel(shard, load_tokenizer(path), dtype)
            logger.warning("vattn: %s has no safetensors weights: every rank reads the whole checkpoint", path)
        # a config: the seeded full weights, as at TP 1 (on the host in float32; on CUDA made on
        # this rank's GPU in the run dtype, the whole model for a moment before it is sliced);
        # the wrong type raises load_model's error
        full = load_model(model, config, self.device)
        shard = shard_model(full.model.config, _StateDictSource(full.model.state_dict()), self.rank, self.size,
                            full.dtype, self)
        shard.generation_config = copy.deepcopy(full.model.generation_config)
        return LoadedModel(shard, full.tokenizer, full.dtype)


# --------------------------------------------------------------- sharding ----
class _Slice(NamedTuple):
    dim: int | None  # None: the whole tensor
    start: int
    stop: int


class _StateDictSource:
    def __init__(self, state: Mapping[str, torch.Tensor]) -> None:
        self.state = state

    def keys(self) -> set[str]:
        return set(self.state)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.state[name].shape)

    def read(self, name: str, s: _Slice) -> torch.Tensor:
        t = self.state[name]
        return t if s.dim is None else t.narrow(s.dim, s.start, s.stop - s.start)


class _SafetensorsSource:
    """The tensors of a safetensors checkpoint (one file or an index), read slice by slice."""

    def __init__(self, files: dict[str, Any]) -> None:
        self.files = files  # tensor name -> open safe_open handle

    @classmethod
    def open(cls, path: str) -> _SafetensorsSource | None:
        from safetensors import safe_open

        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        elif os.path.isfile(os.path.join(path, "model.safetensors")):
            weight_map = None
        else:
            return None
        handles: dict[str, Any] = {}
        names = sorted(set(weight_map.values())) if weight_map else ["model.safetensors"]
        opened = {n: safe_open(os.path.join(path, n), framework="pt") for n in names}
        for n, h in opened.items():
            for key in h.keys():
                handles[key] = h
        return cls(handles)

    def keys(self) -> set[str]:
        return set(self.files)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.files[name].get_slice(name).get_shape())

    def read(self, name: str, s: _Slice) -> torch.Tensor:
        sl = self.files[name].get_slice(name)
        if s.dim is None:
            return sl[:]
        index = tuple([slice(None)] * s.dim + [slice(s.start, s.stop)])
        return sl[index]


def shard_config(hf_config: Any, world: int) -> Any:
    """The config of one rank's model: H/N heads, H_kv/N kv heads (1 when a kv head is
    replicated), I/N intermediate features, head_dim kept. Raises InvalidConfigError when
    the sizes do not divide."""
    h = hf_config.num_attention_heads
    h_kv = getattr(hf_config, "num_key_value_heads", None) or h
    inter = hf_config.intermediate_size
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // h
    if h % world:
        raise InvalidConfigError(f"num_attention_heads={h} is not divisible by tensor_parallel_size={world}; "
                                 f"use a tensor_parallel_size that divides it")
    if h_kv % world and world % h_kv:
        raise InvalidConfigError(
            f"num_key_value_heads={h_kv} and tensor_parallel_size={world}: one must divide the other (each rank "
            "holds kv_heads / N heads, or, with fewer kv heads than ranks, one kv head shared by N / kv_heads ranks)")
    if inter % world:
        raise InvalidConfigError(f"intermediate_size={inter} is not divisible by tensor_parallel_size={world}")
    local = copy.deepcopy(hf_config)
    local.num_attention_heads = h // world
    local.num_key_value_heads = max(1, h_kv // world)
    local.intermediate_size = inter // world
    local.head_dim = head_dim
    return local


def tp_plan(hf_config: Any) -> dict[str, str]:
    """The model's transformers plan (module pattern -> "colwise" | "rowwise"), or the
    Llama one. Raises InvalidConfigError for a style vattn does not shard (e.g. experts)."""
    plan = dict(getattr(hf_config, "base_model_tp_plan", None) or DEFAULT_PLAN)
    odd = {k: v for k, v in plan.items() if v not in ("colwise", "rowwise")}
    if odd:
        raise InvalidConfigError(f"vattn shards only 'colwise' / 'rowwise' modules; this model's plan has {odd}: "
                                 "use tensor_parallel_size=1")
    return plan


def shard_model(hf_config: Any, source: Any, rank: int, world: int, dtype: torch.dtype, tp: Any) -> Any:
    """Build this rank's model from `source` (the full model's tensors by name): planned
    modules sliced, the rest copied; rowwise modules all-reduce their output (`tp.all_reduce_`)."""
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    plan = tp_plan(hf_config)
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(shard_config(hf_config, world), dtype=dtype)
    prefix = model.base_model_prefix + "."
    styles: dict[str, str] = {}  # module name -> style
    for name, _ in model.named_modules():
        rel = name[len(prefix):] if name.startswith(prefix) else None
        style = next((s for pat, s in plan.items() if rel is not None and fnmatchcase(rel, pat)), None)
        if style is not None:
            styles[name] = style
    if not styles:
        raise InvalidConfigError(f"no module of {type(model).__name__} matches its tensor-parallel plan {plan}")
    available = source.keys()
    state = model.state_dict()
    loaded: set[str] = set()
    with torch.no_grad():
        for name, tensor in state.items():
            if name not in available:
                continue
            module, _, kind = name.rpartition(".")
            s = _slice_of(name, styles.get(module), kind, source.shape(name), tuple(tensor.shape), rank, world)
            tensor.copy_(source.read(name, s))
            loaded.add(name)
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded_ids = {id(params[n]) for n in loaded if n in params}
    missing = [n for n in state if n not in loaded and not (n in params and id(params[n]) in loaded_ids)]
    if missing:
        raise InvalidConfigError(f"the checkpoint lacks {missing[:5]}: load the model yourself and pass it to LLM")
    for name, style in styles.items():
        if style == "rowwise":
            _all_reduce_output(model.get_submodule(name), tp)
    return model.eval()


def _slice_of(name: str, style: str | None, kind: str, full: tuple[int, ...], local: tuple[int, ...],
              rank: int, world: int) -> _Slice:
    """Which part of the full tensor `name` this rank's tensor holds."""
    if style is None or (style == "rowwise" and kind == "bias"):
        if full != local:
            raise InvalidConfigError(f"{name}: the shard has shape {local}, the model {full}: the model's sizes "
                                     "do not shard the way its tensor-parallel plan says")
        return _Slice(None, 0, 0)
    dim = 0 if style == "colwise" else 1
    blocks = full[dim] // local[dim]
    if full[dim] % local[dim] or world % blocks or (style == "rowwise" and blocks != world):
        raise InvalidConfigError(f"{name}: {style} shard of shape {local} does not divide the model's {full}")
    start = (rank * blocks // world) * local[dim]  # blocks < world: a replicated kv head
    return _Slice(dim, start, start + local[dim])


def _all_reduce_output(module: torch.nn.Module, tp: Any) -> None:
    """A rowwise module: its partial output is summed over the ranks, then its bias added once."""
    bias = module.bias
    module.bias = None
    module._vattn_tp_bias = bias  # a parameter of the module still: .to() moves it

    def hook(mod: torch.nn.Module, _args: Any, out: torch.Tensor) -> torch.Tensor:
        tp.all_reduce_(out)
        return out if mod._vattn_tp_bias is None else out + mod._vattn_tp_bias

    module.register_forward_hook(hook)


# ----------------------------------------------------------------- agreement ----
class AgreedStep(NamedTuple):
    """A `step` outcome every rank agreed on."""

    failed: tuple[int, ...]  # the union of the ranks' failed slots
    out_of_memory: bool

    def __bool__(self) -> bool:
        return not self.failed


class AgreedSlots:
    """The scheduler's cache (`KVSlots`) under tensor parallelism: this rank's `KVCache`,
    with every result that could differ between ranks agreed before the scheduler sees it.

    - `step`: failed on any rank = failed on every rank, with the union of the failed slots;
      raised on any rank = raises on every rank (`RankCacheError`, the same message). The
      scheduler then preempts the same sequences everywhere.
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
    a new sequence maps (`map_prefix`) is agreed: each rank maps what it still has, and every
    rank keeps the fewest (`KVCache.truncate_pinned` unmaps the rest, which stays pinned). A
    rank whose mapping raised makes it a miss on every rank (the same RankCacheError
    everywhere; the scheduler computes the whole prompt). One round trip per lookup, miss or
    hit: whether a rank has anything to map is its own. Pinning (`insert`) needs no
    agreement: a rank that pinned fewer pages maps fewer later, and the minimum holds."""

    def __init__(self, cache: Any, tp: TensorParallel, salt: bytes | str = b"") -> None:
        super().__init__(cache, salt)
        self.tp = tp

    def map_prefix(self, reqid: int, token_ids: Any) -> int:
        keys, handles = self.lookup(token_ids)
        self.num_query_tokens += len(token_ids)
        mapped, error = 0, None
        if handles:
            try:
                mapped = self.cache.map_pinned(reqid, handles)
            except Exception as e:  # noqa: BLE001 - agreed below; the books hold (nothing mapped)
                error = e
            else:
                self.forget_evicted(keys[:len(handles)], mapped)
        agreed = self.tp.agree(PREFIX, error=error is not None, value=mapped)
        n = 0 if agreed.errors else min(agreed.values)
        if mapped > n:
            try:
                self.cache.truncate_pinned(reqid, n)
            except Exception as e:  # noqa: BLE001 - this rank's slot no longer matches the others'
                raise self.tp.fail(f"rank {self.tp.rank} could not unmap the cached pages past the {n} tokens the "
                                   f"ranks agreed on ({type(e).__name__}: {e})") from e
        if agreed.errors:
            raise_agreed(self.tp, "map_prefix", error)
        self.num_hit_tokens += n
        return n


class RankZeroSampler:
    """Rank 0 samples; every rank gets its tokens (and its per-request errors)."""

    def __init__(self, sampler: Any, tp: TensorParallel) -> None:
        self.sampler, self.tp = sampler, tp

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sampler, name)

    def sample(self, logits: torch.Tensor, seq_ids: list, params: list) -> RunOutput:
        tokens = torch.full((len(seq_ids),), -1, dtype=torch.int64)
        errors: dict = {}
        if self.tp.rank == 0:
            out = self.sampler.sample(logits, seq_ids, params)
            tokens = torch.tensor([out.tokens.get(s, -1) for s in seq_ids], dtype=torch.int64)
            errors = out.errors
        self.tp.broadcast(tokens)
        ids = tokens.tolist()
        if min(ids, default=0) < 0:
            errors = self.tp.broadcast_object(errors)
        return RunOutput({s: t for s, t in zip(seq_ids, ids) if t >= 0}, errors)


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

    def run(self, scheduled: list) -> RunOutput:
        if not scheduled:
            return RunOutput({}, {})
        try:
            return self._run(scheduled)
        except TensorParallelError:
            raise
        except Exception as e:  # noqa: BLE001 - see the class docstring
            raise self.tp.fail(f"the model's forward failed on rank {self.tp.rank} ({type(e).__name__}: {e}); every "
                               "rank stops (a collective fails this way when another rank raised or exited: see "
                               "that rank's error)") from e
