"""`vattn serve` end to end: transformers serve (continuous batching) on vattn memory, over
real HTTP on 127.0.0.1, with the OpenAI client.

The checkpoint is built here (a tiny seeded Llama, a character-level tokenizer with a chat
template; no hub). Answers must equal plain `generate` (greedy) on the same checkpoint.
Memory: vattn's mapped bytes rise under a burst of concurrent requests and fall back to
the trash blocks when the idle policy trims (it evicts the prefix-sharing blocks transformers
keeps inside the paused loop: see `at_idle_floor`); a server whose memory limit is below what
the burst needs at once answers every request too (they wait in transformers' scheduler),
and keeps answering afterwards. `python -m vattn serve` itself starts as a process and
answers.

The contract (docs/servers.md, "`vattn serve`: what a client can count on"), each case
followed by a normal request that must get its answer: requests that can never fit (empty,
longer than the cache, larger than the memory limit, max_tokens past the room) are refused
alone with a 400 that says why and what the limit is, and the batching loop never dies of
them; a loop that dies anyway is restarted; `n` gives n choices; every stream ends with
`data: [DONE]`; `/v1/models` lists the served model; SIGTERM drains (503 with Retry-After
for new requests, open ones finish, or end with an error event and [DONE] past
--shutdown-timeout; exit 0).
Needs `transformers[serving]` (the `test` extra has it).
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import http.client
import importlib.util
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

import vattn  # noqa: E402
from tests.conftest import REPO, FakeClock, hf_cb_problem  # noqa: E402
from vattn.bench._models import char_checkpoint  # noqa: E402  (a tiny Llama, a character tokenizer)
from vattn.integrations import hf_cb, hf_serve  # noqa: E402

SKIP = hf_cb_problem()
if not SKIP and (missing := [m for m in (*hf_serve.SERVING_PACKAGES, "prometheus_client")
                             if importlib.util.find_spec(m) is None]):
    SKIP = f"vattn serve needs {missing}: pip install 'transformers[serving]' prometheus_client (in the test extra)"
pytestmark = pytest.mark.skipif(bool(SKIP), reason=SKIP)

PAGE = 4096
BLOCK = 16  # tokens a block: 2 layers x 2 KV heads x 16 x fp32 x K and V = 8 KiB, one block a sector
SECTOR = 2 * 2 * 16 * 4 * BLOCK * 2
TRASH = hf_cb.TRASH_SECTORS * SECTOR
MAX_TOKENS = 12
PROMPTS = ["hello world", "the quick brown fox jumps over", "vattn maps pages on demand", "a b c d e f g",
           "0123456789 is a number", "Once upon a time, there was", "memory comes and goes", "!?"]
CHATS = [[{"role": "user", "content": c}] for c in ("hi", "what is paging?", "tell me a story", "2 + 2 = ?")]
READY_S = 120  # the server must answer /health within this
MAX_CHOICES = hf_serve.MAX_N


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    return char_checkpoint(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def expected(ckpt) -> dict:
    """Plain greedy `generate` on the checkpoint: prompt text or chat -> answer text."""
    tok = AutoTokenizer.from_pretrained(ckpt)
    model = AutoModelForCausalLM.from_pretrained(ckpt).eval()

    def answer(ids: list[int]) -> str:
        x = torch.tensor([ids])
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_TOKENS, do_sample=False)
        return tok.decode(out[0, x.shape[1]:], skip_special_tokens=True)

    ref = {p: answer(tok(p).input_ids) for p in PROMPTS}
    for chat in CHATS:
        ref[chat[0]["content"]] = answer(tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                                                 return_dict=True)["input_ids"])
    return ref


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_ready(base: str, alive=lambda: True) -> None:
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline:
        if not alive():
            raise AssertionError("the server exited before it was ready")
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"the server at {base} was not ready within {READY_S} s")


@pytest.fixture
def server(ckpt):
    """start(**serve kwargs) -> (Serve object, OpenAI client); every server is killed at teardown."""
    import openai

    started = []

    def start(**kw):
        port = free_port()
        srv = hf_serve.serve(ckpt, port=port, device="cpu", num_blocks=64, block_size=BLOCK, page_size=PAGE,
                          non_blocking=True, **kw)
        started.append(srv)
        base = f"http://127.0.0.1:{port}"
        wait_ready(base)
        return srv, openai.OpenAI(base_url=base + "/v1", api_key="unused", timeout=120, max_retries=0)

    yield start
    for srv in started:
        srv.kill_server()
    hf_cb.disable_all()


def burst(client, ckpt: str) -> dict:
    """Every prompt and chat at once, from 12 threads: request text -> answer text."""
    def complete(p):
        r = client.completions.create(model=ckpt, prompt=p, max_tokens=MAX_TOKENS, temperature=0)
        return p, r.choices[0].text

    def chat(messages):
        r = client.chat.completions.create(model=ckpt, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
        assert r.choices[0].message.role == "assistant"
        return messages[0]["content"], r.choices[0].message.content

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS) + len(CHATS)) as ex:
        futures = [ex.submit(complete, p) for p in PROMPTS] + [ex.submit(chat, c) for c in CHATS]
        return dict(f.result(timeout=300) for f in futures)


class Sampler:
    """Samples the handle's mapped bytes every 5 ms on a thread."""

    def __init__(self, handle) -> None:
        self.handle, self.values, self._stop = handle, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            s = self.handle.stats()
            self.values.append(s.mapped_bytes if s is not None else 0)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def wait_for(predicate, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def at_idle_floor(cb) -> bool:
    """Whether mapped memory is down to what a trim leaves with no request in flight: the
    trash blocks alone (the trim evicts transformers' prefix-sharing blocks inside the paused
    loop: 5.18+'s `pause()`, vattn's `LoopPause` on 5.17; 5.17's two trash blocks share a page
    of 4 KiB, 2 KiB of each layer's K or V, as 5.18+'s two 8 KiB sectors fill 4)."""
    s = cb.stats()
    return s.mapped_bytes == TRASH and s.num_used_blocks == hf_cb.TRASH_SECTORS


def test_concurrent_requests_answer_like_generate_and_memory_follows_the_load(server, ckpt, expected):
    srv, client = server(idle_trim_s=30)
    cb = srv.vattn
    clock = cb.idle.clock = FakeClock()  # the idle policy's time moves when the test says
    with Sampler(cb) as sampler:
        answers = burst(client, ckpt)
    assert answers == expected
    assert cb.num_caches == 1 and len(cb.managers) == 1
    # rose under load: the burst's blocks, well above the trash sectors
    assert max(sampler.values) >= TRASH + 8 * SECTOR and cb.stats().peak_mapped_bytes >= max(sampler.values)
    # fell back once idle: the idle policy evicted the prefix-sharing blocks and unmapped every free page
    clock.advance(30)
    assert cb.idle.poll(), "the idle trim was not due"  # what the policy's thread does at the deadline
    assert cb.num_idle_trims == 1 and at_idle_floor(cb), cb.stats()
    assert cb.stats().mapped_bytes < max(sampler.values)  # all but the trash went back
    # and it serves again, on the same cache
    assert burst(client, ckpt) == expected
    assert cb.num_caches == 1 and cb.stats().peak_mapped_bytes > TRASH


def test_a_memory_limit_below_the_load_queues_requests(server, ckpt, expected):
    # room for the trash and 6 blocks: the longest request (about 60 tokens) fits alone, the burst does not
    limit = TRASH + 6 * SECTOR
    srv, client = server(memory_limit=limit)
    cb = srv.vattn
    with Sampler(cb) as sampler:
        answers = burst(client, ckpt)
    assert answers == expected
    assert max(sampler.values) <= limit and cb.stats().peak_mapped_bytes <= limit
    assert cb.stats().limit == limit
    assert cb.trim() >= 0 and at_idle_floor(cb), cb.stats()  # trim() without a manager evicts too
    r = client.completions.create(model=ckpt, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].text == expected[PROMPTS[0]]  # still healthy


@pytest.mark.gpu
def test_vattn_serve_on_cuda_answers_like_generate_and_memory_follows_the_load(ckpt):
    """`vattn serve --device cuda`: transformers' continuous batching on an elastic pool of CUDA
    VMM pages (2 MiB); a burst's answers equal generate's on the GPU (float32; a near-tie may
    flip one), its pages map under the load and the idle policy gives the free ones back."""
    import openai

    tok = AutoTokenizer.from_pretrained(ckpt)
    model = AutoModelForCausalLM.from_pretrained(ckpt).to("cuda").eval()
    expected = {}
    for p in PROMPTS:
        x = torch.tensor([tok(p).input_ids], device="cuda")
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_TOKENS, do_sample=False)
        expected[p] = tok.decode(out[0, x.shape[1]:], skip_special_tokens=True)
    del model
    port = free_port()
    srv = hf_serve.serve(ckpt, port=port, device="cuda", num_blocks=4096, block_size=BLOCK, non_blocking=True,
                         idle_trim_s=30)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_ready(base)
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", timeout=120, max_retries=0)
        cb = srv.vattn
        clock = cb.idle.clock = FakeClock()
        with Sampler(cb) as sampler, concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as ex:
            answers = dict(ex.map(lambda p: (p, client.completions.create(
                model=ckpt, prompt=p, max_tokens=MAX_TOKENS, temperature=0).choices[0].text), PROMPTS))
        assert sum(answers[p] == expected[p] for p in PROMPTS) >= len(PROMPTS) - 1, (answers, expected)
        pool = cb.pool
        assert pool is not None and pool.backend.device.type == "cuda" and pool.page_size >= 2 << 20
        peak = max(sampler.values)
        assert peak >= pool.page_size and cb.stats().peak_mapped_bytes >= peak
        clock.advance(30)
        assert cb.idle.poll() and cb.num_idle_trims == 1
        assert cb.stats().mapped_bytes <= peak and cb.stats().num_spare_pages == 0
        r = client.completions.create(model=ckpt, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0)
        assert r.choices[0].text == answers[PROMPTS[0]]  # and serves again
    finally:
        srv.kill_server()
        hf_cb.disable_all()


