"""The OpenAI-compatible server over HTTP, a `gemma3-serve` this command starts (the shared
flags, plus --server-arg) or a running one (--url): latency percentiles and throughput
(vLLM's benchmark_serving definitions), a soak with bit-for-bit checks, structured output.
The modes (--only) are listed below; what each checks, and examples: docs/benchmarks.md."""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import json
import random
import re
import socket
import subprocess
import sys
import time

import httpx
import numpy as np

import jax_platform
from eval import common
from eval.common import log
from eval.reports import write_json

MODES = {"serving": "streams at each --concurrency: TTFT, ITL, TPOT, E2E percentiles, tok/s",
         "soak": "a --deterministic server under load and abuse: answers, slots, RSS checked",
         "structured": "json_schema requests and tool calls, each validated with jsonschema",
         "bodies": "/health latency idle and while --bodies token-id prompts of --body-mb arrive"}
TOPICS = ["the sea", "a lighthouse keeper", "the first snow of winter", "a lost key", "a robot learning to paint",
          "an old library", "the night train", "a garden on the moon", "two rival bakers", "a forgotten song",
          "the last bookshop", "a storm at harvest", "a clock that runs backwards", "a letter never sent",
          "the mountain village", "a city of bridges"]


def start_server(args, extra: list[str] = ()) -> tuple[subprocess.Popen, str]:
    """`gemma3-serve` with the shared flags, once /health answers 200 (malloc tunables as the
    container image runs it)."""
    cmd = [sys.executable, "-m", "serving.cli", "--port", str(args.port)]
    for flag in ("model", "dtype", "tp", "tp_mesh", "allreduce", "max_seq_len", "max_num_seqs",
                 "page_size", "long_prefill_token_threshold", "precompile", "compile_cache_dir"):
        if getattr(args, flag) is not None:
            cmd += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
    log_file = open(args.server_log, "w") if args.server_log else subprocess.DEVNULL
    proc = subprocess.Popen(cmd + [*extra, *args.server_arg], cwd=common.ROOT, stdout=log_file,
                            stderr=subprocess.STDOUT, env=jax_platform.child_environment())
    url, t0 = f"http://127.0.0.1:{args.port}", time.perf_counter()
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode} (see --server-log)")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                log(f"server ready in {time.perf_counter() - t0:.0f}s")
                return proc, url
        except httpx.HTTPError:
            pass
        if time.perf_counter() - t0 > args.startup_timeout:
            proc.kill()
            raise SystemExit("the server did not become ready in time")
        time.sleep(1)


def summarize(xs) -> dict:
    a = np.asarray(xs, dtype=np.float64)
    if a.size == 0:
        return {"mean": None, "median": None, "p99": None, "max": None, "n": 0}
    return {"mean": float(a.mean()), "median": float(np.median(a)),
            "p99": float(np.percentile(a, 99)), "max": float(a.max()), "n": int(a.size)}


def output_len(i: int, max_tokens: int, range_ratio: float) -> int:
    lo = max(1, round(max_tokens * (1 - range_ratio)))
    hi = max(lo, round(max_tokens * (1 + range_ratio)))
    return int(np.random.default_rng(i).integers(lo, hi + 1))


async def sse_chunks(r):
    """A streamed response's JSON chunks; an error chunk raises."""
    async for line in r.aiter_lines():
        if line.startswith("data: {"):
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            yield chunk


async def one_request(client, model: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True, "logprobs": 0}
    t0, times = time.perf_counter(), []
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:300]}")
        async for chunk in sse_chunks(r):
            lp = chunk["choices"][0]["logprobs"]  # a token each with logprobs on
            times += [time.perf_counter()] * (len(lp["tokens"]) if lp else 0)
    if not times:
        raise RuntimeError("no tokens received")
    n, ttft, e2e = len(times), times[0] - t0, times[-1] - t0
    return {"ttft": ttft, "e2e": e2e, "itl": list(np.diff(times)), "tokens": n,
            "tpot": (e2e - ttft) / (n - 1) if n > 1 else None}


