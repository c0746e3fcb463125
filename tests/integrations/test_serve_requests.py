"""`vattn serve` and what clients send it, over real HTTP on 127.0.0.1 (docs/servers.md,
"`vattn serve`: what a client can count on"): the sampling extensions load generators send
(`ignore_eos`, `min_tokens`) honoured, token for token against `generate`; malformed requests
answered 4xx, never 500, each followed by a normal request that must get its answer; a body
over `--max-body-bytes` refused with 413; a long prompt tokenized off the event loop while a
normal request is answered; a memory limit with no room beyond the trash sectors refused at
start with the smallest one that serves; `GET /metrics` scraped during a burst.
"""
from __future__ import annotations

import concurrent.futures
import http.client
import json
import shutil
import subprocess
import sys
import threading
import time
import urllib.parse

import pytest

from tests.integrations.test_serve import (  # noqa: F401  (fixtures)
    BLOCK, MAX_TOKENS, PROMPTS, SECTOR, SKIP, TRASH, answered, burst, call, ckpt, events, expected, server,
    streamed_text)

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(bool(SKIP), reason=SKIP)

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

import vattn  # noqa: E402
from tests.conftest import REPO  # noqa: E402
from vattn.integrations import hf_cb, hf_serve  # noqa: E402

EOS_PROMPT = "hello world"
NEW = 12
LONG_CHARS = 2_000_000  # a prompt under the default --max-body-bytes whose tokenization takes seconds


def base_of(client) -> str:
    return str(client.base_url).removesuffix("/v1/")


def post_raw(base: str, path: str, raw: bytes | str, headers: dict | None = None) -> tuple[int, dict | str]:
    """POST `raw` as it is (no JSON encoding of ours): (status, JSON body or text)."""
    url = urllib.parse.urlsplit(base)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=120)
    try:
        conn.request("POST", path, raw, {"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        text = r.read().decode()
        try:
            return r.status, json.loads(text)
        except json.JSONDecodeError:
            return r.status, text
    finally:
        conn.close()


# --------------------------------------------------------- ignore_eos, min_tokens ----
def greedy(model, ids: list[int], **kw) -> list[int]:
    x = torch.tensor([ids])
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW, do_sample=False, **kw)
    return out[0, x.shape[1]:].tolist()


@pytest.fixture(scope="module")
def eos_case(ckpt, tmp_path_factory):  # noqa: F811
    """The test checkpoint with an end-of-sequence id its greedy answer to EOS_PROMPT meets at
    the third token or later: (checkpoint, tokenizer, model, prompt ids, eos id, k: the index
    of its first occurrence)."""
    tok = AutoTokenizer.from_pretrained(ckpt)
    model = AutoModelForCausalLM.from_pretrained(ckpt).eval()
    ids = tok(EOS_PROMPT).input_ids
    free = greedy(model, ids)  # the checkpoint's own end-of-sequence id (2) does not come up: no end
    assert tok.eos_token_id not in free
    k = next(i for i in range(2, NEW - 4) if free[i] not in free[:i] and tok.decode([free[i]]))
    path = tmp_path_factory.mktemp("eos") / "ckpt"
    shutil.copytree(ckpt, path)
    for name in ("config.json", "generation_config.json"):
        data = json.loads((path / name).read_text())
        data["eos_token_id"] = free[k]
        (path / name).write_text(json.dumps(data))
    model.generation_config.eos_token_id = free[k]
    return str(path), tok, model, ids, free[k], k, free


@pytest.fixture
def eos_server(eos_case):
    import openai

    path = eos_case[0]
    started = []

    def start(**kw):
        from tests.integrations.test_serve import free_port, wait_ready

        port = free_port()
        srv = hf_serve.serve(path, port=port, device="cpu", num_blocks=64, block_size=BLOCK, page_size=4096,
                             non_blocking=True, **kw)
        started.append(srv)
        wait_ready(f"http://127.0.0.1:{port}")
        return srv, openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=120,
                                  max_retries=0)

    yield start
    for srv in started:
        srv.kill_server()
    hf_cb.disable_all()