@contextlib.contextmanager
def serve_process(ckpt: str, *args: str):
    """`python -m vattn serve` as a process of its own (what users run): yields (process, base
    URL, log file); killed at the end if it still runs."""
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(REPO), os.environ.get("PYTHONPATH", "")]))
    with open(os.devnull, "rb") as stdin, \
            tempfile.TemporaryFile("w+") as log:  # a file: a full pipe would block the server
        proc = subprocess.Popen([sys.executable, "-m", "vattn", "serve", "--engine", "transformers", "--model", ckpt,
                                 "--port", str(port), "--device", "cpu", "--num-blocks", "64", "--block-size", str(BLOCK),
                                 "--page-size", str(PAGE), *args], env=env, stdin=stdin, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            base = f"http://127.0.0.1:{port}"
            wait_ready(base, alive=lambda: proc.poll() is None)
            yield proc, base, log
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=20)


def log_text(log) -> str:
    log.flush()
    log.seek(0)
    return log.read()


def test_vattn_serve_command_answers(ckpt, expected):
    import openai

    with serve_process(ckpt, "--memory-limit", str(1 << 20), "--idle-trim-s", "1") as (proc, base, log):
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", timeout=120, max_retries=0)
        r = client.completions.create(model=ckpt, prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0)
        assert r.choices[0].text == expected[PROMPTS[1]]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log_text(log)[-3000:]


