"""`vattn serve --engine vattn` (the default) end to end, over real HTTP on 127.0.0.1, with the
`openai` client: one server for the module on a tiny seeded Llama with a character tokenizer
(`char_checkpoint`; its EOS is never the point: greedy requests send `ignore_eos`).

Answers equal transformers' `generate` (greedy) on the same weights, streamed or not;
seeded sampling repeats; `n` choices differ at temperature 1; stop strings cut exactly;
logprobs equal the model's log-softmax; every refused field is a 400 with an OpenAI error
body naming it (never FastAPI's 422); usage counts are the same streamed and not; auth;
cut streams free everything and are logged once at INFO (40 at a time, by FIN and RST, under
memory contention: test_serve_clients.py's raw-socket clients); a lone surrogate is a 400 and
a Content-Length over --max-body-bytes a 413 before the body; vLLM's Grafana queries find
their metrics in a scrape.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import socket
import time
import urllib.request

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
missing = [m for m in ("fastapi", "uvicorn", "openai", "prometheus_client") if importlib.util.find_spec(m) is None]
pytestmark = pytest.mark.skipif(bool(missing), reason=f"vattn serve's tests need {missing}")

from tests.conftest import REPO  # noqa: E402
from vattn.bench._models import char_checkpoint  # noqa: E402

MAX_TOKENS = 12
PROMPTS = ["hello world", "the quick brown fox", "vattn maps pages"]
GREEDY = {"temperature": 0, "max_tokens": MAX_TOKENS, "extra_body": {"ignore_eos": True}}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    return char_checkpoint(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def hf(ckpt):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(ckpt).eval()
    model.generation_config.eos_token_id = None  # as ignore_eos: never stop before max_new_tokens
    return model, AutoTokenizer.from_pretrained(ckpt)


def hf_greedy(hf, ids: list[int], n: int = MAX_TOKENS) -> list[int]:
    model, _ = hf
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


def wait_ready(server, within: float = 60) -> None:
    deadline = time.monotonic() + within
    while True:
        try:
            with urllib.request.urlopen(server.url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.05)


@pytest.fixture(scope="module")
def srv(ckpt):
    from vattn.serve import serve

    server = serve(ckpt, port=free_port(), non_blocking=True, device="cpu", page_size=4096, max_model_len=256,
                   max_num_seqs=8, served_model_name=["tiny", "tiny-alias"], log_level="warning")
    wait_ready(server)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(srv):
    import openai

    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", timeout=60, max_retries=0)


class Answer:
    def __init__(self, status: int, text: str) -> None:
        self.status_code, self.text = status, text

    def json(self):
        return json.loads(self.text)


def request(srv, method: str, path: str, body: dict | bytes | None = None, headers: dict | None = None) -> Answer:
    """One HTTP exchange with the server (http.client: nothing between the test and the wire)."""
    import http.client
    import urllib.parse

    conn = http.client.HTTPConnection(urllib.parse.urlsplit(srv.url).netloc, timeout=60)
    try:
        content = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        conn.request(method, path, body=content, headers={"content-type": "application/json", **(headers or {})})
        r = conn.getresponse()
        return Answer(r.status, r.read().decode())
    finally:
        conn.close()


def post(srv, path: str, body: dict | bytes, headers: dict | None = None) -> Answer:
    return request(srv, "POST", path, body, headers)


def get(srv, path: str, headers: dict | None = None) -> Answer:
    return request(srv, "GET", path, None, headers)


def scrape(srv) -> tuple[dict, dict]:
    """A real /metrics scrape, parsed by prometheus_client: (samples by name, families by name)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(srv.url + "/metrics") as r:
        families = list(text_string_to_metric_families(r.read().decode()))
    return {s.name: s for f in families for s in f.samples}, {f.name: f for f in families}


def cut_after_first_event(url: str, body: dict) -> None:
    """A streamed completion whose client goes away (shutdown, close) after its first event."""
    import http.client
    import urllib.parse

    conn = http.client.HTTPConnection(urllib.parse.urlsplit(url).netloc, timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"content-type": "application/json"})
    r = conn.getresponse()
    while not r.readline().startswith(b"data: {"):
        pass
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()