async def run_level(url: str, model: str, concurrency: int, requests_per_stream: int,
                    max_tokens: int, range_ratio: float = 0.0) -> dict:
    results = []
    limits = httpx.Limits(max_connections=concurrency + 2)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as client:
        async def stream(k: int):
            for j in range(requests_per_stream):
                i = k * requests_per_stream + j
                prompt = (f"Write a short story about {TOPICS[i % len(TOPICS)]}. Describe the "
                          f"place, the people and what changes for them by the end.\n\nStory:")
                results.append(await one_request(client, model, prompt,
                                                 output_len(i, max_tokens, range_ratio)))

        t0 = time.perf_counter()
        await asyncio.gather(*(stream(k) for k in range(concurrency)))
        wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in results)
    return {"concurrency": concurrency, "requests": len(results), "output_tokens": tokens,
            "wall_s": wall, "output_tokens_per_s": tokens / wall,
            "ttft_s": summarize([r["ttft"] for r in results]),
            "tpot_s": summarize([r["tpot"] for r in results if r["tpot"] is not None]),
            "itl_s": summarize([x for r in results for x in r["itl"]]),
            "e2e_s": summarize([r["e2e"] for r in results])}


def serving(url: str, args) -> dict:
    info = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]
    if args.warmup_requests:
        asyncio.run(run_level(url, info["id"], 1, args.warmup_requests, 8))
    levels = []
    for c in common.ints(args.concurrency):
        levels.append(asyncio.run(run_level(url, info["id"], c, args.requests_per_stream,
                                            args.max_tokens or 64, args.range_ratio)))
    ms = lambda lv, s, ks=("mean", "median", "p99"): " / ".join(  # noqa: E731
        f"{1000 * lv[s][k]:.0f}" for k in ks)
    print("| streams | requests | output tok/s | TTFT ms mean / median / p99 | TPOT ms mean / "
          "median / p99 | ITL ms mean / median / p99 / max | E2E ms mean / median / p99 |")
    print("|---|---|---|---|---|---|---|")
    for lv in levels:
        print(f"| {lv['concurrency']} | {lv['requests']} | {lv['output_tokens_per_s']:.1f} | "
              f"{ms(lv, 'ttft_s')} | {ms(lv, 'tpot_s')} | "
              f"{ms(lv, 'itl_s', ('mean', 'median', 'p99', 'max'))} | {ms(lv, 'e2e_s')} |")
    return {"server": {k: info.get(k) for k in ("id", "tp", "dtype", "allreduce_label", "max_model_len")},
            "max_tokens": args.max_tokens or 64, "range_ratio": args.range_ratio,
            "requests_per_stream": args.requests_per_stream, "levels": levels}


PROMPTS = ["The capital of France is",
           "Once upon a time, in a small village by the sea, there lived an old fisherman who",
           "def fibonacci(n):", "Rings, tori and meshes: a short history of interconnects. Chapter one.",
           "1, 2, 3, 5, 8, 13,", "The quick brown fox",
           "In 1969 the first humans landed on the Moon. The mission was called", "Water boils at"]
MAX_TOKENS = [12, 24, 8, 32, 16, 20, 6, 28]
BAD_REQUESTS = [("malformed JSON", b'{"prompt": "x", "max_tokens": ', {}),
                ("negative max_tokens", None, {"prompt": "x", "max_tokens": -1}),
                ("temperature out of range", None, {"prompt": "x", "max_tokens": 4, "temperature": -3}),
                ("prompt longer than the context", None, {"prompt": "word " * 5000, "max_tokens": 4}),
                ("wrong type", None, {"prompt": 12, "max_tokens": "many"})]


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+) kB", f.read()).group(1)) / 1024