def test_ignore_eos_runs_past_the_end_and_min_tokens_holds_it_back(eos_server, eos_case):
    """transformers serve 5.24 answers 422 to both (guidellm sends ignore_eos; vLLM's benchmark
    client ignore_eos and min_tokens)."""
    path, tok, model, ids, eos, k, free = eos_case
    _, client = eos_server()

    def complete(**extra):
        r = client.completions.create(model=path, prompt=EOS_PROMPT, max_tokens=NEW, temperature=0, extra_body=extra)
        return r.choices[0], r.usage.completion_tokens

    choice, n = complete()  # stops at the end-of-sequence token, which it includes (as generate does)
    assert n == k + 1 and choice.finish_reason == "stop" and choice.text == tok.decode(free[:k + 1])
    assert greedy(model, ids) == free[:k + 1]
    choice, n = complete(ignore_eos=True)  # runs past it, to max_tokens: the answer without an end
    assert n == NEW and choice.finish_reason == "length" and choice.text == tok.decode(free)
    for least in (k + 1, k + 3):  # no end-of-sequence token among the first `least`: generate's min_new_tokens
        want = greedy(model, ids, min_new_tokens=least)
        assert eos not in want[:least] and len(want) > least
        choice, n = complete(min_tokens=least)
        assert n == len(want) and choice.text == tok.decode(want), least
    choice, n = complete(min_tokens=k)  # the end may come at token k + 1: it does
    assert n == k + 1 and choice.text == tok.decode(free[:k + 1])
    # streamed, and a chat: the same
    payloads = events(base_of(client), "/v1/completions", dict(model=path, prompt=EOS_PROMPT, max_tokens=NEW,
                                                               temperature=0, ignore_eos=True))
    assert payloads[-1] == "[DONE]" and streamed_text(payloads) == {0: tok.decode(free)}
    r = client.chat.completions.create(model=path, messages=[{"role": "user", "content": "hi"}], max_tokens=NEW,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == NEW


# ----------------------------------------------------------- malformed requests ----
def test_malformed_requests_get_4xx_never_500(server, ckpt, expected):  # noqa: F811
    """Each was a 500 (or a 200 with no tokens: max_tokens 0 and -1) from transformers'
    handlers; each is refused with an OpenAI error body naming the field, and a normal
    request after it is answered."""
    _, client = server()
    base = base_of(client)
    comp = dict(model=ckpt, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0)
    chat = dict(model=ckpt, messages=[{"role": "user", "content": "hi"}], max_tokens=MAX_TOKENS, temperature=0)
    cases = [  # (path, body: a dict to encode or raw text, param, code)
        ("/v1/chat/completions", dict(chat, messages=[]), "messages", "empty_array"),
        ("/v1/chat/completions", dict(chat, messages="hi"), "messages", "invalid_type"),
        ("/v1/chat/completions", dict(chat, messages=["hi"]), "messages[0]", "invalid_type"),
        ("/v1/chat/completions", dict(chat, messages=[{"role": "user", "content": 5}]), "messages[0].content",
         "invalid_type"),
        ("/v1/completions", dict(comp, temperature="x"), "temperature", "invalid_type"),
        ("/v1/completions", dict(comp, temperature=3), "temperature", "decimal_above_max_value"),
        ("/v1/completions", dict(comp, top_p=-0.5), "top_p", "decimal_below_min_value"),
        ("/v1/completions", dict(comp, frequency_penalty="x"), "frequency_penalty", "invalid_type"),
        ("/v1/completions", dict(comp, seed=2 ** 70), "seed", "integer_above_max_value"),
        ("/v1/completions", dict(comp, seed="1"), "seed", "invalid_type"),
        ("/v1/completions", dict(comp, max_tokens=0), "max_tokens", "integer_below_min_value"),
        ("/v1/completions", dict(comp, max_tokens=-1), "max_tokens", "integer_below_min_value"),
        ("/v1/completions", dict(comp, max_tokens="5"), "max_tokens", "invalid_type"),
        ("/v1/completions", dict(comp, max_tokens=5.0), "max_tokens", "invalid_type"),
        ("/v1/chat/completions", dict(chat, max_completion_tokens=0), "max_completion_tokens",
         "integer_below_min_value"),
        ("/v1/completions", dict(comp, ignore_eos="yes"), "ignore_eos", "invalid_type"),
        ("/v1/completions", dict(comp, min_tokens=-1), "min_tokens", "integer_below_min_value"),
        ("/v1/completions", dict(comp, min_tokens=MAX_TOKENS + 1), "min_tokens", "invalid_value"),
        ("/v1/completions", dict(comp, stream="yes"), "stream", "invalid_type"),
        ("/v1/completions", dict(comp, prompt=["a", "b"]), "prompt", "invalid_type"),
        ("/v1/completions", f'{{"model": "{ckpt}", "prompt": "hi", "temperature": NaN}}', None, "invalid_json"),
        ("/v1/completions", f'{{"model": "{ckpt}", "prompt": "hi", "top_p": Infinity}}', None, "invalid_json"),
        ("/v1/completions", '{"model": ', None, "invalid_json"),
        ("/v1/completions", "[1, 2]", None, "invalid_type"),
    ]
    for path, body, param, code in cases:
        status, answer = post_raw(base, path, body if isinstance(body, str) else json.dumps(body))
        assert status == 400, (body, answer)
        error = answer["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == code and error["param"] == param, error
        if param is not None:
            assert repr(param.split("[")[0]) in error["message"] or param in error["message"], error
        answered(client, ckpt, expected)
    # fields of the right kind pass: a seed at int64's end, an extension with its neutral value
    r = client.completions.create(model=ckpt, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                  seed=2 ** 63 - 1, extra_body={"ignore_eos": False, "min_tokens": 0})
    assert r.choices[0].text == expected[PROMPTS[0]]
    status, answer = post_raw(base, "/v1/completions", json.dumps(dict(comp, top_k=5)))
    assert status == 422 and "top_k" in str(answer)  # an extension vattn does not take: transformers' own 422
    answered(client, ckpt, expected)


# ------------------------------------------------------------------ large bodies ----
def test_a_body_over_the_cap_is_refused_with_413(server, ckpt, expected):  # noqa: F811
    _, client = server()
    base = base_of(client)
    ten_mb = json.dumps(dict(model=ckpt, prompt="a" * (10 << 20), max_tokens=1))  # the default cap is 4 MiB
    status, answer = post_raw(base, "/v1/completions", ten_mb)
    assert status == 413 and answer["error"]["code"] == "request_too_large"
    assert f"the request body is {len(ten_mb)} bytes" in answer["error"]["message"]
    assert f"--max-body-bytes {hf_serve.MAX_BODY_BYTES}" in answer["error"]["message"]
    answered(client, ckpt, expected)
    # without a Content-Length (chunked): refused once that much came
    url = urllib.parse.urlsplit(base)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=120)
    try:
        conn.request("POST", "/v1/completions", (ten_mb[i:i + (1 << 20)].encode() for i in range(0, len(ten_mb), 1 << 20)),
                     {"Content-Type": "application/json"}, encode_chunked=True)
        r = conn.getresponse()
        assert r.status == 413 and json.loads(r.read())["error"]["code"] == "request_too_large"
    finally:
        conn.close()
    answered(client, ckpt, expected)
    # a chunked body under the cap is served
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=120)
    try:
        body = json.dumps(dict(model=ckpt, prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0)).encode()
        conn.request("POST", "/v1/completions", iter([body[:10], body[10:]]), {"Content-Type": "application/json"},
                     encode_chunked=True)
        r = conn.getresponse()
        assert r.status == 200 and json.loads(r.read())["choices"][0]["text"] == expected[PROMPTS[1]]
    finally:
        conn.close()
    metrics = call(base, "/metrics")[2]
    assert 'vattn:requests_refused_total{code="request_too_large"} 2.0' in metrics


