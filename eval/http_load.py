"""/health latency while large request bodies arrive: N concurrent POSTs of a token-id prompt of
about SIZE bytes each (by default over the context: each is refused with a 400 once read, parsed
and checked), while /health is polled. Against a running server:

    python -m eval.http_load --url http://127.0.0.1:8000 [--bodies 8] [--mb 2]

Prints /health's latency idle and under the load (median, max) and the bodies' statuses.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

import httpx


def token_body(megabytes: float, vocab: int = 256_000, seed: int = 0) -> bytes:
    rng = random.Random(seed)
    ids: list[int] = []
    size = 0
    while size < megabytes * 1e6:
        ids.append(rng.randrange(vocab))
        size += len(str(ids[-1])) + 2
    return json.dumps({"prompt": ids, "max_tokens": 1}).encode()


async def _poll(client: httpx.AsyncClient, stop: asyncio.Event, every: float) -> list[float]:
    seconds = []
    while not stop.is_set():
        t = time.perf_counter()
        await client.get("/health")
        seconds.append(time.perf_counter() - t)
        await asyncio.sleep(every)
    return seconds


async def measure(url: str, bodies: int, megabytes: float, every: float = 0.02) -> dict:
    body = token_body(megabytes)
    async with httpx.AsyncClient(base_url=url, timeout=120) as health, \
            httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=bodies)) as posts:
        idle = []
        for _ in range(20):
            t = time.perf_counter()
            await health.get("/health")
            idle.append(time.perf_counter() - t)
        stop = asyncio.Event()
        poller = asyncio.create_task(_poll(health, stop, every))
        t0 = time.perf_counter()
        replies = await asyncio.gather(*(posts.post("/v1/completions", content=body,
                                                    headers={"content-type": "application/json"})
                                         for _ in range(bodies)))
        elapsed = time.perf_counter() - t0
        stop.set()
        loaded = await poller
    return {"body_bytes": len(body), "bodies": bodies, "seconds": round(elapsed, 3),
            "statuses": sorted({r.status_code for r in replies}),
            "health_idle_median_s": round(statistics.median(idle), 4),
            "health_loaded_median_s": round(statistics.median(loaded), 4),
            "health_loaded_max_s": round(max(loaded), 4), "health_polls": len(loaded)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--bodies", type=int, default=8)
    parser.add_argument("--mb", type=float, default=2.0, help="size of each body, in MB")
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args(argv)
    for _ in range(args.repeat):
        print(json.dumps(asyncio.run(measure(args.url, args.bodies, args.mb))))


if __name__ == "__main__":
    main()
