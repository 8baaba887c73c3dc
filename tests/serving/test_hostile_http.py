"""Hostile HTTP clients against the server as `gemma3-serve` runs it (serving.http_server's
protocol under the app, over the fake engine): bodies built to crash the parser or the field
checks, protocol errors, requests that never finish, too many connections, and SIGTERM with
such requests and streams open. Nothing of it may get a 5xx, hang, or log a traceback; every
4xx is an OpenAI error body, and a 4xx leaves its keep-alive connection usable."""
import http.client
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

import jax_platform
from serving.config import ServerConfig
from serving.fake_runner import fake_paged_runner
from testkit import ServerThread, free_port, stop_processes, wait_group_ready

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 1.0  # the test server's header, body and keep-alive timeouts
LIMIT = 6  # its connection cap


@pytest.fixture(scope="module")
def server():
    config = ServerConfig(model="fake", served_model_name="fake", max_num_seqs=2, max_seq_len=4096,
                          compile_cache_dir="", background_compile=False, port=free_port(),
                          timeout_headers=TIMEOUT, timeout_body=TIMEOUT, timeout_keep_alive=TIMEOUT,
                          limit_concurrency=LIMIT)
    # The server gemma3-serve builds, its log records going to pytest's caplog.
    s = ServerThread(config, fake_paged_runner(max_num_seqs=2, max_seq_len=4096),
                     log_config=None, log_level="info")
    yield s
    s.stop()


def _openai_error(status: int, body: bytes) -> dict:
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], body
    assert 400 <= status < 500, (status, body)
    return err


def _no_errors_logged(caplog):
    bad = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not bad, [r.getMessage() for r in bad]


# ---- bodies ----

DEEP = "[" * 1000 + "]" * 1000
DEEP_OBJECT = '{"a": ' * 1000 + "1" + "}" * 1000
BIG = "1" * 5000  # digits: over Python's int-conversion limit (4,300)


def _tool(parameters: dict) -> list:
    return [{"type": "function", "function": {"name": "f", "parameters": parameters}}]


def _with_required(required) -> dict:
    return {"type": "object", "properties": {"a": {"type": "string"}}, "required": required}


def _assistant_args(args: str) -> list:
    return [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": args}}]},
            {"role": "user", "content": "x"}]


USER = [{"role": "user", "content": "x"}]
NAMED = {"type": "function", "function": {"name": "f"}}
HOSTILE = [  # (name, path, body, param the error names)
    ("deep prompt", "/v1/completions", '{"prompt": %s}' % DEEP, None),
    ("deep message content", "/v1/chat/completions", '{"messages": [{"role": "user", "content": %s}]}' % DEEP, None),
    ("deep unknown field", "/v1/completions", '{"prompt": "x", "extra": %s}' % DEEP_OBJECT, None),
    ("deep schema", "/v1/completions", '{"prompt": "x", "response_format": {"type": "json_schema", '
     '"json_schema": {"name": "a", "schema": %s}}}' % DEEP_OBJECT, None),
    ("moderately deep body", "/v1/completions", '{"prompt": "x", "extra": %s}' % ("[" * 200 + "]" * 200), None),
    ("long integer", "/v1/completions", '{"prompt": "x", "seed": %s}' % BIG, None),
    ("long logit_bias key", "/v1/completions", json.dumps({"prompt": "x", "logit_bias": {BIG: 1}}), "logit_bias"),
    ("guided_json long integer", "/v1/completions",
     json.dumps({"prompt": "x", "guided_json": '{"maximum": %s}' % BIG}), "guided_json"),
    ("guided_json deep", "/v1/completions", json.dumps({"prompt": "x", "guided_json": DEEP}), "guided_json"),
    ("tool_calls arguments long integer", "/v1/chat/completions",
     json.dumps({"messages": _assistant_args('{"a": %s}' % BIG)}), "messages.0.tool_calls.0.function.arguments"),
    ("tool_calls arguments deep", "/v1/chat/completions",
     json.dumps({"messages": _assistant_args('{"a": %s}' % DEEP)}), "messages.0.tool_calls.0.function.arguments"),
    ("tokenize tool_calls arguments long integer", "/tokenize",
     json.dumps({"messages": _assistant_args('{"a": %s}' % BIG)}), "messages.0.tool_calls.0.function.arguments"),
    ("required 5", "/v1/chat/completions",
     json.dumps({"messages": USER, "tools": _tool(_with_required(5)), "tool_choice": "required"}), "tools.0.function.parameters"),
    ("required [['a']]", "/v1/chat/completions",
     json.dumps({"messages": USER, "tools": _tool(_with_required([["a"]])), "tool_choice": "required"}),
     "tools.0.function.parameters"),
    ("required [{}], named", "/v1/chat/completions",
     json.dumps({"messages": USER, "tools": _tool(_with_required([{}])), "tool_choice": NAMED}), "tools.0.function.parameters"),
    ("a property's schema 5", "/v1/chat/completions",
     json.dumps({"messages": USER, "tools": _tool({"type": "object", "properties": {"a": 5}}), "tool_choice": "required"}),
     "tools.0.function.parameters"),
    ("tool_choice naming a list", "/v1/chat/completions",
     json.dumps({"messages": USER, "tools": _tool(_with_required(["a"])),
                 "tool_choice": {"type": "function", "function": {"name": ["f"]}}}), "tool_choice"),
    ("tool_choice 5", "/v1/chat/completions",
     json.dumps({"messages": USER, "tools": _tool(_with_required(["a"])), "tool_choice": 5}), "tool_choice"),
    ("$defs 5", "/v1/chat/completions",
     json.dumps({"messages": USER, "tools": _tool({"type": "object", "$defs": 5}), "tool_choice": NAMED}),
     "tools.0.function.parameters"),
]