# ------------------------------------------------------------------- answers ----
def test_completions_equal_transformers_generate(srv, client, hf):
    _, tok = hf
    for prompt in PROMPTS:
        want = tok.decode(hf_greedy(hf, tok.encode(prompt)))
        r = client.completions.create(model="tiny", prompt=prompt, **GREEDY)
        assert r.choices[0].text == want and r.choices[0].finish_reason == "length"
        assert r.usage.completion_tokens == MAX_TOKENS and r.usage.prompt_tokens == len(tok.encode(prompt))
        chunks = list(client.completions.create(model="tiny", prompt=prompt, stream=True, **GREEDY))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want
        assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_equals_transformers_generate(srv, client, hf):
    _, tok = hf
    messages = [{"role": "user", "content": "what is paging?"}]
    ids = tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                     add_special_tokens=False)
    want = tok.decode(hf_greedy(hf, ids))
    r = client.chat.completions.create(model="tiny", messages=messages, **GREEDY)
    assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
    parts = [{"role": "user", "content": [{"type": "text", "text": "what is "}, {"type": "text", "text": "paging?"}]}]
    stream = client.chat.completions.create(model="tiny-alias", messages=parts, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS
    assert chunks[-1].usage.prompt_tokens == len(ids)


def test_prompt_forms_batch_token_ids_and_echo(srv, client, hf):
    _, tok = hf
    ids = tok.encode("hello world")
    want = tok.decode(hf_greedy(hf, ids))
    r = client.completions.create(model="tiny", prompt=[ids, "hello world"], **GREEDY)
    assert [c.index for c in r.choices] == [0, 1] and {c.text for c in r.choices} == {want}
    assert r.usage.prompt_tokens == 2 * len(ids)
    r = client.completions.create(model="tiny", prompt="hello world", echo=True, **GREEDY)
    assert r.choices[0].text == "hello world" + want


def test_seeded_sampling_repeats_and_n_choices_differ(srv, client):
    kw = dict(model="tiny", prompt="once upon", max_tokens=16, temperature=1.0, top_p=0.95,
              extra_body={"ignore_eos": True, "repetition_penalty": 1.1, "top_k": 50, "min_p": 0.01})
    a = client.completions.create(seed=7, n=2, **kw)
    b = client.completions.create(seed=7, n=2, **kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.choices[0].text != a.choices[1].text  # n samples at temperature 1 differ
    c = client.completions.create(seed=8, **kw)
    assert c.choices[0].text != a.choices[0].text
    streamed = list(client.completions.create(seed=7, n=2, stream=True, stream_options={"include_usage": True}, **kw))
    texts = [""] * 2
    for ch in streamed:
        for choice in ch.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in a.choices]
    assert streamed[-1].usage.completion_tokens == a.usage.completion_tokens == 32  # the same count, streamed or not


def test_stop_strings_cut_exactly(srv, client, hf):
    _, tok = hf
    full = client.completions.create(model="tiny", prompt="hello world", **GREEDY).choices[0].text
    stop = full[4:6]
    cut = full[:full.find(stop)]
    r = client.completions.create(model="tiny", prompt="hello world", stop=[stop, "never-there"], **GREEDY)
    c = r.choices[0]
    assert (c.text, c.finish_reason, c.model_extra["stop_reason"]) == (cut, "stop", stop)
    r = client.completions.create(model="tiny", prompt="hello world", stop=stop,
                                  **{**GREEDY, "extra_body": {"ignore_eos": True, "include_stop_str_in_output": True}})
    assert r.choices[0].text == cut + stop
    chunks = list(client.completions.create(model="tiny", prompt="hello world", stop=stop, stream=True, **GREEDY))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == cut
    token = tok.encode(full[2])[0]
    r = client.completions.create(model="tiny", prompt="hello world",
                                  **{**GREEDY, "extra_body": {"ignore_eos": True, "stop_token_ids": [token]}})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].model_extra["stop_reason"] == token


def test_logprobs_are_the_models(srv, client, hf):
    model, tok = hf
    ids = tok.encode("hello world")
    r = client.completions.create(model="tiny", prompt="hello world", logprobs=3, **GREEDY)
    lp = r.choices[0].logprobs
    out = hf_greedy(hf, ids)
    with torch.no_grad():
        logits = model(torch.tensor([ids + out])).logits[0, len(ids) - 1:-1]
    want = torch.log_softmax(logits.float(), -1)
    assert len(lp.token_logprobs) == MAX_TOKENS
    for i, t in enumerate(out):
        assert lp.token_logprobs[i] == pytest.approx(want[i, t].item(), abs=1e-3)
        # (keyed by text, as OpenAI's shape is: this model's tokens past its tokenizer's vocabulary all read "")
        assert 1 <= len(lp.top_logprobs[i]) <= 3 and max(lp.top_logprobs[i].values()) <= lp.token_logprobs[i] + 1e-5
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == r.choices[0].text
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], logprobs=True,
                                          top_logprobs=2, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == MAX_TOKENS and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob for c in content)
    assert "".join(c.token for c in content) == chat.choices[0].message.content


# ------------------------------------------------------------------- refusals ----
REFUSED = [
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"prompt_logprobs": 1}, "prompt_logprobs"),
    ({"best_of": 3}, "best_of"),
    ({"suffix": "end"}, "suffix"),
    ({"logit_bias": {"5": 10}}, "logit_bias"),
    ({"guided_json": {}}, "guided_json"),  # vLLM's extension, not built: refused, not ignored
    ({"not_a_field": 1}, "not_a_field"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"n": 0}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 10_000}, "max_tokens"),
    ({"min_tokens": 8, "max_tokens": 4}, "min_tokens"),
    ({"logprobs": 50}, "logprobs"),
    ({"stop": 3}, "stop"),
    ({"stop_token_ids": ["a"]}, "stop_token_ids"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"echo": True, "logprobs": 1}, "echo"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": [1, 2, 100000]}, "prompt"),
    ({"prompt": [1, 2, 128]}, "prompt"),  # the model has 128 tokens (its tokenizer 98)
    ({"model": "another"}, "model"),
]


@pytest.mark.parametrize("extra,param", REFUSED, ids=[p for _, p in REFUSED])
def test_refused_fields_get_an_openai_400(srv, extra, param):
    r = post(srv, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 4, **extra})
    assert r.status_code == (404 if param == "model" else 400), r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param and err["message"]


@pytest.mark.parametrize("extra,param", [({"top_logprobs": 2}, "top_logprobs"), ({"echo": True}, "echo"),
                                         ({"messages": []}, "messages"), ({"tool_choice": "required"}, "tool_choice"),
                                         ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
                                          "messages[0].content")])
def test_chat_refusals(srv, extra, param):
    r = post(srv, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_never_a_422_and_bodies_checked(srv):
    for body in (b"{not json", b"[1, 2]", b'{"prompt": "hi", "max_tokens": NaN}'):
        r = post(srv, "/v1/completions", body)
        assert r.status_code == 400 and "error" in r.json() and "detail" not in r.json()
    r = post(srv, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "user": "someone", "seed": 1,
                                      "temperature": 0.5, "n": 1, "best_of": 1, "logit_bias": {},
                                      "response_format": {"type": "text"}, "skip_special_tokens": False,
                                      "presence_penalty": 0.5, "frequency_penalty": 0.5, "min_tokens": 1})
    assert r.status_code == 200, r.text  # the fields that change nothing, and the honoured ones, are accepted


