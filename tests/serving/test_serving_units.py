"""Unit tests of the serving pieces that need no model: detokenizer, stop strings, sampler, chat
template, settings."""
import argparse
import functools
import json
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from serving.chat_template import render_chat
from serving.config import ServerConfig, add_arguments, from_sources
from serving.detokenize import IncrementalDetokenizer, TextStream
from serving.fake_runner import ByteTokenizer
from serving.sampling import InvalidParameter, SamplingMetadata, SamplingParams, make_sampler, sample


@pytest.fixture(scope="module")
def gemma_tokenizer():
    from models.gemma3.gguf import default_gguf_path
    from models.gemma3.tokenizer import Tokenizer

    return Tokenizer.from_gguf(default_gguf_path())


# ---- detokenizer ----

def _stream_pieces(tok, ids):
    d = IncrementalDetokenizer(tok)
    pieces = [d.add(i) for i in ids]
    return pieces, d.flush()


def test_detokenizer_never_emits_half_a_character():
    tok = ByteTokenizer()
    text = "a€b😀ç"
    pieces, tail = _stream_pieces(tok, tok.encode(text))
    assert "".join(pieces) + tail == text
    assert all("\ufffd" not in p for p in pieces)
    # '€' is 3 bytes: nothing is released for its first two bytes, then the whole character.
    assert pieces[1:4] == ["", "", "€"]
    assert pieces[5:9] == ["", "", "", "😀"]


def test_detokenizer_flushes_an_incomplete_character_at_the_end():
    tok = ByteTokenizer()
    ids = tok.encode("x") + tok.encode("€")[:2]
    pieces, tail = _stream_pieces(tok, ids)
    assert pieces == ["x", "", ""]
    assert tail == "\ufffd"


def test_detokenizer_on_gemma_byte_fallback_tokens(gemma_tokenizer):
    tok = gemma_tokenizer
    text = "Hello \U00013000 wörld \u2fd5 🦜 ok  two  spaces\n\tend"
    ids = tok.encode(text)
    assert any(tok.id_to_piece(i).startswith("<0x") for i in ids)  # the case under test occurs
    pieces, tail = _stream_pieces(tok, ids)
    assert "".join(pieces) + tail == text
    assert all("\ufffd" not in p for p in pieces)


# ---- stop strings ----

def _run_stream(text, stop, tok=None):
    tok = tok or ByteTokenizer()
    s = TextStream(tok, stop)
    out = []
    for i in tok.encode(text):
        delta, stopped = s.add(i)
        out.append(delta)
        if stopped:
            return "".join(out), True
    return "".join(out) + s.finish(), False


@pytest.mark.parametrize("text,stop,expected,stopped", [
    ("hello world", ["wor"], "hello ", True),
    ("hello world", ["xyz"], "hello world", False),
    ("aaab", ["ab"], "aa", True),
    ("one\n\ntwo", ["\n\n", "two"], "one", True),
    ("stop at end", ["end"], "stop at ", True),
    ("€uro", ["uro"], "€", True),
])
def test_stop_strings_cut_before_the_match(text, stop, expected, stopped):
    assert _run_stream(text, stop) == (expected, stopped)


def test_stop_string_prefix_is_held_back_while_streaming():
    tok = ByteTokenizer()
    s = TextStream(tok, ["END"])
    deltas = [s.add(i)[0] for i in tok.encode("abcEN")]
    # "EN" could start "END": held back, then released once it cannot.
    assert "".join(deltas) == "abc"
    assert s.add(tok.encode("x")[0]) == ("ENx", False)


# ---- sampler ----

def _run_sample(logits, temperature, top_k, top_p, seeds, position=7):
    n = len(seeds)
    params = SamplingMetadata(np.full(n, temperature, np.float32), np.full(n, top_k, np.int32),
                              np.full(n, top_p, np.float32), np.asarray(seeds, np.uint32))
    out = jax.jit(sample)(jnp.asarray(np.tile(logits, (n, 1))), params, jnp.full((n,), position, jnp.int32))
    return jax.device_get(out)


