"""`vattn serve`: `transformers serve` (OpenAI-compatible, continuous batching) on vattn
memory, for a local checkpoint, under a contract no request can break.

transformers builds the app (its routes, tokenization, generation and streaming); vattn
holds it to this contract (the README's "vattn serve" states it):

- **Malformed, 400** (an OpenAI error body naming the field): a body that is not a strict
  JSON object, text that is not Unicode (a lone surrogate: `contract.check_text`), a field of
  the wrong type or range (`contract.read_body`); **413** for a body over `max_body_bytes`,
  sent as soon as its Content-Length is read; a long prompt is tokenized off the event loop
  (`offload`).
- **A client that goes away** (FIN or RST) cancels its request at once, whose blocks and
  result handler are freed: a cut stream (its event stream closed and its requests cancelled
  when the answer ends, however it ends: `routes._closing`), and a client that leaves before
  its answer started (the gate watches it: `gate._Exchange`); a loop whose running requests
  were all cancelled serves the waiting ones (`cancel`).
- **Extensions**: `ignore_eos` and `min_tokens` (vLLM's and SGLang's) honoured (`extensions`).
- **Refused, 400** (an OpenAI error body that says why and what the limit is), alone: an
  empty prompt; a prompt longer than one request can ever hold (`Room`: the cache's
  blocks, or fewer under `--memory-limit`, counted as transformers counts them); a prompt whose
  `max_tokens` would not fit with it (without `max_tokens`, generation stops where the
  room ends: finish_reason "length"); `n` not an int in [1, MAX_N]. A request that fits
  but not now waits in transformers' scheduler.
- **The batching loop restarts** if it dies anyway: the requests it had fail (transformers'
  5xx), a warning says so, and the next request (or `/health`) gets a new loop and cache.
- **`n` choices**: n requests of the batch, merged into one answer (streamed: their chunks
  interleaved, each with its choice index).
- **Every event stream ends with `data: [DONE]`** (transformers' end with their last chunk).
- **SIGTERM (or SIGINT) drains**: new requests get 503 with Retry-After; open ones finish
  within `shutdown_timeout` (30 s); then those still open end (a stream with an error
  event and [DONE], a request not yet answered with 503); the process exits 0. A second
  signal stops at once.
- **`GET /v1/models`** lists the served model (transformers' listing scans the hub cache:
  500 on an offline machine, 5.17-5.23). **`GET /metrics`**: Prometheus text (`metrics`).
- **A memory limit that cannot serve one request** is refused at start, with the smallest
  one that can (`_check_room`).

Hooks, the same on every supported release (5.17-5.24 share this serving code): transformers'
`Serve` is built with its start held back and with our `GenerationState` (restarts; hands
out our `CBGenerateManager`, which checks each request before it is queued); our routes
replace four of its own; `_Gate` (ASGI) wraps the app, and a uvicorn server whose first
signal drains (`_server_class`) runs it.

Here: `serve` and `main` (the server's start, run and stop) and transformers' serving
classes; `contract` (what one request may ask, `Refusal`, `Room`, `admit`), `routes` (the
routes that replace transformers'), `gate` (the body cap, draining, [DONE]), `extensions`
(`ignore_eos`, `min_tokens`), `offload` (long prompts tokenized off the loop), `cancel`
(cancelled requests in transformers' scheduler), `metrics`.
"""
from __future__ import annotations

import asyncio
import functools
import importlib.util
import logging
import math
import os
import threading
import time
from typing import Any

from vattn.budget import Budget
from vattn.errors import InvalidConfigError
from vattn.integrations import hf_cb
from vattn.integrations.hf_cb.probe import CACHE_WAIT_S, PROBE_BYTES, _budget_limit, probe_room  # noqa: F401
from vattn.integrations.hf_serve import cancel, extensions, offload
# The parts, re-exported: `vattn.integrations.hf_serve.X` keeps working for every name below
from vattn.integrations.hf_serve.contract import MAX_N, Refusal, Room, _asked, admit  # noqa: F401
from vattn.integrations.hf_serve.gate import DONE, _Gate, _server_class  # noqa: F401
from vattn.integrations.hf_serve.gate import MAX_BODY_BYTES
from vattn.integrations.hf_serve.metrics import Metrics
from vattn.integrations.hf_serve.routes import _replace_routes

