"""The engine in-process, as the server builds it (`eval.common.build_engine`: an `EngineCore`
over a `PagedRunner`, no HTTP): latency and throughput of greedy requests, a step's cost and
program, KV capacity, images, time to ready, compiles. The modes (--only) are listed below;
what each measures, and example commands: docs/benchmarks.md."""
from __future__ import annotations

import collections
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

import jax_platform
from eval import common
from eval.common import log
from eval.reports import write_json

MODES = {
    "lone": "one stream's inter-token latency (ITL: the median gap)",
    "batch": "--max-num-seqs streams at once: output tok/s, ITL, TTFT",
    "streams": "the same at each --streams count",
    "ttft": "a lone --long-prompt-token prompt's time to first token",
    "prefix": "TTFT of a prompt whose prefix an earlier one cached, against the earlier one's",
    "itl": "4 streams' p99 gap while a --long-prompt is admitted, against their median before",
    "grammar": "sampled streams under a JSON schema against the same without: ITL, tok/s",
    "step": "one decode step of 8 rows: run_step, its dispatch, the model program alone",
    "census": "that step's compiled program; per step, programs, device puts and kernels",
    "capacity": "sequences the scheduler runs in a dense 8 x 8,192 cache's KV bytes",
    "images": "a stream's gap while an image is admitted; image TTFT; encoder images/s",
    "ready": "time to ready in a fresh process, cold then over the cache it filled",
    "compiles": "compiles and cache reads after ready, prompts of mixed lengths"}
WORDS = ("the sea lighthouse keeper winter snow lost key robot paint library night train garden "
         "moon rival bakers forgotten song bookshop storm harvest clock letter mountain village "
         "city bridges river market children evening quiet light road").split()


def text_ids(tok, n: int, seed: int) -> list[int]:
    """`n` token ids of ordinary text, deterministic per seed."""
    rng = np.random.default_rng(seed)
    ids: list[int] = []
    while len(ids) < n:
        ids += tok.encode(" ".join(rng.choice(WORDS, 64)) + ". ")
    return ids[:n]


class Stream:
    """A sink recording when each token of one request arrived."""

    def __init__(self, on_tokens=None):
        self.times: list[float] = []
        self.done = threading.Event()
        self.error = None
        self.on_tokens = on_tokens

    def __call__(self, event) -> None:
        self.times += [time.perf_counter()] * len(event.tokens)
        if self.on_tokens:
            self.on_tokens(len(event.tokens))
        if event.finish_reason is not None:
            self.error = event.error
            self.done.set()

    def wait(self, timeout: float = 3600) -> "Stream":
        if not self.done.wait(timeout) or self.error:
            raise RuntimeError(f"request failed: {self.error}")
        return self


def submit(core, ids, tokens: int, images=(), stream: Stream | None = None, **params) -> Stream:
    """A request of `tokens` tokens (greedy, EOS ignored, unless `params` say otherwise);
    returns its Stream (`.seq_id` set)."""
    from serving import SamplingParams

    s = stream or Stream()
    params = SamplingParams(**{"max_tokens": tokens, "temperature": 0.0, "ignore_eos": True, **params})
    [s.seq_id] = core.submit([(ids, params, s, images)])
    return s


def run_round(core, prompts, tokens: int, **params) -> dict:
    """All `prompts` at once, `tokens` each: output tok/s, ITL (per stream the median gap,
    then the median over streams) and the median TTFT. Stream i's seed: i."""
    t0 = time.perf_counter()
    streams = [submit(core, p, tokens, seed=i, **params) for i, p in enumerate(prompts)]
    for s in streams:
        s.wait()
    gaps = [np.median(np.diff(s.times)) for s in streams if len(s.times) > 1]
    return {"tok_s": sum(len(s.times) for s in streams) / (max(s.times[-1] for s in streams) - t0),
            "itl_s": float(np.median(gaps)) if gaps else float("nan"),
            "ttft_s": float(np.median([s.times[0] - t0 for s in streams]))}