def _expected(logits, temperature, top_k, top_p):
    z = logits / temperature
    order = np.argsort(-z)
    p = np.exp(z - z.max())
    p /= p.sum()
    k = len(z) if top_k <= 0 else top_k
    kept = order[:k]
    cum = np.cumsum(p[kept]) / p[kept].sum()
    n = int(np.searchsorted(cum, top_p) + 1) if top_p < 1 else k
    q = np.zeros_like(p)
    q[kept[:n]] = p[kept[:n]]
    return q / q.sum()


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, 0, 1.0),  # full vocabulary (the two-level inverse-CDF path)
    (0.7, 10, 1.0),  # top-k inside the candidates
    (1.0, 400, 1.0),  # top-k beyond the candidates (bisection)
    (1.0, 0, 0.5),  # narrow nucleus (candidates)
    (1.5, 0, 0.97),  # nucleus wider than the candidates (bisection)
    (1.2, 300, 0.9),  # both
])
def test_sampler_matches_the_truncated_distribution(temperature, top_k, top_p):
    rng = np.random.default_rng(0)
    logits = (rng.normal(size=1000) * 2).astype(np.float32)
    n = 6000
    toks = _run_sample(logits, temperature, top_k, top_p, np.arange(n)).tokens
    q = _expected(logits, temperature, top_k, top_p)
    assert np.all(q[toks] > 0), "a token outside the top-k / top-p set was drawn"
    tv = 0.5 * np.abs(np.bincount(toks, minlength=len(q)) / n - q).sum()
    # Compare with the sampling noise of an exact sampler of the same size.
    ref = rng.choice(len(q), size=(5, n), p=q)
    noise = max(0.5 * np.abs(np.bincount(r, minlength=len(q)) / n - q).sum() for r in ref)
    assert tv < 1.3 * noise + 0.01, (tv, noise)


def test_sampler_greedy_and_logprobs():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(3, 5000)).astype(np.float32)
    params = SamplingMetadata.greedy(3)
    out = jax.device_get(jax.jit(sample)(jnp.asarray(logits), params, jnp.zeros(3, jnp.int32)))
    np.testing.assert_array_equal(out.tokens, logits.argmax(-1))
    logp = logits - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
    np.testing.assert_allclose(out.logprobs, logp.max(-1), rtol=1e-5, atol=1e-5)
    top = np.argsort(-logits, -1)[:, :20]
    np.testing.assert_array_equal(out.top_ids, top)
    np.testing.assert_allclose(out.top_logprobs, np.take_along_axis(logp, top, -1), rtol=1e-5, atol=1e-5)


def test_the_greedy_fast_path_gives_the_samplers_tokens_and_logprobs():
    """A step of greedy rows that report no alternatives runs `greedy` (no candidates): the
    full sampler's tokens (the first of tied maxima too) and logprobs, over the tokenizer's
    ids only; a row that wants alternatives or samples takes the full sampler."""
    rng = np.random.default_rng(4)
    logits = rng.normal(size=(4, 3000)).astype(np.float32)
    logits[1, [7, 9]] = 50.0  # a tie: the lower id wins
    logits[2, 2990] = 60.0  # past the tokenizer's ids: never drawn
    run = make_sampler(vocab=2900)
    greedy_rows = SamplingMetadata.greedy(4)
    got = jax.device_get(run(jnp.asarray(logits), greedy_rows, np.zeros(4, np.int32)))
    want = jax.device_get(jax.jit(functools.partial(sample, vocab=2900))(
        jnp.asarray(logits), greedy_rows, jnp.zeros(4, jnp.int32)))
    np.testing.assert_array_equal(got.tokens, want.tokens)
    assert got.tokens[1] == 7 and got.tokens[2] != 2990
    np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=1e-6, atol=1e-6)
    assert not np.any(got.top_ids)  # no alternatives were found
    asks = greedy_rows._replace(top_logprobs=np.array([0, 3, 0, 0], np.int32))
    top = jax.device_get(run(jnp.asarray(logits), asks, np.zeros(4, np.int32)))
    np.testing.assert_array_equal(top.top_ids, want.top_ids)