# ------------------------------------------------------------------ the contract ----
def send(base: str, path: str, body: dict | None = None, timeout: float = 120) -> http.client.HTTPConnection:
    """Send one request over plain HTTP (GET without a body); `receive` reads its answer."""
    url = urllib.parse.urlsplit(base)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout)
    if body is None:
        conn.request("GET", path)
    else:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    return conn


def receive(conn: http.client.HTTPConnection) -> tuple[int, dict, dict | str]:
    """The answer to `send`: (status, headers, JSON body or text)."""
    try:
        r = conn.getresponse()
        text = r.read().decode()
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            data = text
        return r.status, {k.lower(): v for k, v in r.getheaders()}, data
    finally:
        conn.close()


def call(base: str, path: str, body: dict | None = None) -> tuple[int, dict, dict | str]:
    """One request over plain HTTP: (status, headers, JSON body or text)."""
    return receive(send(base, path, body))


def events(base: str, path: str, body: dict, on_first=None, timeout: float = 120) -> list[str]:
    """The `data:` payloads of a streamed answer, in order ([DONE] included); `on_first` runs
    after the first one arrived (while the stream is open)."""
    url = urllib.parse.urlsplit(base)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout)
    try:
        conn.request("POST", path, json.dumps(dict(body, stream=True)), {"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200, r.read()
        out = []
        for line in r:
            line = line.decode().rstrip("\r\n")
            if line.startswith("data: "):
                out.append(line[6:])
                if len(out) == 1 and on_first is not None:
                    on_first()
        return out
    finally:
        conn.close()


def streamed_text(payloads: list[str]) -> dict[int, str]:
    """choice index -> the text of a streamed completion or chat ([DONE] left out)."""
    texts: dict[int, str] = {}
    for p in payloads:
        if p == "[DONE]":
            continue
        for c in json.loads(p)["choices"]:
            part = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
            texts[c["index"]] = texts.get(c["index"], "") + (part or "")
    return texts


def answered(client, ckpt: str, expected: dict, prompt: str = PROMPTS[0]) -> None:
    """A normal request, which must get its answer."""
    r = client.completions.create(model=ckpt, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].text == expected[prompt]


def longest_prompt(tokens: int) -> int:
    """The longest prompt a room of `tokens` (whole blocks) holds with one new token: all of
    it on 5.18+; 5.17's scheduler takes (p + 1) // block_size + 1 blocks for a prompt of p."""
    return tokens if hf_cb.design() == "sectors" else tokens - 2


def refused(client, ckpt: str, says: str, **request) -> re.Match:
    """The request is refused with a 400 whose message matches `says`; returns the match."""
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=ckpt, temperature=0, **request)
    body = e.value.body
    assert body["code"] in ("context_length_exceeded", "empty_prompt"), body
    match = re.search(says, body["message"])
    assert match, body["message"]
    return match


def check_room(client, ckpt: str, expected: dict, bound: str, tokens: int) -> None:
    """The room of one request, `tokens` in whole blocks: the longest prompt that fits is
    answered and one token more refused, saying why and the limit; so for max_tokens; and
    without max_tokens generation stops where the room ends. Each case is followed by a
    normal request that must get its answer."""
    longest = longest_prompt(tokens)
    m = refused(client, ckpt, rf"the prompt is {longest + 1} tokens, and {bound} holds at most (\d+) prompt tokens "
                r"of one request: shorten the prompt \(or raise --", prompt="a" * (longest + 1), max_tokens=1)
    assert int(m.group(1)) == longest
    answered(client, ckpt, expected)
    r = client.completions.create(model=ckpt, prompt="a" * longest, max_tokens=1, temperature=0)
    assert r.usage.prompt_tokens == longest and r.usage.completion_tokens == 1  # the room, full
    answered(client, ckpt, expected)
    p = longest - 6
    most = tokens - p + 1  # the prompt and most - 1 generated tokens fill the room (the last one is not stored)
    m = refused(client, ckpt, rf"the prompt is {p} tokens and max_tokens is {most + 1}, and {bound} leaves room for at "
                r"most max_tokens=(\d+) after this prompt", prompt="a" * p, max_tokens=most + 1)
    assert int(m.group(1)) == most
    answered(client, ckpt, expected)
    for request in (dict(max_tokens=most), {}):  # without max_tokens: stopped where the room ends
        r = client.completions.create(model=ckpt, prompt="a" * p, temperature=0, **request)
        assert r.usage.completion_tokens == most and r.choices[0].finish_reason == "length"
        answered(client, ckpt, expected)


LIMITED_TOKENS = 6 * BLOCK  # what a memory limit of the trash and 6 sectors backs for one request


def test_requests_that_can_never_fit_are_refused_alone(server, ckpt, expected):
    """transformers' loop raised "No requests can be scheduled" for a 300-token prompt under
    a 64 KiB limit (and crashed on an empty one): every later request got 503 for good."""
    import openai

    srv, client = server(memory_limit=TRASH + 6 * SECTOR)
    limit = r"the memory limit \(65536 bytes of KV pages\)"
    refused(client, ckpt, rf"the prompt is 300 tokens, and {limit} holds at most {longest_prompt(LIMITED_TOKENS)} "
            r"prompt tokens of one request: shorten the prompt \(or raise --memory-limit\)", prompt="a" * 300,
            max_tokens=5)
    answered(client, ckpt, expected)
    refused(client, ckpt, "the prompt is empty", prompt="", max_tokens=5)
    answered(client, ckpt, expected)
    refused(client, ckpt, "the prompt is 300 tokens", prompt="a" * 300, max_tokens=5, stream=True)
    answered(client, ckpt, expected)
    refused(client, ckpt, "the prompt is 1100 tokens", prompt="a" * 1100)
    answered(client, ckpt, expected)
    with pytest.raises(openai.BadRequestError, match=rf"the prompt is \d+ tokens, and {limit}") as e:
        client.chat.completions.create(model=ckpt, messages=[{"role": "user", "content": "b" * 200}], max_tokens=5,
                                       temperature=0)
    assert e.value.body["param"] == "messages"
    r = client.chat.completions.create(model=ckpt, messages=CHATS[0], max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].message.content == expected[CHATS[0][0]["content"]]
    check_room(client, ckpt, expected, limit, LIMITED_TOKENS)
    assert call(str(client.base_url).removesuffix("/v1/"), "/health")[0] == 200
    assert srv._generation_state.num_restarts == 0  # the loop never died
    assert srv.vattn.stats().peak_mapped_bytes <= TRASH + 6 * SECTOR


def test_a_request_longer_than_the_cache_is_refused_and_the_cache_filled_to_the_last_token(server, ckpt, expected):
    srv, client = server()
    check_room(client, ckpt, expected, "the KV cache", 64 * BLOCK)  # --num-blocks 64 x --block-size 16
    assert srv._generation_state.num_restarts == 0


def test_a_batching_loop_that_dies_anyway_is_restarted(server, ckpt, expected, monkeypatch, caplog):
    from transformers.generation.continuous_batching import continuous_api

    srv, client = server()
    answered(client, ckpt, expected)
    state = srv._generation_state
    dead = state._cb_manager
    real, broken = continuous_api.ContinuousBatchProcessor.prepare_next_batch, threading.Event()

    def prepare_next_batch(self):
        if broken.is_set():
            broken.clear()
            raise RuntimeError("a bug in the batching loop")
        return real(self)

    monkeypatch.setattr(continuous_api.ContinuousBatchProcessor, "prepare_next_batch", prepare_next_batch)
    with caplog.at_level(logging.WARNING, logger="vattn.serve"):
        broken.set()
        assert wait_for(lambda: not dead.is_alive())
        base = str(client.base_url).removesuffix("/v1/")
        assert call(base, "/health")[0] == 200  # not "cb_worker_dead": replaced
        answered(client, ckpt, expected, PROMPTS[2])
    assert "the continuous-batching loop died (a bug in the batching loop); restarting it" in caplog.text
    assert state.num_restarts == 1 and state._cb_manager is not dead and state._cb_manager.is_alive()
    assert srv.vattn.num_caches == 2  # a new cache, on vattn memory too


def test_n_gives_n_choices(server, ckpt, expected):
    import openai

    srv, client = server()
    base = str(client.base_url).removesuffix("/v1/")
    r = client.completions.create(model=ckpt, prompt=PROMPTS[3], max_tokens=MAX_TOKENS, temperature=0, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [expected[PROMPTS[3]]] * 3  # greedy: the same answer thrice
    assert r.usage.completion_tokens == 3 * MAX_TOKENS
    chat = CHATS[1]
    r = client.chat.completions.create(model=ckpt, messages=chat, max_tokens=MAX_TOKENS, temperature=0, n=2)
    assert [c.message.content for c in r.choices] == [expected[chat[0]["content"]]] * 2
    payloads = events(base, "/v1/chat/completions", dict(model=ckpt, messages=chat, max_tokens=MAX_TOKENS,
                                                         temperature=0, n=2))
    assert payloads[-1] == "[DONE]" and payloads.count("[DONE]") == 1
    assert streamed_text(payloads) == {0: expected[chat[0]["content"]], 1: expected[chat[0]["content"]]}
    for bad in (0, MAX_CHOICES + 1, "2", 1.5, True):
        with pytest.raises(openai.BadRequestError, match=rf"n must be an int in \[1, {MAX_CHOICES}\]"):
            client.completions.create(model=ckpt, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, n=bad)
        answered(client, ckpt, expected)


def test_streams_end_with_done_and_models_lists_the_served_model(server, ckpt, expected):
    srv, client = server()
    base = str(client.base_url).removesuffix("/v1/")
    payloads = events(base, "/v1/completions", dict(model=ckpt, prompt=PROMPTS[4], max_tokens=MAX_TOKENS,
                                                    temperature=0))
    assert payloads[-1] == "[DONE]" and streamed_text(payloads) == {0: expected[PROMPTS[4]]}
    chat = CHATS[2]
    payloads = events(base, "/v1/chat/completions", dict(model=ckpt, messages=chat, max_tokens=MAX_TOKENS,
                                                         temperature=0))
    assert payloads[-1] == "[DONE]" and streamed_text(payloads) == {0: expected[chat[0]["content"]]}
    stream = client.chat.completions.create(model=ckpt, messages=chat, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected[chat[0]["content"]]
    # transformers 5.17-5.23 list the hub cache: 500 on an offline machine
    assert [m.id for m in client.models.list()] == [ckpt]
    status, _, body = call(base, "/v1/models")
    assert status == 200 and body["data"][0]["id"] == ckpt and body["data"][0]["object"] == "model"
    answered(client, ckpt, expected)


LONG = "Once upon a time, there was"  # greedy: 900 tokens with no end-of-sequence token


def test_sigterm_drains_open_requests_and_refuses_new_ones(ckpt, expected):
    import openai

    with serve_process(ckpt) as (proc, base, log):
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", timeout=120, max_retries=0)
        answered(client, ckpt, expected)
        seen: dict = {}

        def terminate():  # the stream is open: SIGTERM, then new requests are refused
            proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and (status := call(base, "/health"))[0] != 503:
                time.sleep(0.05)
            seen["health"] = status
            seen["new"] = call(base, "/v1/completions", dict(model=ckpt, prompt=PROMPTS[0], max_tokens=MAX_TOKENS))

        # sent before the stream: the server has read it by the time the stream's first token comes
        plain = send(base, "/v1/completions", dict(model=ckpt, prompt=LONG, max_tokens=300, temperature=0))
        payloads = events(base, "/v1/completions", dict(model=ckpt, prompt=LONG, max_tokens=300, temperature=0),
                          on_first=terminate)
        status, _, r = receive(plain)
        assert status == 200 and r["usage"]["completion_tokens"] == 300  # finished
        assert r["choices"][0]["text"].startswith(expected[LONG])
        last = json.loads(payloads[-2])  # finished, then [DONE]
        assert payloads[-1] == "[DONE]" and last["choices"][0]["finish_reason"] == "length"
        assert last["usage"]["completion_tokens"] == 300 and streamed_text(payloads)[0] == r["choices"][0]["text"]
        status, headers, body = seen["new"]
        assert status == 503 and int(headers["retry-after"]) >= 1 and "shutting down" in body["error"]["message"]
        assert seen["health"][0] == 503
        assert proc.wait(timeout=60) == 0, log_text(log)[-3000:]  # drained: exit 0
        assert "draining: 2 open requests" in log_text(log)


def test_sigterm_ends_what_is_still_open_at_the_shutdown_timeout(ckpt, expected):
    import openai

    with serve_process(ckpt, "--shutdown-timeout", "0.5") as (proc, base, log):
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", timeout=120, max_retries=0)
        answered(client, ckpt, expected)
        started = time.monotonic()
        plain = send(base, "/v1/completions", dict(model=ckpt, prompt=LONG, max_tokens=900, temperature=0))
        payloads = events(base, "/v1/completions", dict(model=ckpt, prompt=LONG, max_tokens=900, temperature=0),
                          on_first=lambda: proc.send_signal(signal.SIGTERM))
        status, _, body = receive(plain)
        assert time.monotonic() - started < 30  # cut at the timeout, not at the end of 900 tokens
        assert payloads[-1] == "[DONE]"
        error = json.loads(payloads[-2])["error"]
        assert error["type"] == "server_shutting_down" and "--shutdown-timeout" in error["message"]
        assert 0 < len(streamed_text(payloads[:-2])[0]) < 900 and not any('"finish_reason":"length"' in p
                                                                         for p in payloads)
        assert status == 503 and "--shutdown-timeout" in body["error"]["message"]
        assert proc.wait(timeout=60) == 0, log_text(log)[-3000:]
        assert "--shutdown-timeout ran out: ending 2 open requests" in log_text(log)


def test_bad_shutdown_timeout_is_a_clear_error(ckpt):
    for bad in (-1, float("nan"), float("inf"), "30", True):
        with pytest.raises(vattn.InvalidConfigError, match="shutdown_timeout"):
            hf_serve.serve(ckpt, shutdown_timeout=bad, non_blocking=True)
