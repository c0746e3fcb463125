"""What other projects' clients and dashboards need of `vattn serve` (issue 36, "Clients as the
bar"), at CI speed, without them: every sample that vLLM's example Grafana dashboard reads
(`benchmarks/data/vllm_grafana_queries.txt`, `vllm:` renamed `vattn:`) is in a `/metrics`
scrape parsed by `prometheus_client.parser`, with the type its query needs (a histogram's
`_bucket` with `le`, `_sum`, `_count`; a counter's `_total`; a gauge) and the labels it
selects or groups by; and a client that goes away before its request's body has come (as
guidellm's cancelled requests do) is logged once at INFO, never an ERROR traceback.

The clients themselves (vLLM's `vllm bench serve`, guidellm, a real Prometheus) run in
`test_serve_peer_clients.py` (slow) and `benchmarks/peer_clients.py`.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import re
import socket
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
missing = [m for m in ("fastapi", "uvicorn", "prometheus_client") if importlib.util.find_spec(m) is None]
pytestmark = pytest.mark.skipif(bool(missing), reason=f"vattn serve's tests need {missing}")

from tests.conftest import REPO  # noqa: E402
from vattn.bench._models import char_checkpoint  # noqa: E402

QUERIES = REPO / "benchmarks" / "data" / "vllm_grafana_queries.txt"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    from vattn.serve import serve

    ckpt = char_checkpoint(tmp_path_factory.mktemp("ckpt"))
    server = serve(ckpt, port=free_port(), non_blocking=True, device="cpu", page_size=4096, max_model_len=256,
                   max_num_seqs=4, served_model_name=["tiny"], log_level="warning")
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(server.url + "/health", timeout=5):
                break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    yield server
    server.stop()


def post(srv, path: str, body: dict) -> bytes:
    req = urllib.request.Request(srv.url + path, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return r.read()


def grafana_queries() -> list[tuple[str, str]]:
    """(panel, query) of the dashboard's 16 panels, renamed for vattn, for the model `tiny`."""
    rows = [line.split("\t", 1) for line in QUERIES.read_text().splitlines()
            if "\t" in line and not line.startswith(("#", "("))]
    return [(panel, q.replace("vllm:", "vattn:").replace("$model_name", "tiny")) for panel, q in rows]


def test_the_queries_are_vllms():
    shared = REPO.parent.parent / "shared" / "data" / "vllm_grafana_queries.txt"
    if shared.exists():  # benchmarks/data's copy is ../shared/data's
        assert shared.read_text() == QUERIES.read_text()
    assert len(grafana_queries()) == 16