@pytest.mark.parametrize("vocab", [None, 2950])  # 2 bans stepped over; 52 masked whole
def test_ids_never_to_generate_are_never_drawn_nor_counted(vocab):
    """The sampler's bans (`never_generate`, and the rows past `vocab`) give what sampling the
    logits without those ids gives: the same tokens (greedy on the fast path and the full one,
    seeded draws among the candidates and over the whole vocabulary), alternatives and
    logprobs, whether the banned ids hold a sliver of the mass, the largest logit, or nearly
    all of it."""
    v, never = 3000, (5, 77)
    rng = np.random.default_rng(6)
    logits = (rng.normal(size=(6, v)) * 2).astype(np.float32)
    logits[1, 77] = logits[1].max() + 1.0  # the largest logit, a small share of the mass
    logits[2, [5, 77]] = 40.0  # nearly all of the mass
    logits[3, 2960] = 50.0  # a row padding the embedding
    logits[4, 5] = logits[4, 9] = logits[4].max() + 0.5  # tied with an allowed id
    removed = logits.copy()
    removed[:, list(never)] = -np.inf
    removed[:, vocab or v:] = -np.inf
    run = make_sampler(vocab=vocab, never_generate=never)
    reference = jax.jit(sample)
    pos = jnp.arange(6, dtype=jnp.int32)
    greedy = SamplingMetadata.greedy(6)
    sampled = greedy._replace(temperature=np.full(6, 1.5, np.float32), seed=np.arange(6, dtype=np.uint32))
    cases = {"greedy, fast path": greedy, "greedy with alternatives": greedy._replace(
                 top_logprobs=np.full(6, 5, np.int32)),
             "top-k 40": sampled._replace(top_k=np.full(6, 40, np.int32)),
             "top-p 0.9": sampled._replace(top_p=np.full(6, 0.9, np.float32)),
             "whole vocabulary": sampled}
    first = None
    for name, params in cases.items():
        got = jax.device_get(run(jnp.asarray(logits), params, pos))
        first = got if first is None else first
        want = jax.device_get(reference(jnp.asarray(removed), params, pos))
        np.testing.assert_array_equal(got.tokens, want.tokens, err_msg=name)
        assert not np.isin(got.tokens, never).any() and np.all(got.tokens < (vocab or v)), name
        np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=1e-5, atol=1e-6, err_msg=name)
        if name != "greedy, fast path":
            np.testing.assert_array_equal(got.top_ids, want.top_ids, err_msg=name)
            np.testing.assert_allclose(got.top_logprobs, want.top_logprobs, rtol=1e-5, atol=1e-6)
    assert first.tokens[1] != 77 and first.tokens[4] == 9  # the tie goes to the allowed id
    # A row's logprobs are its own, bit for bit: alone as beside row 2, whose bans hold most of
    # its mass (batch invariance, --deterministic).
    params = cases["greedy with alternatives"]
    for i in (0, 2):
        alone = jax.device_get(run(jnp.asarray(logits[i:i + 1]), SamplingMetadata(
            *(None if f is None else f[i:i + 1] for f in params)), pos[:1]))
        batched = jax.device_get(run(jnp.asarray(logits), params, pos))
        assert alone.logprobs[0].tobytes() == batched.logprobs[i].tobytes()
        assert alone.top_logprobs[0].tobytes() == batched.top_logprobs[i].tobytes()


def test_a_tiny_temperature_is_greedy():
    """A temperature below 1e-5 is greedy (vLLM's rule): at 1e-9 the scaled logits (~1e10) round
    every candidate's probability to 0 in float32, and top-k / top-p would pick the 256th."""
    rng = np.random.default_rng(3)
    logits = (rng.normal(size=(16, 5000)) * 4).astype(np.float32)
    params = [SamplingParams(temperature=1e-9, top_k=64, top_p=0.95, seed=i) for i in range(16)]
    assert all(p.temperature == 0.0 for p in params)
    assert SamplingParams(temperature=1e-5).temperature == 1e-5
    out = jax.device_get(jax.jit(sample)(jnp.asarray(logits), SamplingMetadata.of(params, list(range(16))),
                                         jnp.zeros(16, jnp.int32)))
    np.testing.assert_array_equal(out.tokens, logits.argmax(-1))


def test_sampler_seed_determinism():
    rng = np.random.default_rng(2)
    logits = rng.normal(size=3000).astype(np.float32)
    a = _run_sample(logits, 1.0, 0, 0.95, [11, 11, 12, 12, 13])
    b = _run_sample(logits, 1.0, 0, 0.95, [11, 11, 12, 12, 13])
    np.testing.assert_array_equal(a.tokens, b.tokens)  # same seed -> same token, in any row
    assert a.tokens[0] == a.tokens[1] and a.tokens[2] == a.tokens[3]
    many = _run_sample(logits, 1.0, 0, 1.0, np.arange(64)).tokens
    assert len(set(many.tolist())) > 20  # different seeds do differ
    other_pos = _run_sample(logits, 1.0, 0, 1.0, np.arange(64), position=8).tokens
    assert (many != other_pos).mean() > 0.5  # so do positions


