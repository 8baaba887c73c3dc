"""The HTTP layer on a real uvicorn server (in a thread, loopback port) over the fake engine, with
real clients: validation and errors, back-pressure, disconnects, API keys and the wire formats.
The same app over the real model is tested in test_server_e2e.py."""
import asyncio
import json
import re
import socket
import time

import httpx
import openai
import pytest

from serving.config import ServerConfig
from serving.fake_runner import fake_paged_runner
from testkit import ServerThread

MAX_SEQ_LEN = 64


@pytest.fixture(scope="module")
def server():
    """The app over the real engine (its scheduler, pages and sampler) over the fake model."""
    config = ServerConfig(model="fake", served_model_name="fake", max_num_seqs=2, max_seq_len=MAX_SEQ_LEN,
                          max_waiting=4, compile_cache_dir="")
    engine = fake_paged_runner(max_num_seqs=2, max_seq_len=MAX_SEQ_LEN, step_delay=0.003)
    s = ServerThread(config, engine)
    yield s
    s.stop()


def _error(r, status, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


# ---- bad input ----

@pytest.mark.parametrize("body,param", [
    (b"{", None),  # malformed JSON
    (b'{"prompt": "x", "max_tokens": 4', None),
    (b"[1, 2]", None),  # not an object
    (b'{"prompt": 12}', "prompt"),  # wrong types
    (b'{"prompt": "x", "max_tokens": "10"}', "max_tokens"),
    (b'{"prompt": "x", "temperature": "hot"}', "temperature"),
    (b'{"prompt": "x", "stream": "yes"}', "stream"),
    (b'{"prompt": "x", "stop": 5}', "stop"),
    (b'{"prompt": "x", "max_tokens": -1}', "max_tokens"),
    (b'{"prompt": "x", "max_tokens": 0}', "max_tokens"),
    (b'{"prompt": "x", "max_tokens": 100}', "max_tokens"),  # over the context
    (b'{"prompt": "x", "temperature": -0.5}', "temperature"),
    (b'{"prompt": "x", "top_p": 0}', "top_p"),
    (b'{"prompt": "x", "top_p": 1.5}', "top_p"),
    (b'{"prompt": "x", "temperature": NaN}', None),
    (b'{"prompt": ""}', "prompt"),
    (b'{"prompt": []}', "prompt"),
    (b'{"prompt": [1, 2, 999999]}', "prompt"),
    (b'{"prompt": "x", "logprobs": 50}', "logprobs"),
    (b'{"prompt": "x", "n": 0}', "n"),
    (b'{"prompt": "x", "presence_penalty": 2.5}', "presence_penalty"),
    (b'{"prompt": "x", "logit_bias": {"--5": 1}}', "logit_bias"),  # not ids, though
    (b'{"prompt": "x", "logit_bias": {"\xc2\xb2": 1}}', "logit_bias"),  # str.isdigit() holds
    (b'{"prompt": "x", "logit_bias": {"-5": 1}}', "logit_bias"),
    (b'{"prompt": "x", "seed": 9223372036854775808}', "seed"),
    (b'{"prompt": "\\ud800"}', None),  # a lone surrogate is not text
    (b'{"prompt": "caf\xe9"}', None),  # invalid UTF-8 (Latin-1 byte)
])
def test_bad_completion_requests_get_400(client, body, param):
    r = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    err = _error(r, 400, param)
    assert err["type"] == "invalid_request_error"


def test_oversized_body_gets_413(client):
    from serving.api import MAX_BODY_BYTES

    r = client.post("/v1/completions", content=b'{"prompt": "' + b"a" * MAX_BODY_BYTES + b'"}',
                    headers={"content-type": "application/json"})
    assert _error(r, 413)["code"] == "request_too_large"


def test_oversized_chunked_body_gets_413_before_it_ends(server):
    """A chunked upload (no Content-Length) is refused as soon as it passes the limit, not
    buffered whole: the 413 comes while the body is still open (its last chunk never sent)."""
    from serving.api import MAX_BODY_BYTES

    piece = b"a" * (1 << 20)
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        for _ in range(MAX_BODY_BYTES // len(piece) + 1):
            sock.sendall(b"%x\r\n" % len(piece) + piece + b"\r\n")
        head = sock.recv(4096)
    assert head.startswith(b"HTTP/1.1 413"), head[:200]


def test_prompt_longer_than_context_states_the_limit(client):
    r = client.post("/v1/completions", json={"prompt": "y" * 200, "max_tokens": 1})
    err = _error(r, 400, "prompt")
    assert f"maximum context length is {MAX_SEQ_LEN} tokens" in err["message"]
    assert "201 tokens" in err["message"] and err["code"] == "context_length_exceeded"
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "y" * 200}]})
    assert f"maximum context length is {MAX_SEQ_LEN}" in _error(r, 400, "prompt")["message"]