def alternate(cores: dict, fn, repeats: int) -> dict:
    """fn(cores[k], r) -> figures: once untimed for each k (r = 0), then `repeats` times, the
    order reversed every other round. Per k: the runs and each figure's median."""
    for core in cores.values():
        fn(core, 0)
    runs: dict = {k: [] for k in cores}
    for r in range(repeats):
        for k in (list(cores) if r % 2 == 0 else list(cores)[::-1]):
            runs[k].append(fn(cores[k], r + 1))
    return {k: {"runs": v, **{f"{f}_median": float(np.median([x[f] for x in v])) for f in v[0]}}
            for k, v in runs.items()}


def prompts(tok, n: int, length: int, seed: int) -> list[list[int]]:
    return [[tok.bos_id] + text_ids(tok, length - 1, seed + i) for i in range(n)]


def per_engine(model, args, only: list[str], length: int, report: dict) -> None:
    """The modes that compare engines (lone, batch, streams, ttft), at one --max-seq-len."""
    import jax

    tok, n = model.tokenizer, args.max_num_seqs
    counts = common.ints(args.streams) if "streams" in only else []
    cores = {}
    for name in args.engines.split(","):
        t0 = time.perf_counter()
        cores[f"{name}@{length}"] = core = common.build_engine(
            args, model, max_seq_len=length, max_num_seqs=max([n] + counts),
            deterministic=name == "deterministic", prefix_caching=False)
        report.setdefault("engines", {})[f"{name}@{length}"] = {
            "ready_s": time.perf_counter() - t0,
            "kv_bytes": sum(x.nbytes for x in jax.tree.leaves(core.runner.pages)),
            "dense_cache_bytes": dense_cache_bytes(model, n, length)}
    long = min(args.long_prompt, length - args.tokens - 1)
    jobs = {"lone": lambda c, r: run_round(c, prompts(tok, 1, args.prompt_tokens, 100 * r), args.tokens),
            "batch": lambda c, r: run_round(c, prompts(tok, n, args.prompt_tokens, 100 * r), args.tokens),
            "ttft": lambda c, r: {"ttft_s": run_round(c, prompts(tok, 1, long, 500 + r), 1)["ttft_s"],
                                  "prompt_tokens": long}}
    jobs.update({f"streams:{k}": lambda c, r, k=k: run_round(
        c, prompts(tok, k, args.prompt_tokens, 1000 * k + 100 * r), args.tokens) for k in counts})
    try:
        for job, fn in jobs.items():
            mode, _, k = job.partition(":")
            if mode in only:
                for name, res in alternate(cores, fn, args.repeats).items():
                    report.setdefault(mode, {}).setdefault(name, {})
                    if k:
                        report[mode][name][k] = res
                    else:
                        report[mode][name] = res
                log(f"{job} at {length} done")
    finally:
        for core in cores.values():
            core.shutdown()


def prefix(model, args) -> dict:
    """TTFT of a prompt sharing a --long-prompt-token prefix with an earlier one's, and the
    prompt tokens the second found cached."""
    core = common.build_engine(args, model, prefix_caching=True)
    tok = model.tokenizer
    shared = [tok.bos_id] + text_ids(tok, min(args.long_prompt, args.max_seq_len[0] - 64), 100)
    try:
        submit(core, [tok.bos_id] + text_ids(tok, 40, 1), 2).wait()  # untimed
        ttft = []
        for i in range(2):
            t0 = time.perf_counter()
            ttft.append(submit(core, shared + text_ids(tok, 40, 200 + i), 2).wait().times[0] - t0)
        hits = core.scheduler.kv.hits
    finally:
        core.shutdown()
    return {"prefix_tokens": len(shared), "first_ttft_s": ttft[0], "second_ttft_s": ttft[1],
            "ratio": ttft[1] / ttft[0], "hit_tokens": hits}


