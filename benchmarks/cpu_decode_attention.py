"""The host's decode attention, one decode step of a model's layers: the engine's kernels on a
vattn-shaped cache against the time to merely read the same K/V.

Variants, each on the same cache tensors `[S, T, H_kv, D]` a layer (the engine's layout), the
caches evicted from the CPU's caches before every step (a decode step reads every layer's
cache once, far more than the L3 holds):
- `sdpa`: the engine's default on the host (`vattn.attention.sdpa_attention`: PyTorch's CPU
  flash attention once per sequence and layer, the GQA heads folded);
- `flex`: `attention="flex"` (`vattn.flex_decode.FlexDecode`: one compiled FlexAttention call
  per layer over every slot);
- `sdpa_head_major`: `sdpa`'s calls on a copy of the cache laid out `[S, H_kv, T, D]` (what a
  per-head cache layout would give; not a vattn layout);
- `read`: the sum of each decoding slot's K and V rows, a floor for any kernel that reads them.

    OMP_NUM_THREADS=1 python benchmarks/cpu_decode_attention.py [--reps 8]

Writes benchmarks/results/cpu_decode_attention.{json,png}: ms a step per variant and scenario,
and each variant's ratio to `sdpa`, medians of `--reps` steps, the variants alternating.
"""
from __future__ import annotations

import argparse
import os
import time
from typing import Any, Callable

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from vattn.attention import AttentionMetadata, sdpa_attention  # noqa: E402
from vattn.bench._common import environment, print_table, save  # noqa: E402
from vattn.flex_decode import FlexDecode  # noqa: E402

# name -> (slots of the engine, the decoding ones' contexts): `vattn bench peers`' model shapes
SCENARIOS = {"8 x 1K": (16, [1040 + 3 * i for i in range(8)]),
             "8 of 16 slots, 100-520": (16, [100 + 60 * i for i in range(8)]),
             "16 x 300": (16, [300 + 4 * i for i in range(16)])}
VARIANTS = ("sdpa", "flex", "sdpa_head_major", "read")


def step_fns(slots: int, ctxs: list[int], args: argparse.Namespace) -> dict[str, Callable[[], Any]]:
    """One decode step of every variant on the same caches and queries."""
    g = torch.Generator().manual_seed(0)
    L, Hq, Hkv, D, T = args.layers, args.heads, args.kv_heads, args.head_dim, args.slot_tokens
    k = [torch.randn(slots, T, Hkv, D, generator=g) for _ in range(L)]  # [S, T, H_kv, D] a layer
    v = [torch.randn(slots, T, Hkv, D, generator=g) for _ in range(L)]
    kh = [x.transpose(1, 2).contiguous() for x in k]  # [S, H_kv, T, D]
    vh = [x.transpose(1, 2).contiguous() for x in v]
    used = list(range(0, slots, max(1, slots // len(ctxs))))[:len(ctxs)]  # decoding slots, spread out
    q = torch.randn(len(used), Hq, D, generator=g)  # [n, H_q, D]: the packed decode rows
    flex = FlexDecode(sdpa_attention)
    flex.page_bytes = 64 << 10  # the host's default page

    def meta() -> AttentionMetadata:
        return AttentionMetadata.build(used, [c - 1 for c in ctxs], [1] * len(used), T, torch.device("cpu"))

    def sdpa() -> None:
        m = meta()
        for layer in range(L):
            sdpa_attention(q, k[layer], v[layer], m, D ** -0.5, None)

    def flex_step() -> None:
        m = meta()
        for layer in range(L):
            flex(q, k[layer], v[layer], m, D ** -0.5, None)

    def head_major() -> None:
        for layer in range(L):
            for i, (s, c) in enumerate(zip(used, ctxs)):
                F.scaled_dot_product_attention(q[i].view(1, Hkv, Hq // Hkv, D), kh[layer][s:s + 1, :, :c],
                                               vh[layer][s:s + 1, :, :c], scale=D ** -0.5)

    def read() -> None:
        for layer in range(L):
            for s, c in zip(used, ctxs):
                k[layer][s, :c].sum()
                v[layer][s, :c].sum()

    return {"sdpa": sdpa, "flex": flex_step, "sdpa_head_major": head_major, "read": read}


def measure(fns: dict[str, Callable[[], Any]], reps: int) -> dict[str, float]:
    """Median ms a step of each variant, the variants alternating, caches evicted before each."""
    flush = torch.empty(64 << 20)  # 256 MiB: more than the L3
    times: dict[str, list[float]] = {n: [] for n in fns}
    for fn in fns.values():
        fn()  # warm-up (flex compiles here)
    for _ in range(reps):
        for name, fn in fns.items():
            flush.add_(1)
            t = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t) * 1e3)
    return {n: sorted(ts)[len(ts) // 2] for n, ts in times.items()}


def plot(results: dict[str, dict[str, float]]) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(VARIANTS)
    for j, variant in enumerate(VARIANTS):
        xs = [i + j * width for i in range(len(results))]
        ax.bar(xs, [r[variant] for r in results.values()], width, label=variant)
    ax.set_xticks([i + width * (len(VARIANTS) - 1) / 2 for i in range(len(results))], list(results))
    ax.set_ylabel("ms a decode step (all layers), one thread")
    ax.set_title("Host decode attention on the vattn cache")
    ax.legend()
    return fig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--slot-tokens", type=int, default=1152)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    results = {}
    for name, (slots, ctxs) in SCENARIOS.items():
        results[name] = measure(step_fns(slots, ctxs, args), args.reps)
    rows = [[name, *(f"{r[v]:.2f}" for v in VARIANTS), *(f"{r[v] / r['sdpa']:.2f}x" for v in VARIANTS[1:])]
            for name, r in results.items()]
    print_table(["scenario", *(f"{v} ms" for v in VARIANTS), *(f"{v} / sdpa" for v in VARIANTS[1:])], rows)
    save("cpu_decode_attention", {"env": environment("cpu"), "args": vars(args),
                                  "omp_num_threads": torch.get_num_threads(), "ms_per_step": results},
         plot(results), out=args.out)


if __name__ == "__main__":
    main()