@pytest.mark.parametrize("body,param", [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "user"}], "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages"),
    # an image to a model without a vision tower (the fake engine's)
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools.0"),
])
def test_bad_chat_requests_get_400(client, body, param):
    _error(client.post("/v1/chat/completions", json=body), 400, param)


def test_unknown_model_and_route_get_404(client, oai):
    err = _error(client.post("/v1/completions", json={"model": "gpt-4", "prompt": "x"}), 404, "model")
    assert err["code"] == "model_not_found"
    _error(client.get("/v1/nothing"), 404)
    _error(client.get("/v1/models/gpt-4"), 404)
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])


def test_bad_requests_do_not_disturb_others(client, server):
    good = {"prompt": "steady", "max_tokens": 30, "temperature": 0}
    expected = client.post("/v1/completions", json=good).json()["choices"][0]["text"]

    async def mixed():
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as c:
            bad = [c.post("/v1/completions", content=b, headers={"content-type": "application/json"})
                   for b in (b"{", b'{"prompt": 1}', b'{"prompt": "x", "top_p": 9}')]
            return await asyncio.gather(c.post("/v1/completions", json=good), *bad)

    first, *bad = asyncio.run(mixed())
    assert first.json()["choices"][0]["text"] == expected
    assert [r.status_code for r in bad] == [400, 400, 400]


# ---- back-pressure, disconnects ----

def test_queue_full_gets_429_with_retry_after(server):
    # 2 slots + 4 waiting: a burst of 12 long requests overflows the queue.
    async def burst():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            reqs = [c.post("/v1/completions", json={"prompt": f"q{i}", "max_tokens": 40, "temperature": 0})
                    for i in range(12)]
            return await asyncio.gather(*reqs)

    rs = asyncio.run(burst())
    codes = sorted(r.status_code for r in rs)
    # At least the queue's worth is accepted (more if slots were taken first), the rest refused.
    assert codes.count(200) >= 4 and codes.count(429) >= 1 and set(codes) == {200, 429}, codes
    limited = next(r for r in rs if r.status_code == 429)
    assert limited.headers["retry-after"] == "1"
    assert _error(limited, 429)["type"] == "rate_limit_error"


def test_a_request_that_can_never_wait_gets_400_not_429(client, server):
    """More sequences (prompts x n) than --max-waiting (4 here) could not be queued even on an
    idle server: a 400 saying the limit, not a 429 the client would retry for ever."""
    _wait_idle(server)
    r = client.post("/v1/completions", json={"prompt": ["a", "b", "c"], "n": 2, "max_tokens": 2})
    err = _error(r, 400, "n")
    assert "6 sequences" in err["message"] and "4" in err["message"] and "retry-after" not in r.headers
    r = client.post("/v1/completions", json={"prompt": ["a", "b"], "n": 2, "max_tokens": 2})
    assert r.status_code == 200 and len(r.json()["choices"]) == 4


def _wait_idle(server, timeout=5.0):
    deadline = time.monotonic() + timeout
    while server.runtime.core.num_running or server.runtime.core.num_waiting:
        assert time.monotonic() < deadline, "slots not freed"
        time.sleep(0.01)


def test_disconnect_mid_stream_frees_the_slot(server):
    _wait_idle(server)
    aborted_before = _aborts(server)
    with httpx.Client(base_url=server.url, timeout=30) as c:
        with c.stream("POST", "/v1/completions",
                      json={"prompt": "zzz", "max_tokens": 60, "stream": True, "temperature": 0}) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(line.startswith("data: ") for line in got)
            assert server.runtime.core.num_running == 1
    # The response is closed: the slot must be released within a few steps.
    _wait_idle(server)
    assert _aborts(server) == aborted_before + 1