def test_a_long_prompt_does_not_stall_the_other_clients(server, ckpt, expected):  # noqa: F811
    """A 10 MB prompt stalled every client for about 35 s: transformers tokenizes on the event
    loop. A long prompt (here two million characters: about 5 s of this test tokenizer's time)
    is tokenized on a worker thread: a normal request sent after it was read is answered
    before its tokens are counted (it is then refused: it is longer than the cache). With
    the tokenization on the loop, the normal request is answered after it."""
    _, client = server()
    base = base_of(client)
    done: list[str] = []

    def long_one() -> dict:
        status, answer = post_raw(base, "/v1/completions", json.dumps(dict(model=ckpt, prompt="a" * LONG_CHARS,
                                                                           max_tokens=1)))
        done.append("long")
        return answer

    def normal_one() -> None:
        answered(client, ckpt, expected, PROMPTS[2])
        done.append("normal")

    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        long = ex.submit(long_one)
        time.sleep(0.5)  # its body is read (2 MB over loopback) and being tokenized
        normal = ex.submit(normal_one)
        normal.result(timeout=120)
        answer = long.result(timeout=300)
    assert done == ["normal", "long"]
    assert answer["error"]["code"] == "context_length_exceeded" and f"the prompt is {LONG_CHARS} tokens" in \
        answer["error"]["message"]
    answered(client, ckpt, expected)