logger = logging.getLogger("vattn.serve")

SERVING_PACKAGES = ("fastapi", "uvicorn", "openai", "pydantic", "typer")
DEFAULT_MAX_BATCH_TOKENS = 8192  # transformers 5.18-5.24's own default (see serve)
SHUTDOWN_TIMEOUT_S = 30.0  # how long SIGTERM lets open requests finish
# vattn serve's page, on every device (the CUDA backend's own; the host backend's default is 64 KiB): each page mapped
# is a call that lets go of the GIL on the batching loop's thread while it schedules a prefill, and the loop then
# waits for the event loop to give it back (up to the 5 ms switch interval); 32x fewer of them closed most of the
# time-to-first-token gap to stock transformers serve (docs/benchmarks.md, "vattn serve against transformers serve")
SERVE_PAGE_SIZE = 2 << 20


# --------------------------------------------------- transformers' classes ----
@functools.cache
def _classes() -> Any:
    """Subclasses of transformers' serving classes (built once transformers is importable)."""
    from transformers.cli.serve import Serve
    from transformers.cli.serving import utils

    class Server(Serve):
        """transformers' `Serve`, whose start is held back until vattn has wrapped its app."""

        vattn_ready = False

        def start_server(self) -> None:
            if self.vattn_ready:
                super().start_server()

    return Server, _state_class(utils, _manager_class(utils)), utils


def _manager_class(utils: Any) -> type:
    """Our subclass of transformers' `CBGenerateManager` (`utils`: transformers.cli.serving.utils)."""

    class Manager(utils.CBGenerateManager):
        """transformers' continuous-batching manager of the server: every request is checked
        (`admit`) before it is queued, with its extensions (`ignore_eos`, `min_tokens`); a
        new loop gets the `min_tokens` logits processor and its cache is waited for, so that
        even the first request is checked, and its scheduler lets cancelled requests (cut
        streams) lift its hold on new ones (`cancel`); `stop` is a hard stop (nothing may keep
        the process up)."""

        def init_cb(self, model: Any, gen_config: Any) -> None:
            if self._cb is not None:
                return
            cb = model.init_continuous_batching(generation_config=gen_config, continuous_batching_config=self._cb_config)
            extensions.install_min_tokens(cb, model.generation_config)  # before the loop sizes its tensors
            queue = cb.add_request
            cb.add_request = functools.partial(_queue_with_extensions, queue)
            self._cb = cb
            cb.start()
            deadline = time.monotonic() + CACHE_WAIT_S
            while cb.batch_processor is None and cb.is_running() and time.monotonic() < deadline:
                time.sleep(0.002)  # the loop's thread builds the cache (virtual memory: quick)
            if cb.batch_processor is not None:  # before any request is queued: this call holds the event loop
                cancel.install(cb.batch_processor)

        def room(self) -> Room | None:
            cache = getattr(getattr(self._cb, "batch_processor", None), "cache", None)
            return Room.of(cache) if cache is not None else None

        def generate_streaming(self, model: Any, processor: Any, inputs: Any, gen_config: Any, *args: Any,
                               **kwargs: Any) -> Any:
            asked = _asked.get()
            admit(len(inputs["input_ids"]), gen_config, self.room(), asked)
            gen_config = extensions.request_config(gen_config, asked)
            queue, streamer = super().generate_streaming(model, processor, inputs, gen_config, *args, **kwargs)
            cancel.note_stream(streamer)  # the answer cancels it if it ends first (routes._closing)
            return queue, streamer

        async def generate_non_streaming(self, model: Any, processor: Any, inputs: Any, gen_config: Any, *args: Any,
                                         **kwargs: Any) -> Any:
            asked = _asked.get()
            admit(len(inputs["input_ids"]), gen_config, self.room(), asked)
            gen_config = extensions.request_config(gen_config, asked)
            try:
                return await super().generate_non_streaming(model, processor, inputs, gen_config, *args, **kwargs)
            except asyncio.CancelledError:  # its client went away (the gate cancels the answer): drop the request
                request_id = kwargs.get("request_id", args[0] if args else None)
                if request_id is not None and self._cb is not None:
                    self._cb.cancel_request(request_id)
                raise

        def stop(self) -> None:
            if self._cb is not None:
                self._cb.stop(block=True, timeout=5, hard_stop=True)

    return Manager


