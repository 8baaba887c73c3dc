"""Load and soak test of a real `gemma3-serve` process: many concurrent streams, then a bounded
soak of mixed traffic, then the checks that nothing leaked and nothing came out wrong.

1. References: each of a few prompts (mixed lengths, each with its own max_tokens) sent alone,
   greedy, one at a time.
2. Load: `--streams` concurrent streamed requests over those prompts; each must return exactly
   its reference text (the server's batch-invariant mode is on by default).
3. Soak for `--seconds`: `--concurrency` clients loop over a random mix of whole requests
   (streamed or not, checked against the references), streams the client closes after a few
   chunks, connections dropped right after the request is sent, and bad requests (malformed
   JSON, bad parameters, over-long prompts: each must get a 4xx, never a 5xx).
4. After: the server still answers and still gives the references (with the AllReduce asked
   for, `--allreduce`), every decode slot is free and nothing waits (/metrics: running,
   waiting, KV usage), the prefix cache holds no more blocks than its capacity, and the
   server's resident memory at the end of the soak is within a bound of what it was after the
   first half (flat: no growth per request).

    python -m eval.soak --model gemma3-270m --seconds 120 --out soak.json
    python -m eval.soak --model gemma3-270m --tp 2 --allreduce int8 --seconds 120
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import socket
import sys
import time
from types import SimpleNamespace

import httpx

from equarx import AllReduceConfig
from eval.bench_serving import start_server

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "def fibonacci(n):",
    "Rings, tori and meshes: a short history of interconnects. Chapter one.",
    "1, 2, 3, 5, 8, 13,",
    "The quick brown fox",
    "In 1969 the first humans landed on the Moon. The mission was called",
    "Water boils at",
]
MAX_TOKENS = [12, 24, 8, 32, 16, 20, 6, 28]


def rss_mib(pid: int) -> float:
    """Resident memory of process `pid` (VmRSS), MiB."""
    with open(f"/proc/{pid}/status") as f:
        kib = int(re.search(r"VmRSS:\s+(\d+) kB", f.read()).group(1))
    return kib / 1024


def gauges(url: str) -> dict[str, float]:
    """The server's gauges that say whether anything is still held (first sample of each)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    out = {}
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "prefix_cache_blocks", "prefix_cache_capacity_blocks"):
        m = re.search(rf"^gemma3:{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, flags=re.M)
        out[name] = float(m.group(1)) if m else None
    return out


def body(i: int, model: str, stream: bool) -> dict:
    # ignore_eos: every request runs its whole length (a random model may end at once)
    return {"model": model, "prompt": PROMPTS[i], "max_tokens": MAX_TOKENS[i], "temperature": 0,
            "stream": stream, "ignore_eos": True, "logprobs": 0}


async def complete(client: httpx.AsyncClient, i: int, model: str, stream: bool) -> list:
    """A greedy completion of prompt i, streamed or not, as [text, tokens, token logprobs]
    (the logprobs compare bit for bit: the batch-invariant mode promises the same bits)."""
    if not stream:
        r = await client.post("/v1/completions", json=body(i, model, False))
        r.raise_for_status()
        choice = r.json()["choices"][0]
        lp = choice["logprobs"]
        return [choice["text"], lp["tokens"], lp["token_logprobs"]]
    out = ["", [], []]
    async with client.stream("POST", "/v1/completions", json=body(i, model, True)) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"])
                choice = chunk["choices"][0]
                out[0] += choice["text"]
                if choice.get("logprobs"):
                    out[1] += choice["logprobs"]["tokens"]
                    out[2] += choice["logprobs"]["token_logprobs"]
    return out


async def cancel_mid_stream(client: httpx.AsyncClient, i: int, model: str, chunks: int) -> None:
    b = dict(body(i, model, True), max_tokens=64, ignore_eos=True)
    async with client.stream("POST", "/v1/completions", json=b) as r:
        seen = 0
        async for line in r.aiter_lines():
            seen += line.startswith("data: {")
            if seen >= chunks:
                break  # leaving the block closes the stream


def drop_connection(host: str, port: int, i: int, model: str) -> None:
    """Send a whole request and close the socket at once, without reading anything."""
    payload = json.dumps(dict(body(i, model, True), max_tokens=48, ignore_eos=True)).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n").encode()
    with socket.create_connection((host, port), timeout=10) as s:
        s.sendall(head + payload)


BAD_REQUESTS = [
    ("malformed JSON", b'{"prompt": "x", "max_tokens": ', {}),
    ("negative max_tokens", None, {"prompt": "x", "max_tokens": -1}),
    ("temperature out of range", None, {"prompt": "x", "max_tokens": 4, "temperature": -3}),
    ("prompt longer than the context", None, {"prompt": "word " * 5000, "max_tokens": 4}),
    ("wrong type", None, {"prompt": 12, "max_tokens": "many"}),
]


async def bad_request(client: httpx.AsyncClient, k: int, model: str) -> int:
    _, raw, fields = BAD_REQUESTS[k]
    if raw is not None:
        r = await client.post("/v1/completions", content=raw,
                              headers={"Content-Type": "application/json"})
    else:
        r = await client.post("/v1/completions", json=dict(fields, model=model))
    return r.status_code


async def references(url: str, model: str) -> list[list]:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        return [await complete(client, i, model, stream=False) for i in range(len(PROMPTS))]


async def load(url: str, model: str, refs: list[list], streams: int) -> dict:
    limits = httpx.Limits(max_connections=streams + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        t0 = time.perf_counter()
        texts = await asyncio.gather(*(complete(client, s % len(PROMPTS), model, stream=True)
                                       for s in range(streams)))
        wall = time.perf_counter() - t0
    wrong = [s for s, t in enumerate(texts) if t != refs[s % len(PROMPTS)]]
    return {"streams": streams, "wrong": wrong, "seconds": wall}


async def soak(url: str, model: str, refs: list[list], seconds: float, concurrency: int,
               pid: int, seed: int) -> dict:
    host, port = url.removeprefix("http://").split(":")
    counts = {"whole": 0, "cancelled": 0, "dropped": 0, "bad": 0}
    wrong, server_errors, rss = [], [], []
    deadline = time.monotonic() + seconds
    half = time.monotonic() + seconds / 2

    async def client_loop(c: int):
        rng = random.Random(seed * 1000 + c)
        limits = httpx.Limits(max_connections=4)
        async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
            while time.monotonic() < deadline:
                kind = rng.choices(["whole", "cancelled", "dropped", "bad"], [6, 2, 1, 2])[0]
                i = rng.randrange(len(PROMPTS))
                if kind == "whole":
                    stream = rng.random() < 0.5
                    text = await complete(client, i, model, stream)
                    if text != refs[i]:
                        wrong.append({"prompt": i, "stream": stream, "got": text})
                elif kind == "cancelled":
                    await cancel_mid_stream(client, i, model, chunks=rng.randint(1, 4))
                elif kind == "dropped":
                    await asyncio.to_thread(drop_connection, host, int(port), i, model)
                else:
                    k = rng.randrange(len(BAD_REQUESTS))
                    status = await bad_request(client, k, model)
                    if not 400 <= status < 500:
                        server_errors.append({"request": BAD_REQUESTS[k][0], "status": status})
                counts[kind] += 1

    async def sampler():
        while time.monotonic() < deadline:
            rss.append((time.monotonic() >= half, rss_mib(pid)))
            await asyncio.sleep(0.5)

    await asyncio.gather(sampler(), *(client_loop(c) for c in range(concurrency)))
    first = [v for late, v in rss if not late]
    second = [v for late, v in rss if late]
    return {"seconds": seconds, "concurrency": concurrency, "requests": counts, "wrong": wrong,
            "bad_request_5xx": server_errors,
            "rss_mib_first_half_max": max(first), "rss_mib_second_half_max": max(second)}


def settle(url: str, timeout: float = 30.0) -> dict:
    """Wait until no sequence runs or waits (dropped connections are noticed a step later)."""
    t0 = time.monotonic()
    while True:
        g = gauges(url)
        if g["num_requests_running"] == 0 and g["num_requests_waiting"] == 0:
            return g
        if time.monotonic() - t0 > timeout:
            return g
        time.sleep(0.2)


def run(model: str = "random:tiny", dtype: str = "float32", tp: int = 1, streams: int = 64,
        seconds: float = 20.0, concurrency: int = 12, max_num_seqs: int = 8, max_seq_len: int = 256,
        port: int = 8013, server_log: str | None = None, seed: int = 0,
        rss_growth_mib: float = 64.0, allreduce: str = "bf16", log=print) -> dict:
    """Start a server, run the three phases, check it afterwards, stop it. The report's "ok"
    is whether every check holds."""
    args = SimpleNamespace(port=port, model=model, dtype=dtype, tp=tp, allreduce=allreduce,
                           max_num_seqs=max_num_seqs, max_seq_len=max_seq_len, server_log=server_log,
                           server_arg=["--compile-cache-dir", "", "--deterministic"], startup_timeout=1800)
    proc, url = start_server(args)
    try:
        card = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]
        served = card["id"]
        refs = asyncio.run(references(url, served))
        log(f"references: {len(refs)} prompts")
        rss_start = rss_mib(proc.pid)
        loaded = asyncio.run(load(url, served, refs, streams))
        log(f"load: {streams} concurrent streams in {loaded['seconds']:.1f}s, "
            f"{len(loaded['wrong'])} wrong")
        soaked = asyncio.run(soak(url, served, refs, seconds, concurrency, proc.pid, seed))
        log(f"soak: {soaked['requests']} in {seconds:.0f}s, {len(soaked['wrong'])} wrong, "
            f"RSS max {soaked['rss_mib_first_half_max']:.0f} -> "
            f"{soaked['rss_mib_second_half_max']:.0f} MiB (first / second half)")
        after = settle(url)
        again = asyncio.run(references(url, served))
        health = httpx.get(url + "/health", timeout=10).status_code
        rss_end = rss_mib(proc.pid)
    finally:
        proc.terminate()
        proc.wait(60)
    checks = {
        "load_all_correct": not loaded["wrong"],
        "soak_all_correct": not soaked["wrong"],
        "bad_requests_all_4xx": not soaked["bad_request_5xx"],
        "slots_free": after["num_requests_running"] == 0 and after["num_requests_waiting"] == 0
        and after["kv_cache_usage_perc"] == 0,
        "prefix_cache_within_capacity": after["prefix_cache_blocks"] is None
        or after["prefix_cache_blocks"] <= after["prefix_cache_capacity_blocks"],
        "still_serving_the_references": health == 200 and again == refs,
        "serving_the_allreduce_asked": card["allreduce_label"]
        == AllReduceConfig.from_label(allreduce).label,
        "rss_flat": soaked["rss_mib_second_half_max"]
        <= soaked["rss_mib_first_half_max"] + rss_growth_mib,
    }
    report = {"model": model, "dtype": dtype, "tp": tp, "allreduce": allreduce,
              "max_num_seqs": max_num_seqs, "references": refs, "load": loaded, "soak": soaked,
              "after": after, "rss_mib_start": rss_start, "rss_mib_end": rss_end,
              "rss_growth_bound_mib": rss_growth_mib, "checks": checks,
              "ok": all(checks.values())}
    for name, held in checks.items():
        log(f"{'ok ' if held else 'FAIL'} {name}")
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="random:tiny", help="e.g. gemma3-270m (the real weights)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--allreduce", default="bf16",
                   help="the server's --allreduce (with --tp > 1: e.g. int8, whose token-local "
                        "results keep every stream equal to its reference)")
    p.add_argument("--streams", type=int, default=64, help="concurrent streams of the load phase")
    p.add_argument("--seconds", type=float, default=60.0, help="length of the soak")
    p.add_argument("--concurrency", type=int, default=12, help="clients during the soak")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-seq-len", type=int, default=256)
    p.add_argument("--rss-growth-mib", type=float, default=64.0,
                   help="allowed growth of the second half's peak RSS over the first half's")
    p.add_argument("--port", type=int, default=8013)
    p.add_argument("--server-log")
    p.add_argument("--out", help="write the report as JSON here")
    args = p.parse_args(argv)
    report = run(args.model, args.dtype, args.tp, args.streams, args.seconds, args.concurrency,
                 args.max_num_seqs, args.max_seq_len, args.port, args.server_log,
                 rss_growth_mib=args.rss_growth_mib, allreduce=args.allreduce,
                 log=lambda *a: print(*a, file=sys.stderr))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    print(json.dumps({k: report[k] for k in ("checks", "ok", "rss_mib_start", "rss_mib_end")}))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
