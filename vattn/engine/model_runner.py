"""`ModelRunner`: owns the model, the vattn cache and every tensor of an iteration.

One forward serves the whole batch: the scheduled sequences' new tokens are packed into
`input_ids [1, T]` with their absolute `position_ids [1, T]`, the model's own modules run
unchanged, and each attention layer goes through the "vattn" attention function
(`vattn.integrations.hf`), which reads this iteration's `AttentionMetadata` from the
forward context. Logits are computed only for the last token of each sequence that
samples this iteration (`logits_to_keep`); a sequence whose prompt ends this iteration
with PENDING samples (parallel sampling) lends its row to each of them.

`launch` queues the forward and the sampling on the device and returns at once (`InFlight`,
`vattn.engine.inflight`): the sampled tokens stay on the device, where the next iteration's
inputs read them, and a copy to the host is under way; `InFlight.result()` waits for it. A
sequence whose last token is still a placeholder (asynchronous scheduling:
`Sequence.num_placeholders`) gets it from the tokens of the iteration launched before, on the
device:
```
input_ids [T] (host)     [ 17  4  9 | 0 | 0 | 3 ... ]   0: a placeholder, `feed` row r >= 0
feed      [T] (host)     [ -1 -1 -1 | 2 | 0 |-1 ... ]
ids on the device = where(feed >= 0, previous tokens [S'] at feed, input_ids)
```
On the host (the CPU backend) the forward has run when `launch` returns.

The rows are sampled by `vattn.engine.sampler.Sampler` (batched on the device). Loading the
model, and the prefix cache's and disk tier's salts, are `vattn.engine.loader`'s.

Failures (see `ModelRunner.launch`): one request's sampling that raises fails that request
only; a forward that raises cannot be pinned on one request, so every sequence of the
batch is run again alone, and only those that fail alone fail.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from vattn.attention import (AttentionKernel, AttentionMetadata, ForwardContext, forward_context, select_kernel,
                             to_device)
from vattn.cache import KVCache
from vattn.config import CacheConfig
from vattn.engine import states
from vattn.engine.compile import CompiledForward, compile_mode
from vattn.engine.config import EngineConfig
from vattn.engine.cuda_graphs import GRAPH_KERNELS, DecodeGraphs, GraphTarget
from vattn.engine.inflight import InFlight
from vattn.engine.loader import weights_fingerprint
from vattn.engine.mappings import ModelMapping, model_mappings
from vattn.engine.rejection import verify
from vattn.engine.sampler import NOTHING_SAMPLED, Sampled, Sampler
from vattn.engine.scheduler import ScheduledSequence, SeqId
from vattn.errors import InvalidConfigError, UnsupportedModelError
from vattn.prefix_cache import PrefixCache

MAX_DEFAULT_CONTEXT = 4096

logger = logging.getLogger(__name__)


def _kv_layers(config: Any) -> list[int]:
    """The layers of a model with recurrent states that have attention (so K/V)."""
    from vattn.integrations.hf import layer_kinds

    return [i for i, kind in enumerate(layer_kinds(config)) if kind != "linear_attention"]


class ModelRunner:
    """Runs the model on a batch of scheduled sequences and samples their next tokens."""

    def __init__(self, model: Any, dtype: torch.dtype, device: torch.device, config: EngineConfig) -> None:
        # What close() undoes, each set once it is built: an __init__ that raises closes what it
        # built (the cache, the state mixers' binding, the graphs, the attention), nothing else
        self.cache: KVCache | None = None
        self._unbind_states: Callable[[], None] | None = None
        self.graphs: DecodeGraphs | None = None
        self.previous_attention: str | None = None  # the model's attention before vattn's (None: not switched)
        self.packed_linears: Any = None  # the host's linear layers on oneDNN (vattn.engine.cpu_gemm)
        self._last: InFlight | None = None  # the iteration launched last: its tokens feed the next one's placeholders
        self.k_caches: list[Any] = []
        self.v_caches: list[Any] = []
        try:
            self._build(model, dtype, device, config)
        except BaseException:
            try:
                self.close()
            except Exception:  # noqa: BLE001 - the caller must see why __init__ failed, not this
                logger.exception("closing a model runner whose construction failed")
            raise

    def _build(self, model: Any, dtype: torch.dtype, device: torch.device, config: EngineConfig) -> None:
        """__init__'s work: every refusal that needs no cache first, then the cache and what
        runs on it."""
        from vattn.integrations.hf import use_vattn_attention

        self.device, self.dtype = device, dtype
        self.model = model.to(device=device, dtype=dtype).eval()
        has_states, mapped, compiled = self._check(config)
        self.vocab_size = self.model.get_input_embeddings().num_embeddings
        # K/V only for the layers that have attention: not a state model's Mamba2 / gated delta-net
        # layers (a model with none still gets one small layer: the cache also hands out the slots);
        # their recurrent states are a layer kind of the same cache (vattn.engine.states)
        kv_layers = _kv_layers(self.model.config) if has_states else list(range(self.model.config.num_hidden_layers))
        specs = states.state_specs(self.model) if has_states else []
        # A batch whose forward raised is run again request by request, unless a layer keeps a
        # state: the layers that ran moved it on
        self.rerun_alone = not specs
        self.kernel = AttentionKernel(config.attention or select_kernel(self.device, self.dtype))
        cache_config = self._cache_config(config, kv_layers, specs, mapped)
        want_graphs = self._graphs_wanted(config)  # InvalidConfigError for cuda_graphs=True where they cannot run
        # UnsupportedModelError: the model cannot route its attention through vattn's
        self.previous_attention = use_vattn_attention(self.model)
        try:
            self.cache = KVCache(cache_config, budget=config.budget)
        except ImportError as e:  # e.g. no CUDA backend in this build
            raise InvalidConfigError(f"vattn has no cache backend for device {self.device}: {e}") from None
        self._bind_cache(kv_layers, specs, mapped)
        if self.kernel.flex is not None:  # (its blocks must not run past a slot's mapped pages)
            self.kernel.flex.page_bytes = self.cache.page_size
        self.sampler = Sampler(self.device, config.seed)
        self.eos_token_ids: frozenset[int] = frozenset()  # masked under min_tokens (LLM keeps it the scheduler's)
        self.num_fed_tokens = 0  # input tokens read on the device from the iteration before (async scheduling)
        self.compiled = (CompiledForward(self.model, compiled, [c for c in self.k_caches + self.v_caches if c is not None])
                         if compiled else None)  # vattn.engine.compile
        if want_graphs:
            self.graphs = DecodeGraphs(self.graph_target(), config.max_num_seqs or config.max_batch_size)
        self.offload = (config.offload_bytes, config.offload_dir, config.offload_dir_bytes)
        if config.offload_bytes is not None and not config.enable_prefix_caching:  # swapped-out requests only
            self.cache.host.configure(config.offload_bytes)

    def _check(self, config: EngineConfig) -> tuple[bool, list[tuple[ModelMapping, list[Any]]], str | None]:
        """The refusals that need no cache: what the model has (recurrent states, the layers of
        its model mappings: (mapping, their modules) of each it has) and the inductor mode it
        compiles with (None: eager); packs the host's linear layers (`cpu_linear`). Sets `eager_only`."""
        from vattn.engine.cpu_gemm import pack_linears
        from vattn.integrations.hf import check_model, has_attention_sinks, sdpa_only

        # UnsupportedModelError: layers vattn cannot run; Mamba2 / gated delta-net states and
        # the model mappings' layers (latent attention) only on one rank
        one_rank = config.tensor_parallel_size == 1
        has_states = check_model(self.model, states=one_rank, engine=one_rank)
        # layers with a kind of their own on the model's side (vattn.engine.mappings: latent attention)
        mapped = [(m, found) for m in model_mappings() for found in [m.find(self.model)] if found]
        # what the library kernels, CUDA graphs and compile= do not cover: run eagerly on the sdpa path
        sinks = has_attention_sinks(self.model)  # gpt-oss
        if sinks and not one_rank:
            raise UnsupportedModelError("attention sinks (gpt-oss) run on one rank only: their heads are not sharded")
        self.eager_only = mapped[0][0].LABEL if mapped else sdpa_only(self.model)
        compiled = compile_mode(config, has_states)  # inductor's mode or None; refusals before the cache exists
        if compiled and self.eager_only:
            raise InvalidConfigError(f"compile={config.compile!r} does not cover {self.eager_only} yet; pass "
                                     "compile=False (it runs eagerly)")
        if compiled is not None and config.cpu_linear == "onednn":
            raise InvalidConfigError("cpu_linear='onednn' and compile= together: inductor does not lower the packed "
                                     "linear; leave cpu_linear='auto' (compiled engines keep F.linear)")
        # (a compiled forward keeps F.linear: inductor cannot lower the packed op)
        self.packed_linears = pack_linears(self.model, self.dtype, torch.device(self.device),
                                           "default" if compiled is not None else config.cpu_linear)
        if has_states and config.speculative_config is not None:
            raise InvalidConfigError(
                "speculative_config: this model has recurrent-state layers (Mamba2 / gated delta-net), whose states "
                "a rejected draft would have moved on (no rollback through their snapshots yet); pass "
                "speculative_config=None")
        return has_states, mapped, compiled

    def _cache_config(self, config: EngineConfig, kv_layers: list[int], specs: list[Any],
                      mapped: list[tuple[ModelMapping, list[Any]]]) -> CacheConfig:
        """The cache's configuration for this model (its K/V layers `kv_layers`, their windows and
        widths; the recurrent states `specs`) and the engine's `config`. Sets `max_context_len`."""
        from vattn.integrations.hf import layer_windows

        hf = self.model.config
        num_heads = getattr(hf, "num_attention_heads", None) or 1  # (a Mamba2 model has no attention)
        num_kv_heads = getattr(hf, "num_key_value_heads", None) or num_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
        max_pos = getattr(hf, "max_position_embeddings", None) or MAX_DEFAULT_CONTEXT
        self.max_context_len = config.max_context_len or min(max_pos, MAX_DEFAULT_CONTEXT)
        if self.max_context_len > max_pos:
            raise InvalidConfigError(
                f"max_context_len={self.max_context_len} exceeds the model's max_position_embeddings={max_pos}")
        windows = layer_windows(hf)  # by the model's layer index; the cache's by its K/V layer
        for mapping, found in mapped:  # their layers' kinds (latent attention's: its widths, `kv_widths`)
            windows = mapping.layer_kinds(self.model, found, windows)
        kv_windows = tuple(windows[layer] for layer in kv_layers) or (None,)
        return CacheConfig(
            num_layers=max(1, len(kv_layers)), num_kv_heads=num_kv_heads, head_dim=head_dim,
            max_batch_size=config.max_batch_size, max_context_len=self.max_context_len, dtype=self.dtype,
            device=str(self.device), page_size=config.page_size, layout=config.layout,
            physical_memory=config.physical_memory, background=config.background, prefetch=config.prefetch,
            prefetch_tokens=config.prefetch_tokens,
            # FlashAttention 4 multiplies the rows after a context (up to its 128-row tile's end) by
            # zero probabilities: they must be finite, so no page reaches a request with what it did
            # not write (measured on an H200: NaN rows there made NaN outputs; docs/gpu.md)
            zero_reused_pages=self.kernel.name == "flash_attn_4",
            # sliding-window layers give their pages behind the window back (per-layer layout:
            # the fused one keeps every page); a kind may declare its K/V widths (`kv_widths`)
            layer_windows=kv_windows,
            state_bytes=states.state_bytes(specs),
            num_snapshots=states.SNAPSHOTS_PER_SLOT * config.max_batch_size
            if specs and config.enable_prefix_caching else 0)

    def _bind_cache(self, kv_layers: list[int], specs: list[Any], mapped: list[tuple[ModelMapping, list[Any]]]) -> None:
        """The cache's views by the model's layer index (`k_caches`, `v_caches`: `[B, T, H_kv, D]`
        each, None for a layer without attention), and the state mixers and the model mappings'
        layers bound to it (undone at close, the mappings' first)."""
        undo = [m.install(found) for m, found in mapped] + [states.bind(self.model, self.cache, specs)]

        def unbind() -> None:
            for u in undo:
                u()

        self._unbind_states = unbind
        self.slot_tokens = self.cache.geometry.slot_tokens
        num_layers = self.model.config.num_hidden_layers
        self.k_caches = [None] * num_layers
        self.v_caches = [None] * num_layers
        for i, layer in enumerate(kv_layers):
            self.k_caches[layer], self.v_caches[layer] = self.cache.k_cache(i), self.cache.v_cache(i)

    def prefix_cache(self, salt: bytes) -> PrefixCache:
        """The prefix cache over this runner's cache (every layer kind's part of a block), with
        the offload tiers asked for. A disk tier's salt also names the weights (their
        fingerprint) and this rank: its files outlive the process."""
        offload_bytes, offload_dir, offload_dir_bytes = self.offload
        if offload_dir is not None:
            salt += weights_fingerprint(self.model) + self.rank_name()
        return self.make_prefix_cache(salt, offload_bytes=offload_bytes, offload_dir=offload_dir,
                                      offload_dir_bytes=offload_dir_bytes)

    def make_prefix_cache(self, salt: bytes, **offload: Any) -> PrefixCache:
        return PrefixCache(self.cache, salt=salt, **offload)

    def rank_name(self) -> bytes:
        """This runner's tensor-parallel rank, for the disk tier's salt (one process: rank 0 of 1)."""
        return b"rank 0 of 1"

    def logits(self, ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor | int) -> torch.Tensor:
        """The model on ids, positions `[1, T]` inside a forward context: logits `[S, V]` of
        the rows `keep` (`[S]`, or 0: every row), compiled or eager."""
        if self.compiled is not None:
            return self.compiled(ids, positions, keep)
        return self.model(input_ids=ids, position_ids=positions, use_cache=False, logits_to_keep=keep).logits[0]

    def _graphs_wanted(self, config: EngineConfig) -> bool:
        """Whether decode runs under CUDA graphs (`EngineConfig.cuda_graphs`; see
        vattn.engine.cuda_graphs); InvalidConfigError for cuda_graphs=True where they cannot."""
        want = config.cuda_graphs
        if want is False:
            return False
        why_not = None
        if self.device.type != "cuda":
            why_not = f"they need a CUDA device, not {self.device}"
        elif not self.rerun_alone:
            why_not = "they do not cover the recurrent-state layers (the batch is split by request in Python)"
        elif self.eager_only:
            why_not = f"they do not cover {self.eager_only} (run per sequence group in Python)"
        elif config.tensor_parallel_size > 1:
            why_not = "they are not supported under tensor parallelism"
        elif config.speculative_config is not None:
            why_not = "they do not capture speculative decoding's verification forwards (speculative_config) yet"
        elif self.kernel.name not in GRAPH_KERNELS:
            why_not = f"they need attention={GRAPH_KERNELS[0]!r}, not {self.kernel.name!r}"
        if why_not is not None and want:
            raise InvalidConfigError(f"cuda_graphs=True: {why_not}; pass cuda_graphs=None (where they apply) or False")
        return why_not is None

    def graph_target(self) -> GraphTarget:
        """What a captured decode of this runner runs (`vattn.engine.cuda_graphs`)."""
        return GraphTarget(self.logits, self.kernel, self.k_caches, self.v_caches, self.device, self.slot_tokens,
                           self.max_context_len, self.cache.synchronize)

    def launch(self, scheduled: list[ScheduledSequence]) -> InFlight:
        """Launch one iteration: the forward over the batch and its sampling, queued on the
        device. Returns at once with its tokens there (`InFlight`; the next launch reads the
        placeholders of its batch from them); `result()` gives the sampled token of every
        sequence whose computed tokens reach its end, and the sequences that failed.

        Never raises an `Exception` for a failure inside the iteration:
        - a sequence whose sampling raises is in `errors`; the others keep their tokens;
        - when the batch's forward (or the batch-wide part of sampling) raises, nothing of
          it is kept and every sequence of the batch is run again alone, at once; those
          whose solo run raises too are in `errors`, the others continue with their solo
          results. Every sequence thus gets two tries, and one bad request cannot fail the
          others. K/V written by a failed run sits at the positions the retry writes again
          (nothing counts as computed before `launch` returns), so retrying is sound.
        Failures are host exceptions, known when `launch` returns (`InFlight.errors`)."""
        self._last = InFlight(self._launch(scheduled) if scheduled else NOTHING_SAMPLED)
        return self._last

    def _launch(self, scheduled: list[ScheduledSequence]) -> Sampled:
        try:
            return self._run(scheduled)
        except Exception as e:  # noqa: BLE001 - see launch's docstring
            if not self.rerun_alone:  # states were updated in place by the layers that ran: no retry
                return self._fail_all(scheduled, e)
            logger.warning("vattn: the forward of a batch of %d sequences failed (%s: %s); "
                           "running each alone", len(scheduled), type(e).__name__, e)
        parts: list[Sampled] = []
        for item in scheduled:
            rid = item.seq.request_id
            try:
                parts.append(self._run([item]))
            except Exception as e:  # noqa: BLE001
                logger.warning("vattn: request %d failed when run alone", rid, exc_info=True)
                msg = (f"the model's forward raised for request {rid} in its batch of {len(scheduled)} "
                       f"and again when it ran alone: {type(e).__name__}: {e}")
                parts.append(Sampled([], None, dict.fromkeys([s.seq_id for s in (item.seq, *item.fan_out)], msg)))
        return Sampled.merge(parts)

    def _fail_all(self, scheduled: list[ScheduledSequence], e: Exception) -> Sampled:
        """A model with recurrent states cannot run a failed batch again: the layers that ran
        advanced its states. Every sequence of the batch fails."""
        logger.warning("vattn: the forward of a batch of %d sequences failed", len(scheduled), exc_info=True)
        msg = (f"the model's forward raised ({type(e).__name__}: {e}); with recurrent states it is not run again "
               "(the states of the layers that ran moved on)")
        return Sampled([], None, {s.seq_id: msg for item in scheduled for s in (item.seq, *item.fan_out)})

    @torch.inference_mode()
    def _run(self, scheduled: list[ScheduledSequence]) -> Sampled:
        batch = sorted(scheduled, key=lambda s: s.seq.slot)  # slot-ascending for the varlen kernel
        input_ids: list[int] = []
        placeholders: list[tuple[int, int]] = []  # (packed position, its row of the previous iteration's tokens)
        sample_rows: list[int] = []  # packed positions whose logits are computed
        rows: list[int] = []  # per sampled sequence, its row of those logits
        sampling = []
        speculating: list[tuple[SeqId, Any, tuple[int, ...]]] = []  # sequences with drafts, their rows at the end
        spec_rows: list[int] = []
        for s in batch:
            seq = s.seq
            start, n = seq.num_computed_tokens, s.num_new_tokens - len(s.drafts)
            input_ids += seq.token_ids[start:start + n]
            if start + n > len(seq.token_ids):  # its last token is the sample of the iteration in flight
                placeholders.append((len(input_ids), self._last.rows[seq.seq_id]))
                input_ids.append(0)  # read on the device (feed)
            if s.drafts:  # speculative decoding: every row from its last token on is verified
                spec_rows += range(len(input_ids) - 1, len(input_ids) + len(s.drafts))
                input_ids += s.drafts
                speculating.append((seq.seq_id, seq.params, s.drafts))
            elif start + n == seq.num_tokens:
                sample_rows.append(len(input_ids) - 1)
                for x in (seq, *s.fan_out):  # a fan-out: every sample draws from this row
                    rows.append(len(sample_rows) - 1)
                    sampling.append(x)
        fed = self._last.tokens if placeholders else None  # [S'] on the device
        self.num_fed_tokens += len(placeholders)
        slots, starts = [s.seq.slot for s in batch], [s.seq.num_computed_tokens for s in batch]
        logits = None
        if (self.graphs is not None and len(sample_rows) == len(batch) == len(input_ids)
                and self.graphs.usable(len(batch))):  # a decode: every sequence 1 token, every one samples
            logits = self.graphs.run(slots, starts, input_ids, placeholders, fed)  # [S, V]; None: the capture failed, run eagerly
        if logits is None:
            meta = AttentionMetadata.build(slots, starts, [s.num_new_tokens for s in batch], self.slot_tokens,
                                           self.device)
            ids = self._input_ids(input_ids, placeholders, fed)  # [T]
            keep = to_device(sample_rows + spec_rows, self.device)  # [S]
            logits = self._forward(ids[None], keep, meta)  # [S, V]
        verified = None
        if speculating:
            verified = verify(self.sampler, logits[len(sample_rows):], speculating)
            logits = logits[:len(sample_rows)]
        if not sampling:
            return verified or NOTHING_SAMPLED
        if len(rows) != len(sample_rows):
            logits = logits[to_device(rows, logits.device)]  # [S', V]: fan-out rows repeated
        sampled = self.sampler.sample(logits, [s.seq_id for s in sampling], [s.params for s in sampling],
                                      seqs=sampling, eos_token_ids=self.eos_token_ids)
        return sampled if verified is None else Sampled.merge([sampled, verified])

    @torch.inference_mode()
    def last_logits(self, rows: list[tuple[int, int, list[int]]]) -> torch.Tensor:
        """One forward over `rows` (slot, start, tokens written from `start` on, already backed
        by the cache's `step`), no sampling: float32 logits `[S, V]` of each row's last token,
        in the order given (beam search: `vattn.engine.beam_search`). Eager or compiled, never a
        CUDA graph; raises what the forward raises."""
        order = sorted(range(len(rows)), key=lambda i: rows[i][0])  # slot-ascending for the varlen kernel
        ids: list[int] = []
        keep: list[int] = []
        for i in order:
            ids += rows[i][2]
            keep.append(len(ids) - 1)
        meta = AttentionMetadata.build([rows[i][0] for i in order], [rows[i][1] for i in order],
                                       [len(rows[i][2]) for i in order], self.slot_tokens, self.device)
        logits = self._forward(to_device(ids, self.device)[None], to_device(keep, self.device), meta)
        back = [0] * len(order)
        for row, i in enumerate(order):
            back[i] = row
        return logits[to_device(back, logits.device)].float()

    def _input_ids(self, input_ids: list[int], placeholders: list[tuple[int, int]],
                   fed: torch.Tensor | None) -> torch.Tensor:
        """The packed tokens `[T]` on the device, each placeholder (position, row) the row of
        `fed` (the previous iteration's sampled tokens `[S']`, on the device)."""
        if not placeholders:
            return to_device(input_ids, self.device)
        if len(placeholders) == len(input_ids):  # a decode of the tokens in flight: all of them read there
            return fed[to_device([row for _, row in placeholders], self.device)]
        ids = to_device(input_ids, self.device)
        where = to_device([[pos for pos, _ in placeholders], [row for _, row in placeholders]], self.device)  # [2, F]
        ids[where[0]] = fed[where[1]]
        return ids

    def _forward(self, ids: torch.Tensor, keep: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The model's forward outside CUDA graphs (compiled or eager): ids `[1, T]` packed
        tokens, keep `[S]` rows whose logits are computed. Returns logits `[S, V]`."""
        with forward_context(ForwardContext(self.k_caches, self.v_caches, meta, self.kernel)):
            return self.logits(ids, meta.positions[None], keep)  # [S, V]

    def release(self, seq_id: SeqId) -> None:
        """Forget a finished sequence's sampling state."""
        self.sampler.release(seq_id)

    def close(self) -> None:
        """Wait for the iteration in flight, then undo what this runner built: the graphs,
        the state mixers' binding, the cache, the model's attention. Also closes a runner whose
        __init__ raised (only what it had built). Every step runs even where one before it
        raised (a CUDA error in the graphs' close must not keep the cache's memory); the first
        error is raised after them."""
        from vattn.integrations.hf import restore_attention

        failures: list[BaseException] = []

        def undo(step: Callable[[], Any]) -> None:  # every step runs, whatever the ones before did
            try:
                step()
            except BaseException as e:  # noqa: BLE001 - the first is raised below
                failures.append(e)

        if self._last is not None:  # nothing may write into the cache once it is closed
            last, self._last = self._last, None
            undo(last.result)
        if self.graphs is not None:
            graphs, self.graphs = self.graphs, None
            undo(graphs.close)
        if self._unbind_states is not None:
            unbind, self._unbind_states = self._unbind_states, None
            undo(unbind)
        self.k_caches, self.v_caches = [], []
        if self.cache is not None:
            undo(self.cache.close)
        if self.previous_attention is not None:
            previous, self.previous_attention = self.previous_attention, None
            undo(lambda: restore_attention(self.model, previous))
        if self.packed_linears is not None:
            packed, self.packed_linears = self.packed_linears, None
            undo(packed.unpack)
        if failures:
            raise failures[0]