def test_vllm_bench_bodies_are_served(srv):
    """What `vllm bench serve --backend openai` / `openai-chat` send."""
    r = post(srv, "/v1/completions", {"model": "tiny", "prompt": "hi there", "repetition_penalty": 1.0,
                                      "max_tokens": 5, "logprobs": None, "stream": True, "ignore_eos": True,
                                      "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n") and r.text.count("[DONE]") == 1
    usage = json.loads(r.text.split("data: ")[-2])["usage"]
    assert usage["completion_tokens"] == 5
    r = post(srv, "/v1/chat/completions", {"model": "tiny", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi there"}]}], "temperature": 0.0,
        "max_completion_tokens": 5, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
        "top_p": 1.0, "top_k": -1, "min_p": 0.0})
    assert r.status_code == 200 and json.loads(r.text.split("data: ")[-2])["usage"]["completion_tokens"] == 5


def test_body_limit_is_413(srv):
    srv.gate.max_body_bytes, saved = 1000, srv.gate.max_body_bytes
    try:
        r = post(srv, "/v1/completions", {"prompt": "x" * 2000, "max_tokens": 1})
    finally:
        srv.gate.max_body_bytes = saved
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_auth_routes_and_models(srv):
    srv.state.api_key = "sekret"
    try:
        assert get(srv, "/v1/models").status_code == 401
        assert post(srv, "/v1/completions", {"prompt": "hi"}).json()["error"]["code"] == "invalid_api_key"
        assert get(srv, "/v1/models", headers={"authorization": "Bearer wrong"}).status_code == 401
        models = get(srv, "/v1/models", headers={"authorization": "Bearer sekret"})
        assert models.status_code == 200 and [m["id"] for m in models.json()["data"]] == ["tiny", "tiny-alias"]
        assert get(srv, "/health").status_code == 200  # no key needed
        assert get(srv, "/metrics").status_code == 200
        assert get(srv, "/version", headers={"authorization": "Bearer sekret"}).json()["version"]
    finally:
        srv.state.api_key = None
    assert get(srv, "/nowhere").json()["error"]["code"] == 404


def test_beam_search_is_a_400_that_says_where_it_runs(srv):
    for path, body in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions",
                                                              {"messages": [{"role": "user", "content": "hi"}]})):
        r = post(srv, path, {"model": "tiny", "use_beam_search": True, "n": 2, **body})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "use_beam_search" and "beam_search" in err["message"], err