def gauges(url: str) -> dict:
    """The server's gauges that say whether anything is still held."""
    text = httpx.get(url + "/metrics", timeout=10).text
    out = {}
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "prefix_cache_blocks", "prefix_cache_capacity_blocks"):
        m = re.search(rf"^gemma3:{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, flags=re.M)
        out[name] = float(m.group(1)) if m else None
    return out


def body(i: int, model: str, stream: bool, **kw) -> dict:
    return {"model": model, "prompt": PROMPTS[i], "max_tokens": MAX_TOKENS[i], "temperature": 0,
            "stream": stream, "ignore_eos": True, "logprobs": 0, **kw}


async def complete(client, i: int, model: str, stream: bool) -> list:
    """Prompt i's greedy answer as [text, tokens, token logprobs] (compared bit for bit)."""
    if not stream:
        r = await client.post("/v1/completions", json=body(i, model, False))
        r.raise_for_status()
        c = r.json()["choices"][0]
        return [c["text"], c["logprobs"]["tokens"], c["logprobs"]["token_logprobs"]]
    out = ["", [], []]
    async with client.stream("POST", "/v1/completions", json=body(i, model, True)) as r:
        r.raise_for_status()
        async for chunk in sse_chunks(r):
            c = chunk["choices"][0]
            out[0] += c["text"]
            if c.get("logprobs"):
                out[1] += c["logprobs"]["tokens"]
                out[2] += c["logprobs"]["token_logprobs"]
    return out


async def references(url: str, model: str) -> list:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        return [await complete(client, i, model, False) for i in range(len(PROMPTS))]


async def soak_phase(url: str, model: str, refs: list, args, pid: int) -> dict:
    host, port = url.removeprefix("http://").split(":")
    counts = {"whole": 0, "cancelled": 0, "dropped": 0, "bad": 0}
    wrong, server_errors, rss = [], [], []
    start = time.monotonic()

    async def client_loop(c: int):
        rng = random.Random(c)
        async with httpx.AsyncClient(base_url=url, timeout=600) as client:
            while time.monotonic() < start + args.seconds:
                kind = rng.choices(list(counts), [6, 2, 1, 2])[0]
                i = rng.randrange(len(PROMPTS))
                if kind == "whole":
                    stream = rng.random() < 0.5
                    if (got := await complete(client, i, model, stream)) != refs[i]:
                        wrong.append({"prompt": i, "stream": stream, "got": got})
                elif kind == "cancelled":  # leaving the block closes the stream
                    async with client.stream("POST", "/v1/completions",
                                             json=body(i, model, True, max_tokens=64)) as r:
                        seen, chunks = 0, rng.randint(1, 4)
                        async for line in r.aiter_lines():
                            seen += line.startswith("data: {")
                            if seen >= chunks:
                                break
                elif kind == "dropped":  # a whole request sent, the socket closed at once
                    payload = json.dumps(body(i, model, True, max_tokens=48)).encode()
                    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: "
                            f"application/json\r\nContent-Length: {len(payload)}\r\n\r\n").encode()
                    with socket.create_connection((host, int(port)), timeout=10) as s:
                        s.sendall(head + payload)
                else:
                    name, raw, fields = BAD_REQUESTS[rng.randrange(len(BAD_REQUESTS))]
                    r = await (client.post("/v1/completions", content=raw, headers={
                        "Content-Type": "application/json"}) if raw is not None else
                        client.post("/v1/completions", json=dict(fields, model=model)))
                    if not 400 <= r.status_code < 500:
                        server_errors.append({"request": name, "status": r.status_code})
                counts[kind] += 1

    async def sampler():
        while time.monotonic() < start + args.seconds:
            rss.append((time.monotonic() >= start + args.seconds / 2, rss_mib(pid)))
            await asyncio.sleep(0.5)

    await asyncio.gather(sampler(), *(client_loop(c) for c in range(args.clients)))
    return {"requests": counts, "wrong": wrong, "bad_request_5xx": server_errors,
            "rss_mib_first_half_max": max(v for late, v in rss if not late),
            "rss_mib_second_half_max": max(v for late, v in rss if late)}


def soak(args) -> dict:
    """The server started here with --deterministic: each prompt alone, then --streams at once
    (the same answers, bit for bit), then --seconds of clients mixing whole, cancelled, dropped
    and bad requests; afterwards nothing held, the same answers, RSS flat."""
    from equarx import AllReduceConfig

    proc, url = start_server(args, ["--deterministic"])
    try:
        card = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]
        refs = asyncio.run(references(url, card["id"]))

        async def load():
            async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(
                    max_connections=args.streams + 4)) as client:
                return await asyncio.gather(*(complete(client, s % len(PROMPTS), card["id"], True)
                                              for s in range(args.streams)))

        t0 = time.perf_counter()
        loaded = [s for s, got in enumerate(asyncio.run(load())) if got != refs[s % len(PROMPTS)]]
        load_s = time.perf_counter() - t0
        log(f"load: {args.streams} streams in {load_s:.1f}s, {len(loaded)} wrong")
        soaked = asyncio.run(soak_phase(url, card["id"], refs, args, proc.pid))
        log(f"soak: {soaked['requests']}, {len(soaked['wrong'])} wrong")
        for _ in range(150):  # a dropped connection is noticed a step later
            after = gauges(url)
            if after["num_requests_running"] == 0 and after["num_requests_waiting"] == 0:
                break
            time.sleep(0.2)
        again = asyncio.run(references(url, card["id"]))
        health = httpx.get(url + "/health", timeout=10).status_code
    finally:
        proc.terminate()
        proc.wait(60)
    checks = {
        "load_all_correct": not loaded, "soak_all_correct": not soaked["wrong"],
        "bad_requests_all_4xx": not soaked["bad_request_5xx"],
        "slots_free": after["num_requests_running"] == after["num_requests_waiting"] == 0
        and after["kv_cache_usage_perc"] == 0,
        "prefix_cache_within_capacity": after["prefix_cache_blocks"] is None
        or after["prefix_cache_blocks"] <= after["prefix_cache_capacity_blocks"],
        "still_serving_the_references": health == 200 and again == refs,
        "serving_the_allreduce_asked": card["allreduce_label"]
        == AllReduceConfig.from_label(args.allreduce).label,
        "rss_flat": soaked["rss_mib_second_half_max"]
        <= soaked["rss_mib_first_half_max"] + args.rss_growth_mib}
    for name, held in checks.items():
        log(f"{'ok ' if held else 'FAIL'} {name}")
    return {"references": refs, "load": {"streams": args.streams, "wrong": loaded, "seconds": load_s},
            "soak": soaked, "after": after, "checks": checks, "ok": all(checks.values())}


