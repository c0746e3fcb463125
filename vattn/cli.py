"""The `vattn` command: `vattn demo`, `vattn generate` (`serve`, `bench`, `top` and `budget`
have parsers of their own)."""
from __future__ import annotations

import argparse
import os
import shlex
import sys
from typing import Sequence

from vattn.report import key_value_table


def _synthetic_demo(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    import vattn
    from vattn.engine.demo import default_device
    from vattn.workload import run_workload, synthetic_requests

    device = args.device or default_device()
    page = args.page_size or (None if device.startswith("cuda") else 64 << 10)
    reqs = synthetic_requests(args.requests, args.max_context_len, seed=args.seed)
    with vattn.KVCache(num_layers=8, num_kv_heads=4, head_dim=64, max_batch_size=args.max_batch_size or 16,
                       max_context_len=args.max_context_len, dtype="float16", device=device, page_size=page,
                       layout=args.layout, physical_memory=args.physical_memory) as cache:
        with tqdm(total=len(reqs), desc="requests", unit="req", disable=not sys.stderr.isatty()) as bar:
            rep = run_workload(cache, reqs, progress=bar)
        s = rep.summary()
    rows = [
        ("device / page size / layout", f"{device} / {cache.page_size >> 10} KiB / {args.layout}"),
        ("requests / iterations", f"{s['requests']} / {s['iterations']}"),
        ("K/V tokens written", f"{s['tokens_written']:,}"),
        ("preemptions", str(s["preemptions"])),
        ("step latency p50 / p99 / max",
         f"{s['step_ms_p50']:.3f} / {s['step_ms_p99']:.3f} / {s['step_ms_max']:.3f} ms"),
        ("peak mapped / peak used", f"{s['peak_mapped_MiB']:.1f} / {s['peak_used_MiB']:.1f} MiB"),
        ("mean internal fragmentation", f"{100 * s['mean_fragmentation']:.1f} %"),
        ("page groups mapped / unmapped", f"{s['pages_mapped']} / {s['pages_unmapped']}"),
        ("slots reused (deferred reclamation)", str(s["slot_reuses"])),
        ("wall time", f"{s['seconds']:.2f} s"),
    ]
    print(key_value_table(rows, title="vattn synthetic allocator demo"))
    return 0


def _engine_demo(args: argparse.Namespace) -> int:
    from vattn.engine.demo import run_demo

    r = run_demo(num_requests=args.requests, seed=args.seed, device=args.device, page_size=args.page_size,
                 layout=args.layout, physical_memory=args.physical_memory,
                 max_batch_size=args.max_batch_size or 8, tensor_parallel_size=args.tensor_parallel_size)
    if r["num_errors"]:
        print(f"vattn: error: {r['num_errors']} of {r['num_requests']} requests failed:", file=sys.stderr)
        for message in r["errors"][:3]:
            print(f"  {message}", file=sys.stderr)
        if len(r["errors"]) > 3:
            print(f"  ... and {len(r['errors']) - 3} more", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    import vattn

    p = argparse.ArgumentParser(prog="vattn", description="vAttention-style KV-cache memory manager")
    p.add_argument("--version", action="version", version=f"vattn {vattn.__version__}",
                   help="print the version and exit")
    sub = p.add_subparsers(dest="cmd", required=True)

    d = sub.add_parser("demo", help="serve a few dozen requests on a tiny built-in model and print figures",
                       description="Serve requests on a tiny built-in model (or, with --synthetic, drive the "
                       "allocator alone) and print figures. Exits 1 if any request failed.")
    d.add_argument("--synthetic", action="store_true",
                   help="drive the allocator alone with synthetic requests (no model; tensor-parallel size 1)")
    d.add_argument("--requests", type=_positive_int, default=32, help="number of requests (default: 32)")
    d.add_argument("--seed", type=int, default=0, help="seed of the request mix and the model weights (default: 0)")
    d.add_argument("--device", default=None, help="cpu (host backend) or cuda[:N]; default: cuda if available")
    d.add_argument("--page-size", type=_positive_int, default=None,
                   help="bytes; default: 64 KiB on the host, the GPU's granularity on CUDA")
    d.add_argument("--layout", choices=["per-layer", "fused"], default="per-layer",
                   help="one K and one V buffer per layer, or one of each for all layers (default: per-layer)")
    d.add_argument("--physical-memory", type=_positive_int, default=None,
                   help="cap on physical KV page memory, bytes (default: no cap)")
    d.add_argument("--max-batch-size", type=_positive_int, default=None,
                   help="cache slots (default: 8 for the model demo, 16 with --synthetic)")
    d.add_argument("--max-context-len", type=_positive_int, default=4096,
                   help="(--synthetic) tokens per slot (default: 4096)")
    _add_tensor_parallel(d)

    g = sub.add_parser("generate", help="generate from a local Hugging Face checkpoint",
                       description="Generate from a local Hugging Face checkpoint; prints one line per prompt.")
    g.add_argument("--model", required=True, help="a local checkpoint directory")
    g.add_argument("--prompt", action="append", default=[], help="text (needs the checkpoint's tokenizer); repeatable")
    g.add_argument("--prompt-ids", action="append", default=[], type=_token_ids,
                   help="comma-separated token ids, e.g. 1,15,27; repeatable")
    g.add_argument("--max-tokens", type=_positive_int, default=32, help="tokens to generate at most (default: 32)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default: 1 = off)")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (default: 0 = off)")
    g.add_argument("--seed", type=int, default=None, help="sampling seed (default: the engine's generator)")
    g.add_argument("--device", default=None, help="cpu or cuda[:N]; default: cuda if available")
    g.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], default=None,
                   help="model and cache dtype (default: float32 on CPU, the checkpoint's half type on CUDA)")
    g.add_argument("--page-size", type=_positive_int, default=None, help="bytes (default: the backend's)")
    g.add_argument("--layout", choices=["per-layer", "fused"], default="per-layer",
                   help="KV cache layout (default: per-layer)")
    _add_tensor_parallel(g)

    sub.add_parser("bench", add_help=False,
                   help="page-size experiments and the paper's comparisons (tables, JSON, plots); "
                   "see vattn bench --help")
    sub.add_parser("serve", add_help=False,
                   help="an OpenAI-compatible server on vattn's engine (--engine transformers: transformers "
                   "serve on vattn memory); see vattn serve --help")
    sub.add_parser("top", add_help=False, help="the members of each shared memory budget, live; see vattn top --help")
    sub.add_parser("budget", add_help=False,
                   help="shared memory budgets: set-limit NAME BYTES [--pid PID]; see vattn budget --help")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from vattn.errors import VattnError

    if argv[:1] == ["serve"]:  # its own parser: vLLM's flags (--engine transformers: transformers serve's)
        from vattn.serve import main as serve_main

        try:
            serve_main(argv[1:])
        except VattnError as e:
            print(f"vattn: error: {e}", file=sys.stderr)
            return 2
        return 0
    if argv[:1] == ["bench"]:  # its own parser: one subcommand per benchmark
        from vattn.bench import main as bench_main

        try:
            return bench_main(argv[1:])
        except VattnError as e:
            print(f"vattn: error: {e}", file=sys.stderr)
            return 2
    if argv[:1] in (["top"], ["budget"]):  # shared budgets (vattn.budget.cli)
        from vattn.budget import cli as budget_cli

        try:
            return (budget_cli.top_main if argv[0] == "top" else budget_cli.budget_main)(argv[1:])
        except VattnError as e:
            print(f"vattn: error: {e}", file=sys.stderr)
            return 2
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.cmd == "demo" and args.synthetic and args.tensor_parallel_size > 1:
        parser.error(f"demo --synthetic drives the allocator alone, with no model to split over ranks: "
                     f"--tensor-parallel-size {args.tensor_parallel_size} needs the model demo (drop --synthetic, "
                     "launch with torchrun)")
    if args.tensor_parallel_size > 1 and "WORLD_SIZE" not in os.environ:
        print(_torchrun_message(args.tensor_parallel_size, argv), file=sys.stderr)
        return 2

    try:
        if args.cmd == "demo":
            return _synthetic_demo(args) if args.synthetic else _engine_demo(args)
        return _generate(args)
    except VattnError as e:
        print(f"vattn: error: {e}", file=sys.stderr)
        return 2