def test_api_key_from_the_environment(monkeypatch):
    """`--api-key` defaults to $VATTN_API_KEY, else vllm serve's $VLLM_API_KEY."""
    from vattn.serve import parser

    monkeypatch.delenv("VATTN_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert parser().parse_args(["m"]).api_key is None
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")
    assert parser().parse_args(["m"]).api_key == "from-vllm"
    monkeypatch.setenv("VATTN_API_KEY", "from-vattn")
    assert parser().parse_args(["m"]).api_key == "from-vattn"
    assert parser().parse_args(["m", "--api-key", "flag"]).api_key == "flag"


# --------------------------------------------------------------- cut streams ----
def test_cut_streams_are_aborted_and_freed(srv, client, caplog):
    import http.client
    import urllib.parse

    caplog.set_level(logging.INFO, logger="vattn.serve")
    body = json.dumps({"model": "tiny", "prompt": "a long story", "max_tokens": 200, "stream": True,
                       "ignore_eos": True})
    for _ in range(3):
        cut_after_first_event(srv.url, json.loads(body))  # the client goes away after its first chunk
    deadline = time.monotonic() + 30
    while scrape(srv)[0]["vattn:num_requests_running"].value and time.monotonic() < deadline:
        time.sleep(0.01)
    # a client of a non-streamed request that goes away while it waits (n=2: both samples stop)
    conn = http.client.HTTPConnection(urllib.parse.urlsplit(srv.url).netloc, timeout=60)
    whole = json.loads(body) | {"stream": False, "n": 2, "max_tokens": 240}
    conn.request("POST", "/v1/completions", body=json.dumps(whole), headers={"content-type": "application/json"})
    deadline = time.monotonic() + 30
    while scrape(srv)[0]["vattn:num_requests_running"].value < 2 and time.monotonic() < deadline:
        time.sleep(0.01)  # (a connection closed before the server read its request never becomes one)
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    deadline = time.monotonic() + 30
    while True:
        m, families = scrape(srv)
        aborted = [x.value for x in families["vattn:request_success"].samples
                   if x.labels["finished_reason"] == "abort"]
        idle = (m["vattn:num_requests_running"].value, m["vattn:num_requests_waiting"].value,
                m["vattn:kv_cache_usage_perc"].value, aborted) == (0, 0, 0, [4])
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert idle, ("the cut streams' requests were not aborted and freed: running, waiting, usage, aborted = "
                  f"{m['vattn:num_requests_running'].value}, {m['vattn:num_requests_waiting'].value}, "
                  f"{m['vattn:kv_cache_usage_perc'].value}, {aborted}")
    cancelled = [r for r in caplog.records if "cancelled its stream" in r.getMessage()]
    assert len(cancelled) == 3 and all(r.levelno == logging.INFO and r.exc_info is None for r in cancelled)
    assert len([r for r in caplog.records if "went away" in r.getMessage()]) == 1
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert client.completions.create(model="tiny", prompt="after", **GREEDY).choices[0].finish_reason == "length"


# -------------------------------------------------- clients that no client should be ----
# (docs/servers.md, "`vattn serve`: what a client can count on"; the same checks as
# test_serve_clients.py's for --engine transformers, with its raw-socket clients)
TIGHT_GROUPS = 8  # page groups of --memory-limit: 256 tokens in all, for 8 sequences of up to 256 (they preempt)
TIGHT_BODY_BYTES = 1 << 20
STREAMS, ROUNDS, RECOVER_S = 40, 3, 15.0


@pytest.fixture(scope="module")
def tight(ckpt):
    """A server whose memory the 40 cut streams contend for: 8 sequences at most, the rest
    waiting; the pages of 8 page groups (a group: one 4096-byte page of each of the 4 KV
    buffers, 32 tokens), so running sequences grow past the limit and preempt each other."""
    from vattn.serve import serve

    server = serve(ckpt, port=free_port(), non_blocking=True, device="cpu", page_size=4096, max_model_len=256,
                   max_num_seqs=8, memory_limit=TIGHT_GROUPS * 4 * 4096, max_body_bytes=TIGHT_BODY_BYTES,
                   served_model_name=["tiny"], log_level="warning")
    wait_ready(server)
    assert server.llm.memory_stats().group_bytes == 4 * 4096
    yield server
    server.stop()


def books(server) -> dict:
    """The server's requests running and waiting, KV usage and bytes, aborts and preemptions (a /metrics scrape)."""
    samples, families = scrape(server)
    aborted = sum(x.value for x in families["vattn:request_success"].samples
                  if x.name.endswith("_total") and x.labels["finished_reason"] == "abort")
    return {"running": samples["vattn:num_requests_running"].value,
            "waiting": samples["vattn:num_requests_waiting"].value,
            "usage": samples["vattn:kv_cache_usage_perc"].value, "used": samples["vattn:kv_used_bytes"].value,
            "mapped": samples["vattn:kv_mapped_bytes"].value, "aborted": aborted,
            "preemptions": samples["vattn:num_preemptions_total"].value}


def idle(b: dict) -> bool:
    return (b["running"], b["waiting"], b["usage"], b["used"]) == (0, 0, 0, 0)


def settle(server, aborted: float | None = None, within: float = RECOVER_S) -> dict:
    """The books once idle (and `aborted` requests aborted, if given), or after `within` seconds."""
    deadline = time.monotonic() + within
    while not (idle(b := books(server)) and aborted in (None, b["aborted"])) and time.monotonic() < deadline:
        time.sleep(0.02)
    return b


def test_cut_streams_under_contention_leave_nothing_behind(tight, hf, caplog):
    """3 rounds of 40 streams (1 in 8 with n=2; `ignore_eos`, no max_tokens: each would run to
    the end of its room) cut after 1-10 events, half by a close (FIN), half by a reset (RST),
    while 8 run, the rest wait and the running ones preempt each other for 8 page groups.
    After each round: every cut request is aborted (the abort count grows by the streams cut,
    each logged once at INFO), running, waiting, KV usage and KV bytes in use are back to 0,
    and a normal request is answered at once as transformers' `generate` answers it. After
    the rounds: the KV bytes in use are what they were before, the engine holds no request
    and the engine loop no handle; no ERROR anywhere (uvicorn's log included)."""
    import random
    import threading

    import openai

    from tests.integrations.serve_clients_util import cut_stream

    _, tok = hf
    quick = openai.OpenAI(base_url=tight.url + "/v1", api_key="unused", timeout=RECOVER_S, max_retries=0)

    def answered(prompt: str) -> float:
        start = time.monotonic()
        r = quick.completions.create(model="tiny", prompt=prompt, **GREEDY)
        assert r.choices[0].text == tok.decode(hf_greedy(hf, tok.encode(prompt))), prompt
        return time.monotonic() - start

    answered(PROMPTS[0])
    before = settle(tight)
    assert idle(before), before
    caplog.set_level(logging.INFO, logger="vattn.serve")
    uvicorn_log = logging.getLogger("uvicorn")  # (it does not propagate to the root, where caplog listens)
    uvicorn_log.addHandler(caplog.handler)
    rng = random.Random(38)
    cut: list = []
    try:
        for round_ in range(ROUNDS):
            first = len(cut)
            clients = [threading.Thread(target=cut_stream, args=(tight.url, "tiny", random.Random(rng.random()), cut))
                       for _ in range(STREAMS)]
            for t in clients:
                t.start()
            for t in clients:
                t.join()
            assert len(cut) - first == STREAMS, f"round {round_}: {STREAMS - len(cut) + first} streams never started"
            start = time.monotonic()
            b = settle(tight, before["aborted"] + len(cut))  # (an abort is counted with its final output, a step on)
            assert idle(b) and b["aborted"] - before["aborted"] == len(cut), (round_, b, len(cut))
            took = answered(PROMPTS[round_])
            assert took < 5 and time.monotonic() - start < RECOVER_S, (round_, took)
            assert idle(settle(tight)), round_
    finally:
        uvicorn_log.removeHandler(caplog.handler)
    after = books(tight)
    assert after["preemptions"] > before["preemptions"], "the streams never contended for memory"
    assert after["used"] == before["used"] == 0 and after["mapped"] <= TIGHT_GROUPS * 4 * 4096, after
    assert not tight.llm.scheduler.has_unfinished() and not tight.state.loop._handles
    cancelled = [r for r in caplog.records if "cancelled its stream" in r.getMessage()]
    assert len(cancelled) == len(cut) == ROUNDS * STREAMS and all(r.levelno == logging.INFO for r in cancelled)
    assert len({r.getMessage() for r in cancelled}) == len(cancelled), "each cut stream is logged once"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], "a cut stream is no error"


SURROGATES = [  # (path, raw body, the field named)
    ("/v1/completions", '{"model": "tiny", "prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
    ("/v1/completions", '{"model": "tiny", "prompt": "\\udfff", "max_tokens": 2, "stream": true}', "prompt"),
    ("/v1/completions", '{"model": "tiny", "prompt": ["ok", "\\udfff"], "max_tokens": 2}', "prompt[1]"),
    ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "hi \\udc80"}], '
     '"max_tokens": 2}', "messages[0].content"),
    ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", '
     '"text": "\\ud800"}]}], "max_tokens": 2}', "messages[0].content[0].text"),
    ("/v1/completions", '{"model": "tiny", "prompt": "hi", "user": "\\ud800", "max_tokens": 2}', "user"),
]


@pytest.mark.parametrize("path,raw,param", SURROGATES, ids=[p for _, _, p in SURROGATES])
def test_a_lone_surrogate_is_a_400_that_names_the_field(srv, client, hf, path, raw, param):
    """JSON's escapes spell a lone UTF-16 surrogate, which no tokenizer encodes: a 400 with an
    OpenAI error body naming the field, never a 500; the server answers normally after it."""
    r = post(srv, path, raw.encode())
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["type"], err["code"], err["param"]) == ("invalid_request_error", "invalid_unicode", param), err
    assert "lone UTF-16 surrogate" in err["message"]
    _, tok = hf
    want = tok.decode(hf_greedy(hf, tok.encode("hello world")))
    assert client.completions.create(model="tiny", prompt="hello world", **GREEDY).choices[0].text == want


