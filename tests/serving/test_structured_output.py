"""Structured output and the sampling parameters, through the real HTTP app and the official
`openai` client, on a real engine: a tiny random model (byte tokenizer) whose output is noise, so
every valid JSON document it returns is the grammar's doing; validated with `jsonschema`."""
import json
import re

import jsonschema
import numpy as np
import pytest

from serving.config import ServerConfig
from serving.sampling import SamplingParams, SamplingMetadata, sample
from testkit import ServerThread

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "score", "role", "tags", "address"],
    "additionalProperties": False,
}
MODES = [dict(temperature=0.0), dict(temperature=1.0, seed=1), dict(temperature=0.8, top_p=0.9, seed=2, extra_body={"top_k": 40})]


@pytest.fixture(scope="module")
def server():
    from models.gemma3 import load_model
    from serving.paged_runner import PagedRunner

    model = load_model("random:tiny", tp=1, dtype="float32", seed=5)
    engine = PagedRunner(model, max_num_seqs=4, max_seq_len=256)  # compiles on use
    config = ServerConfig(model="random:tiny", served_model_name="tiny", max_num_seqs=4, max_seq_len=256,
                          compile_cache_dir="")
    s = ServerThread(config, engine)
    yield s
    s.stop()


def _response_format(schema=SCHEMA):
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


@pytest.mark.parametrize("mode", MODES, ids=["greedy", "sampled", "top_k_top_p"])
def test_json_schema_chat_validates(oai, mode):
    r = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "A person as JSON"}],
                                    response_format=_response_format(), max_tokens=150, n=2, **mode)
    for c in r.choices:
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
        assert c.finish_reason == "stop"


def test_json_schema_streamed_and_completions(oai):
    stream = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "JSON"}],
                                         response_format=_response_format(), max_tokens=150, temperature=1.0,
                                         seed=7, stream=True)
    text, reasons = "", []
    for chunk in stream:
        for c in chunk.choices:
            text += c.delta.content or ""
            reasons.append(c.finish_reason)
    jsonschema.validate(json.loads(text), SCHEMA)
    assert reasons[-1] == "stop"
    r = oai.completions.create(model="tiny", prompt="Person:", max_tokens=150, temperature=1.0, seed=3,
                               extra_body={"guided_json": SCHEMA})
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)


def test_short_budget_still_parses(oai):
    """max_tokens too short for free text: the grammar closes in time (finish_reason stop); with
    less than the shortest document the output is cut, and finish_reason says length."""
    schema = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "array", "items": {"type": "integer"}}},
              "required": ["a", "b"]}
    for seed in range(3):
        r = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=24,
                                        temperature=1.0, seed=seed, response_format=_response_format(schema))
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
        assert r.choices[0].finish_reason == "stop"
    r = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                    response_format=_response_format(schema))
    assert r.choices[0].finish_reason == "length"


def test_json_object_regex_choice_grammar(oai):
    r = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=60,
                                    temperature=1.0, seed=4, response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = oai.completions.create(model="tiny", prompt="phone:", max_tokens=20, temperature=1.0, seed=1,
                               extra_body={"guided_regex": r"\d{3}-\d{4}"})
    assert re.fullmatch(r"\d{3}-\d{4}", r.choices[0].text) and r.choices[0].finish_reason == "stop"
    r = oai.completions.create(model="tiny", prompt="pick:", max_tokens=20, temperature=1.0, seed=2, n=3,
                               extra_body={"guided_choice": ["red", "green", "blue"]})
    assert all(c.text in ("red", "green", "blue") for c in r.choices)
    grammar = 'start: "(" expr ")"\nexpr: NUM ("+" NUM)*\nNUM: /[0-9]{1,3}/'
    r = oai.completions.create(model="tiny", prompt="sum:", max_tokens=30, temperature=1.0, seed=3,
                               extra_body={"guided_grammar": grammar})
    assert re.fullmatch(r"\(\d{1,3}(\+\d{1,3})*\)", r.choices[0].text), r.choices[0].text


def test_grammar_rows_beside_plain_rows(client):
    """A batch mixing constrained and free requests: each gets what it asked for."""
    import concurrent.futures

    def one(i):
        body = {"prompt": "x", "max_tokens": 12, "temperature": 1.0, "seed": i}
        if i % 2:
            body["guided_choice"] = ["yes", "no"]
        else:
            body["ignore_eos"] = True  # free rows run all 12 steps, unconstrained
        return i, client.post("/v1/completions", json=body).json()["choices"][0]

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        for i, c in pool.map(one, range(8)):
            if i % 2:
                assert c["text"] in ("yes", "no")
            else:
                assert c["finish_reason"] == "length"


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {  # strict: what is not enforced is refused
        "name": "x", "strict": True, "schema": {"type": "array", "uniqueItems": True}}}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"logit_bias": {"99999": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_tokens": 50, "max_tokens": 10}, "min_tokens"),
])
def test_bad_structured_and_sampling_fields_are_400(client, body, param):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 10, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_unimplemented_keyword_without_strict_is_best_effort(oai):
    schema = {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 2, "uniqueItems": True}
    r = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=30,
                                    response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert isinstance(json.loads(r.choices[0].message.content), list)