def test_disconnect_while_waiting_non_streaming_frees_the_slot(server):
    _wait_idle(server)
    before = _aborts(server)
    fake = server.runner.model
    fake.step_delay = 0.05  # 60 tokens take 3 seconds: the client leaves long before
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/completions", json={"prompt": "w", "max_tokens": 60}, timeout=0.1)
        _wait_idle(server, timeout=2.0)
    finally:
        fake.step_delay = 0.003
    assert _aborts(server) == before + 1


def _aborts(server) -> float:
    text = httpx.get(server.url + "/metrics").text
    for line in text.splitlines():
        if line.startswith("gemma3:request_success_total") and 'finished_reason="abort"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


# ---- formats (official client) ----

def test_completion_with_echo_logprobs_n_and_usage(server, oai):
    r = oai.completions.create(model="fake", prompt="héllo", max_tokens=7, temperature=0, n=2,
                               logprobs=2, echo=True)
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        assert c.text == "héllo" + "hélloh"  # 'é' is two byte tokens: 6 tokens per "héllo"
        assert c.finish_reason == "length"
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == 6 + 7
        assert lp.tokens[:3] == ["h", "<0xC3>", "<0xA9>"]
        assert lp.text_offset[:4] == [0, 1, 2, 2]
        assert all(v is not None for v in lp.token_logprobs)
        assert all(len(t) <= 2 for t in lp.top_logprobs)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (7, 14, 21)


def test_echo_with_zero_max_tokens_scores_the_prompt(server, client):
    r = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 0, "echo": True, "logprobs": 0})
    body = r.json()
    c = body["choices"][0]
    assert c["text"] == "abc" and c["logprobs"]["tokens"] == ["a", "b", "c"]
    assert body["usage"]["completion_tokens"] == 0


def test_multiple_prompts_and_token_id_prompts(oai):
    r = oai.completions.create(model="fake", prompt=["ab", "cd"], max_tokens=3, temperature=0)
    assert [c.text for c in r.choices] == ["aba", "cdc"]
    r = oai.completions.create(model="fake", prompt=[2, 300 + ord("x"), 300 + ord("y")], max_tokens=3,
                               temperature=0)
    assert r.choices[0].text == "xyx"


def test_streaming_chat_with_usage_and_stop(oai):
    stream = oai.chat.completions.create(
        model="fake", messages=[{"role": "system", "content": "S"}, {"role": "user", "content": "hello"}],
        max_tokens=40, temperature=0, stop=["ll"], stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    # The fake model repeats the prompt: "user\nS\n\nhello" then markers: the stop cuts at "ll".
    assert text == "user\nS\n\nhe"
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 9


def test_chat_logprobs_format(oai):
    r = oai.chat.completions.create(model="fake", messages=[{"role": "user", "content": "é"}], max_tokens=3,
                                    temperature=0, logprobs=True, top_logprobs=1)
    content = r.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 1 for t in content)
    # The fake repeats the prompt from its second token: <start_of_turn> (no text), "u", "s".
    assert [t.bytes for t in content] == [[], [ord("u")], [ord("s")]]
    assert [t.token for t in content] == ["<start_of_turn>", "u", "s"]


def test_seeded_sampling_is_reproducible(client):
    body = {"prompt": "s", "max_tokens": 12, "temperature": 1.0, "seed": 7}
    a = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    b = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    c = client.post("/v1/completions", json={**body, "seed": 8}).json()["choices"][0]["text"]
    assert a == b and a != c