def test_a_surrogate_pair_is_a_character(srv):
    r = post(srv, "/v1/completions", b'{"prompt": "\\ud83d\\ude00 hi", "max_tokens": 2, "ignore_eos": true}')
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text


def test_a_length_over_the_cap_is_a_413_before_the_body_comes(tight, hf):
    """The 413 is decided by the Content-Length (over --max-body-bytes): a client that sends
    the head and no body (or waits for `100 Continue` first) gets it at once."""
    from tests.integrations.serve_clients_util import address, post_head, read_answer

    for length in (TIGHT_BODY_BYTES + 1, 1 << 40):
        for expect in ("", "Expect: 100-continue\r\n"):
            with socket.create_connection(address(tight.url), timeout=10) as sock:
                head = post_head("/v1/completions", length)
                sock.sendall(head[:-2] + expect.encode() + b"\r\n")
                start = time.monotonic()
                status, body = read_answer(sock)
                took = time.monotonic() - start
            assert status == 413 and body["error"]["code"] == "request_too_large", body
            assert f"is {length} bytes" in body["error"]["message"], body
            assert took < 3, f"the 413 took {took:.1f} s"
    r = post(tight, "/v1/completions", {"prompt": "hello world", "max_tokens": 4, "ignore_eos": True,
                                        "temperature": 0})
    assert r.status_code == 200, r.text


# -------------------------------------------------------------------- metrics ----
# The metric each query of vLLM's example Grafana dashboard reads (vLLM 0.33's
# examples/online_serving/prometheus_grafana/grafana.json; the queries: ../shared/data/vllm_grafana_queries.txt)
GRAFANA = ["e2e_request_latency_seconds", "e2e_request_latency_seconds", "prompt_tokens", "generation_tokens",
           "time_per_output_token_seconds", "num_requests_running", "num_requests_waiting",
           "time_to_first_token_seconds", "gpu_cache_usage_perc", "request_prompt_tokens", "request_generation_tokens",
           "request_success", "request_queue_time_seconds", "request_prefill_time_seconds",
           "request_decode_time_seconds", "request_max_num_generation_tokens"]
OWN = ["inter_token_latency_seconds", "kv_cache_usage_perc", "num_preemptions", "prefix_cache_queries",
       "prefix_cache_hits", "cache_config_info", "request_time_per_output_token_seconds", "kv_mapped_bytes"]


def _query_metric(query: str) -> str:
    import re

    name = re.search(r"vllm:([a-z0-9_]+)", query).group(1)
    return re.sub(r"_(bucket|sum|count|total)$", "", name)


def test_grafana_queries_find_their_metrics(srv, client):
    client.completions.create(model="tiny", prompt="for the figures", **GREEDY)
    samples, families = scrape(srv)
    queries = REPO.parent.parent / "shared" / "data" / "vllm_grafana_queries.txt"
    if queries.exists():  # the list above is the file's (16 panels' queries; the template variable's is not one)
        lines = [line.split("\t")[1] for line in queries.read_text().splitlines()
                 if "\t" in line and not line.startswith(("#", "("))]
        assert [_query_metric(q) for q in lines] == GRAFANA
    found = [name for name in GRAFANA if "vattn:" + name in families]
    assert len(found) == len(GRAFANA) == 16, f"missing: {sorted(set(GRAFANA) - set(found))}"
    assert all("vattn:" + name in families for name in OWN)
    ok = [x for x in families["vattn:request_success"].samples if x.value]
    assert ok and all(x.labels["model_name"] == "tiny" and x.labels["engine"] == "0" for x in ok)
    assert {x.labels["finished_reason"] for x in ok} <= {"stop", "length", "abort", "error"}
    assert families["vattn:time_to_first_token_seconds"].type == "histogram"
    assert families["vattn:generation_tokens"].type == "counter"
    assert samples["vattn:generation_tokens_total"].value >= MAX_TOKENS
    buckets = [x.labels["le"] for x in families["vattn:time_to_first_token_seconds"].samples
               if x.name.endswith("_bucket")]
    assert buckets[:3] == ["0.001", "0.005", "0.01"] and buckets[-1] == "+Inf"  # vLLM's buckets


# ---------------------------------------------------------------------- flags ----
def test_flags_that_cannot_serve_exit_2(ckpt, capsys):
    from vattn.cli import main

    assert main(["serve", "--model", ckpt, "--device", "cpu", "--page-size", "4096", "--memory-limit", "1000"]) == 2
    err = capsys.readouterr().err
    assert "--memory-limit 1000 bytes holds no request" in err
    smallest = int(err.split("the smallest limit that serves one request is ")[1].split()[0])
    assert main(["serve", ckpt, "--tensor-parallel-size", "2"]) == 2
    assert "--tensor-parallel-size 2" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # argparse's own refusal
        main(["serve", ckpt, "--engine", "vattn", "--dtype", "int8"])
    assert e.value.code == 2

    from vattn.serve import serve  # the smallest limit serves a request (and one at a time)

    server = serve(ckpt, port=free_port(), non_blocking=True, device="cpu", page_size=4096, memory_limit=smallest,
                   log_level="warning")
    try:
        wait_ready(server)
        r = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 4, "ignore_eos": True, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    finally:
        server.stop()