def _state_class(utils: Any, Manager: type) -> type:
    """Our subclass of transformers' `GenerationState`, handing out `Manager`s."""

    class State(utils.GenerationState):
        """transformers' generation state of the server: hands out `Manager`s, and replaces
        one whose loop died (a warning says so) instead of answering 503 for good."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.num_restarts = 0
            self._vattn_lock = threading.Lock()

        def get_manager(self, model_id: str, use_cb: bool = False) -> Any:
            if use_cb:
                with self._vattn_lock:
                    self._replace_dead()
                    if self._cb_manager is None:  # ours, which transformers' get_manager then hands out
                        self._cb_manager, self._cb_model_id = Manager(cb_config=self._cb_config), model_id
            return super().get_manager(model_id, use_cb=use_cb)

        def is_cb_alive(self) -> bool:
            with self._vattn_lock:
                self._replace_dead()
            return super().is_cb_alive()

        def _replace_dead(self) -> None:
            manager = self._cb_manager
            if manager is None or manager.is_alive():
                return
            self.num_restarts += 1
            logger.warning("vattn serve: the continuous-batching loop died (%s); restarting it: the next request gets "
                           "a new loop and cache (restart %d)", manager._cb.background_thread_status.fatal_error,
                           self.num_restarts)
            try:
                manager.stop()
            except Exception:  # noqa: BLE001 - a dead loop that will not stop cleanly is still replaced
                logger.warning("vattn serve: stopping the dead loop failed", exc_info=True)
            self._cb_manager = None

    return State


def _queue_with_extensions(queue: Any, *args: Any, **kwargs: Any) -> Any:
    """transformers' `add_request` with the request's `min_tokens` (its logits processor's
    argument), read from the request being handled."""
    return queue(*args, **kwargs, **extensions.queue_kwargs(_asked.get()))


def _build(model: str, shutdown_timeout: float, max_body_bytes: int, **kw: Any) -> Any:
    """transformers' `Serve` with our generation state, routes, metrics, gate and uvicorn server."""
    import uvicorn

    Server, State, utils = _classes()
    with hf_cb._lock:  # one build at a time: transformers' Serve looks GenerationState up in its module
        saved, utils.GenerationState = utils.GenerationState, State
        try:
            srv = Server(force_model=model, continuous_batching=True, non_blocking=True, **kw)
        finally:
            utils.GenerationState = saved
    app = srv.server.config.app
    srv.metrics = Metrics(srv)
    _replace_routes(app, srv)
    manager = srv._model_manager
    offload.install(manager.load_model_and_processor(manager.process_model_name(manager.force_model))[1])
    srv.gate = _Gate(app, shutdown_timeout, max_body_bytes)
    srv.gate.on_refused = srv.metrics.refused
    config = uvicorn.Config(srv.gate, host=kw["host"], port=kw["port"], log_level="info", timeout_graceful_shutdown=5)
    srv.server = _server_class()(config, srv.gate)
    srv.vattn_ready = True
    return srv