def test_sampling_params_validation():
    for bad in (-0.1, 1e308, float("inf")):  # 1e308 would be inf as a float32 row's divisor
        with pytest.raises(InvalidParameter) as e:
            SamplingParams(temperature=bad)
        assert e.value.param == "temperature"
    assert SamplingParams(temperature=100.0).temperature == 100.0
    for bad in (0.0, 1.5, float("nan")):
        with pytest.raises(InvalidParameter, match="top_p"):
            SamplingParams(top_p=bad)
    with pytest.raises(InvalidParameter, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(InvalidParameter, match="logprobs"):
        SamplingParams(logprobs=21)
    with pytest.raises(InvalidParameter, match="stop"):
        SamplingParams(stop=("",))
    assert SamplingParams(seed=-1).seed32(0) == 2**32 - 1


# Gemma 3's instruction-tuned checkpoints' generation_config.json, as Hugging Face ships it.
GEMMA3_IT_GENERATION_CONFIG = {"bos_token_id": 2, "cache_implementation": "hybrid", "do_sample": True,
                               "eos_token_id": [1, 106], "pad_token_id": 0, "top_k": 64, "top_p": 0.95,
                               "transformers_version": "4.50.0.dev0"}


def test_a_models_sampling_defaults_fill_what_a_request_leaves_out(tmp_path):
    from models.gemma3.hf_tokenizer import read_sampling_defaults
    from serving.endpoints import _sampling
    from serving.openai_schema import ChatCompletionRequest, CompletionRequest

    (tmp_path / "generation_config.json").write_text(json.dumps(GEMMA3_IT_GENERATION_CONFIG))
    defaults = read_sampling_defaults(tmp_path)
    assert defaults == {"top_k": 64, "top_p": 0.95}  # do_sample and the ids are not sampling fields
    assert read_sampling_defaults(tmp_path / "missing") == {}
    msgs = [{"role": "user", "content": "hi"}]
    p = _sampling(ChatCompletionRequest(messages=msgs), 8, None, defaults=defaults)
    assert (p.temperature, p.top_k, p.top_p) == (1.0, 64, 0.95)
    # A request's own values win, a value that turns a filter off included.
    p = _sampling(ChatCompletionRequest(messages=msgs, top_k=0, top_p=1.0, temperature=0), 8, None,
                  defaults=defaults)
    assert (p.temperature, p.top_k, p.top_p) == (0, 0, 1.0)
    p = _sampling(CompletionRequest(prompt="hi", top_p=0.5), 8, None,
                  defaults={"temperature": 0.6, "top_p": 0.95, "repetition_penalty": 1.1, "min_p": 0.05})
    assert (p.temperature, p.top_p, p.repetition_penalty, p.min_p, p.top_k) == (0.6, 0.5, 1.1, 0.05, 0)
    p = _sampling(CompletionRequest(prompt="hi"), 8, None)  # no model defaults: OpenAI's
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty) == (1.0, 0, 1.0, 0.0, 1.0)


def test_bad_sampling_defaults_fail_at_start_up_naming_the_file():
    from serving.sampling import checked_defaults

    assert checked_defaults({"top_k": 64, "top_p": 0.95}, "f") == {"top_k": 64, "top_p": 0.95}
    with pytest.raises(ValueError, match="generation_config.json: top_p must be in"):
        checked_defaults({"top_p": 1.5}, "the model's generation_config.json")
    with pytest.raises(ValueError, match="temperature must be a number"):
        checked_defaults({"temperature": "hot"}, "the model's generation_config.json")


# ---- chat template ----

def test_chat_template_matches_gemma_format(gemma_tokenizer):
    tok = gemma_tokenizer
    ids = render_chat([("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello!"), ("user", "Bye")], tok)
    assert ids[0] == tok.bos_id
    text = tok.decode(ids)  # control tokens decode to nothing; check the structure by ids
    assert text == "user\nBe brief.\n\nHi\nmodel\nHello!\nuser\nBye\nmodel\n"
    assert ids.count(tok.start_of_turn_id) == 4 and ids.count(tok.end_of_turn_id) == 3
    assert ids[-len(tok.encode("model\n")) - 1] == tok.start_of_turn_id
    expected = ([tok.bos_id, 105] + tok.encode("user\nBe brief.\n\nHi") + [106] + tok.encode("\n")
                + [105] + tok.encode("model\nHello!") + [106] + tok.encode("\n")
                + [105] + tok.encode("user\nBye") + [106] + tok.encode("\n") + [105] + tok.encode("model\n"))
    assert ids == expected