def test_every_sampling_field_reaches_the_engine(srv, client, ckpt):
    """Seeded requests with every sampling field give, over HTTP, what `vattn.LLM` gives in
    process on the same checkpoint with the same SamplingParams (tokens, text, logprobs)."""
    from vattn.engine import LLM, SamplingParams

    cases = [
        dict(temperature=0.8, top_p=0.9, seed=1),
        dict(temperature=1.0, top_k=5, min_p=0.05, seed=2, n=2),
        dict(temperature=0.7, presence_penalty=1.5, frequency_penalty=-0.5, repetition_penalty=1.3, seed=3),
        dict(temperature=1.0, seed=4, logprobs=2, min_tokens=6),
        dict(temperature=0.0, repetition_penalty=2.0, stop_token_ids=[50], skip_special_tokens=False),
    ]
    names = {"top_k", "min_p", "repetition_penalty", "min_tokens", "stop_token_ids", "skip_special_tokens"}
    with LLM(ckpt, device="cpu", page_size=4096, max_context_len=256, max_batch_size=8) as llm:
        for case in cases:
            want = llm.generate("the quick brown fox", SamplingParams(max_tokens=14, ignore_eos=True, **case))[0]
            body = {k: v for k, v in case.items() if k not in names}
            r = client.completions.create(model="tiny", prompt="the quick brown fox", max_tokens=14,
                                          extra_body={"ignore_eos": True, **{k: v for k, v in case.items()
                                                                            if k in names}}, **body)
            assert [c.text for c in r.choices] == [o.text for o in want.outputs], case
            assert r.usage.completion_tokens == sum(len(o.token_ids) for o in want.outputs)
            if "logprobs" in case:
                got = r.choices[0].logprobs.token_logprobs
                assert got == pytest.approx([lp[t].logprob for t, lp in zip(want.outputs[0].token_ids,
                                                                            want.outputs[0].logprobs)], abs=1e-5)


def test_more_shapes(srv, client, hf):
    """Streamed echo, streamed chat n=2, continuous usage, and max_tokens left out (to the context's end)."""
    _, tok = hf
    chunks = list(client.completions.create(model="tiny", prompt="hello world", echo=True, stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices).startswith("hello world")
    texts = ["", ""]
    for c in client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], n=2, seed=5,
                                            temperature=1.0, stream=True, max_tokens=8,
                                            extra_body={"ignore_eos": True}):
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
    assert all(len(t) > 0 for t in texts)
    r = post(srv, "/v1/completions", {"prompt": "hi", "max_tokens": 3, "ignore_eos": True, "stream": True,
                                      "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    events = [json.loads(e[6:]) for e in r.text.split("\n\n") if e.startswith("data: {")]
    assert all("usage" in e for e in events) and events[-1]["usage"]["completion_tokens"] == 3
    r = client.completions.create(model="tiny", prompt="hello world", temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 256 - len(tok.encode("hello world"))  # --max-model-len 256


def test_the_command_serves_and_drains_on_sigterm(ckpt):
    """`python -m vattn serve DIR` (vattn's engine, the default) as a process: answers, then
    exits 0 on SIGTERM."""
    import os
    import signal
    import subprocess
    import sys
    import tempfile

    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen([sys.executable, "-m", "vattn", "serve", ckpt, "--port", str(port), "--device", "cpu",
                                 "--page-size", "4096", "--max-model-len", "128", "--served-model-name", "tiny",
                                 "--api-key", "k"], env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            server = type("S", (), {"url": f"http://127.0.0.1:{port}"})()
            wait_ready(server, within=120)
            r = post(server, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 4},
                     headers={"authorization": "Bearer k"})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 4
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 0
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=20)
            log.seek(0)
            output = log.read()
    assert "Traceback" not in output, output[-3000:]


def test_asynchronous_scheduling_serves_the_same(ckpt, client, hf):
    """The engine loop under asynchronous scheduling (CUDA's default; forced here on the host):
    the same answers as the synchronous server, and a cut stream still frees everything."""
    import openai

    from vattn.serve import serve

    _, tok = hf
    server = serve(ckpt, port=free_port(), non_blocking=True, device="cpu", page_size=4096, max_model_len=256,
                   served_model_name=["tiny"], async_scheduling=True, log_level="warning")
    try:
        wait_ready(server)
        assert server.llm.async_scheduling
        other = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=60, max_retries=0)
        want = tok.decode(hf_greedy(hf, tok.encode("hello world")))
        assert other.completions.create(model="tiny", prompt="hello world", **GREEDY).choices[0].text == want
        kw = dict(model="tiny", prompt="once upon", max_tokens=16, temperature=1.0, seed=7, n=2,
                  extra_body={"ignore_eos": True})
        assert [c.text for c in other.completions.create(**kw).choices] == \
            [c.text for c in client.completions.create(**kw).choices]
        cut_after_first_event(server.url, {"prompt": "a", "max_tokens": 200, "stream": True, "ignore_eos": True})
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            samples, _ = scrape(server)
            if (samples["vattn:num_requests_running"].value, samples["vattn:kv_cache_usage_perc"].value) == (0, 0):
                break
            time.sleep(0.02)
        assert (samples["vattn:num_requests_running"].value, samples["vattn:kv_cache_usage_perc"].value) == (0, 0)
        assert other.completions.create(model="tiny", prompt="hello world", **GREEDY).choices[0].text == want
    finally:
        server.stop()


def test_vattn_flags_reach_the_engine_config(ckpt, tmp_path):
    from vattn.serve import build_llm, parser

    a = parser().parse_args([ckpt, "--max-model-len", "200", "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
                             "--no-enable-prefix-caching", "--dtype", "float", "--seed", "3", "--page-size", "4096",
                             "--memory-limit", "1048576", "--idle-trim-s", "5", "--device", "cpu"])
    assert (a.model_tag, a.enable_prefix_caching, a.dtype) == (ckpt, False, "float")
    llm = build_llm(ckpt, max_model_len=200, max_num_seqs=4, max_num_batched_tokens=64, dtype="float", seed=3,
                    page_size=4096, memory_limit=1 << 20, idle_trim_s=5, offload_bytes=1 << 20,
                    offload_dir=str(tmp_path), offload_dir_bytes=1 << 20, device="cpu")
    try:
        c = llm.config
        assert (llm.max_context_len, c.max_batch_size, c.max_num_batched_tokens, c.seed, c.physical_memory,
                c.idle_trim_s, c.enable_prefix_caching, c.offload_bytes, c.offload_dir_bytes, str(c.dtype)) == \
            (200, 4, 64, 3, 1 << 20, 5.0, True, 1 << 20, 1 << 20, "torch.float32")
    finally:
        llm.close()


def test_a_batch_prompt_streams_what_it_answers_whole(srv, client):
    """A list of prompts streamed (each event may carry several choices: a stream that fell
    behind sends every step it missed at once) gives the texts and usage of the answer whole."""
    whole = client.completions.create(model="tiny", prompt=PROMPTS, **GREEDY)
    texts: dict[int, str] = {}
    usage = None
    for chunk in client.completions.create(model="tiny", prompt=PROMPTS, stream=True,
                                           stream_options={"include_usage": True}, **GREEDY):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
        usage = chunk.usage or usage
    assert texts == {c.index: c.text for c in whole.choices}
    assert usage.completion_tokens == whole.usage.completion_tokens == len(PROMPTS) * MAX_TOKENS


def test_a_request_answered_whole_gets_only_its_final_output():
    """`EngineLoop.add(final_only=True)` (a non-streamed answer): the event loop hears of it once,
    when it finishes (not once a step); a streamed one hears every step."""
    import asyncio
    from types import SimpleNamespace

    from vattn.serve.engine import EngineLoop

    loop = asyncio.new_event_loop()
    try:
        engine = EngineLoop(SimpleNamespace(), loop)
        whole, streamed = asyncio.Queue(), asyncio.Queue()
        for rid, (sink, final_only) in enumerate([(whole, True), (streamed, False)]):
            handle = engine.add(rid, [1], None, sink, final_only=final_only)
            handle.request_id = rid
            engine._handles[rid] = handle
        for finished in (False, False, True):
            engine._deliver([SimpleNamespace(request_id=r, finished=finished) for r in (0, 1)], 0.0, 0.0)
        loop.run_until_complete(asyncio.sleep(0))
        assert whole.qsize() == 1 and whole.get_nowait()[1].finished
        assert streamed.qsize() == 3
    finally:
        loop.close()


def test_a_streamed_choice_from_its_template_is_what_json_dumps_writes():
    """The streamed path writes a plain choice from a template (issue 36): the same bytes as
    json.dumps of its dict, for any text (quotes, backslashes, controls, non-ASCII, surrogates)."""
    import json

    from vattn.serve.app import _CHAT_CHOICE, _TEXT_CHOICE, _json_str

    for piece in ["", "a", 'say "hi"\\', "\n\t\x00\x1f\x7f", "caf\u00e9 \u4e2d \U0001f600", "\ud800", "</script>"]:
        for index in (0, 7, 123):
            text = {"index": index, "text": piece, "logprobs": None, "finish_reason": None}
            chat = {"index": index, "delta": {"content": piece}, "logprobs": None, "finish_reason": None}
            assert _TEXT_CHOICE % (index, _json_str(piece)) == json.dumps(text, separators=(",", ":"))
            assert _CHAT_CHOICE % (index, _json_str(piece)) == json.dumps(chat, separators=(",", ":"))


def test_a_steps_inter_token_gaps_are_observed_as_one_update_each():
    """`ServeMetrics.on_step` observes each distinct inter-token gap of a step once with its
    count (issue 36): the histogram reads as if observed once per request."""
    from types import SimpleNamespace

    from vattn.serve.engine import Handle
    from vattn.serve.metrics import ServeMetrics

    def value(m, name, **labels):
        return m.registry.get_sample_value(name, {"model_name": "m", "engine": "0", **labels})

    m = ServeMetrics("m", 64, {})
    handles = [Handle(i, None, num_tokens=3, last_token_time=1.0) for i in range(5)]
    handles[4].last_token_time = 1.25
    outs = [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[1, 2, 3, 4])], finished=False) for _ in handles]
    m.on_step(list(zip(handles, outs)), 1.4, 1.5)
    assert value(m, "vattn:inter_token_latency_seconds_count") == 5
    assert value(m, "vattn:inter_token_latency_seconds_bucket", le="0.2") == 0
    assert value(m, "vattn:inter_token_latency_seconds_bucket", le="0.3") == 1  # 0.25 s, once
    assert value(m, "vattn:inter_token_latency_seconds_bucket", le="0.5") == 5  # 0.5 s, four times
    assert value(m, "vattn:inter_token_latency_seconds_sum") == 4 * 0.5 + 0.25
    assert value(m, "vattn:time_per_output_token_seconds_count") == 5
    assert value(m, "vattn:generation_tokens_total") == 5