SCHEMAS = [
    {"type": "object", "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]+$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "height_m": {"type": "number"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4}},
     "required": ["name", "age", "height_m", "role", "tags"], "additionalProperties": False},
    {"type": "object", "properties": {
        "order_id": {"type": "string", "pattern": "^ORD-[0-9]{4}$"},
        "customer": {"type": "object", "properties": {
            "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
            "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                        "required": ["city", "zip"], "additionalProperties": False}},
            "required": ["email", "address"], "additionalProperties": False},
        "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "object", "properties": {
            "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}, "price": {"type": "number"}},
            "required": ["sku", "qty", "price"], "additionalProperties": False}},
        "status": {"enum": ["new", "paid", "shipped"]}},
     "required": ["order_id", "customer", "items", "status"], "additionalProperties": False},
    {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 40},
        "year": {"type": "integer"},
        "rating": {"type": "number", "minimum": 0, "maximum": 10},
        "genres": {"type": "array", "items": {"enum": ["drama", "comedy", "action", "sci-fi"]}, "maxItems": 3},
        "sequel": {"type": ["boolean", "null"]}},
     "required": ["title", "year", "rating", "genres", "sequel"]},
]
SCHEMA_PROMPTS = ["Give a person record as JSON.", "Give an order as JSON.", "Describe a film as JSON."]
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather for a city",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
                                          "required": ["city", "unit"]}}},
    {"type": "function", "function": {"name": "book_table", "description": "Book a restaurant table",
                                      "parameters": {"type": "object", "properties": {
                                          "restaurant": {"type": "string"}, "people": {"type": "integer", "minimum": 1},
                                          "time": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"}},
                                          "required": ["restaurant", "people", "time"]}}},
]


def structured(url: str, args) -> dict:
    import jsonschema
    import openai

    client = openai.OpenAI(base_url=url.rstrip("/") + "/v1", api_key="unused", max_retries=0, timeout=600)
    model, max_tokens = client.models.list().data[0].id, args.max_tokens or 256

    def schema_request(i: int) -> dict:
        k, stream = i % len(SCHEMAS), i % 2 == 1
        kwargs = dict(model=model, messages=[{"role": "user", "content": SCHEMA_PROMPTS[k]}],
                      max_tokens=max_tokens, temperature=[0.0, 0.7, 1.0][i % 3], seed=i,
                      response_format={"type": "json_schema", "json_schema": {
                          "name": f"s{k}", "schema": SCHEMAS[k], "strict": True}})
        if stream:
            text, reason = "", None
            for chunk in client.chat.completions.create(stream=True, **kwargs):
                for c in chunk.choices:
                    text, reason = text + (c.delta.content or ""), c.finish_reason or reason
        else:
            c = client.chat.completions.create(**kwargs).choices[0]
            text, reason = c.message.content, c.finish_reason
        try:
            jsonschema.validate(json.loads(text), SCHEMAS[k])
            return {"ok": True, "stream": stream, "finish_reason": reason}
        except Exception as e:  # noqa: BLE001 - report any failure
            log(f"request {i} (schema {k}) invalid: {e!s:.200}\n  {text!r:.300}")
            return {"ok": False, "stream": stream, "finish_reason": reason}

    def tool_request(i: int) -> bool:
        choice = "required" if i % 2 == 0 else {"type": "function", "function": {"name": "book_table"}}
        c = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Book a table for two at Luigi's at 19:30."}],
            tools=TOOLS, tool_choice=choice, max_tokens=max_tokens, temperature=[0.0, 1.0][i % 2],
            seed=i).choices[0]
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
        try:
            assert c.finish_reason == "tool_calls" and c.message.tool_calls
            for call in c.message.tool_calls:
                assert isinstance(choice, str) or call.function.name == "book_table"
                jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
            return True
        except Exception as e:  # noqa: BLE001
            log(f"tool request {i} invalid: {e!s:.200} {c}")
            return False

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(schema_request, range(args.requests)))
        tools_ok = list(pool.map(tool_request, range(args.tool_requests)))
    streamed = [r for r in results if r["stream"]]
    return {"results": results, "json_schema_valid": sum(r["ok"] for r in results), "requests": len(results),
            "streamed_valid": sum(r["ok"] for r in streamed), "streamed": len(streamed),
            "finish_reasons": dict(collections.Counter(r["finish_reason"] for r in results)),
            "tool_calls_valid": sum(tools_ok), "tool_requests": len(tools_ok)}