def test_logit_bias_min_tokens_stop_token_ids(client):
    tok_a = 107 + ord("a")  # the byte tokenizer's id of "a"
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 5, "temperature": 0,
                                           "logit_bias": {str(tok_a): 100}}).json()
    assert r["choices"][0]["text"] == "aaaaa"
    # A stop token id that greedy would pick at once, held off by min_tokens.
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 6, "temperature": 0,
                                           "logit_bias": {str(tok_a): 100}, "stop_token_ids": [tok_a],
                                           "min_tokens": 3}).json()
    # "a" is banned for 3 tokens, then ends the sequence at once.
    assert r["choices"][0]["finish_reason"] == "stop" and len(r["choices"][0]["text"]) == 3
    assert r["usage"]["completion_tokens"] == 4 and "a" not in r["choices"][0]["text"]
    assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, "temperature": 0, "logit_bias": {
        str(tok_a): 100}, "stop_token_ids": [tok_a]}).json()["usage"]["completion_tokens"] == 1


def test_penalties_change_greedy_repeats(client):
    body = {"prompt": "the the the", "max_tokens": 40, "temperature": 0}
    plain = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    pen = client.post("/v1/completions", json={**body, "frequency_penalty": 2.0, "presence_penalty": 2.0,
                                             "repetition_penalty": 1.5}).json()["choices"][0]["text"]
    assert len(set(pen)) >= len(set(plain)) and pen != plain


def test_tokenize_detokenize(client):
    r = client.post("/tokenize", json={"prompt": "hé", "return_token_strs": True}).json()
    assert r["tokens"] == [2, 107 + 0x68, 107 + 0xC3, 107 + 0xA9] and r["count"] == 4 and r["max_model_len"] == 256
    assert client.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": "hé"}
    chat = client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["tokens"][:2] == [2, 105] and chat["token_strs"] is None
    assert client.post("/detokenize", json={"tokens": [999999]}).status_code == 400
    assert client.post("/tokenize", json={}).status_code == 400


def test_sampler_processing_units():
    """The device sampler's processing: mask, bias, min_p and penalties, on small logits."""
    from serving.logits_processing import step_extras
    from serving.sequence import Sequence

    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]] * 3, np.float32))
    seqs = [Sequence(1, [0], SamplingParams(temperature=0.0, logit_bias=((2, 100.0),)), 1),
            Sequence(2, [0], SamplingParams(temperature=0.0, min_tokens=2), 1, generated=[]),
            Sequence(3, [0, 0], SamplingParams(temperature=0.0, repetition_penalty=2.0), 1)]
    import jax

    sample_jit = jax.jit(sample)
    ex = step_extras(seqs, None, eos_ids=(0,))
    params = SamplingMetadata.of([s.params for s in seqs], [1, 1, 1])._replace(extras=ex)
    out = sample_jit(logits, params, np.ones(3, np.int32))
    # bias picks 2; min_tokens bans EOS (0) so 1 wins; token 0 seen -> log(.5)*2 < log(.3) -> 1
    assert out.tokens.tolist() == [2, 1, 1]
    mask = np.zeros((3, 1), np.int32)
    mask[:, 0] = 1 << 3
    params = SamplingMetadata.greedy(3)._replace(extras=ex._replace(mask=mask))
    assert sample_jit(logits, params, np.ones(3, np.int32)).tokens.tolist() == [3, 3, 3]
    sampled = SamplingMetadata(np.ones(3, np.float32), np.zeros(3, np.int32), np.ones(3, np.float32),
                               np.arange(3, dtype=np.uint32), ex._replace(mask=mask))
    assert sample_jit(logits, sampled, np.ones(3, np.int32)).tokens.tolist() == [3, 3, 3]
    min_p = ex._replace(min_p=np.full(3, 0.9, np.float32), bias_vals=np.zeros_like(ex.bias_vals),
                        repetition=np.ones(3, np.float32))
    draws = [sample_jit(logits, SamplingMetadata(np.ones(3, np.float32), np.zeros(3, np.int32),
                                                 np.ones(3, np.float32), np.full(3, s, np.uint32), min_p),
                        np.ones(3, np.int32)).tokens[0]
             for s in range(20)]
    assert set(int(t) for t in draws) == {0}


