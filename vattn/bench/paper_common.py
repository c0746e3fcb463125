"""What every figure of `vattn bench paper` shares: the paper's experiments and headlines, the
axis picked per device and size (recorded in `scaled` when it differs from the paper's), the
stand-in models and the engine arguments."""
from __future__ import annotations

import argparse
import random
from typing import Any

import torch

KB, MB = 1 << 10, 1 << 20
FIGURES = (2, 3, 4, 6, 7, 8, 9, 11)
HOST_PAGED = "gather+SDPA (no paged kernel on the host)"
PAGED_ENGINE = "transformers continuous batching (paged cache)"
PAPER = {  # the paper's experiment and its headline (../shared/PAPER_NOTES.md, the issue)
    2: ("prefill kernel latency, paged vs non-paged, Llama-3-8B, 1K-32K tokens",
        "paged prefill kernels slower than non-paged: vAttention 1.60-3.92x over FA_Paged, 1.03-1.45x over FI_Paged"),
    3: ("a paged decode kernel at block sizes 16/32/64/128, batch 1-16 x 16K",
        "the paged kernel's latency depends on the block size; FlashAttention's decode kernel 2.85x faster than "
        "vLLM's paged one (Yi-6B, 16 x 16K)"),
    4: ("decode tokens/s and the allocation bandwidth it needs (MB/s), batch 1-300, 900-token requests",
        "peak need 600 MB/s; the driver gives up to 7.6 GB/s per GPU even at 64 KB pages"),
    6: ("single-request prefill throughput, 2K-192K tokens, paged vs vAttention",
        "prefill 1.60-3.92x over FA_Paged, 1.03-1.45x over FI_Paged"),
    7: ("decode tokens/s vs batch 1-32 at 16K context",
        "decode up to 1.97x vLLM (Yi-6B), 1.3x (Llama-3-8B), 1.6x (Yi-34B); about FA_Paged with blocks of 128"),
    8: ("offline arXiv trace, 64K-192K tokens: requests per minute",
        "end to end 1.22x / 1.29x vs paged FlashAttention / FlashInfer"),
    9: ("online trace: latency CDF at two request rates", "lower latency than the paged systems at both rates"),
    11: ("decode iteration latency with and without overlapped allocation",
         "synchronous mapping spikes 25 -> 41 ms (Llama-3-8B, batch 4, 2 MB pages); overlap removes them"),
}

# the engine figures' (7, 8, 9) models: random seeded weights, Llama-shaped
HOST_ENGINE_MODEL = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64)
CUDA_ENGINE_MODEL = dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64)


def is_cuda(args: argparse.Namespace) -> bool:
    """Whether the figures run on a GPU (`--device cuda...`)."""
    return str(args.device).startswith("cuda")


def pick(args: argparse.Namespace, paper: Any, cuda_full: Any, cuda_quick: Any, host_full: Any,
         host_quick: Any, scaled: dict, name: str) -> Any:
    """The value of one axis here; recorded in `scaled` when it differs from the paper's."""
    used = (cuda_quick if args.quick else cuda_full) if is_cuda(args) else (host_quick if args.quick else host_full)
    if used != paper:
        scaled[name] = dict(paper=paper, used=used)
    return used


def seed_tokens(n: int, vocab: int, rng: random.Random) -> list[int]:
    """`n` random token ids (never 0, the paged engine's padding id)."""
    return [rng.randrange(1, vocab) for _ in range(n)]


def dtype_of(args: argparse.Namespace) -> torch.dtype:
    return torch.bfloat16 if is_cuda(args) else torch.float32


def model(args: argparse.Namespace, cuda_shape: dict, host_shape: dict, scaled: dict) -> tuple[Any, dict]:
    """A Llama-shaped model with random seeded weights (`_models.build_model`) and its shape."""
    from ._models import build_model, llama_config

    shape = cuda_shape if is_cuda(args) else host_shape
    if not is_cuda(args):
        scaled["model"] = dict(paper="Yi-6B / Llama-3-8B / Yi-34B", used=f"random Llama, {shape}")
    cfg = llama_config(max_position_embeddings=1 << 18, tie_word_embeddings=False, **shape)
    return build_model(cfg, args.device, dtype_of(args), args.seed, attn_implementation="sdpa"), shape


def token_bytes(shape: dict, dtype: torch.dtype) -> int:
    """K and V of one token, every layer."""
    head_dim = shape.get("head_dim", shape["hidden_size"] // shape["num_attention_heads"])
    return 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * head_dim * \
        torch.empty((), dtype=dtype).element_size()


def engine_args(batch: int, tokens: int, page_size: int | None = None) -> argparse.Namespace:
    """What `throughput.run_vattn` / `run_hf_cb` read."""
    return argparse.Namespace(max_batch_size=batch, max_num_batched_tokens=tokens, page_size=page_size,
                              attention=None)


def hf_cb_problem() -> str | None:
    """Why transformers' continuous batching cannot run here, or None."""
    from vattn.integrations.hf_cb import memory_problem

    return memory_problem()
