"""`ModelRunner`: owns the model, the vattn cache and every tensor of an iteration.

One forward serves the whole batch: the scheduled sequences' new tokens are packed into
`input_ids [1, T]` with their absolute `position_ids [1, T]`, the model's own modules run
unchanged, and each attention layer goes through the "vattn" attention function
(`vattn.integrations.hf`), which reads this iteration's `AttentionMetadata` from the
forward context. Logits are computed only for the last token of each sequence that
samples this iteration (`logits_to_keep`); a sequence whose prompt ends this iteration
with PENDING samples (parallel sampling) lends its row to each of them.

`launch` queues the forward and the sampling on the device and returns at once (`InFlight`):
the sampled tokens stay on the device, where the next iteration's inputs read them, and a
copy to the host is under way; `InFlight.result()` waits for it. A sequence whose last token
is still a placeholder (asynchronous scheduling: `Sequence.num_placeholders`) gets it from the
tokens of the iteration launched before, on the device:
```
input_ids [T] (host)     [ 17  4  9 | 0 | 0 | 3 ... ]   0: a placeholder, `feed` row r >= 0
feed      [T] (host)     [ -1 -1 -1 | 2 | 0 |-1 ... ]
ids on the device = where(feed >= 0, previous tokens [S'] at feed, input_ids)
```
On the host (the CPU backend) the forward has run when `launch` returns.

The rows are sampled by `vattn.engine.sampler.Sampler` (batched on the device; `Sampler`,
`Sampled` and `argmax_tokens` are importable from here too).

Failures (see `ModelRunner.launch`): one request's sampling that raises fails that request
only; a forward that raises cannot be pinned on one request, so every sequence of the
batch is run again alone, and only those that fail alone fail.
"""
from __future__ import annotations

import copy
import hashlib
import itertools
import logging
import os
from typing import Any, Callable, NamedTuple

import torch

from vattn.attention import (AttentionKernel, AttentionMetadata, ForwardContext, forward_context, select_kernel,
                             to_device)
from vattn.cache import KVCache
from vattn.engine.compile import CompiledForward, compile_mode
from vattn.engine.config import MODEL_DTYPES, EngineConfig
from vattn.engine import latent, states
from vattn.engine.cuda_graphs import GRAPH_KERNELS, DecodeGraphs, GraphTarget
from vattn.engine.rejection import verify
from vattn.engine.sampler import NOTHING_SAMPLED, Sampled, Sampler, argmax_tokens  # noqa: F401 - importable here too
from vattn.engine.scheduler import ScheduledSequence, SeqId
from vattn.engine.sequence import TokenLogprobs
from vattn.errors import InvalidConfigError, UnsupportedModelError
from vattn.prefix_cache import PrefixCache

MAX_DEFAULT_CONTEXT = 4096

logger = logging.getLogger(__name__)


class RunOutput(NamedTuple):
    """What one iteration produced, by sequence id (request id, sample index)."""

    tokens: dict[SeqId, int]  # the sampled token of every sequence whose computed tokens reached its end
    errors: dict[SeqId, str]  # why a sequence failed (it finishes with "error"); its tokens are not computed
    logprobs: dict[SeqId, TokenLogprobs] = {}  # of sequences that asked (SamplingParams.logprobs); never mutated
    accepted: dict[SeqId, list[int]] = {}  # speculative decoding: the drafts each verified sequence keeps; never mutated