def test_chat_template_rejects_bad_conversations():
    tok = ByteTokenizer()
    with pytest.raises(ValueError, match="role"):
        render_chat([("user", "a"), ("tool", "b")], tok)
    with pytest.raises(ValueError, match="user"):
        render_chat([("assistant", "a")], tok)
    # Turn markers typed as text stay text.
    ids = render_chat([("user", "<start_of_turn>model")], tok)
    assert ids.count(tok.start_of_turn_id) == 2


# ---- settings ----

def test_config_precedence_file_env_cli(tmp_path):
    f = tmp_path / "server.toml"
    f.write_text('port = 9001\ntp = 2\nallreduce = "int8"\nmax-num-seqs = 4\n')
    c = from_sources({"config": str(f)}, env={})
    assert (c.port, c.tp, c.allreduce, c.max_num_seqs) == (9001, 2, "int8", 4)
    c = from_sources({"config": str(f)}, env={"GEMMA3_PORT": "9002", "GEMMA3_DTYPE": "float32"})
    assert (c.port, c.dtype, c.tp) == (9002, "float32", 2)
    c = from_sources({"config": str(f), "port": 9003}, env={"GEMMA3_PORT": "9002"})
    assert c.port == 9003
    j = tmp_path / "s.json"
    j.write_text(json.dumps({"api_key": "k", "max_seq_len": 512}))
    c = from_sources({}, env={"GEMMA3_CONFIG": str(j)})
    assert (c.api_key, c.max_seq_len) == ("k", 512)
    defaults = from_sources({}, env={})
    assert (defaults.host, defaults.port, defaults.model, defaults.dtype) == \
        ("127.0.0.1", 8000, "gemma3-270m", "bfloat16")


@pytest.mark.parametrize("kwargs,env,match", [
    ({"allreduce": "int3"}, {}, "allreduce"),
    ({}, {"GEMMA3_TP": "two"}, "tp"),
    ({}, {"GEMMA3_MAX_NUM_SEQS": "0"}, "max_num_seqs"),
    ({"bogus": 1}, {}, "unknown"),
])
def test_config_errors(kwargs, env, match):
    with pytest.raises(ValueError, match=match):
        from_sources(kwargs, env=env)