def _add_tensor_parallel(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tensor-parallel-size", type=_positive_int, default=1,
                   help="ranks to split the model's heads over, one process each, launched with torchrun "
                   "(default: 1); see docs/tensor-parallel.md")


def _torchrun_message(n: int, argv: list[str]) -> str:
    command = " ".join(shlex.quote(a) for a in argv)
    return (f"vattn: --tensor-parallel-size {n} runs one process per rank (one GPU each); launch it with torchrun:\n"
            f"  torchrun --nproc-per-node {n} -m vattn {command}\n"
            f"several nodes: torchrun --nnodes NODES --nproc-per-node GPUS_PER_NODE --node-rank I "
            f"--master-addr HOST --master-port PORT -m vattn {command}  (NODES x GPUS_PER_NODE = {n})")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _token_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {text!r}") from None


def _generate(args: argparse.Namespace) -> int:
    from vattn.engine import LLM, SamplingParams
    from vattn.errors import InvalidRequestError

    prompts = list(args.prompt) + list(args.prompt_ids)
    if not prompts:
        raise InvalidRequestError("give at least one --prompt TEXT or --prompt-ids 1,2,3")

    kw = {k: v for k, v in dict(device=args.device, dtype=args.dtype, page_size=args.page_size,
                                layout=args.layout, tensor_parallel_size=args.tensor_parallel_size).items()
          if v is not None}
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.seed)
    with LLM(args.model, **kw) as llm:
        for out in llm.generate(prompts, params):
            print(out.text if out.text is not None else " ".join(map(str, out.token_ids)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