def _check_room(srv: Any, handle: Any, memory_limit: int | None, budget: Budget | None) -> None:
    """Refuse (InvalidConfigError) a memory limit, or a budget's limit, that leaves no room for
    one request beyond the trash blocks, with the smallest limit that serves one (a prompt
    token and a new one): `probe_room` on the server's model and batching config."""
    if memory_limit is None and (budget is None or _budget_limit(budget) is None):
        return
    mm = srv._model_manager
    model, _ = mm.load_model_and_processor(mm.process_model_name(mm.force_model))
    probe_room(model, srv._generation_state._cb_config, handle, memory_limit, budget,
               ("--memory-limit", "--budget-limit"))


# ------------------------------------------------------------------- serve ----
def serve(model: str, *, host: str = "127.0.0.1", port: int = 8000, memory_limit: int | None = None,
          page_size: int | None = None, idle_trim_s: float | None = None, device: str = "auto",
          num_blocks: int | None = None, block_size: int | None = None, max_batch_tokens: int | None = None,
          log_level: str = "warning", shutdown_timeout: float = SHUTDOWN_TIMEOUT_S, non_blocking: bool = False,
          budget: Budget | str | None = None, budget_limit: int | None = None,
          max_body_bytes: int = MAX_BODY_BYTES) -> Any:
    """`transformers serve` with continuous batching on vattn memory, for a local checkpoint
    (offline), under the contract of the module docstring: the OpenAI-compatible
    `/v1/chat/completions`, `/v1/completions`, `/v1/models`, `/health`. Blocks until the
    server stops (SIGTERM drains for `shutdown_timeout` seconds), unless `non_blocking`:
    then it returns transformers' `Serve` object, with the `ElasticCB` handle as `.vattn`
    and the gate as `.gate` (`kill_server()` stops it). The memory limit is in bytes of KV
    pages; `idle_trim_s` is the idle policy (see `hf_cb.enable`); `num_blocks` and
    `block_size` (tokens) size transformers' (virtual) cache; `page_size` defaults to
    `SERVE_PAGE_SIZE` (2 MiB) on every device. Requests that fit but not
    now wait in transformers' scheduler. `budget`: a `vattn.Budget`, or the name of a budget
    shared with the other servers of this GPU or host (`vattn.Budget.shared(budget,
    budget_limit)`; `vattn top` shows them). A request body larger than `max_body_bytes` is
    refused with 413. A memory limit (or a budget's limit) that cannot serve one request is
    refused here, with the smallest one that can (InvalidConfigError)."""
    _check_serve_args(model, shutdown_timeout, max_body_bytes)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local checkpoint: never reach the Hub
    if max_batch_tokens is None and num_blocks is not None and hf_cb.design() == "blocks":
        # transformers 5.17, given num_blocks alone, sizes max_batch_tokens (its attention mask and IO
        # buffers, M x (num_blocks * block_size + M)) to fill the device's free memory: 21 GB of a 23 GB
        # host in tests/integrations/test_serve.py, memory vattn's cache is there to leave free. 5.18-5.24 take
        # 8192 when it is not given: so does 5.17 here.
        max_batch_tokens = DEFAULT_MAX_BATCH_TOKENS
    if isinstance(budget, str):  # one budget for the servers of this GPU (or host), named
        budget = Budget.shared(budget, budget_limit, device=None if device == "auto" else device,
                               label=os.path.basename(os.path.abspath(model)))
    page_size = SERVE_PAGE_SIZE if page_size is None else page_size
    handle = hf_cb.enable_all(memory_limit=memory_limit, budget=budget, page_size=page_size, idle_trim_s=idle_trim_s)
    server = None
    try:
        server = _build(os.path.abspath(model), shutdown_timeout, max_body_bytes, host=host, port=port, device=device,
                        cb_num_blocks=num_blocks, cb_block_size=block_size, cb_max_batch_tokens=max_batch_tokens,
                        log_level=log_level)
        server.vattn = handle
        _check_room(server, handle, memory_limit, budget)
    except BaseException:
        if server is not None:  # the model is loaded (with its unload timer): nothing may keep the process up
            server._generation_state.shutdown()
            server._model_manager.shutdown()
        hf_cb.disable_all()
        raise
    if non_blocking:
        server.start_server()
        return server
    try:
        server.server.run()
    finally:
        server._generation_state.shutdown()  # a hard stop of the batching loop: nothing keeps the process up
        hf_cb.disable_all()
    return server