def itl(model, args, deterministic: bool) -> dict:
    """4 running streams; a --long-prompt-token prompt arrives once each has 20 tokens; their
    gaps before it arrived against those until its first token (the streams then cancelled)."""
    core = common.build_engine(args, model, deterministic=deterministic, prefix_caching=False)
    tok = model.tokenizer
    length = min(args.long_prompt, args.max_seq_len[0] - 8)
    try:
        submit(core, [tok.bos_id] + text_ids(tok, 20, 1), 4).wait()
        streams = [submit(core, [tok.bos_id] + text_ids(tok, 20, 10 + i), args.max_seq_len[0] - 32)
                   for i in range(4)]
        while min(len(s.times) for s in streams) < 20:
            time.sleep(0.005)
        t_arrive = time.perf_counter()
        t_first = submit(core, [tok.bos_id] + text_ids(tok, length - 1, 2), 1).wait().times[0]
        core.cancel([s.seq_id for s in streams])
        for s in streams:
            s.done.wait(60)
    finally:
        core.shutdown()
    base, during = [], []
    for s in streams:
        t = np.asarray(s.times[4:])  # past the start-up
        gaps = np.diff(t)
        base += list(gaps[t[1:] < t_arrive])
        during += list(gaps[(t[1:] > t_arrive) & (t[:-1] < t_first)])
    if not during:
        raise RuntimeError("no gap fell in the admission: raise --long-prompt")
    med, p99 = float(np.median(base)), float(np.percentile(during, 99))
    return {"baseline_median_itl_s": med, "admission_p99_itl_s": p99, "admission_gaps": len(during),
            "admission_max_itl_s": float(np.max(during)), "admission_s": t_first - t_arrive,
            "prompt_tokens": length, "ratio": p99 / med}


def grammar(model, args) -> dict:
    """--max-num-seqs sampled streams with a JSON schema's grammar (eval.bench_serving's order)
    against the same without one, alternating: ITL and tok/s of each, the grammar's cost."""
    from eval.bench_serving import SCHEMAS
    from serving import build_grammar

    core = common.build_engine(args, model, prefix_caching=False)
    tok = model.tokenizer
    grammar = build_grammar("json_schema", SCHEMAS[1], "bench", tok, core.runner.info.eos_ids)
    prompt = [tok.bos_id] + tok.encode("An order as JSON: ")
    try:
        out = alternate({"plain": None, "grammar": grammar}, lambda g, r: run_round(
            core, [prompt] * args.max_num_seqs, args.tokens, temperature=1.0, grammar=g), args.repeats)
    finally:
        core.shutdown()
    out["grammar_itl_cost"] = out["grammar"]["itl_s_median"] / out["plain"]["itl_s_median"] - 1
    return out


def decode_inputs(runner, rows: int = 8, context: int = 256):
    """The step inputs of `rows` decodes at position `context` as the scheduler plans them
    (their prompts of `context` tokens computed first, untimed)."""
    from serving import PagedScheduler, SamplingParams, Sequence, step_inputs

    sched = PagedScheduler(runner.info)
    bos, params = runner.tokenizer.bos_id, SamplingParams(max_tokens=1, temperature=0.0)
    sched.add([Sequence(id=i, prompt=[bos] * context, params=params, seed=i) for i in range(rows)])
    while True:
        plan = sched.schedule()
        inputs = step_inputs(plan, sched.kv, runner.info)
        if len(plan.pieces) == rows and all(p.end - p.start == 1 for p in plan.pieces):
            return inputs
        out = runner.run_step(inputs)
        for row, p in enumerate(plan.pieces):
            if p.sample:
                p.seq.generated.append(int(out.tokens[row]))


def median_ms(fn, n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times) * 1000)


