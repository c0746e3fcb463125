"""`vattn serve` and clients that go away or send what no client should, over raw sockets on
127.0.0.1 (docs/servers.md, "`vattn serve`: what a client can count on"): streams cut at
random points, by a close (FIN) and by a reset (RST), in rounds of 40 while the cache is full,
leave nothing behind (their requests cancelled, their blocks free, the batching loop serving
normal requests at once, as `generate` answers), and so do clients that leave before their
answer (their requests cancelled); a lone surrogate in a prompt is a 400; a
Content-Length over `--max-body-bytes` is a 413 before any of the body came; requests that
share an `X-Request-ID` are answered each alone.
"""
from __future__ import annotations

import concurrent.futures
import gc
import http.client
import json
import logging
import random
import socket
import struct
import threading
import time

import pytest

from tests.integrations.test_serve import (  # noqa: F401  (fixtures)
    MAX_TOKENS, PROMPTS, SKIP, TRASH, answered, burst, call, ckpt, expected, server, wait_for)
from tests.integrations.serve_clients_util import address, cut_stream, post_head, read_answer
from tests.integrations.test_serve_requests import base_of, parse_metrics, post_raw

pytestmark = pytest.mark.skipif(bool(SKIP), reason=SKIP)

STREAMS = 40  # cut at once, each round
ROUNDS = 3
RECOVER_S = 15.0  # a normal request after a round is answered, and the books are back, within this


def batch_ids(cut: list) -> list[str]:
    """The ids of the batch requests the cut streams stood for (`cut_stream`'s records)."""
    return [i for request_id, n in cut if request_id is not None
            for i in ([request_id] if n == 1 else [f"{request_id}-{k}" for k in range(n)])]


def cancelled_ids(records: list) -> list[str]:
    """The request ids of vattn serve's "cancelled" log lines."""
    return [r.getMessage().split()[3] for r in records if "cancelled (its client went away)" in r.getMessage()]


def books(base: str) -> dict:
    """The server's KV bytes in use and its requests running and waiting (GET /metrics)."""
    m = parse_metrics(call(base, "/metrics")[2])
    return {k: m[(f"vattn:{k}", ())] for k in ("kv_used_bytes", "num_requests_running", "num_requests_waiting")}


def test_clients_that_cut_their_streams_leave_nothing_behind(server, ckpt, expected, caplog):  # noqa: F811
    """The reviewer's wedge: clients that cut streams while transformers' loop held new
    requests back (a full cache made it offload requests) left it idle for good with
    running=0, waiting=1; every later request timed out. After each round of 40 cut streams
    every cut stream's request is cancelled (logged once at INFO, no error; a stream whose
    write was waiting when it was cut had run on to the end of its room, until the garbage
    collector finalized it), a normal request is answered at once, running and waiting go back
    to 0; after the rounds every prompt is answered as `generate` answers it, a trim leaves
    exactly the KV in use before (every cancelled request's blocks were freed), and no
    cancelled request's result handler is left."""
    srv, client = server()
    base, quick = base_of(client), client.with_options(timeout=RECOVER_S)
    answered(quick, ckpt, expected)
    srv.vattn.trim()
    before = books(base)
    assert before == {"kv_used_bytes": TRASH, "num_requests_running": 0, "num_requests_waiting": 0}, before
    caplog.set_level(logging.INFO, logger="vattn.serve")
    rng = random.Random(38)
    cut: list = []
    for round_ in range(ROUNDS):
        seeds = [rng.random() for _ in range(STREAMS)]
        clients = [threading.Thread(target=cut_stream, args=(base, ckpt, random.Random(s), cut)) for s in seeds]
        gc.disable()  # a stream left open until the collector finalizes it must not be rescued by a collection
        try:
            for t in clients:
                t.start()
            for t in clients:
                t.join()
            start = time.monotonic()
            assert wait_for(lambda: set(batch_ids(cut)) <= set(cancelled_ids(caplog.records)), RECOVER_S), \
                (round_, sorted(set(batch_ids(cut)) - set(cancelled_ids(caplog.records))))  # every cut request
        finally:
            gc.enable()
        answered(quick, ckpt, expected, PROMPTS[round_])
        assert wait_for(lambda: books(base)["num_requests_running"] == books(base)["num_requests_waiting"] == 0,
                        RECOVER_S), (round_, books(base))
        assert time.monotonic() - start < RECOVER_S
    assert len(cut) >= STREAMS
    assert burst(quick, ckpt) == expected
    srv.vattn.trim()  # the blocks transformers keeps for prefix sharing go: what is left is in use
    assert books(base) == before
    manager = srv._generation_state._cb_manager._cb
    assert not manager.output_router.result_handlers, "a cancelled request's result handler stays"
    cancelled = cancelled_ids(caplog.records)
    assert len(cancelled) == len(set(cancelled)), "each cancelled request is logged once"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], "a cut stream is no error"