def _check_serve_args(model: str, shutdown_timeout: float, max_body_bytes: int) -> None:
    """Refuse (InvalidConfigError) what `serve` cannot run: transformers' serving packages or
    prometheus_client missing, `model` not a local checkpoint, a bad timeout or body bound."""
    missing = [m for m in SERVING_PACKAGES if importlib.util.find_spec(m) is None]
    if missing:
        raise InvalidConfigError(f"vattn serve runs `transformers serve`, which needs {', '.join(missing)}: "
                                 "pip install 'transformers[serving]'")
    if importlib.util.find_spec("prometheus_client") is None:  # not in transformers[serving]: /metrics needs it
        raise InvalidConfigError("vattn serve's /metrics needs prometheus_client: pip install prometheus_client "
                                 "(vattn's serve extra has it)")
    if not os.path.isdir(model) or not os.path.isfile(os.path.join(model, "config.json")):
        raise InvalidConfigError(f"--model must be a local checkpoint directory with a config.json, got {model!r}")
    if isinstance(shutdown_timeout, bool) or not isinstance(shutdown_timeout, (int, float)) \
            or not 0 <= shutdown_timeout < math.inf:
        raise InvalidConfigError(f"shutdown_timeout must be a finite number of seconds >= 0, got {shutdown_timeout!r}")
    if isinstance(max_body_bytes, bool) or not isinstance(max_body_bytes, int) or max_body_bytes < 1:
        raise InvalidConfigError(f"max_body_bytes must be an int >= 1 (bytes of a request body), got {max_body_bytes!r}")


def main(argv: list[str] | None = None) -> None:
    """`vattn serve --model DIR [--port N] [--memory-limit BYTES] [--shutdown-timeout S] ...`."""
    import argparse

    ap = argparse.ArgumentParser(prog="vattn serve", description=serve.__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="local checkpoint directory (config, weights, tokenizer)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--memory-limit", type=int, default=None, help="bytes of KV pages (default: no limit)")
    ap.add_argument("--page-size", type=int, default=None,
                    help=f"vattn page bytes (default: {SERVE_PAGE_SIZE}, on every device)")
    ap.add_argument("--idle-trim-s", type=float, default=None,
                    help="give the KV memory back after this many idle seconds (default, or negative: never by itself)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--num-blocks", type=int, default=None, help="transformers' cache size in blocks (virtual)")
    ap.add_argument("--block-size", type=int, default=None, help="tokens per cache block")
    ap.add_argument("--max-batch-tokens", type=int, default=None)
    ap.add_argument("--shutdown-timeout", type=float, default=SHUTDOWN_TIMEOUT_S,
                    help="seconds SIGTERM lets open requests finish before it ends them (default: 30)")
    ap.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES,
                    help=f"a larger request body is refused with 413 (default: {MAX_BODY_BYTES})")
    ap.add_argument("--log-level", default="warning")
    ap.add_argument("--budget", default=None, metavar="NAME",
                    help="share KV memory with the other servers of this GPU or host in the budget NAME "
                    "(vattn top shows it)")
    ap.add_argument("--budget-limit", type=int, default=None,
                    help="bytes: the budget's limit when this server creates it (default: none)")
    a = ap.parse_args(argv)
    serve(a.model, host=a.host, port=a.port, memory_limit=a.memory_limit, page_size=a.page_size,
          idle_trim_s=a.idle_trim_s, device=a.device, num_blocks=a.num_blocks, block_size=a.block_size,
          max_batch_tokens=a.max_batch_tokens, log_level=a.log_level, shutdown_timeout=a.shutdown_timeout,
          budget=a.budget, budget_limit=a.budget_limit, max_body_bytes=a.max_body_bytes)


__all__ = ["MAX_N", "SHUTDOWN_TIMEOUT_S", "Refusal", "Room", "admit", "serve", "main"]