def test_hostile_bodies_get_400_on_a_connection_that_stays_open(server, caplog):
    """Every class of body that reached a 500: a 400 with an OpenAI error body naming the limit
    or the field (never Python's own advice), all on one keep-alive connection, with a good
    request after each; nothing logged as an error."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.connect()
    local = conn.sock.getsockname()
    headers = {"content-type": "application/json"}
    for name, path, body, param in HOSTILE:
        conn.request("POST", path, body=body.encode(), headers=headers)
        r = conn.getresponse()
        data = r.read()
        assert r.status == 400, (name, r.status, data[:300])
        err = _openai_error(r.status, data)
        assert "set_int_max_str_digits" not in err["message"] and "Traceback" not in err["message"], name
        assert err["param"] == param, (name, err)
        if "deep" in name:
            assert "nested deeper than 128 levels" in err["message"], (name, err)
        if "integer" in name or "key" in name:
            assert "digits" in err["message"], (name, err)
        conn.request("POST", "/tokenize", body=json.dumps({"prompt": "ok"}), headers=headers)
        ok = conn.getresponse()
        assert ok.status == 200, (name, ok.read())
        ok.read()
        assert conn.sock is not None and conn.sock.getsockname() == local, f"{name}: the connection was closed"
    conn.close()
    _no_errors_logged(caplog)


def test_an_internal_error_is_one_logged_500_and_the_connection_stays(server, caplog):
    @server.app.get("/test-internal-error")
    async def fail():  # a bug, as the server's own code could have one
        raise RuntimeError("a bug")

    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("GET", "/test-internal-error")
    r = conn.getresponse()
    assert r.status == 500 and json.loads(r.read())["error"]["type"] == "server_error"
    local = conn.sock.getsockname()
    conn.request("GET", "/health")
    assert conn.getresponse().status == 200 and conn.sock.getsockname() == local
    conn.close()
    assert len([r for r in caplog.records if r.exc_info]) == 1


def test_a_body_within_the_limits_is_served(server):
    r = httpx.post(server.url + "/tokenize", json={"prompt": "x", "extra": [[[[10 ** 40]]]] * 3})
    assert r.status_code == 200, r.text


# ---- the protocol ----

def _exchange(port: int, *pieces: bytes, pause: float = 0.0, wait: float = 10.0) -> tuple[bytes, float]:
    """Sends the pieces (`pause` apart), then reads until the server closes: (what it sent, the
    seconds from the first piece to the close)."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait) as s:
        t0 = time.monotonic()
        for p in pieces:
            s.sendall(p)
            if select.select([s], [], [], pause)[0]:
                break  # the server answered (and closes): stop sending
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out, time.monotonic() - t0


def _status_and_body(response: bytes) -> tuple[int, bytes]:
    head, _, body = response.partition(b"\r\n\r\n")
    assert b"connection: close" in head.lower(), head
    return int(head.split(b" ", 2)[1]), body


@pytest.mark.parametrize("request_bytes", [
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{}",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
    b"\x16\x03\x01 garbage \xff\r\n\r\n",
], ids=["content-length", "chunk-size", "request-line"])
def test_protocol_errors_get_an_openai_error_body(server, request_bytes):
    out, _ = _exchange(server.port, request_bytes)
    status, body = _status_and_body(out)
    assert status == 400 and _openai_error(status, body)["code"] == "invalid_http_request"


def test_headers_that_never_finish_get_408_however_slowly_they_trickle(server):
    # One byte every 0.2 s: the deadline counts from the first byte, not from the last.
    pieces = [bytes([b]) for b in b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 40]
    out, seconds = _exchange(server.port, *pieces[:2], pause=0.2)
    status, body = _status_and_body(out)
    assert status == 408 and _openai_error(status, body)["code"] == "request_timeout"
    out, seconds = _exchange(server.port, *pieces, pause=0.1, wait=10)
    assert out.startswith(b"HTTP/1.1 408") and seconds < TIMEOUT + 3, seconds


def test_a_body_short_of_its_length_gets_408_and_no_traceback(server, caplog):
    out, seconds = _exchange(server.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                             b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\": ")
    status, body = _status_and_body(out)
    assert status == 408 and "request body" in _openai_error(status, body)["message"]
    assert seconds < TIMEOUT + 3
    # A client that leaves halfway through its upload: nothing to answer, nothing to log.
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"pro")
        time.sleep(0.2)
    time.sleep(0.3)
    _no_errors_logged(caplog)