def bodies(url: str, args) -> dict:
    """/health polled idle, then while --bodies POSTs of a token-id prompt of --body-mb MB each
    arrive at once (over the context: each is read, parsed, checked and refused with a 400)."""
    rng = random.Random(0)
    ids = [rng.randrange(256_000) for _ in range(int(args.body_mb * 125_000))]  # ~8 bytes each
    body = json.dumps({"prompt": ids, "max_tokens": 1}).encode()

    async def run() -> dict:
        limits = httpx.Limits(max_connections=args.bodies + 1)
        async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as c:
            async def health(times: list, until) -> None:
                while not until():
                    t = time.perf_counter()
                    await c.get("/health")
                    times.append(time.perf_counter() - t)
                    await asyncio.sleep(0.02)

            idle, loaded = [], []
            await health(idle, lambda: len(idle) >= 20)
            t0 = time.perf_counter()
            posts = [asyncio.ensure_future(c.post("/v1/completions", content=body,
                                                  headers={"content-type": "application/json"}))
                     for _ in range(args.bodies)]
            await health(loaded, lambda: all(p.done() for p in posts))
            return {"body_bytes": len(body), "bodies": args.bodies, "seconds": time.perf_counter() - t0,
                    "statuses": sorted({p.result().status_code for p in posts}),
                    "health_idle": summarize(idle), "health_loaded": summarize(loaded)}

    return asyncio.run(run())


def main(argv: list[str] | None = None) -> dict:
    p = common.parser(__doc__, MODES, only="serving", max_seq_len=512)
    p.add_argument("--url", help="a running server (serving, structured) instead of starting one")
    p.add_argument("--concurrency", default="1,8", help="serving: stream counts")
    p.add_argument("--requests-per-stream", type=int, default=4)
    p.add_argument("--max-tokens", type=int, help="tokens a request (serving: 64, mean; structured: 256)")
    p.add_argument("--range-ratio", type=float, default=0.5)
    p.add_argument("--warmup-requests", type=int, default=1)
    p.add_argument("--streams", type=int, default=64, help="soak: concurrent streams")
    p.add_argument("--seconds", type=float, default=60.0, help="soak: its length")
    p.add_argument("--clients", type=int, default=12, help="soak: clients looping")
    p.add_argument("--rss-growth-mib", type=float, default=64.0)
    p.add_argument("--requests", type=int, default=50, help="structured: json_schema requests")
    p.add_argument("--tool-requests", type=int, default=10)
    p.add_argument("--bodies", type=int, default=8, help="bodies: concurrent large requests")
    p.add_argument("--body-mb", type=float, default=2.0, help="bodies: each one's size in MB")
    p.add_argument("--port", type=int, default=8011)
    p.add_argument("--server-log")
    p.add_argument("--server-arg", action="append", default=[], help="a gemma3-serve flag (repeatable)")
    p.add_argument("--startup-timeout", type=float, default=1800)
    args = p.parse_args(argv)
    report: dict = {"command": "python -m eval.bench_serving " + " ".join(
        sys.argv[1:] if argv is None else argv)}
    only = common.names(args.only)
    if "soak" in only:
        report["soak"] = soak(args)
    proc, url = (None, args.url) if args.url or only == ["soak"] else start_server(args)
    try:
        for mode, run in (("serving", serving), ("structured", structured), ("bodies", bodies)):
            if mode in only:
                report[mode] = run(url, args)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    if "structured" in report:
        print(json.dumps(report["structured"], indent=1))
    write_json(args.out, report)
    return report


if __name__ == "__main__":
    sys.exit(0 if main().get("soak", {}).get("ok", True) else 1)