def test_the_largest_seed_takes_n_choices(client):
    """Choice j draws with seed + j, wrapped into the seeds' signed 64-bit range: the largest
    seed a client may send works with n > 1, and an error names the seed that was sent."""
    body = {"prompt": "s", "max_tokens": 12, "temperature": 1.0, "n": 2}
    r = client.post("/v1/completions", json={**body, "seed": 2**63 - 1})
    assert r.status_code == 200, r.text
    # The device seeds are 32-bit: 2**63 - 1 + 1 wraps to -2**63, the same seed as 0 there.
    zero = client.post("/v1/completions", json={**body, "n": 1, "seed": 0}).json()["choices"][0]["text"]
    assert r.json()["choices"][1]["text"] == zero
    err = _error(client.post("/v1/completions", json={**body, "seed": 2**63}), 400, "seed")
    assert str(2**63) in err["message"] and str(2**63 + 1) not in err["message"]


def test_generate_endpoint_plain_and_streamed(client):
    r = client.post("/generate", json={"prompt": "ab", "max_tokens": 3})
    assert r.json()["text"] == "aba" and r.json()["finish_reason"] == "length"
    with client.stream("POST", "/generate", json={"prompt": "ab", "max_tokens": 3, "stream": True}) as r:
        lines = [json.loads(x) for x in r.iter_lines() if x]
    assert "".join(x["text"] for x in lines) == "aba" and lines[-1]["usage"]["completion_tokens"] == 3
    _error(client.post("/generate", json={"max_tokens": 3}), 400, "prompt")


def test_prompts_are_tokenized_off_the_event_loop(server, client, monkeypatch):
    """Tokenizing a prompt (or rendering a chat) of megabytes takes seconds: it runs on a worker
    thread, never on the event loop that streams every other request's chunks."""
    tok = server.runner.tokenizer
    threads = []

    def encode(text, _encode=tok.encode):
        import threading
        threads.append(threading.get_ident())
        return _encode(text)

    monkeypatch.setattr(tok, "encode", encode)
    assert client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2}).status_code == 200
    assert client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "ab"}],
                                                     "max_tokens": 2}).status_code == 200
    assert client.post("/generate", json={"prompt": "ab", "max_tokens": 2}).status_code == 200
    assert client.post("/tokenize", json={"prompt": "ab"}).status_code == 200
    long = client.post("/v1/completions", json={"prompt": "ab" * 2_000_000, "max_tokens": 2})
    assert long.status_code == 400 and "maximum context length" in long.text
    assert len(threads) >= 5 and server.thread.ident not in threads


def test_models_health_and_metrics(client):
    m = client.get("/v1/models").json()
    assert m["data"][0]["id"] == "fake" and m["data"][0]["allreduce"]["method"] == "bf16"
    h = client.get("/health")
    assert h.status_code == 200 and h.json()["allreduce_label"] == "bf16"
    text = client.get("/metrics").text
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
                 "prompt_tokens_total", "generation_tokens_total", "num_requests_running",
                 "num_requests_waiting", "kv_cache_usage_perc", "prefill_steps_total",
                 "prefill_padding_tokens_total"):
        assert f"gemma3:{name}" in text, name
    assert 'allreduce="bf16"' in text
    assert re.search(r'gemma3:prefill_steps_total\{allreduce="bf16",batch="1",bucket="\d+",model_name="fake"\} [1-9]', text)


# ---- readiness and API key ----

def test_not_ready_gives_503_then_200_and_api_key():
    config = ServerConfig(model="fake", served_model_name="fake", max_num_seqs=1, max_seq_len=32,
                          api_key="sekret", compile_cache_dir="")
    s = ServerThread(config, fake_paged_runner(max_num_seqs=1, max_seq_len=32), load=False)
    try:
        assert httpx.get(s.url + "/health").status_code == 503
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer sekret"})
        assert _error(r, 503)["type"] == "service_unavailable"
        s.runtime.load()
        assert httpx.get(s.url + "/health").status_code == 200
        _error(httpx.post(s.url + "/v1/completions", json={"prompt": "x"}), 401)
        _error(httpx.post(s.url + "/v1/completions", json={"prompt": "x"},
                          headers={"Authorization": "Bearer wrong"}), 401)
        ok = openai.OpenAI(base_url=s.url + "/v1", api_key="sekret", max_retries=0)
        assert ok.completions.create(model="fake", prompt="ab", max_tokens=2, temperature=0).choices[0].text == "ab"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.url + "/v1", api_key="nope", max_retries=0).models.list()
    finally:
        s.stop()