def test_closing_searches_stay_bounded_far_from_the_end(monkeypatch):
    """A grammar whose closing paths the searches never find ([a-z]+é: letters are always
    preferred, é never) at a long budget: one bounded search (greedy, then taking new tokens
    first) when the sequence starts, none while its end is far, then searches no longer than
    the budget left in its last tokens, where a closing path matters. (Each search fills one
    mask per token it tries; it used to try the whole budget at every step.)"""
    from models.gemma3 import load_model
    from serving import SamplingParams, Sequence
    from serving import structured_output as so

    tok = load_model("random:tiny", tp=1, dtype="float32").tokenizer
    eos = (1,)
    grammar = so.build_grammar("regex", "[a-z]+é", "guided_regex", tok, eos)
    limits, search = [], so.closing_path

    def counted(*args, **kwargs):
        limits.append(args[-1])
        return search(*args, **kwargs)

    monkeypatch.setattr(so, "closing_path", counted)
    outputs = so.StructuredOutputs(tok.vocab_size, eos, max_seq_len=32_768, tokenizer=tok)
    try:
        budget = 30_000
        outputs.add(Sequence(0, [2] * 5, SamplingParams(max_tokens=budget, grammar=grammar), seed=0))
        a = tok.encode("a")[0]

        def step():
            bits = outputs.masks([0]).result()[0].view(np.uint32)
            assert bits[a // 32] >> (a % 32) & 1  # 'a' stays allowed: the grammar is not forced yet
            assert outputs.accept(0, a) is None

        for _ in range(50):
            step()
        assert limits == [so.CLOSING_HORIZON + so.CLOSING_WINDOW] * 2
        # The last tokens: a search at every step, bounded by the budget left.
        for _ in range(budget - 50 - so.CLOSING_HORIZON - so.CLOSING_WINDOW):
            outputs._rows[0].budget -= 1  # skip ahead without the steps in between
        limits.clear()
        for _ in range(40):
            step()
        assert len(limits) == 80 and max(limits) <= so.CLOSING_HORIZON + so.CLOSING_WINDOW
        assert limits[-1] == outputs._rows[0].budget + 1 + so.CLOSING_WINDOW
    finally:
        outputs.close()


def test_a_grammar_whose_greedy_closing_loops_still_closes_in_time():
    """x+y: the greedy walk takes 'x' for ever; the walk that takes new tokens first ends it, so
    a sequence that always picks 'x' is made to close with its last tokens, and parses."""
    from models.gemma3 import load_model
    from serving import SamplingParams, Sequence
    from serving import structured_output as so

    tok = load_model("random:tiny", tp=1, dtype="float32").tokenizer
    grammar = so.build_grammar("regex", "x+y", "guided_regex", tok, (1,))
    outputs = so.StructuredOutputs(tok.vocab_size, (1,), max_seq_len=256, tokenizer=tok)
    try:
        outputs.add(Sequence(0, [2], SamplingParams(max_tokens=30, grammar=grammar), seed=0))
        x, text, end = tok.encode("x")[0], [], None
        while end is None and len(text) < 30:  # max_tokens
            bits = outputs.masks([0]).result()[0].view(np.uint32)
            allowed = [t for t in range(tok.vocab_size) if bits[t // 32] >> (t % 32) & 1]
            token = x if x in allowed else allowed[0]  # a model that loves 'x'
            text.append(token)
            end = outputs.accept(0, token)
        assert end == "stop"
        assert re.fullmatch("x+y", tok.decode(text))
    finally:
        outputs.close()


def test_an_embedding_padded_past_its_tokenizer():
    """A checkpoint whose embedding has more rows than its tokenizer has ids (Gemma 3 4B-27B:
    262,208 for 262,144 pieces), here 544 for a 512-id tokenizer: structured output works (the
    grammar's masks are the tokenizer's width, widened to the logits' with the padded ids off;
    llguidance refused a mask of the logits' width), the sampler never draws a padded id (it
    cannot be detokenized), and a request naming one is refused."""
    import httpx

    from models.gemma3 import load_model
    from models.gemma3.api import Gemma3Model
    from models.gemma3.byte_tokenizer import ByteTokenizer
    from serving.paged_runner import PagedRunner

    padded = load_model("random:tiny?vocab=544", tp=1, dtype="float32", seed=5)
    model = Gemma3Model.from_programs(padded.programs, padded.weights, ByteTokenizer(512))
    engine = PagedRunner(model, max_num_seqs=2, max_seq_len=96)
    assert (engine.info.vocab_size, engine.info.token_ids) == (544, 512)
    s = ServerThread(ServerConfig(model="random:tiny", served_model_name="tiny", max_num_seqs=2,
                                  max_seq_len=96, compile_cache_dir=""), engine)
    try:
        with httpx.Client(base_url=s.url, timeout=300) as c:
            schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "y"]}},
                      "required": ["a", "b"], "additionalProperties": False}
            r = c.post("/v1/completions", json=dict(prompt="x", max_tokens=40, temperature=1.0, seed=3,
                                                    response_format=_response_format(schema)))
            assert r.status_code == 200, r.text
            jsonschema.validate(json.loads(r.json()["choices"][0]["text"]), schema)
            drawn = []
            for seed in range(3):  # ~6% of a random model's draws would be padded ids
                r = c.post("/generate", json=dict(prompt="x", max_tokens=60, temperature=1.5,
                                                  seed=seed, ignore_eos=True))
                assert r.status_code == 200, r.text
                drawn += r.json()["token_ids"]
            assert len(drawn) == 180 and max(drawn) < 512
            for body in (dict(prompt=[2, 530], max_tokens=2), dict(prompt="x", max_tokens=2, logit_bias={"530": 5})):
                r = c.post("/v1/completions", json=body)
                assert r.status_code == 400 and "512" in r.json()["error"]["message"], r.text
            assert c.post("/detokenize", json={"tokens": [530]}).status_code == 400
    finally:
        s.stop()