def test_old_setting_names_give_the_new_ones_with_a_warning(tmp_path, caplog):
    """max_batch is max_num_seqs and prefill_chunk long_prefill_token_threshold (vLLM's names):
    the old flag, environment variable and file key still set them, each with a warning naming
    the new one; an old name counts as the new one in its source's precedence."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    f = tmp_path / "old.toml"
    f.write_text("max-batch = 3\nprefill_chunk = 32\n")
    with caplog.at_level(logging.WARNING, logger="serving.config"):
        flag = from_sources(vars(parser.parse_args(["--max-batch", "2", "--prefill-chunk", "48"])), env={})
        env = from_sources({}, env={"GEMMA3_MAX_BATCH": "5", "GEMMA3_PREFILL_CHUNK": "64"})
        file = from_sources({"config": str(f)}, env={})
    assert (flag.max_num_seqs, flag.long_prefill_token_threshold) == (2, 48)
    assert (env.max_num_seqs, env.long_prefill_token_threshold) == (5, 64)
    assert (file.max_num_seqs, file.long_prefill_token_threshold) == (3, 32)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "--max-batch is deprecated: use --max-num-seqs",
        "--prefill-chunk is deprecated: use --long-prefill-token-threshold",
        "GEMMA3_MAX_BATCH is deprecated: use GEMMA3_MAX_NUM_SEQS (--max-num-seqs)",
        "GEMMA3_PREFILL_CHUNK is deprecated: use GEMMA3_LONG_PREFILL_TOKEN_THRESHOLD "
        "(--long-prefill-token-threshold)",
        f"config file {f}: max_batch is deprecated: use max_num_seqs (--max-num-seqs)",
        f"config file {f}: prefill_chunk is deprecated: use long_prefill_token_threshold "
        f"(--long-prefill-token-threshold)"]
    # Precedence by source whatever the name: the environment's new name over the file's old one,
    # the old flag over the environment's new name; both names in one source are refused.
    assert from_sources({"config": str(f)}, env={"GEMMA3_MAX_NUM_SEQS": "6"}).max_num_seqs == 6
    assert from_sources({"max_batch": 7}, env={"GEMMA3_MAX_NUM_SEQS": "6"}).max_num_seqs == 7
    with pytest.raises(ValueError, match="--max-batch and --max-num-seqs are the same setting"):
        from_sources({"max_batch": 7, "max_num_seqs": 6}, env={})
    assert "--max-batch" in parser.format_help() and "old name of --max-num-seqs" in parser.format_help()


def test_deterministic_mode_is_off_by_default_and_batch_invariant_with_a_token_local_allreduce():
    c = from_sources({}, env={})
    assert (c.deterministic, c.batch_invariant) == (False, False)
    assert from_sources({"deterministic": True}, env={}).batch_invariant
    assert not from_sources({"deterministic": True, "tp": 2, "allreduce": "int8-full+tile"}, env={}).batch_invariant


@pytest.mark.parametrize("kwargs,env,flag", [
    ({"engine": "slots"}, {}, "--engine"),
    ({"engine": "paged"}, {}, "--engine"),
    ({"prefill_batch": 4}, {}, "--prefill-batch"),
    ({}, {"GEMMA3_PREFIX_CACHE_MB": "64"}, "--prefix-cache-mb"),
])
def test_a_retired_slot_engine_setting_is_refused_with_what_to_do(kwargs, env, flag):
    with pytest.raises(ValueError, match=f"^{flag} was removed: .*drop it"):
        from_sources(kwargs, env=env)


def test_the_long_prefill_token_threshold_is_a_multiple_of_the_page():
    with pytest.raises(ValueError, match="long_prefill_token_threshold .12. must be a positive "
                                         "multiple of page_size .8."):
        from_sources({"long_prefill_token_threshold": 12, "page_size": 8}, env={})


def test_the_default_prompt_piece_follows_the_mode():
    """Unset (0), the piece is 16 tokens, 64 in deterministic mode (where every piece has it,
    a lone prompt's too), within the context and a given budget, in whole pages."""
    from serving.paged_runner import default_long_prefill_token_threshold as default

    assert from_sources({}, env={}).long_prefill_token_threshold == 0
    assert from_sources({"page_size": 32}, env={}).page_size == 32  # 0 is a multiple of any page
    assert default(False, 16, 2048) == 16
    assert default(True, 16, 2048) == 64
    assert default(True, 16, 40) == 32
    assert default(True, 4, 2048, max_num_batched_tokens=22) == 20
    assert default(True, 128, 2048) == default(False, 128, 2048) == 128


def test_served_model_name():
    assert ServerConfig().model_name == "gemma3-270m"
    assert ServerConfig(model="/models/my-gemma.gguf").model_name == "my-gemma"
    assert ServerConfig(model="random:1b").model_name == "random:1b"
    assert ServerConfig(served_model_name="x").model_name == "x"


# ---- command line ----

@pytest.mark.parametrize("main,argv", [
    ("serve_main", ["--allreduce", "int3"]),
    ("serve_main", ["--tp", "two"]),
    ("serve_main", ["--max-num-seqs", "0"]),
    ("serve_main", ["--prefill-batch", "4"]),  # a slot engine flag with the paged default
    ("generate_main", ["hello", "--temperature", "-1"]),
    ("generate_main", ["hello", "--top-p", "2"]),
    ("generate_main", [""]),
])
def test_cli_rejects_bad_settings_before_loading(main, argv, capsys):
    import serving.cli

    with pytest.raises(SystemExit) as e:
        getattr(serving.cli, main)(argv)
    assert e.value.code == 2
    assert "error" in capsys.readouterr().err


def test_allreduce_switch_reaches_the_model_config():
    c = from_sources({"tp": 2, "allreduce": "int8", "allreduce_variant": "semi", "allreduce_min_bytes": 4096},
                     env={})
    cfg = c.allreduce_config()
    assert (cfg.method, cfg.variant, cfg.min_bytes, cfg.label) == ("int8", "semi", 4096, "int8-semi")
    cfg = from_sources({"allreduce": "int8"}, env={"GEMMA3_ALLREDUCE_BLOCKS": "hadamard"}).allreduce_config()
    assert cfg.label == "int8+hadamard"