def step(runner, args) -> dict:
    """One decode step of 8 rows at --step-context (at most half --max-seq-len): `run_step`
    (inputs up, step, sampler, tokens back), its dispatch alone and the model program alone."""
    import jax

    from models.gemma3.ragged import RaggedBatch

    n, context = 10 * args.repeats, min(args.step_context, runner.info.max_seq_len // 2)
    inputs = decode_inputs(runner, 8, context)
    t0 = time.perf_counter()
    runner.run_step(inputs)
    out = {"rows": 8, "context": context, "first_step_s": time.perf_counter() - t0,
           "step_ms": median_ms(lambda: runner.run_step(inputs), n),
           "dispatch_ms": median_ms(lambda: runner.dispatch_step(inputs), n)}
    jax.block_until_ready(runner.pages)
    if not runner.info.deterministic:  # (there a step runs as two programs)
        model = runner.model
        batch = RaggedBatch(**{k: jax.device_put(np.asarray(v), model.programs.replicated)
                               for k, v in inputs.batch.items()})

        def model_only():
            logits, runner.pages = model.ragged_step(runner.pages, batch)
            jax.block_until_ready(logits)

        model_only()
        out["model_program_ms"] = median_ms(model_only, n)
    return out


def hlo_census(text: str) -> dict:
    """The compiled module's ENTRY: its kernels (every instruction but parameters, tuples,
    constants and bitcasts), parameters and while loops, and the opcodes' counts."""
    entry, ops = False, collections.Counter()
    for line in text.splitlines():
        if not line.startswith(" "):
            entry = line.startswith("ENTRY")
        elif entry and (m := re.search(r"=\s*[^=]*?\s([a-z][\w\-]*)\(", line)):
            ops[m.group(1)] += 1
    free = {"parameter", "tuple", "get-tuple-element", "constant", "bitcast"}
    return {"entry_kernels": sum(v for k, v in ops.items() if k not in free),
            "parameters": ops["parameter"], "while_loops": ops["while"],
            "ops": dict(ops.most_common(12))}


def trace_events(trace_dir: str, steps: int) -> dict:
    """Per step, from a profiler trace: the programs dispatched (outermost PjitFunction events)
    and arrays put on a device (host); the device's kernels, their busy time and the largest."""
    import jax

    files = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    data = jax.profiler.ProfileData.from_file(max(files, key=os.path.getmtime))
    programs, puts, count, kernels = collections.Counter(), 0, 0, collections.defaultdict(float)
    for plane in data.planes:
        device = "GPU" in plane.name or "TPU" in plane.name
        for line in plane.lines:
            until = 0.0
            for ev in sorted(line.events, key=lambda e: e.start_ns):
                if device and ("Stream" in line.name or "XLA Ops" in line.name):
                    kernels[ev.name[:90]] += ev.duration_ns / 1e6
                    count += 1
                elif plane.name.startswith("/host") and ev.name.startswith("PjitFunction("):
                    if ev.start_ns >= until:
                        programs[ev.name[len("PjitFunction("):-1]] += 1
                        until = ev.start_ns + ev.duration_ns
                elif plane.name.startswith("/host") and ev.name.startswith("DevicePut"):
                    puts += 1
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:10]
    return {"programs": sum(programs.values()) / steps,
            "by_name": {k: v / steps for k, v in sorted(programs.items())},
            "device_puts": puts / steps, "device_kernels": count / steps,
            "device_busy_ms": sum(kernels.values()) / steps, "largest_kernels_ms": top}