def test_a_stream_interval_posts_every_nth_token_and_the_ends():
    """`EngineLoop(stream_interval=3)` (--stream-interval): a streamed request's output reaches
    its sink with its first token, then once it has 3 more than it last posted, and when it
    finishes; an answer whole still only at its end."""
    import asyncio
    from types import SimpleNamespace

    from vattn.serve.engine import EngineLoop

    loop = asyncio.new_event_loop()
    try:
        engine = EngineLoop(SimpleNamespace(), loop, stream_interval=3)
        whole, streamed = asyncio.Queue(), asyncio.Queue()
        for rid, (sink, final_only) in enumerate([(whole, True), (streamed, False)]):
            handle = engine.add(rid, [1], None, sink, final_only=final_only)
            handle.request_id = rid
            engine._handles[rid] = handle
        for n in range(1, 9):
            engine._deliver([SimpleNamespace(request_id=r, finished=n == 8,
                                             outputs=[SimpleNamespace(token_ids=[0] * n)]) for r in (0, 1)], 0.0, 0.0)
        loop.run_until_complete(asyncio.sleep(0))
        got = [len(streamed.get_nowait()[1].outputs[0].token_ids) for _ in range(streamed.qsize())]
        assert got == [1, 4, 7, 8]
        assert whole.qsize() == 1 and whole.get_nowait()[1].finished
    finally:
        loop.close()


