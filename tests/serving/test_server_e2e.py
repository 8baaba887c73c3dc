"""End to end: a `gemma3-serve` process on a loopback port serving the real Gemma 3 270M (float32,
short context to keep compiles short), driven by real clients (httpx and the official `openai`).

One server, shared by every test here: tp=2 on two virtual CPU devices with a float32 AllReduce,
whose greedy outputs must be the golden greedy continuations made with the official `gemma`
implementation, one prompt at a time (and its prompt logprobs the official logits). A served
tp=1 270M is compared with a golden in test_hf_checkpoint.py, and `gemma3-serve` runs at tp=1 in
tests/eval/test_bench_serving.py and test_watchdog.py.
"""
import asyncio
import functools
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

import jax_platform
from testkit import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
# transformers' golden (tests/golden/make_hf_golden.py): the official one's logits and greedy
# continuations on prompts 0 and 2-5 (8e-6 relative), and the prompts tokenized as Gemma's own
# tokenizer does (the official golden split prompt 1's runs of spaces into single pieces).
GOLDEN = np.load(ROOT / "tests" / "golden" / "gemma3_270m_hf.npz")
PROMPTS = [str(p) for p in GOLDEN["prompts"]]
MAX_SEQ_LEN = 64
NEW_TOKENS = 8
STARTUP_TIMEOUT = 900




class ServerProcess:
    def __init__(self, name: str, args: list[str], log_dir: Path, cache_dir: Path, max_seq_len: int):
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"{name}.log"
        # The test session's 8 virtual devices are not the server's business: --tp decides.
        env = jax_platform.child_environment(dict(os.environ, JAX_PLATFORMS="cpu"), malloc_tunables=False)
        cmd = [sys.executable, "-m", "serving.cli", "--port", str(self.port), "--dtype", "float32",
               "--max-seq-len", str(max_seq_len), "--compile-cache-dir", str(cache_dir), *args]
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self.health_codes: list[int] = []

    def poll_ready(self) -> bool:
        """One /health probe; records what it answered while the model loaded and compiled."""
        if self.proc.poll() is not None:
            pytest.fail(f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}")
        try:
            self.health_codes.append(httpx.get(self.url + "/health", timeout=2).status_code)
        except httpx.HTTPError:
            return False
        return self.health_codes[-1] == 200

    def tail(self) -> str:
        self.log.flush()
        return "\n".join(self.log_path.read_text().splitlines()[-40:])

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    logs = tmp_path_factory.mktemp("server-logs")
    cache = tmp_path_factory.mktemp("compile-cache")
    s = ServerProcess("tp2", ["--tp", "2", "--allreduce", "f32", "--max-num-seqs", "8", "--deterministic",
                              "--max-waiting", "64"], logs, cache, MAX_SEQ_LEN)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while not s.poll_ready():
            if time.monotonic() > deadline:
                pytest.fail(f"not ready after {STARTUP_TIMEOUT}s:\n" + s.tail())
            time.sleep(0.5)
        yield s
    finally:
        s.stop()


def _complete(url: str, prompt, **kw) -> dict:
    body = {"prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "logprobs": 0, **kw}
    r = httpx.post(url + "/v1/completions", json=body, timeout=600)
    assert r.status_code == 200, r.text
    return r.json()


@functools.lru_cache(maxsize=1)
def _tokenizer():
    from models.gemma3.gguf import default_gguf_path
    from models.gemma3.tokenizer import Tokenizer

    return Tokenizer.from_gguf(default_gguf_path())


def _golden_strings(i: int) -> str:
    return _tokenizer().decode(GOLDEN[f"greedy_{i}"][:NEW_TOKENS])


@pytest.fixture(scope="module")
def batch(server):
    """The golden prompts together on the server (non-streamed, greedy, with logprobs)."""
    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=600) as c:
            body = lambda p: {"prompt": p, "max_tokens": NEW_TOKENS, "temperature": 0, "logprobs": 0}  # noqa: E731
            return await asyncio.gather(*(c.post("/v1/completions", json=body(p)) for p in PROMPTS))

    responses = asyncio.run(run())
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    return [r.json() for r in responses]


def test_health_is_503_until_warmed_up(server):
    codes = server.health_codes
    assert codes[-1] == 200 and 503 in codes and set(codes) <= {200, 503}


def test_health_models_and_metrics_show_the_allreduce_mode(server):
    h = httpx.get(server.url + "/health").json()
    assert (h["status"], h["tp"], h["dtype"], h["allreduce_label"]) == ("ready", 2, "float32", "f32")
    assert h["allreduce"]["method"] == "f32"
    assert h["batch_invariant"]  # deterministic, token-local f32 psum
    assert h["long_prefill_token_threshold"] == 64  # deterministic mode's own default piece (context 64)
    models = openai.OpenAI(base_url=server.url + "/v1", api_key="x").models.list()
    assert [m.id for m in models.data] == ["gemma3-270m"]
    assert models.data[0].model_extra["allreduce"]["method"] == "f32"
    assert 'allreduce="f32"' in httpx.get(server.url + "/metrics").text


def test_single_requests_match_the_official_implementation(server):
    # The golden continuations were made one prompt at a time by the official implementation: they
    # are the single-request outputs every batched run below must reproduce.
    for i in (0, 4):
        r = _complete(server.url, PROMPTS[i])
        assert r["choices"][0]["text"] == _golden_strings(i), i
        assert r["choices"][0]["finish_reason"] == "length"
        n = len(GOLDEN[f"tokens_{i}"])
        assert r["usage"] == {"prompt_tokens": n, "completion_tokens": NEW_TOKENS, "total_tokens": n + NEW_TOKENS}


