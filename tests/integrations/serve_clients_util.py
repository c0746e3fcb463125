"""Raw-socket clients of `vattn serve` that no polite client is: streams cut at random points
(FIN, or RST by SO_LINGER 0), a Content-Length and no body. Shared by the tests of both
engines (test_serve_clients.py: `--engine transformers`; test_serve_vattn.py: `--engine vattn`).
"""
from __future__ import annotations

import json
import random
import socket
import struct
import time
import urllib.parse

STREAM_WAIT_S = 20.0  # a client waits this long for the events it will cut after (a wedged server sends none)


def address(base: str) -> tuple[str, int]:
    url = urllib.parse.urlsplit(base)
    return url.hostname, url.port


def post_head(path: str, length: int, host: str = "x") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def read_answer(sock: socket.socket) -> tuple[int, dict]:
    """The status and JSON body of an answer read from `sock` (by its Content-Length)."""
    got = b""
    while b"\r\n\r\n" not in got:
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed before an answer: {got!r}"
        got += chunk
    head, body = got.split(b"\r\n\r\n", 1)
    lines = head.decode().split("\r\n")
    length = int(next(v for k, _, v in (h.partition(":") for h in lines[1:]) if k.lower() == "content-length"))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed inside the answer: {got!r}"
        body += chunk
    return int(lines[0].split()[1]), json.loads(body[:length])


def cut_stream(base: str, model: str, rng: random.Random, cut: list) -> None:
    """A streamed completion (1 in 8 with n=2) with `ignore_eos` and without max_tokens: it
    runs to the end of its room unless cancelled. Read for 1-10 events, then cut: closed (FIN)
    or reset (RST, SO_LINGER 0). Once its answer started (its status line came; nothing within
    STREAM_WAIT_S: none), appends to `cut` (its `X-Request-ID` header or None, its n)."""
    n = 2 if rng.random() < 1 / 8 else 1
    body = json.dumps({"model": model, "prompt": "cut " + "xyz"[rng.randrange(3)] * rng.randint(1, 40), "n": n,
                       "stream": True, "temperature": 0, "ignore_eos": True}).encode()
    want, got = rng.randint(1, 10), b""
    with socket.create_connection(address(base), timeout=STREAM_WAIT_S) as sock:
        sock.sendall(post_head("/v1/completions", len(body)) + body)
        deadline = time.monotonic() + STREAM_WAIT_S
        try:
            while got.count(b"data: ") < want and time.monotonic() < deadline:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                got += chunk
        except OSError:  # timed out: cut anyway
            pass
        if rng.random() < 0.5:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close sends RST
    assert b"data: [DONE]" not in got, "a stream with ignore_eos and no max_tokens ended before its cut"
    if not got.startswith(b"HTTP/1.1 200"):
        return
    headers = got.split(b"\r\n\r\n", 1)[0].decode(errors="replace").split("\r\n")[1:]
    request_id = next((v.strip() for k, _, v in (h.partition(":") for h in headers) if k.lower() == "x-request-id"), None)
    cut.append((request_id, n))