class _RaisingMatcher:
    """A real matcher whose mask llguidance refuses to compute: the batched call takes only
    llguidance's own matchers (TypeError), and alone it asks for a mask one word short
    (llguidance's ValueError on a wrong mask size). Everything else is the real matcher's."""

    def __init__(self, real):
        self._real = real

    def deep_copy(self):
        return _RaisingMatcher(self._real.deep_copy())

    def unsafe_compute_mask_ptr(self, pointer, size):
        self._real.unsafe_compute_mask_ptr(pointer, size - 4)

    def __getattr__(self, name):
        return getattr(self._real, name)


def test_a_grammar_that_raises_in_the_mask_job_ends_its_request_alone(server):
    """llguidance raising inside the step's mask job ends that request with a short error; a
    constrained and a free request in the same steps go on, and the engine serves after."""
    from serving import structured_output as so
    from testkit import Collector

    tok = server.runner.tokenizer
    eos = server.runner.info.eos_ids
    good = so.build_grammar("regex", r"\d{3}-\d{4}", "guided_regex", tok, eos)
    bad = so.build_grammar("regex", "[a-z]{5}", "guided_regex", tok, eos)
    bad = so.Grammar(bad.kind, bad.source, _RaisingMatcher(bad.matcher))
    prompt = [2] + tok.encode("x")
    params = [SamplingParams(max_tokens=20, temperature=1.0, seed=1, grammar=good),
              SamplingParams(max_tokens=20, temperature=1.0, seed=2, grammar=bad),
              SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True)]
    sinks = [Collector() for _ in params]
    server.runtime.core.submit([(prompt, p, s) for p, s in zip(params, sinks)])  # one step, one mask job
    constrained, raising, free = (s.wait(60) for s in sinks)
    assert re.fullmatch(r"\d{3}-\d{4}", constrained.text) and constrained.finish == "stop"
    assert free.finish == "length" and len(free.tokens) == 12
    assert raising.finish == "error" and raising.text == ""
    assert "mask failed" in raising.error and len(raising.error) < 500, raising.error
    after = Collector()
    server.runtime.core.submit([(prompt, SamplingParams(max_tokens=20, seed=4, grammar=good), after)])
    assert re.fullmatch(r"\d{3}-\d{4}", after.wait(60).text)


def test_a_rejected_token_is_a_short_error():
    """A token the grammar refuses (here one its mask did not allow) ends the sequence with a
    short error: the matcher's first line, without llguidance's parser state."""
    from models.gemma3 import load_model
    from serving import Sequence
    from serving import structured_output as so

    tok = load_model("random:tiny", tp=1, dtype="float32").tokenizer
    grammar = so.build_grammar("choice", ["yes", "no"], "guided_choice", tok, (1,))
    outputs = so.StructuredOutputs(tok.vocab_size, (1,), max_seq_len=256, tokenizer=tok)
    try:
        outputs.add(Sequence(0, [2], SamplingParams(max_tokens=30, grammar=grammar), seed=0))
        outputs.masks([0]).result()
        assert outputs.accept(0, tok.encode("z")[0]) == "error"
        error = outputs.error(0)
        assert error.startswith("the grammar rejected token") and len(error) < 500, error
        assert "<state>" not in error and "Parser:" not in error
        # EOS goes through the matcher too: where the grammar does not accept, it is an error.
        outputs.add(Sequence(1, [2], SamplingParams(max_tokens=30, grammar=grammar), seed=0))
        outputs.masks([1]).result()
        assert outputs.accept(1, 1) == "error"
    finally:
        outputs.close()
