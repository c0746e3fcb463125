"""`vattn serve`: an OpenAI-compatible server. Two engines:

- `--engine vattn` (the default): vattn's own engine (`vattn.LLM`) behind FastAPI + uvicorn,
  driven by one loop thread (`engine.EngineLoop`); the routes (`app`: generation; `routes`: the
  others and what they share), what a request may hold
  (`protocol`: every field honoured or refused with 400), vLLM's metrics with `vattn:` for
  `vllm:` (`metrics`). Flags spelled as `vllm serve` spells them (`--max-model-len`,
  `--max-num-seqs`, `--served-model-name`, `--api-key`, ...), plus vattn's own.
- `--engine transformers`: `transformers serve`'s continuous batching on vattn's elastic pool
  (`vattn.integrations.hf_serve`, the plug-in path), its flags unchanged.

```
vattn serve --model DIR --port 8000 --memory-limit 268435456        # vattn's engine
vattn serve --engine transformers --model DIR --num-blocks 256 ...   # transformers serve
```
docs/servers.md has the table of what each engine supports.
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import logging
import os
import threading
import time
from typing import Any, Sequence

from vattn.errors import InvalidConfigError

logger = logging.getLogger("vattn.serve")

ENGINES = ("vattn", "transformers")
SERVING_PACKAGES = ("fastapi", "uvicorn", "prometheus_client")
DTYPES = {"auto": None, "half": "float16", "float16": "float16", "bfloat16": "bfloat16", "float": "float32",
          "float32": "float32"}


class Server:
    """A running server (`serve(..., non_blocking=True)`): `url`, `llm`, `stop()`."""

    def __init__(self, uvicorn_server: Any, thread: threading.Thread | None, state: Any, gate: Any, url: str) -> None:
        self.server, self.thread, self.state, self.gate, self.url = uvicorn_server, thread, state, gate, url

    @property
    def llm(self) -> Any:
        return self.state.loop.llm

    def stop(self) -> None:
        """Stop uvicorn, then the engine loop, and close the engine."""
        self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(30)
        self.state.loop.close()


def build_llm(model: str, *, max_model_len: int | None = None, max_num_seqs: int | None = None,
              max_num_batched_tokens: int | None = None, enable_prefix_caching: bool = True, dtype: str = "auto",
              seed: int = 0, tensor_parallel_size: int = 1, page_size: int | None = None,
              memory_limit: int | None = None, budget: Any = None, budget_limit: int | None = None,
              idle_trim_s: float | None = None, offload_bytes: int | None = None, offload_dir: str | None = None,
              offload_dir_bytes: int | None = None, device: str | None = None,
              async_scheduling: bool | None = None, speculative_config: dict | None = None,
              attention: str | None = None) -> Any:
    """The engine `vattn serve` runs, from its flags (vLLM's names mapped to `EngineConfig`'s).
    InvalidConfigError for what cannot be served, with what to change."""
    from vattn.engine import LLM

    if tensor_parallel_size != 1:
        raise InvalidConfigError(
            f"--tensor-parallel-size {tensor_parallel_size}: vattn's engine runs one process per rank under "
            "torchrun, every rank making the same calls, and this server's one event loop drives rank 0 only; "
            "serve with --tensor-parallel-size 1 (or use vattn.LLM under torchrun in your own process)")
    if not os.path.isdir(model) or not os.path.isfile(os.path.join(model, "config.json")):
        raise InvalidConfigError(f"--model must be a local checkpoint directory with a config.json, got {model!r}")
    if dtype not in DTYPES:
        raise InvalidConfigError(f"--dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if isinstance(budget, str):
        from vattn.budget import Budget

        budget = Budget.shared(budget, budget_limit, device=device, label=os.path.basename(os.path.abspath(model)))
    kw: dict[str, Any] = dict(
        max_context_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens,
        enable_prefix_caching=enable_prefix_caching, dtype=DTYPES[dtype], seed=seed, page_size=page_size,
        physical_memory=memory_limit, budget=budget, idle_trim_s=idle_trim_s, offload_bytes=offload_bytes,
        offload_dir=offload_dir, offload_dir_bytes=offload_dir_bytes, device=device,
        async_scheduling=async_scheduling, speculative_config=speculative_config, attention=attention)
    if max_num_seqs is not None:
        kw["max_batch_size"] = max_num_seqs
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local checkpoint: never reach the Hub

    def start() -> Any:
        return LLM(os.path.abspath(model), **{k: v for k, v in kw.items() if v is not None})

    try:
        try:
            llm = start()
        except InvalidConfigError as e:
            alts = getattr(e, "sharing_alternatives", None)
            if alts is None or not enable_prefix_caching:
                raise
            # Prefix caching is on by default, and on a GPU (2 MiB pages, one KV buffer a layer)
            # a small model's block can outgrow the context. The server then starts with the
            # fused layout (one buffer for all layers: shorter blocks), or without prefix
            # caching where no layout fits, and says so (vllm serve starts with its default too).
            # A --page-size given is kept where a layout fits at it.
            change = min(alts, key=lambda a: a["page_size"] != page_size, default={"enable_prefix_caching": False})
            kw.update(change)
            logger.warning("vattn serve: %s; starting with %s", e, ", ".join(f"{k}={v}" for k, v in change.items()))
            llm = start()
    except InvalidConfigError as e:
        raise _in_flag_terms(e, memory_limit) from None
    if llm.tokenizer is None:
        llm.close()
        raise InvalidConfigError(f"{model} has no tokenizer: vattn serve needs one (save it with the checkpoint)")
    return llm


def _in_flag_terms(e: InvalidConfigError, memory_limit: int | None) -> InvalidConfigError:
    """The engine's refusal of a physical_memory too small for one request, said in --memory-limit's terms."""
    import re

    found = re.search(r"^physical_memory=\d+ is less than one page group \((.*) = (\d+) bytes\)", str(e))
    if memory_limit is None or found is None:
        return e
    return InvalidConfigError(
        f"--memory-limit {memory_limit} bytes holds no request: a request needs one page of every KV buffer at least "
        f"({found.group(1)}); the smallest limit that serves one request is {found.group(2)} bytes: raise "
        "--memory-limit to at least that (more serves more at once), or lower --page-size")


def serve(model: str, *, host: str = "127.0.0.1", port: int = 8000, served_model_name: Sequence[str] | None = None,
          api_key: str | None = None, max_body_bytes: int | None = None, shutdown_timeout: float = 30.0,
          log_level: str = "info", non_blocking: bool = False, stream_interval: int = 1, **engine: Any) -> Server:
    """Serve `model` (a local checkpoint directory) on vattn's engine: OpenAI's
    `/v1/completions`, `/v1/chat/completions`, `/v1/models`, plus `/health`, `/version`,
    `/metrics`. `**engine`: `build_llm`'s arguments. Blocks until the server stops (SIGTERM
    drains for `shutdown_timeout` seconds), unless `non_blocking`: then it runs in a thread
    and the returned `Server` stops it. A request body over `max_body_bytes` gets 413."""
    missing = [m for m in SERVING_PACKAGES if importlib.util.find_spec(m) is None]
    if missing:
        raise InvalidConfigError(f"vattn serve needs {', '.join(missing)}: pip install 'vattn[serve]'")
    import uvicorn

    from vattn.integrations.hf_serve.gate import MAX_BODY_BYTES, _Gate, _server_class
    from vattn.serve.app import ServerState, build_app
    from vattn.serve.engine import EngineLoop
    from vattn.serve.metrics import ServeMetrics

    llm = build_llm(model, **engine)
    try:
        names = tuple(served_model_name or (model,))
        cfg = llm.config
        info = {"page_size": str(llm.cache.page_size), "physical_memory": str(cfg.physical_memory),
                "max_num_seqs": str(cfg.max_num_seqs or cfg.max_batch_size),
                "max_model_len": str(llm.max_context_len), "enable_prefix_caching": str(cfg.enable_prefix_caching),
                "cache_dtype": str(llm.runner.dtype).replace("torch.", ""), "device": str(llm.runner.device)}
        metrics = ServeMetrics(names[0], llm.max_context_len, info)
        loop = asyncio.new_event_loop()
        engine_loop = EngineLoop(llm, loop, on_step=metrics.on_step, stream_interval=stream_interval)
        state = ServerState(engine_loop, llm.tokenizer, names, os.path.abspath(model), llm.max_context_len, metrics,
                            api_key, int(time.time()), llm.runner.vocab_size)
        gate = _Gate(build_app(state), shutdown_timeout, max_body_bytes or MAX_BODY_BYTES)
        gate.on_refused = metrics.on_refused
        config = uvicorn.Config(gate, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5,
                                lifespan="off")
        server = _server_class()(config, gate)
        engine_loop.start()
    except BaseException:
        llm.close()
        raise
    url = f"http://{host}:{port}"

    def run() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(server.serve())
        finally:
            loop.close()

    if non_blocking:
        thread = threading.Thread(target=run, name="vattn-serve-http", daemon=True)
        thread.start()
        return Server(server, thread, state, gate, url)
    try:
        logger.warning("vattn serve: %s on %s (vattn engine)", names[0], url)
        run()
    finally:
        engine_loop.close()
    return Server(server, None, state, gate, url)


def _json_object(text: str) -> dict:
    import json

    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _bytes(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive number of bytes, got {text!r}")
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def parser() -> argparse.ArgumentParser:
    """`vattn serve`'s options for the vattn engine (vLLM's spelling where the meaning is the same)."""
    from vattn.attention import KERNELS

    ap = argparse.ArgumentParser(prog="vattn serve", description="An OpenAI-compatible server on vattn's engine "
                                 "(--engine vattn, the default) or on transformers serve (--engine transformers: "
                                 "see vattn serve --engine transformers --help).")
    ap.add_argument("model_tag", nargs="?", default=None, help="the checkpoint directory (vllm serve's positional)")
    ap.add_argument("--engine", choices=ENGINES, default="vattn")
    ap.add_argument("--model", default=None, help="a local checkpoint directory (config, weights, tokenizer)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--served-model-name", nargs="+", default=None,
                    help="the name(s) clients send as `model` (the first is the one reported; default: --model)")
    ap.add_argument("--api-key", default=os.environ.get("VATTN_API_KEY") or os.environ.get("VLLM_API_KEY") or None,
                    help="require 'Authorization: Bearer KEY' (all but /health, /metrics); default $VATTN_API_KEY, "
                         "else $VLLM_API_KEY (vllm serve's variable), else none")
    ap.add_argument("--max-model-len", type=int, default=None, help="tokens of prompt + output a request may have "
                    "(default: the model's max_position_embeddings, at most 4096)")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="sequences in a batch at most (default: 16)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="tokens an iteration computes at most: the prefill chunk (default: 1024)")
    ap.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                    help="map cached prompt blocks instead of computing them (default: on, as in vLLM)")
    ap.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="only 1 (see docs/servers.md)")
    ap.add_argument("--dtype", default="auto", choices=sorted(DTYPES))
    ap.add_argument("--seed", type=int, default=0, help="the engine's sampling seed (requests without `seed`)")
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                    help="schedule step N+1 while step N runs (default: on CUDA)")
    ap.add_argument("--speculative-config", type=_json_object, default=None, metavar="JSON",
                    help='speculative decoding, as vllm serve takes it: \'{"method": "ngram", '
                         '"num_speculative_tokens": 4}\' (see docs/engine.md)')
    ap.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda when there is one)")
    ap.add_argument("--attention", default=None, choices=KERNELS,
                    help="the attention kernel (default: the device's; 'flex' on the host: decodes in one compiled "
                         "FlexAttention call per layer, see docs/engine.md)")
    ap.add_argument("--page-size", type=_bytes, default=None, help="bytes of a vattn page (default: the backend's)")
    ap.add_argument("--memory-limit", type=_bytes, default=None, help="bytes of KV pages at most (default: no limit)")
    ap.add_argument("--budget", default=None, metavar="NAME", help="share KV memory with the other servers of this "
                    "GPU or host in the budget NAME (vattn top shows it)")
    ap.add_argument("--budget-limit", type=_bytes, default=None, help="bytes: the budget's limit if it is created")
    ap.add_argument("--idle-trim-s", type=float, default=None,
                    help="give unused KV pages back after this many idle seconds (default: never)")
    ap.add_argument("--offload-bytes", type=_bytes, default=None,
                    help="host memory for cached blocks evicted from the device (needs prefix caching)")
    ap.add_argument("--offload-dir", default=None, help="a directory for blocks evicted from host memory")
    ap.add_argument("--offload-dir-bytes", type=_bytes, default=None, help="bytes of files in --offload-dir")
    ap.add_argument("--max-body-bytes", type=_bytes, default=None,
                    help="a larger request body is refused with 413 (default: 4 MiB)")
    ap.add_argument("--shutdown-timeout", type=float, default=30.0,
                    help="seconds SIGTERM lets open requests finish (default: 30)")
    ap.add_argument("--stream-interval", type=_positive, default=1,
                    help="a stream's event carries at least this many tokens (its first and last at once), as "
                    "vLLM's: more cuts the server's work per token where that bounds throughput (default: 1, "
                    "an event a step)")
    ap.add_argument("--log-level", "--uvicorn-log-level", default="info")
    return ap


def main(argv: list[str] | None = None) -> None:
    """`vattn serve [--engine vattn|transformers] ...`: InvalidConfigError (exit 2 from the CLI)
    for flags that cannot be served."""
    argv = list(argv or [])
    if _engine_of(argv) == "transformers":
        from vattn.integrations.hf_serve import main as hf_main

        return hf_main([a for a in _without_engine(argv)])
    a = parser().parse_args(argv)
    model = a.model or a.model_tag
    if model is None:
        raise InvalidConfigError("give the checkpoint: vattn serve --model DIR (or vattn serve DIR)")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    serve(model, host=a.host, port=a.port, served_model_name=a.served_model_name, api_key=a.api_key,
          max_body_bytes=a.max_body_bytes, shutdown_timeout=a.shutdown_timeout, log_level=a.log_level,
          max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs,
          max_num_batched_tokens=a.max_num_batched_tokens, enable_prefix_caching=a.enable_prefix_caching,
          dtype=a.dtype, seed=a.seed, tensor_parallel_size=a.tensor_parallel_size, page_size=a.page_size,
          memory_limit=a.memory_limit, budget=a.budget, budget_limit=a.budget_limit, idle_trim_s=a.idle_trim_s,
          offload_bytes=a.offload_bytes, offload_dir=a.offload_dir, offload_dir_bytes=a.offload_dir_bytes,
          device=a.device, async_scheduling=a.async_scheduling, speculative_config=a.speculative_config,
          stream_interval=a.stream_interval, attention=a.attention)


def _engine_of(argv: list[str]) -> str:
    for i, arg in enumerate(argv):
        if arg == "--engine" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--engine="):
            return arg.split("=", 1)[1]
    return "vattn"


def _without_engine(argv: list[str]) -> list[str]:
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--engine":
            skip = True
        elif not arg.startswith("--engine="):
            out.append(arg)
    return out


__all__ = ["Server", "build_llm", "serve", "main", "parser"]