# --------------------------------------------------- a limit with no room at start ----
def test_a_memory_limit_with_no_room_beyond_the_trash_is_refused_at_start(ckpt, expected):  # noqa: F811
    """256 KiB with two 128 KiB trash sectors was accepted, then every request failed with
    transformers' "No requests can be scheduled". It is refused at start, with the smallest
    limit that serves one request; that one serves."""
    import openai

    from tests.integrations.test_serve import free_port, wait_ready

    block = 256  # tokens: 2 layers x 2 KV heads x 16 x fp32 x K and V = 128 KiB a block, one block a sector
    sector = SECTOR // BLOCK * block
    page = 64 << 10
    with pytest.raises(vattn.InvalidConfigError, match=r"--memory-limit of 262144 bytes leaves no room for a request: "
                       rf"transformers' cache keeps 2 trash blocks of {sector} bytes always mapped.* the smallest "
                       r"limit that serves one request is (\d+) bytes") as e:
        hf_serve.serve(ckpt, device="cpu", num_blocks=8, block_size=block, page_size=page, memory_limit=2 * sector,
                       non_blocking=True)
    smallest = int(e.value.args[0].split("is ")[-1].split(" bytes")[0])
    assert smallest == 3 * sector  # the trash sectors and one more, in whole pages
    port = free_port()
    srv = hf_serve.serve(ckpt, port=port, device="cpu", num_blocks=8, block_size=block, page_size=page,
                         memory_limit=smallest, non_blocking=True)
    try:
        wait_ready(f"http://127.0.0.1:{port}")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=120, max_retries=0)
        answered(client, ckpt, expected)  # its prompt and answer fit one sector of 256 tokens
        assert srv.vattn.stats().peak_mapped_bytes <= smallest
    finally:
        srv.kill_server()
        hf_cb.disable_all()
    # the command says so and exits 2
    out = subprocess.run([sys.executable, "-m", "vattn", "serve", "--engine", "transformers", "--model", ckpt, "--device",
                          "cpu", "--num-blocks",
                          "8", "--block-size", str(block), "--page-size", str(page), "--memory-limit", str(2 * sector)],
                         capture_output=True, text=True, timeout=300, env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
                                                                           "PATH": "/usr/bin:/bin"})
    assert out.returncode == 2 and f"the smallest limit that serves one request is {smallest} bytes" in out.stderr


# ----------------------------------------------------------------------- metrics ----
def parse_metrics(text: str) -> dict:
    """Prometheus text -> {(name, labels as a sorted tuple): value} (prometheus_client's parser)."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_are_scraped_during_a_burst(server, ckpt, expected):  # noqa: F811
    limit = TRASH + 6 * SECTOR  # the burst does not fit at once: requests wait
    srv, client = server(memory_limit=limit)
    base = base_of(client)
    answered(client, ckpt, expected)
    scrapes: list[dict] = []
    stop = threading.Event()

    def scrape() -> None:
        while not stop.is_set():
            status, headers, text = call(base, "/metrics")
            assert status == 200 and headers["content-type"].startswith("text/plain")
            scrapes.append(parse_metrics(text))

    thread = threading.Thread(target=scrape, daemon=True)
    thread.start()
    try:
        assert burst(client, ckpt) == expected
    finally:
        stop.set()
        thread.join(timeout=60)
    assert len(scrapes) >= 3
    for m in scrapes:  # consistent at every scrape
        mapped, used = m[("vattn:kv_mapped_bytes", ())], m[("vattn:kv_used_bytes", ())]
        assert TRASH <= mapped <= limit and used <= mapped and m[("vattn:kv_limit_bytes", ())] == limit
        assert m[("vattn:kv_peak_mapped_bytes", ())] >= mapped and 0 <= m[("vattn:kv_cache_usage_perc", ())] <= 1
    busy = [m for m in scrapes if m[("vattn:num_requests_running", ())] > 0]
    assert busy and max(m[("vattn:kv_mapped_bytes", ())] for m in busy) > TRASH
    assert any(m[("vattn:num_requests_waiting", ())] > 0 for m in scrapes)  # more than the limit holds at once
    after = parse_metrics(call(base, "/metrics")[2])
    assert after[("vattn:num_requests_running", ())] == after[("vattn:num_requests_waiting", ())] == 0
    assert after[("vattn:kv_peak_mapped_bytes", ())] == srv.vattn.stats().peak_mapped_bytes
    assert after[("vattn:caches_total", ())] == srv.vattn.num_caches
    assert post_raw(base, "/v1/completions", json.dumps(dict(model=ckpt, prompt="", max_tokens=1)))[0] == 400
    refused = parse_metrics(call(base, "/metrics")[2])
    assert refused[("vattn:requests_refused_total", (("code", "empty_prompt"),))] == 1