def census(runner, steps: int = 8) -> dict:
    import jax

    inputs = decode_inputs(runner, 8, min(256, runner.info.max_seq_len // 2))
    model, layers = runner.model, runner.model.config.num_layers
    key = model.ragged_key(inputs.buckets, runner.pages)
    out = {"program": key.describe(), **hlo_census(model.lower_ragged(key).compile().as_text()),
           "layers": layers}
    out["entry_kernels_per_layer"] = out["entry_kernels"] / layers
    out["parameters_per_layer"] = out["parameters"] / layers
    runner.run_step(inputs)
    trace = tempfile.mkdtemp(prefix="bench-engine-trace-")
    try:
        with jax.profiler.trace(trace):
            for _ in range(steps):
                runner.run_step(inputs)
        out["per_step"] = trace_events(trace, steps)
    except Exception as e:  # a backend whose trace cannot be read back
        out["per_step"] = {"error": repr(e)[:300]}
    finally:
        shutil.rmtree(trace, ignore_errors=True)
    return out


def kv_bytes(model) -> int:
    """Bytes of one position's keys and values in one layer, as the pools hold them (codes, scales)."""
    c, pages = model.config, model.pages_shapes(2, 2, 1)
    return pages.nbytes * c.num_kv_heads // (c.num_layers * pages.layers[0].kv.shape[2])


def dense_cache_bytes(model, rows: int, seq_len: int) -> int:
    """KV bytes of a dense cache of `rows` x `seq_len` tokens (the global layers every position,
    the local ones their window) in the activations' dtype: a whole context reserved for each."""
    c = model.config
    return rows * 2 * c.num_kv_heads * c.head_dim * np.dtype(model.dtype).itemsize * (
        c.num_global_layers * seq_len + c.num_local_layers * min(c.sliding_window, seq_len))


def capacity(model, args, seqs: int = 48, row_len: int = 8192) -> dict:
    """How many sequences of --prompt-tokens run at once in a dense 8 x `row_len` cache's KV
    bytes, pools of --kv-cache-dtype. A sequence's bytes are the pages the allocator gave it (its
    prompt and 16 tokens); the pools as the engine sizes them for N sequences."""
    from serving import PagedScheduler, SamplingParams, Sequence, paged_runner_info

    c, page = model.config, args.page_size
    budget, per_token = dense_cache_bytes(model, 8, row_len), kv_bytes(model)

    def info(n: int):
        return paged_runner_info(model, n, row_len, page, max(row_len, n * (args.prompt_tokens + 32)),
                                 None, None, False, False, "bench")

    def run(info, n: int) -> tuple:
        sched = PagedScheduler(info)
        sched.add([Sequence(id=i, prompt=[2] * args.prompt_tokens, params=SamplingParams(
            max_tokens=16, temperature=0.0, ignore_eos=True), seed=0) for i in range(n)])
        most = steps = 0
        held = None
        while sched.num_running or sched.num_waiting:
            plan, steps = sched.schedule(), steps + 1
            most = max(most, sched.num_running)
            for p in plan.pieces:
                if p.sample:
                    p.seq.generated.append(7)
                    if len(p.seq.generated) == 16:
                        kv = sched.kv.seqs[p.seq.id]
                        held = held or (len(kv.global_pages), len(kv.local_pages))
                        sched.finish(p.seq)
        return most, sched.num_preemptions, steps, held

    g, loc = run(info(1), 1)[3]
    per_seq = (g * c.num_global_layers + loc * c.num_local_layers) * page * per_token

    def pool_bytes(i):
        return ((i.num_global_pages - 1) * c.num_global_layers
                + (i.num_local_pages - 1) * c.num_local_layers) * page * per_token

    fits = int(budget // per_seq) + 1
    while pool_bytes(info(fits)) > budget:
        fits -= 1
    most, preempted, steps, _ = run(info(fits), seqs)
    return {"dense_cache_bytes": int(budget), "bytes_per_sequence": int(per_seq),
            "global_pages": g, "local_pages": loc, "sequences_that_fit": fits,
            "pool_bytes": int(pool_bytes(info(fits))), "most_running": most,
            "preemptions": preempted, "steps": steps, "sequences": seqs,
            "bytes_for_all_over_dense": per_seq * seqs / budget, "kv_bytes_per_token_layer": per_token}


def image_request(model, text: list[int], seed: int):
    """A prompt with one image after `text` (start, soft tokens, end, then text) and its
    SeqImage of random pixels (a new content key per seed)."""
    from serving import SeqImage

    t, vc = model.vision.tokens, model.vision.config
    a = len(text) + 1
    ids = text + [t.start] + [t.soft] * vc.tokens_per_image + [t.end] + text[1:9]
    pixels = np.random.default_rng(seed).uniform(-1, 1, (1, vc.image_size, vc.image_size, 3))
    return ids, (SeqImage(spans=((a, a + vc.tokens_per_image),), pixels=pixels.astype(np.float32),
                          key=f"bench-{seed}"),)


def stall(core, model, kind: str, seed: int) -> dict:
    """A running stream's gaps while another request (`kind`: an image prompt, or a text
    prompt as long) is admitted, to that request's first token; split at the moment the
    image's features were ready (the encoder's stages, then its soft tokens)."""
    tok, runner = model.tokenizer, core.runner
    text = [tok.bos_id] + text_ids(tok, 11, seed)
    ids, images = image_request(model, text, seed)
    if kind == "text":
        ids, images = [tok.bos_id] + text_ids(tok, len(ids) - 1, seed + 1), ()
    encoded = []  # images encoded when each of the stream's tokens arrived
    stream = Stream(lambda n: encoded.extend([runner.images_encoded] * n))
    submit(core, [tok.bos_id] + text_ids(tok, 7, seed + 2), core.runner.info.max_seq_len - 16,
           stream=stream)
    while len(stream.times) < 4:
        time.sleep(0.001)
    t0 = time.perf_counter()
    first = submit(core, ids, 1, images).wait().times[0]
    while stream.times[-1] <= first and not stream.done.is_set():
        time.sleep(0.001)
    core.cancel([stream.seq_id])
    stream.done.wait(60)
    times, enc = np.array(stream.times), np.array(encoded)
    lo = int(np.searchsorted(times, t0)) - 1
    hi = min(int(np.searchsorted(times, first, side="right")), len(times) - 1)
    gaps, after = np.diff(times[lo:hi + 1]), enc[lo + 1:hi + 1] > enc[lo]
    return {"max_itl_s": float(gaps.max()), "other_ttft_s": float(first - t0),
            "max_itl_while_encoding_s": float(gaps[~after].max()) if (~after).any() else None,
            "max_itl_after_features_s": float(gaps[after].max()) if after.any() else None,
            "median_itl_before_s": float(np.median(np.diff(times[:lo + 1])))}


def images(model, args) -> dict:
    if model.vision is None:
        raise SystemExit("--only images needs a model with a tower, e.g. random:tiny?vision=tiny")
    core = common.build_engine(args, model, max_num_seqs=4, prefix_caching=True)
    out: dict = {"encoder_stages": len(core.runner.encoder.stages), "stall": {}, "ttft": {"runs": []}}
    seed = 100
    try:
        for r in range(args.repeats + 1):  # the first round compiles what each kind meets
            for kind in ("text", "image"):
                seed += 10
                res = stall(core, model, kind, seed)
                if r:
                    out["stall"].setdefault(kind, {"runs": []})["runs"].append(res)
        for r in range(args.repeats + 1):
            ids, ims = image_request(model, [model.tokenizer.bos_id] + text_ids(model.tokenizer, 11, r), r)
            t = []
            for _ in range(2):
                t0 = time.perf_counter()
                t.append(submit(core, ids, 1, ims).wait().times[0] - t0)
            if r:
                out["ttft"]["runs"].append({"first_s": t[0], "again_s": t[1], "ratio": t[1] / t[0]})
    finally:
        core.shutdown()
    for part in (*out["stall"].values(), out["ttft"]):  # the largest gaps, the median TTFTs
        for k, v in part["runs"][0].items():
            vs = [x[k] for x in part["runs"] if x[k] is not None]
            part[k] = (max if "max" in k else np.median)(vs) if vs else None
    pixels = image_request(model, [1], 0)[1][0].pixels
    import jax

    jax.block_until_ready(model.image_features(pixels))
    t0 = time.perf_counter()
    for _ in range(args.repeats):
        jax.block_until_ready(model.image_features(pixels))
    out["encoder_images_per_s"] = args.repeats / (time.perf_counter() - t0)
    return out


def ready(argv: list[str]) -> dict:
    """`ready-child` in a fresh process, cold then over the cache the first filled; process_s:
    the child's whole life (interpreter, imports, exit too)."""
    out = {}
    cache = tempfile.mkdtemp(prefix="bench-engine-cache-")
    try:
        for phase in ("cold", "cached"):
            cmd = [sys.executable, "-m", "eval.bench_engine", *argv, "--only", "ready-child",
                   "--compile-cache-dir", cache]
            t0 = time.perf_counter()
            r = subprocess.run(cmd, cwd=common.ROOT, env=jax_platform.child_environment(),
                               capture_output=True, text=True, timeout=3600)
            if r.returncode:
                raise SystemExit(f"ready ({phase}): the child failed\n{r.stderr[-3000:]}")
            out[phase] = {**json.loads(r.stdout.strip().splitlines()[-1]),
                          "process_s": time.perf_counter() - t0}
            log(f"ready ({phase}) in {out[phase]['ready_s']:.1f}s")
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    return out


def ready_child(args) -> dict:
    from eval.compile_events import counted_compiles
    from serving import load_runner

    counts = counted_compiles()
    t0 = time.perf_counter()
    load_runner(common.server_config(args), lambda msg: None)
    return {"ready_s": time.perf_counter() - t0, **counts()}


def compiles(model, args) -> dict:
    """Compiles and cache reads after ready (the engine built as --precompile says): prompts of
    mixed lengths at 1, 8, 32 and 64 streams."""
    from eval.compile_events import counted_compiles

    core = common.build_engine(args, model)
    figures = counted_compiles()
    rng = np.random.default_rng(7)
    counts = sorted({min(n, args.max_num_seqs) for n in (1, 8, 32, 64)})
    longest = args.max_seq_len[0] - args.tokens
    try:
        for n in counts:
            run_round(core, [[model.tokenizer.bos_id] + text_ids(model.tokenizer, int(k) - 1, i)
                             for i, k in enumerate(rng.integers(2, longest + 1, n))], args.tokens)
    finally:
        core.shutdown()
    return {"streams": counts, "longest_prompt": longest, **figures()}


def summary(tree: dict, path: str = "") -> list[str]:
    """A line of scalar figures for every dict in the report (the runs left out)."""
    scalars = ", ".join(f"{k} {v:.4g}" for k, v in tree.items()
                        if isinstance(v, (int, float)) and not isinstance(v, bool))
    lines = [f"{path}: {scalars}"] if scalars and path else []
    for k, v in tree.items():
        if isinstance(v, dict) and k != "runs":
            lines += summary(v, f"{path} {k}".strip())
    return lines


def main(argv: list[str] | None = None) -> dict:
    p = common.parser(__doc__, {**MODES, "ready-child": "(internal) one process of ready"},
                      only="lone,batch", lists=("max_seq_len",), repeats=2, max_seq_len=2048)
    p.add_argument("--engines", default="default", help="comma-separated: default, deterministic")
    p.add_argument("--streams", default="1,8", help="streams: stream counts")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--tokens", type=int, default=64, help="output tokens a stream")
    p.add_argument("--long-prompt", type=int, default=2000, help="ttft, prefix, itl: prompt tokens")
    p.add_argument("--step-context", type=int, default=256, help="step: the rows' context")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    only = common.names(args.only)
    unknown = set(only) - set(MODES) - {"ready-child"} or set(common.names(args.engines)) - {
        "default", "deterministic"}
    if unknown:
        p.error(f"unknown {sorted(unknown)}")
    jax_platform.request_cpu_devices(common.devices(args))
    if only == ["ready-child"]:
        print(json.dumps(ready_child(args)))
        return {}
    report: dict = {"ready": ready(argv)} if "ready" in only else {}
    import jax

    from models.gemma3.byte_tokenizer import ByteTokenizer

    t0 = time.perf_counter()
    model = common.load(args, max_seq_len=max(args.max_seq_len + [8192] * ("capacity" in only)))
    c = model.config
    report = {"model": args.model, "dtype": args.dtype, "tp": common.devices(args),
              "allreduce": args.allreduce, "backend": jax.default_backend(),
              "device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "layers": c.num_layers, "vocab_size": c.vocab_size, "max_num_seqs": args.max_num_seqs,
              "tokenizer": "byte" if isinstance(model.tokenizer, ByteTokenizer) else "real",
              "load_s": time.perf_counter() - t0, "command": "python -m eval.bench_engine " + " ".join(argv),
              **report}
    engines = common.names(args.engines)
    for length in args.max_seq_len:
        if {"lone", "batch", "streams", "ttft"} & set(only):
            per_engine(model, args, only, length, report)
        for name in engines * ("step" in only):
            core = common.build_engine(args, model, start=False, max_seq_len=length, max_num_seqs=8,
                                       prefix_caching=False, deterministic=name == "deterministic")
            report.setdefault("step", {})[f"{name}@{length}"] = step(core.runner, args)
            del core
    for name in engines * ("itl" in only):
        report.setdefault("itl", {})[name] = itl(model, args, name == "deterministic")
    single = {"prefix": prefix, "grammar": grammar, "capacity": capacity, "images": images,
              "compiles": compiles,
              "census": lambda m, a: census(common.build_engine(
                  a, m, start=False, max_num_seqs=8, prefix_caching=False).runner)}
    for mode in only:
        if mode in single:
            report[mode] = single[mode](model, args)
            log(f"{mode} done")
    log("\n".join(summary({m: report[m] for m in ("engines", *MODES) if m in report})))
    write_json(args.out, report)
    print(json.dumps(report, indent=1, default=str))
    return report


if __name__ == "__main__":
    main()