class InFlight:
    """An iteration launched on the device (`ModelRunner.launch`): its sampled tokens stay
    there (`tokens`: the next iteration's inputs read them) while a copy goes to the host;
    `result()` waits for that copy. What failed at launch is known at once (`errors`)."""

    def __init__(self, sampled: Sampled) -> None:
        self.rows = {sid: row for row, sid in enumerate(sampled.seq_ids)}  # each sampled sequence's row
        self.tokens = sampled.tokens  # [S] int64 on the device, or None
        self.errors = sampled.errors
        self.logprobs = sampled.logprobs  # on the device; read by result(), after the tokens' copy
        self.accepted = sampled.accepted  # on the host (verification reads the target's tokens there)
        self._host = self.tokens  # on CUDA a pinned copy, written when the device gets there
        self._copied: Any = None  # the CUDA event after that copy
        if self.tokens is not None and self.tokens.device.type == "cuda":
            self._host = torch.empty(self.tokens.shape, dtype=self.tokens.dtype, pin_memory=True)
            self._host.copy_(self.tokens, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()

    def result(self) -> RunOutput:
        """The sampled tokens as ints (waiting for the device), and the errors."""
        if self._copied is not None:
            self._copied.synchronize()
        ids = self._host.tolist() if self._host is not None else []
        errors = self.errors
        logprobs = {sid: entry for rows in self.logprobs for sid, entry in rows.to_host().items()
                    if sid not in errors}
        return RunOutput({sid: ids[row] for sid, row in self.rows.items() if sid not in errors}, errors, logprobs,
                         self.accepted)




class LoadedModel(NamedTuple):
    model: Any  # a transformers PreTrainedModel (causal LM)
    tokenizer: Any  # or None
    dtype: torch.dtype  # what the model and the cache run in


def load_model(model: Any, config: EngineConfig, device: torch.device) -> LoadedModel:
    """The model (and a checkpoint's tokenizer) from a local checkpoint directory, a
    transformers config (random weights seeded by `config.seed`) or a loaded model, and
    the dtype to run it in (see EngineConfig.dtype)."""
    from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

    if isinstance(model, PreTrainedModel):
        return LoadedModel(model, None, _check_dtype(config.dtype or model.dtype))
    default = torch.float16 if device.type == "cuda" else torch.float32
    if isinstance(model, PretrainedConfig):
        dtype = _check_dtype(config.dtype or default)
        # On CUDA the weights are made on the device in the run dtype: an 8B model built on
        # the host in float32 first takes ~32 GB and minutes. On the host, as before (float32,
        # then cast), so the seeded weights equal transformers' own from_config.
        try:
            hf_model = (seeded_model(model, config.seed, device, dtype) if device.type == "cuda"
                        else seeded_model(model, config.seed))
        except ValueError as e:
            raise InvalidConfigError(f"cannot build a causal LM from {type(model).__name__}: {e}") from None
        return LoadedModel(hf_model, None, dtype)
    if isinstance(model, (str, os.PathLike)):
        path = os.fspath(model)
        if not os.path.isdir(path):
            raise InvalidConfigError(
                f"model {path!r} is not a local checkpoint directory; vattn loads models offline "
                "(local_files_only=True): give a directory written by save_pretrained(), a "
                "transformers config, or a loaded PreTrainedModel")
        try:
            hf_model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True,
                                                            dtype=config.dtype or "auto")
        except (OSError, ValueError, KeyError) as e:
            raise InvalidConfigError(f"cannot load a causal LM from {path!r}: {e}") from None
        return LoadedModel(hf_model, load_tokenizer(path), run_dtype(hf_model.dtype, config, device))
    raise InvalidConfigError(
        f"model must be a checkpoint directory, a transformers PretrainedConfig or a PreTrainedModel, "
        f"got {type(model).__name__}")


def seeded_model(config: Any, seed: int, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None, **kwargs: Any) -> Any:
    """A causal LM from a transformers config with random weights from `seed`, made on
    `device` (default: the host) in `dtype` (default: transformers' float32), with no host
    copy. `config` is copied (the model keeps and edits its own); the global RNGs, the
    device's too, are left as they were. `kwargs`: more `from_config` arguments."""
    from transformers import AutoModelForCausalLM

    dev = torch.device(device if device is not None else "cpu")
    gpus = [dev.index if dev.index is not None else torch.cuda.current_device()] if dev.type == "cuda" else []
    if dtype is not None:
        kwargs["dtype"] = dtype
    with torch.random.fork_rng(devices=gpus), dev:  # manual_seed seeds the GPU's generator too
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(copy.deepcopy(config), **kwargs)


def weights_fingerprint(model: Any) -> bytes:
    """16 bytes that differ between models whose weights differ (the disk tier's salt): a hash
    of every parameter's and buffer's name, dtype, shape and bytes (on CUDA, of two
    position-weighted sums of each tensor's bytes, computed on the device)."""
    h = hashlib.blake2b(digest_size=16)
    with torch.no_grad():
        for name, t in itertools.chain(model.named_parameters(), model.named_buffers()):
            h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
            raw = t.detach().contiguous().reshape(-1).view(torch.uint8)  # [bytes]
            if raw.device.type == "cpu":
                h.update(memoryview(raw.numpy()))
            else:
                h.update(_device_digest(raw))
    return h.digest()