def test_idle_connections_are_closed(server):
    out, seconds = _exchange(server.port)  # never sends a byte
    assert out == b"" and seconds < TIMEOUT + 3
    out, seconds = _exchange(server.port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")  # then idles
    assert out.startswith(b"HTTP/1.1 200") and seconds < 2 * TIMEOUT + 3, seconds


def test_connections_beyond_the_limit_get_503_then_the_server_serves_again(server):
    idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(LIMIT + 1)]
    try:
        out, _ = _exchange(server.port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        status, body = _status_and_body(out)
        assert status == 503 and json.loads(body)["error"]["code"] == "too_many_connections"
    finally:
        for s in idle:
            s.close()
    deadline = time.monotonic() + 10
    while httpx.get(server.url + "/health").status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.1)


# ---- SIGTERM ----

# gemma3-serve over the fake engine: the real CLI, signal handling and HTTP server.
FAKE_SERVE = """
import sys
from serving import runtime
from serving.fake_runner import fake_paged_runner
runtime.load_runner = lambda config, progress: fake_paged_runner(
    max_num_seqs=config.max_num_seqs, max_seq_len=config.max_seq_len, step_delay=0.02)
from serving.cli import serve_main
serve_main(sys.argv[1:])
"""


@pytest.fixture
def serve_process(tmp_path):
    procs = []

    def start(*flags: str):
        port = free_port()
        env = jax_platform.child_environment(dict(os.environ, JAX_PLATFORMS="cpu"), malloc_tunables=False)
        log = open(tmp_path / f"serve-{len(procs)}.log", "w")
        cmd = [sys.executable, "-c", FAKE_SERVE, "--model", "fake", "--port", str(port),
               "--max-seq-len", "512", "--compile-cache-dir", "", *flags]
        procs.append((subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), log))
        wait_group_ready(f"http://127.0.0.1:{port}", procs[-1:], 120)
        return procs[-1][0], port, Path(log.name)

    yield start
    stop_processes(procs)


def test_sigterm_is_not_held_by_half_sent_requests_or_idle_connections(serve_process):
    proc, port, log = serve_process("--timeout-headers", "60", "--timeout-body", "60",
                                    "--timeout-keep-alive", "60")
    half_body = socket.create_connection(("127.0.0.1", port))
    half_body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"prompt\"")
    half_headers = socket.create_connection(("127.0.0.1", port))
    half_headers.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(20)]
    kept_alive = http.client.HTTPConnection("127.0.0.1", port)
    kept_alive.request("GET", "/health")
    assert kept_alive.getresponse().read()
    time.sleep(0.3)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    assert time.monotonic() - t0 < 10
    half_body.settimeout(5)
    status, body = _status_and_body(half_body.recv(65536))
    assert status == 503 and json.loads(body)["error"]["type"] == "service_unavailable"
    for s in [half_body, half_headers, *idle]:
        s.close()
    assert "Traceback" not in log.read_text(), log.read_text()[-3000:]


def test_sigterm_with_a_stream_open_past_the_grace_period_logs_no_traceback(serve_process):
    proc, port, log = serve_process("--shutdown-timeout", "0.5", "--max-seq-len", "128", "--max-num-seqs", "2")
    url, body = f"http://127.0.0.1:{port}/v1/completions", {"prompt": "x", "max_tokens": 60, "ignore_eos": True}
    # Once whole first: the fake engine's programs for every step shape compile (a compile under
    # the shutdown would hold up the engine thread's exit).
    assert httpx.post(url, json=body, timeout=120).status_code == 200
    got = {}

    def stream():
        with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as r:
            got["lines"] = [line for line in r.iter_lines() if line]

    t = threading.Thread(target=stream)
    t.start()
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0, log.read_text()[-3000:]
    t.join(30)
    assert got["lines"] and "[DONE]" not in got["lines"][-1]  # cut short, and ended cleanly
    text = log.read_text()
    assert "Traceback" not in text and "Event loop is closed" not in text, text[-3000:]



# ---- large bodies ----

def test_large_bodies_are_parsed_off_the_event_loop(server):
    """Megabyte bodies are decoded and validated on the parser thread: /health, answered on the
    event loop, is not held up while they are (each is then refused: over the context)."""
    import asyncio
    import threading as th

    ids = list(range(300, 556)) * 1600  # ~2 MB of token ids the fake vocabulary has
    body = json.dumps({"prompt": ids, "max_tokens": 1}).encode()
    assert len(body) > 1_500_000

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            posts = [asyncio.create_task(c.post("/v1/completions", content=body,
                                                headers={"content-type": "application/json"}))
                     for _ in range(4)]
            worst = 0.0
            while not all(p.done() for p in posts):
                t = time.perf_counter()
                assert (await c.get("/health")).status_code == 200
                worst = max(worst, time.perf_counter() - t)
                await asyncio.sleep(0.01)
            return [p.result() for p in posts], worst

    replies, worst = asyncio.run(run())
    for r in replies:
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert any(t.name.startswith("request-parser") for t in th.enumerate())
    assert worst < 1.0, worst
