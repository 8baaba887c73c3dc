"""Command-line entry points: `gemma3-serve` (the HTTP server), `gemma3-generate` (one prompt,
streamed to the terminal) and `gemma3-convert` (weights converted once, for fast restarts, or
written as a Hugging Face checkpoint).

Process set-up comes from `jax_platform`. On a CPU-only machine `--tp N` runs on N
virtual CPU devices, which XLA only creates when they are asked for before its backend starts;
so each entry point reads its settings, asks for the devices, and only then imports the serving
stack (inside the functions).
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time

import jax_platform
from serving.config import ServerConfig, add_arguments, from_sources

log = logging.getLogger("serving")


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)


def _config(parser: argparse.ArgumentParser, args: argparse.Namespace, extra: tuple[str, ...] = ()) -> ServerConfig:
    values = {k: v for k, v in vars(args).items() if k not in extra}
    try:
        return from_sources(values)
    except ValueError as e:
        parser.error(str(e))


# ---- gemma3-serve ----

def serve_main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="gemma3-serve",
        description="OpenAI-compatible server for Gemma 3 with an optional int8 (EQuARX) AllReduce. "
                    "Settings also come from a config file (--config) or GEMMA3_* environment variables.")
    add_arguments(parser)
    jax_platform.add_group_arguments(parser)
    args = parser.parse_args(argv)
    config = _config(parser, args, extra=tuple(jax_platform.GROUP_FLAGS))
    try:
        # The watchdog's limits are server settings (from flags, the environment or the file).
        group = jax_platform.group_from({**vars(args), "step_timeout": config.step_timeout,
                                         "compile_timeout": config.compile_timeout})
        jax_platform.request_cpu_devices(group.local_device_count(config.tp))
    except ValueError as e:
        parser.error(str(e))
    _setup_logging(config.log_level)
    leader = None
    if group.enabled:
        # Before any other jax use. Processes other than 0 serve no HTTP: they follow its steps.
        from serving import distributed

        try:
            jax_platform.join_process_group(group)
        except jax_platform.GroupFormationError as e:
            jax_platform.exit_group_not_formed(e)
        import jax

        if jax.process_index() != 0:
            sys.exit(distributed.run_worker(config, group))
        leader = distributed.leader_factory(group)

    import uvicorn

    from serving.api import create_app
    from serving.http_server import uvicorn_config
    from serving.runtime import Runtime

    runtime = Runtime(config, runner_factory=leader)
    app = create_app(runtime)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            # SIGTERM/SIGINT: refuse new work at once; uvicorn then stops listening and gives
            # in-flight requests `shutdown_timeout` seconds before cancelling them.
            # Unlike uvicorn's own handler, the signal is not re-raised after the graceful
            # shutdown: a drained server exits with status 0.
            log.info("signal %s: shutting down", sig)
            runtime.begin_shutdown()
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True  # a second Ctrl-C stops waiting for open requests
            else:
                self.should_exit = True

    server = Server(uvicorn_config(app, config, log_level=config.log_level,
                                   timeout_graceful_shutdown=config.shutdown_timeout,
                                   access_log=config.log_level == "debug"))
    failed: list[str] = []

    def on_load_failure(message: str) -> None:
        failed.append(message)
        server.should_exit = True

    runtime.on_load_failure = on_load_failure
    log.info("serving %s on http://%s:%d (/health turns 200 once the model is warmed up)",
             config.model_name, config.host, config.port)
    runtime.start_loading()
    server.run()
    if not runtime.shutdown(drain_timeout=0.0, join_timeout=ENGINE_STOP_GRACE_S) or runtime.status == "stuck":
        _exit_stuck(runtime)
    if leader is not None and runtime.runner is not None:
        runtime.runner.close()  # the other processes leave their step loops
    if failed:
        log.error("the model failed to load: %s", failed[0])
        sys.exit(1)
    if not server.started:
        sys.exit(1)  # e.g. the port was taken (uvicorn logged why)


# After SIGTERM and the HTTP server's own shutdown, how long the engine thread may take to end.
ENGINE_STOP_GRACE_S = 3.0


def _exit_stuck(runtime) -> None:
    """Ends the process at once: its engine thread is stuck (possibly inside the runtime, where
    nothing reaches it; a normal exit could wait for it forever)."""
    from serving.watchdog import EXIT_STUCK

    core = runtime.core
    why = core.stuck or (f"the engine thread did not stop within {ENGINE_STOP_GRACE_S:g}s: it is in "
                         f"{core.busy_with() or 'an engine call'}")
    log.error("exiting with status %d without waiting for the engine thread: %s", EXIT_STUCK, why)
    for h in logging.getLogger().handlers:
        h.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_STUCK)


# ---- gemma3-generate ----

_GENERATE_SETTINGS = ("model", "tp", "tp_mesh", "allreduce", "allreduce_minishards",
                      "allreduce_min_bytes", "dtype", "quantization", "quantization_group_size",
                      "max_seq_len", "compile_cache_dir", "log_level")


def generate_main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="gemma3-generate",
        description="Generate a continuation of one prompt and stream it to the terminal.")
    parser.add_argument("prompt", help="the prompt text")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in Gemma's chat template")
    parser.add_argument("--image", action="append", default=[], metavar="PATH",
                        help="an image file (png, jpeg, webp, gif) shown before the prompt "
                        "(repeatable; implies --chat; needs a model with a vision tower)")
    add_arguments(parser, only=_GENERATE_SETTINGS)
    args = parser.parse_args(argv)
    own = ("prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "chat", "image")
    config = _config(parser, args, extra=own)
    if config.log_level == "info":
        config = ServerConfig(**{**config.__dict__, "log_level": "warning"})
    jax_platform.request_cpu_devices(config.tp)
    _setup_logging(config.log_level)

    from serving.sampling import InvalidParameter, SamplingParams

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.seed, stop=tuple(args.stop))
    except InvalidParameter as e:
        parser.error(str(e))
    if not args.prompt:
        parser.error("the prompt is empty")
    sys.exit(_generate(config, args.prompt, params, args.chat or bool(args.image), args.image))


def _image_prompt(model, prompt: str, paths: list[str]):
    """(ids, images) of one user turn holding the images at `paths`, then the prompt, as the
    chat endpoint lays out such a message (serving/chat_images.py); raises ValueError (a
    MediaError for an unreadable image) with a message for the user."""
    from serving import chat_images, media
    from serving.chat_template import render_chat
    from serving.sequence import SeqImage

    vision = getattr(model, "vision", None)
    if vision is None:
        raise ValueError(f"{model.config.name}: this model has no vision tower: it takes no images")
    prepared = []
    for path in paths:
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as e:
            raise ValueError(f"{path}: {e.strerror}") from None
        try:
            prepared.append(media.prepare_image(data, size=vision.config.image_size))
        except media.MediaError as e:
            raise ValueError(f"{path}: {e}") from None
    tok = chat_images.ImageTokenizer(model.tokenizer, vision.tokens.start, vision.tokens.end,
                                     vision.tokens.soft, vision.config.tokens_per_image)
    ids = render_chat([("user", tok.sentinel * len(paths) + prompt.strip())], tok)
    spans = chat_images.soft_spans(ids, tok.soft)
    return ids, tuple(SeqImage(spans=(span,), pixels=p.pixels, key=p.content_hash)
                      for span, p in zip(spans, prepared))


def _generate(config: ServerConfig, prompt: str, params, chat: bool, image_paths=()) -> int:
    from serving.chat_template import render_chat
    from serving.engine_core import EngineCore
    from serving.paged_runner import PagedRunner
    from serving.runtime import configure_jax, load_configured_model
    from serving.sampling import SamplingParams

    t_start = time.perf_counter()
    progress = _Progress(t_start)
    mesh = f" ({config.tp_mesh})" if config.tp_mesh else ""
    progress(f"loading {config.model} ({config.dtype}, tp={config.tp}{mesh}, allreduce={config.allreduce_config().label})")
    configure_jax(config)
    model = load_configured_model(config)
    # The server's engine, for text and images alike. One sequence shares nothing, and
    # a prefix cache would give the timed run other steps (hits) than its warm-up below.
    runner = PagedRunner(model, max_num_seqs=1, max_seq_len=config.max_seq_len,
                         page_size=config.page_size,
                         long_prefill_token_threshold=config.long_prefill_token_threshold,
                         prefix_caching=False, model_name=config.model_name)
    tok = runner.tokenizer
    core = EngineCore(runner, max_waiting=1)
    try:
        if image_paths:
            ids, images = _image_prompt(model, prompt, image_paths)
        else:
            ids = render_chat([("user", prompt)], tok) if chat else [tok.bos_id] + tok.encode(prompt)
            images = ()
        core.check(len(ids), params.max_tokens)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    done = threading.Event()
    result = {}

    def sink(event) -> None:
        if event.text:
            sys.stdout.write(event.text)
            sys.stdout.flush()
        if event.finish_reason is not None:
            result.update(reason=event.finish_reason, n=event.num_generated, error=event.error)
            done.set()

    core.start()
    try:
        if not image_paths:
            # The prompt's steps and a decode step run once (compiling them and the sampler),
            # so that the timing below is the generation's. Not with images: the encoder would
            # run twice, and its features would be cached for the timed run.
            progress("compiling the prompt's steps")
            _run_once(core, ids, SamplingParams(max_tokens=min(2, params.max_tokens), temperature=0.0,
                                                ignore_eos=True))
        progress("generating", done=True)
        t0 = time.perf_counter()
        core.submit([(ids, params, sink, images)])
        done.wait()
    except KeyboardInterrupt:
        core.shutdown()
        return 130
    elapsed = time.perf_counter() - t0
    core.shutdown()
    sys.stdout.write("\n")
    sys.stdout.flush()
    if result.get("reason") == "error":
        print(f"error: {result['error']}", file=sys.stderr)
        return 1
    print(f"[{result['n']} tokens in {elapsed:.2f}s, {result['n'] / max(elapsed, 1e-9):.1f} tokens/s, "
          f"finish: {result['reason']}; start-up {t0 - t_start:.1f}s]", file=sys.stderr)
    return 0


def _run_once(core, ids: list[int], params) -> None:
    done = threading.Event()
    core.submit([(ids, params, lambda event: event.finish_reason is not None and done.set())])
    done.wait()


class _Progress:
    """Progress lines on stderr with the elapsed time (a terminal sees them as they happen)."""

    def __init__(self, t0: float):
        self.t0 = t0

    def __call__(self, message: str, done: bool = False) -> None:
        print(f"[{time.perf_counter() - self.t0:6.1f}s] {message}{'' if done else ' ...'}", file=sys.stderr,
              flush=True)


# ---- gemma3-convert ----

def convert_main(argv: list[str] | None = None) -> None:
    """Convert weights once (GGUF dequantization, layout, dtype) into an orbax checkpoint that
    `gemma3-serve --model DIR` and `load_model(DIR)` restore straight into the sharded layout,
    or into a Hugging Face directory (--format hf) that transformers loads too."""
    parser = argparse.ArgumentParser(
        prog="gemma3-convert",
        description="Convert a model source (gemma3-270m, a .gguf file, a Hugging Face or official "
                    "Flax/orbax checkpoint) into a converted checkpoint directory for fast "
                    "restarts, or into a Hugging Face checkpoint. Either loads at any --tp.")
    parser.add_argument("source", help="'gemma3-270m', a .gguf path or a checkpoint directory")
    parser.add_argument("out", help="directory to write (created; an existing checkpoint there is replaced)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                        help="dtype of the stored weights")
    parser.add_argument("--format", default="orbax", choices=("orbax", "hf", "official"),
                        help="orbax: ours, fastest to restore (text only); hf: Hugging Face "
                             "Gemma3ForCausalLM, or Gemma3ForConditionalGeneration with the vision "
                             "tower (config.json, safetensors, tokenizer files); official: the "
                             "official gemma library's parameter tree (orbax), tower included")
    parser.add_argument("--max-shard-gb", type=float, default=5.0,
                        help="--format hf: largest safetensors file, in GiB (more files and an index "
                             "beyond it)")
    parser.add_argument("--tp", type=int, default=1,
                        help="devices to convert on (each writes its shards; on CPU: virtual devices)")
    args = parser.parse_args(argv)
    if args.tp < 1:
        parser.error("--tp must be >= 1")
    if args.max_shard_gb <= 0:
        parser.error("--max-shard-gb must be > 0")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        parser.error(f"{args.out} exists and is not a directory")
    jax_platform.request_cpu_devices(args.tp)
    _setup_logging("warning")

    from models.gemma3 import load_model

    t0 = time.perf_counter()
    try:
        model = load_model(args.source, tp=args.tp, dtype=args.dtype)
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))
    model.save(args.out, format=args.format, max_shard_bytes=int(args.max_shard_gb * (1 << 30)))
    print(f"wrote {model.config.name} ({args.dtype}, {args.format}) to {args.out} in "
          f"{time.perf_counter() - t0:.1f} s; serve it with: gemma3-serve --model {args.out}")


if __name__ == "__main__":
    serve_main()