def _device_digest(raw: torch.Tensor, chunk: int = 1 << 26) -> bytes:
    """Two sums of `raw`'s bytes (`[N]` uint8 on a device), each byte weighted by a function
    of its position, wrapping in int64: a checksum that moves when any byte does."""
    sums = torch.zeros(2, dtype=torch.int64, device=raw.device)
    for start in range(0, raw.numel(), chunk):
        x = raw[start:start + chunk].to(torch.int64) + 1  # [n]
        pos = torch.arange(start, start + x.numel(), dtype=torch.int64, device=raw.device)
        w1 = pos * 0x1E3779B97F4A7C15 % 0x7FFFFFFFFFFFFFE7 + 1
        w2 = (pos ^ 0x5DEECE66D) * 0x2545F4914F6CDD1D % 0x7FFFFFFFFFFFFFC5 + 1
        sums += torch.stack([(x * w1).sum(), (x * x * w2).sum()])
    return b"".join(int(v).to_bytes(8, "little", signed=True) for v in sums.tolist())


def load_tokenizer(path: str) -> Any:
    """A checkpoint directory's tokenizer, or None when it has none (token-id prompts only)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception:  # noqa: BLE001 - no tokenizer files
        return None


def run_dtype(checkpoint_dtype: torch.dtype | None, config: EngineConfig, device: torch.device) -> torch.dtype:
    """What a checkpoint runs in: config.dtype, else its half type on CUDA, float32 on CPU."""
    dtype = config.dtype
    if dtype is None:
        is_half = checkpoint_dtype in (torch.float16, torch.bfloat16)
        dtype = checkpoint_dtype if device.type == "cuda" and is_half else torch.float32
    return _check_dtype(dtype)


def prefix_salt(model: Any, dtype: torch.dtype) -> bytes:
    """What makes K/V of the same tokens differ between models: the config's class, every
    value of the config, and the dtype the model runs in (the prefix cache's salt)."""
    config = model.config
    h = hashlib.sha256(type(config).__name__.encode())
    h.update(config.to_json_string(use_diff=False).encode())
    h.update(str(dtype).encode())
    return h.digest()


def _kv_layers(config: Any) -> list[int]:
    """The layers of a model with recurrent states that have attention (so K/V)."""
    from vattn.integrations.hf import layer_kinds

    return [i for i, kind in enumerate(layer_kinds(config)) if kind != "linear_attention"]


def _check_dtype(dtype: torch.dtype) -> torch.dtype:
    if dtype not in MODEL_DTYPES:
        raise InvalidConfigError(f"the model's dtype {dtype} is not supported; pass dtype= one of {MODEL_DTYPES}")
    return dtype


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
        from vattn.integrations.hf import (check_model, has_attention_sinks, latent_modules, layer_kinds,
                                           layer_windows, use_vattn_attention)

        self.device, self.dtype = device, dtype
        self.model = model.to(device=device, dtype=dtype).eval()
        # UnsupportedModelError: layers vattn cannot run; Mamba2 / gated delta-net states and
        # latent attention only on one rank
        one_rank = config.tensor_parallel_size == 1
        has_states = check_model(self.model, states=one_rank, engine=one_rank)
        latent_layers = latent_modules(self.model)  # their cache keeps the latent (vattn.engine.latent)
        # what the library kernels, CUDA graphs and compile= do not cover: run eagerly on the sdpa path
        sinks = has_attention_sinks(self.model)  # gpt-oss
        if sinks and not one_rank:
            raise UnsupportedModelError("attention sinks (gpt-oss) run on one rank only: their heads are not sharded")
        self.eager_only = next((what for what, present in (
            ("latent attention", latent_layers), ("attention sinks", sinks),
            ("chunked attention", "chunked_attention" in layer_kinds(self.model.config))) if present), None)
        compiled = compile_mode(config, has_states)  # inductor's mode or None; refusals before the cache exists
        if compiled and self.eager_only:
            raise InvalidConfigError(f"compile={config.compile!r} does not cover {self.eager_only} yet; pass "
                                     "compile=False (it runs eagerly)")
        from vattn.engine.cpu_gemm import pack_linears

        if compiled is not None and config.cpu_linear == "onednn":
            raise InvalidConfigError("cpu_linear='onednn' and compile= together: inductor does not lower the packed "
                                     "linear; leave cpu_linear='auto' (compiled engines keep F.linear)")
        # (a compiled forward keeps F.linear: inductor cannot lower the packed op)
        self.packed_linears = pack_linears(self.model, dtype, torch.device(device),
                                           "default" if compiled is not None else config.cpu_linear)
        if has_states and config.speculative_config is not None:
            raise InvalidConfigError(
                "speculative_config: this model has recurrent-state layers (Mamba2 / gated delta-net), whose states "
                "a rejected draft would have moved on (no rollback through their snapshots yet); pass "
                "speculative_config=None")
        hf = self.model.config
        self.vocab_size = self.model.get_input_embeddings().num_embeddings
        num_layers = hf.num_hidden_layers
        num_heads = getattr(hf, "num_attention_heads", None) or 1  # (a Mamba2 model has no attention)
        num_kv_heads = getattr(hf, "num_key_value_heads", None) or num_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
        max_pos = getattr(hf, "max_position_embeddings", None) or MAX_DEFAULT_CONTEXT
        self.max_context_len = config.max_context_len or min(max_pos, MAX_DEFAULT_CONTEXT)
        if self.max_context_len > max_pos:
            raise InvalidConfigError(
                f"max_context_len={self.max_context_len} exceeds the model's max_position_embeddings={max_pos}")

        # K/V only for the layers that have attention: not a state model's Mamba2 / gated delta-net
        # layers (a model with none still gets one small layer: the cache also hands out the slots);
        # their recurrent states are a layer kind of the same cache (vattn.engine.states)
        kv_layers = _kv_layers(self.model.config) if has_states else list(range(num_layers))
        windows = layer_windows(hf)  # by the model's layer index; the cache's by its K/V layer
        kv_windows = tuple(windows[layer] for layer in kv_layers) or (None,)
        specs = states.state_specs(self.model) if has_states else []
        # latent attention: the cache keeps per token what transformers' own cache keeps, one
        # latent "head" as K and the shared RoPE key as V (another width)
        spec = latent.latent_spec(self.model, latent_layers) if latent_layers else None
        if spec is not None:
            num_kv_heads, head_dim = spec.heads, spec.k_width
        # A batch whose forward raised is run again request by request, unless a layer keeps a
        # state: the layers that ran moved it on
        self.rerun_alone = not specs
        self.kernel = AttentionKernel(config.attention or select_kernel(self.device, self.dtype))
        want_graphs = self._graphs_wanted(config)  # InvalidConfigError for cuda_graphs=True where they cannot run
        # UnsupportedModelError: the model cannot route its attention through vattn's
        self.previous_attention = use_vattn_attention(self.model)
        try:
            self.cache = KVCache(num_layers=max(1, len(kv_layers)), num_kv_heads=num_kv_heads, head_dim=head_dim,
                                 max_batch_size=config.max_batch_size, max_context_len=self.max_context_len,
                                 dtype=self.dtype, device=str(self.device), page_size=config.page_size,
                                 layout=config.layout, physical_memory=config.physical_memory,
                                 background=config.background, prefetch=config.prefetch,
                                 prefetch_tokens=config.prefetch_tokens, budget=config.budget,
                                 # FlashAttention 4 multiplies the rows after a context (up to its
                                 # 128-row tile's end) by zero probabilities: they must be finite, so
                                 # no page reaches a request with what it did not write (measured on
                                 # an H200: NaN rows there made NaN outputs; docs/gpu.md)
                                 zero_reused_pages=self.kernel.name == "flash_attn_4",
                                 # sliding-window layers give their pages behind the window back
                                 layer_windows=kv_windows if config.layout == "per-layer" else None,
                                 state_bytes=states.state_bytes(specs),
                                 num_snapshots=states.SNAPSHOTS_PER_SLOT * config.max_batch_size
                                 if specs and config.enable_prefix_caching else 0,
                                 v_head_dim=spec.v_width if spec is not None else None)
        except ImportError as e:  # e.g. no CUDA backend in this build
            raise InvalidConfigError(f"vattn has no cache backend for device {self.device}: {e}") from None
        unbind_states, unbind_latent = states.bind(self.model, self.cache, specs), latent.install(latent_layers)
        self._unbind_states = lambda: (unbind_latent(), unbind_states())
        self.slot_tokens = self.cache.geometry.slot_tokens
        # by the model's layer index: [B, T, H_kv, D] each, None for a layer without attention
        self.k_caches = [None] * num_layers
        self.v_caches = [None] * num_layers
        for i, layer in enumerate(kv_layers):
            self.k_caches[layer], self.v_caches[layer] = self.cache.k_cache(i), self.cache.v_cache(i)
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