# ---------------------------------------------------------------------- CUDA ----
@pytest.mark.gpu
def test_vattn_engine_serves_on_cuda(ckpt):
    """`vattn serve --device cuda` on vattn's engine (asynchronous scheduling, CUDA's default):
    greedy answers equal `generate` on the same GPU (float32), streamed and not, 16 at once;
    a stream cut after its first event is aborted and its pages freed; /metrics reads the
    device's pages (2 MiB VMM pages)."""
    import concurrent.futures

    import openai
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from vattn.serve import serve

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).to("cuda").eval()
    model.generation_config.eos_token_id = None
    tok = AutoTokenizer.from_pretrained(ckpt)
    prompts = [f"{p} {i}" for i in range(6) for p in PROMPTS][:16]
    with torch.no_grad():
        want = {}
        for p in prompts:
            x = torch.tensor([tok(p).input_ids], device="cuda")
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_TOKENS, do_sample=False,
                                 pad_token_id=0)
            want[p] = tok.decode(out[0, x.shape[1]:], skip_special_tokens=True)  # as the server (vLLM's default)
    del model
    server = serve(ckpt, port=free_port(), non_blocking=True, device="cuda", dtype="float32", max_model_len=256,
                   max_num_seqs=8, served_model_name=["tiny"], log_level="warning")
    try:
        wait_ready(server)
        llm = server.llm
        assert llm.runner.device.type == "cuda" and llm.async_scheduling, (llm.runner.device, llm.async_scheduling)
        assert llm.cache.page_size >= 2 << 20
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=120, max_retries=0)

        def whole(p: str) -> str:
            return client.completions.create(model="tiny", prompt=p, **GREEDY).choices[0].text

        def streamed(p: str) -> str:
            return "".join(c.choices[0].text for c in
                           client.completions.create(model="tiny", prompt=p, stream=True, **GREEDY) if c.choices)

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            got_whole = dict(zip(prompts, pool.map(whole, prompts)))
            got_streamed = dict(zip(prompts, pool.map(streamed, prompts)))
        assert got_whole == want, {p: (got_whole[p], want[p]) for p in prompts if got_whole[p] != want[p]}
        assert got_streamed == want
        # a stream cut after its first event: aborted, its pages freed
        cut_after_first_event(server.url, {"model": "tiny", "prompt": "a long story", "max_tokens": 200,
                                           "stream": True, "ignore_eos": True})
        deadline = time.monotonic() + 30
        while True:
            m = scrape(server)[0]
            done = (m["vattn:num_requests_running"].value, m["vattn:kv_used_bytes"].value) == (0, 0)
            if done or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert done, (m["vattn:num_requests_running"].value, m["vattn:kv_used_bytes"].value)
        assert m["vattn:kv_mapped_bytes"].value > 0  # what stays mapped is the device's (2 MiB pages), counted
        assert whole(prompts[0]) == want[prompts[0]]
    finally:
        server.stop()


def test_default_prefix_caching_finds_a_layout_or_steps_aside(ckpt, caplog):
    """Prefix caching is on by default; where the default layout's blocks outgrow the context
    (a small model on large pages: 2 MiB on a GPU) the server starts with a layout whose blocks
    fit, keeping the page size asked for, or without prefix caching where none fits, and says
    why (an H200 run found `vattn serve --device cuda` refusing to start instead)."""
    from vattn.serve import build_llm

    caplog.set_level(logging.WARNING, logger="vattn.serve")
    with build_llm(ckpt, device="cpu", page_size=65536, max_model_len=512) as llm:  # 512-token blocks per layer
        assert llm.config.enable_prefix_caching and llm.config.layout == "fused"
        assert llm.cache.page_size == 65536 and llm.prefix_cache is not None
    with build_llm(ckpt, device="cpu", page_size=65536, max_model_len=8) as llm:  # no block fits in 8 tokens
        assert not llm.config.enable_prefix_caching and llm.prefix_cache is None
    said = [r.getMessage() for r in caplog.records if "starting with" in r.getMessage()]
    assert len(said) == 2 and "layout=fused, page_size=65536" in said[0] and "enable_prefix_caching=False" in said[1]
    with build_llm(ckpt, device="cpu", page_size=4096, max_model_len=256) as llm:  # fits: nothing changed
        assert llm.config.layout == "per-layer" and llm.config.enable_prefix_caching
    assert len([r for r in caplog.records if "starting with" in r.getMessage()]) == 2


def test_speculative_config_serves_the_same_and_counts(ckpt, hf):
    """`--speculative-config` (vllm serve's JSON): n-gram speculation behind the server, greedy
    answers as without it (generate's), vLLM's spec_decode counters on /metrics; a config the
    engine refuses is an InvalidConfigError before the server starts; bad JSON an argparse error."""
    from vattn.errors import InvalidConfigError
    from vattn.serve import parser, serve

    _, tok = hf
    server = serve(ckpt, port=free_port(), non_blocking=True, device="cpu", page_size=4096, max_model_len=256,
                   max_num_seqs=8, served_model_name=["tiny"], log_level="warning",
                   speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2,
                                       "prompt_lookup_min": 1})
    try:
        wait_ready(server)
        prompt = "abcabcabcabcabc"  # repeats: drafts are proposed
        got = post(server, "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0,
                                               "ignore_eos": True}).json()["choices"][0]["text"]
        assert got == tok.decode(hf_greedy(hf, tok.encode(prompt), 24))
        import openai

        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=60, max_retries=0)
        chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0,
                                                stream=True, stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == got  # several tokens a step, streamed
        assert chunks[-1].usage.completion_tokens == 24
        samples = scrape(server)[0]
        assert samples["vattn:spec_decode_num_draft_tokens_total"].value > 0
        assert 0 <= samples["vattn:spec_decode_num_accepted_tokens_total"].value \
            <= samples["vattn:spec_decode_num_draft_tokens_total"].value
    finally:
        server.stop()
    with pytest.raises(InvalidConfigError, match="speculative"):
        serve(ckpt, port=free_port(), non_blocking=True, device="cpu", speculative_config={"method": "eagle3"})
    with pytest.raises(SystemExit):
        parser().parse_args(["m", "--speculative-config", "[1, 2]"])
    assert parser().parse_args(["m", "--speculative-config", '{"method": "ngram"}']).speculative_config == {
        "method": "ngram"}