def test_batched_greedy_equals_single_request_outputs(batch):
    for i, r in enumerate(batch):
        assert r["choices"][0]["text"] == _golden_strings(i), i


def test_streaming_equals_non_streaming(server, batch):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    results = [None] * len(PROMPTS)

    def stream(i):
        chunks = list(client.completions.create(model="gemma3-270m", prompt=PROMPTS[i], max_tokens=NEW_TOKENS,
                                                temperature=0, stream=True))
        results[i] = ("".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason,
                      sum(bool(c.choices[0].text) for c in chunks))

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, (text, finish, n_chunks) in enumerate(results):
        assert text == batch[i]["choices"][0]["text"] and finish == "length"
        assert n_chunks >= 3  # really streamed, not one final blob


def test_sixteen_concurrent_requests_each_equal_their_single_request_output(server):
    order = [i % len(PROMPTS) for i in range(16)]

    async def burst():
        async with httpx.AsyncClient(base_url=server.url, timeout=600) as c:
            body = lambda i: {"prompt": PROMPTS[i], "max_tokens": NEW_TOKENS, "temperature": 0}  # noqa: E731
            return await asyncio.gather(*(c.post("/v1/completions", json=body(i)) for i in order))

    responses = asyncio.run(burst())
    for i, r in zip(order, responses):
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == _golden_strings(i), i


def test_chat_streamed_and_not(server):
    from serving.chat_template import render_chat

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    messages = [{"role": "user", "content": "Name a primary colour."}]
    out = {}

    def full():
        out["full"] = client.chat.completions.create(model="gemma3-270m", messages=messages,
                                                     max_tokens=NEW_TOKENS, temperature=0)

    t = threading.Thread(target=full)
    t.start()
    chunks = list(client.chat.completions.create(model="gemma3-270m", messages=messages, max_tokens=NEW_TOKENS,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    t.join()
    full = out["full"]
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    text = full.choices[0].message.content
    assert text and streamed == text
    assert full.choices[0].finish_reason in ("stop", "length")
    n_prompt = len(render_chat([("user", messages[0]["content"])], _tokenizer()))
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens == n_prompt
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_echo_prompt_logprobs_agree_with_the_official_logits(server):
    i = 4  # "Q: What is 12 times 7?\nA:"
    r = _complete(server.url, PROMPTS[i], max_tokens=0, echo=True, logprobs=5)
    lp = r["choices"][0]["logprobs"]
    assert r["choices"][0]["text"] == PROMPTS[i]
    tokens = GOLDEN[f"tokens_{i}"]
    assert len(lp["tokens"]) == len(tokens) - 1  # every prompt token after BOS, scored
    top_idx, top_val = GOLDEN[f"top_idx_{i}"], GOLDEN[f"top_val_{i}"]
    for t, top in enumerate(lp["top_logprobs"]):
        # Position t predicts token t+1; logprob gaps between alternatives equal logit gaps.
        values = sorted(top.values(), reverse=True)
        np.testing.assert_allclose(np.diff(values), np.diff(top_val[t, :len(values)]), atol=2e-3)
        if top_val[t, 0] - top_val[t, 1] > 1e-2:
            assert max(top, key=top.get) == _token_str(top_idx[t, 0])
    # The actual next token's logprob is among / below the top ones.
    assert all(v is not None and v <= 0 for v in lp["token_logprobs"])


def _token_str(token_id: int) -> str:
    tok = _tokenizer()
    text = tok.decode([int(token_id)])
    return text if text and "\ufffd" not in text else tok.id_to_piece(int(token_id))


def test_bad_input_on_the_real_server(server):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "word " * 80, "max_tokens": 4})
    assert r.status_code == 400 and f"maximum context length is {MAX_SEQ_LEN}" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": "gemma-7b", "messages": []})
    assert r.status_code in (400, 404)
    assert httpx.get(server.url + "/health").status_code == 200  # still serving


def _running(url: str) -> float:
    text = httpx.get(url + "/metrics").text
    return float(re.search(r"^gemma3:num_requests_running\{[^}]*\} (\S+)$", text, re.M).group(1))


def test_disconnect_mid_stream_frees_the_slot(server):
    with httpx.Client(base_url=server.url, timeout=600) as c:
        with c.stream("POST", "/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 40,
                                                       "temperature": 0, "stream": True}) as r:
            lines = r.iter_lines()
            while not next(lines).startswith("data: "):
                pass
            assert _running(server.url) == 1
    deadline = time.monotonic() + 30
    while _running(server.url) != 0:
        assert time.monotonic() < deadline, "the slot of a departed client was not freed"
        time.sleep(0.1)


def test_sigterm_finishes_in_flight_requests_then_exits(server):
    result = {}

    def stream():
        with httpx.Client(base_url=server.url, timeout=600) as c:
            with c.stream("POST", "/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": NEW_TOKENS,
                                                           "temperature": 0, "stream": True}) as r:
                events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
                result["text"] = "".join(e["choices"][0]["text"] for e in events)
                result["finish"] = events[-1]["choices"][0]["finish_reason"]

    t = threading.Thread(target=stream)
    t.start()
    while _running(server.url) == 0:
        time.sleep(0.05)
    server.proc.send_signal(signal.SIGTERM)
    t.join(120)
    assert result == {"text": _golden_strings(0), "finish": "length"}
    assert server.proc.wait(60) == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/health")