# ------------------------------------------------------------ what no client should send ----
def test_a_lone_surrogate_is_a_400_that_names_the_field(server, ckpt, expected):  # noqa: F811
    """JSON's escapes can spell a lone UTF-16 surrogate, which no tokenizer encodes: it was a
    500 from transformers' handler. It is a 400 with an OpenAI error body naming the field; a
    surrogate pair (a real character) passes; a normal request after it is answered."""
    _, client = server()
    base = base_of(client)
    cases = [  # (path, raw body, param)
        ("/v1/completions", '{"model": "%s", "prompt": "a\\ud800b", "max_tokens": 2}' % ckpt, "prompt"),
        ("/v1/completions", '{"model": "%s", "prompt": "\\udfff", "max_tokens": 2, "stream": true}' % ckpt, "prompt"),
        ("/v1/chat/completions", '{"model": "%s", "messages": [{"role": "user", "content": "hi \\udc80"}], '
         '"max_tokens": 2}' % ckpt, "messages[0].content"),
        ("/v1/completions", '{"model": "%s", "prompt": "hi", "user": "\\ud800", "max_tokens": 2}' % ckpt, "user"),
    ]
    for path, raw, param in cases:
        status, answer = post_raw(base, path, raw)
        assert status == 400, (raw, answer)
        error = answer["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == "invalid_unicode", error
        assert error["param"] == param and "lone UTF-16 surrogate" in error["message"], error
        answered(client, ckpt, expected)
    status, answer = post_raw(base, "/v1/completions", '{"model": "%s", "prompt": "\\ud83d\\ude00 hi", '
                              '"max_tokens": 2, "temperature": 0}' % ckpt)
    assert status == 200 and answer["usage"]["prompt_tokens"] == 4, answer  # the pair is one (unknown) character
    status, answer = post_raw(base, "/v1/completions", "[" * 100_000)  # nested past json's depth: was a 500 too
    assert status == 400 and answer["error"]["code"] == "invalid_json", answer
    answered(client, ckpt, expected)


def test_a_length_over_the_cap_is_a_413_before_the_body_comes(server, ckpt, expected):  # noqa: F811
    """The 413 is decided by the Content-Length: a client that sends a huge length and then no
    body (or waits for `100 Continue` first) gets it at once; it waited for the body before."""
    _, client = server()
    base = base_of(client)
    for expect in ("", "Expect: 100-continue\r\n"):
        with socket.create_connection(address(base), timeout=10) as sock:
            head = post_head("/v1/completions", 1 << 40)
            sock.sendall(head[:-2] + expect.encode() + b"\r\n")
            start = time.monotonic()
            status, body = read_answer(sock)
            took = time.monotonic() - start
        assert status == 413 and body["error"]["code"] == "request_too_large", body
        assert f"is {1 << 40} bytes" in body["error"]["message"]
        assert took < 5, f"the 413 took {took:.1f} s"
    answered(client, ckpt, expected)


def test_requests_that_share_an_x_request_id_are_answered_alone(server, ckpt, expected):  # noqa: F811
    """transformers' batch keys a request by the id its middleware takes from `X-Request-ID`:
    9 requests in flight with one id (retries, or clients that send a fixed one) killed the
    batching loop (an embedding index out of range; the others timed out or got 503). Each is
    answered as `generate` answers it, the header echoes the client's id, and the loop lives."""
    srv, client = server()
    base = base_of(client)

    def ask(prompt: str) -> tuple[str, str]:
        conn = http.client.HTTPConnection(*address(base), timeout=RECOVER_S)
        try:
            conn.request("POST", "/v1/completions", json.dumps(
                {"model": ckpt, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}),
                {"Content-Type": "application/json", "X-Request-ID": "the-same-id"})
            r = conn.getresponse()
            assert r.status == 200, r.read()
            return r.getheader("x-request-id"), json.loads(r.read())["choices"][0]["text"]
        finally:
            conn.close()

    prompts = PROMPTS[:3] * 3
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as ex:
        answers = list(ex.map(ask, prompts))
    assert answers == [("the-same-id", expected[p]) for p in prompts]
    assert srv._generation_state.num_restarts == 0
    answered(client, ckpt, expected)


def test_clients_that_leave_before_their_answer_cancel_their_requests(server, ckpt, expected, caplog):  # noqa: F811
    """A non-streamed request whose client went away ran on for nobody, to its end: here
    (`ignore_eos`, no max_tokens) the end of its room. Eight such clients close (FIN) or reset
    (RST) once their requests are in the batch; each request is cancelled, the batch empties,
    and a normal request is answered."""
    srv, client = server()
    base = base_of(client)
    caplog.set_level(logging.INFO, logger="vattn.serve")
    socks = []
    for i in range(8):
        body = json.dumps({"model": ckpt, "prompt": f"leave {i} " + "q" * 5 * i, "temperature": 0,
                           "ignore_eos": True}).encode()
        sock = socket.create_connection(address(base), timeout=RECOVER_S)
        head = post_head("/v1/completions", len(body))
        sock.sendall(head[:-2] + f"X-Request-ID: gone-{i}\r\n\r\n".encode() + body)
        socks.append(sock)
    try:
        assert wait_for(lambda: sum(books(base)[k] for k in ("num_requests_running", "num_requests_waiting")) >= 8,
                        RECOVER_S), books(base)
    finally:
        for i, sock in enumerate(socks):
            if i % 2:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()

    def all_cancelled() -> bool:
        ids = cancelled_ids(caplog.records)
        return all(any(c.startswith(f"gone-{i}-") for c in ids) for i in range(8))

    assert wait_for(all_cancelled, RECOVER_S), cancelled_ids(caplog.records)
    assert wait_for(lambda: books(base)["num_requests_running"] == books(base)["num_requests_waiting"] == 0,
                    RECOVER_S), books(base)
    answered(client, ckpt, expected)
    assert not srv._generation_state._cb_manager._cb.output_router.result_handlers
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], "a client that left is no error"