def test_every_grafana_sample_is_scraped_with_its_type_and_labels(srv):
    from prometheus_client.parser import text_string_to_metric_families

    post(srv, "/v1/completions", {"model": "tiny", "prompt": "for the dashboard", "max_tokens": 6, "ignore_eos": True})
    post(srv, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                       "max_tokens": 4, "stream": True})
    with urllib.request.urlopen(srv.url + "/metrics", timeout=30) as r:
        families = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
    samples = {}  # sample name -> [(labels, value)]
    for f in families.values():
        for s in f.samples:
            samples.setdefault(s.name, []).append((s.labels, s.value))
    checked = 0
    for panel, query in grafana_queries():
        for name, selector in re.findall(r"(vattn:[a-z0-9_]+)(\{[^}]*\})?", query):
            base, suffix = re.fullmatch(r"(.+?)(_bucket|_sum|_count|_total)?", name).groups()
            want = {"_bucket": "histogram", "_sum": "histogram", "_count": "histogram", "_total": "counter"}
            family = families.get(base)
            assert family is not None, f"{panel}: no metric {base} for {query}"
            assert family.type == want.get(suffix, "gauge"), f"{panel}: {base} is a {family.type}"
            assert name in samples, f"{panel}: no sample {name} in the scrape"
            selected = dict(re.findall(r'(\w+)="([^"]*)"', selector))
            rows = [labels for labels, _ in samples[name] if selected.items() <= labels.items()]
            assert rows, f"{panel}: {name}{selector} selects nothing"
            for group in re.findall(r"by\s*\(([^)]*)\)", query):
                for label in (g.strip() for g in group.split(",")):
                    assert all(label in labels for labels in rows), f"{panel}: {name} has no label {label}"
            checked += 1
    assert checked == 17  # 16 panels' queries, one of them reading two samples (e2e latency's _sum / _count)
    assert [v for _, v in samples["vattn:generation_tokens_total"]][0] >= 10
    assert sum(v for _, v in samples["vattn:request_success_total"]) >= 2
    e2e = {labels["le"]: v for labels, v in samples["vattn:e2e_request_latency_seconds_bucket"]}
    assert e2e["+Inf"] == [v for _, v in samples["vattn:e2e_request_latency_seconds_count"]][0] >= 2


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_a_client_gone_before_its_body_is_logged_once_at_info(srv):
    """guidellm cancels the requests in flight when a strategy's time is up: some before their
    body has come. uvicorn logged each as an ERROR with ClientDisconnect's traceback."""
    import urllib.parse

    handler = _Records()
    loggers = [logging.getLogger(n) for n in ("vattn.serve", "uvicorn.error", "uvicorn")]
    saved = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(logging.INFO)
    try:
        netloc = urllib.parse.urlsplit(srv.url).netloc
        for path in ("/v1/completions", "/v1/chat/completions"):
            host, port = netloc.rsplit(":", 1)
            sock = socket.create_connection((host, int(port)))
            sock.sendall(f"POST {path} HTTP/1.1\r\nhost: {netloc}\r\ncontent-type: application/json\r\n"
                         f"content-length: 200\r\n\r\n{{\"model\": \"tiny\", ".encode())
            time.sleep(0.3)  # the server waits in request.body() for the rest
            sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            gone = [r for r in handler.records if "before its request's body came" in r.getMessage()]
            if len(gone) == 2:
                break
            time.sleep(0.05)
        time.sleep(0.2)
    finally:
        for lg, level in zip(loggers, saved):
            lg.removeHandler(handler)
            lg.setLevel(level)
    assert len(gone) == 2 and all(r.levelno == logging.INFO for r in gone)
    errors = [r.getMessage() for r in handler.records if r.levelno >= logging.ERROR]
    assert not errors, errors
    assert b'"finish_reason"' in post(srv, "/v1/completions", {"model": "tiny", "prompt": "after", "max_tokens": 2})


def test_tokenize_and_detokenize_as_vllm(srv):
    """vLLM's /tokenize and /detokenize, which `vllm bench serve` asks to align its prompts."""
    tok = srv.state.tokenizer
    r = json.loads(post(srv, "/tokenize", {"model": "tiny", "prompt": "hello", "add_special_tokens": False}))
    assert r["tokens"] == tok.encode("hello", add_special_tokens=False) and r["count"] == 5
    assert r["max_model_len"] == 256
    messages = [{"role": "user", "content": "hi"}]
    r = json.loads(post(srv, "/tokenize", {"model": "tiny", "messages": messages}))
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert r["tokens"] == tok.encode(text, add_special_tokens=False)
    ids = tok.encode("what is paging?", add_special_tokens=False)
    assert json.loads(post(srv, "/detokenize", {"model": "tiny", "tokens": ids}))["prompt"] == "what is paging?"
    for path, body, param in [("/tokenize", {"model": "other", "prompt": "x"}, "model"),
                              ("/tokenize", {"prompt": 3}, "prompt"),
                              ("/detokenize", {"tokens": [10 ** 9]}, "tokens")]:
        with pytest.raises(urllib.error.HTTPError) as e:
            post(srv, path, body)
        assert e.value.code in (400, 404) and json.loads(e.value.read())["error"]["param"] == param


def test_tokenize_and_detokenize_need_the_key(srv):
    srv.state.api_key = "sekret"
    try:
        for path, body in [("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [5]})]:
            with pytest.raises(urllib.error.HTTPError) as e:
                post(srv, path, body)
            assert e.value.code == 401
    finally:
        srv.state.api_key = None
