"""Structured output and tool calls on the real Gemma 3 270M (the base model, in bfloat16, the
server's default dtype) through the real HTTP app: nested json_schema outputs validate, streamed
and not, and "required" / named tool calls are valid calls (`python -m eval.bench_serving --only
structured` runs more); a grammar that cannot be served is a 400 before anything streams; and a seeded
fuzz of mutated requests (schemas, regexes, choices, grammars, tools, malformed bodies) gets no
5xx, no hang, an OpenAI error body for every 4xx and only outputs that satisfy their constraint
(or, cut by max_tokens, are a valid prefix of one), with the server exact after."""
import json
import random
import re

import httpx
import jsonschema
import openai
import pytest

from eval.bench_serving import SCHEMAS as BENCH_SCHEMAS, TOOLS
from serving.config import ServerConfig
from testkit import ServerThread

pytestmark = pytest.mark.slow

MODEL = "gemma3-270m"


@pytest.fixture(scope="module")
def server():
    from models.gemma3 import load_model
    from serving.paged_runner import PagedRunner

    # Not warmed up: a program compiles on its first use, so only the few these requests need
    # are compiled (test_server_e2e covers the warm-up).
    engine = PagedRunner(load_model(MODEL, tp=1, dtype="bfloat16"), max_num_seqs=4, max_seq_len=768)
    s = ServerThread(ServerConfig(model=MODEL, served_model_name=MODEL, max_num_seqs=4, max_seq_len=768,
                                  compile_cache_dir=""), engine)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_nested_json_schema_validates(oai, stream):
    schema = BENCH_SCHEMAS[1]  # nested objects, arrays of objects, enums, patterns, numbers
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Give an order as JSON."}],
                  max_tokens=120, temperature=0.7, seed=11,
                  response_format={"type": "json_schema", "json_schema": {"name": "order", "schema": schema}})
    if stream:
        texts = [""]
        for chunk in oai.chat.completions.create(stream=True, **kwargs):
            texts[0] += "".join(c.delta.content or "" for c in chunk.choices)
    else:
        texts = [c.message.content for c in oai.chat.completions.create(**kwargs).choices]
    for text in texts:
        jsonschema.validate(json.loads(text), schema)


def test_required_and_named_tool_calls(oai):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for choice in ("required", {"type": "function", "function": {"name": "book_table"}}):
        r = oai.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Book a table for two at Luigi's at 19:30."}],
            tools=TOOLS, tool_choice=choice, max_tokens=100, temperature=0.0)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.tool_calls
        for call in c.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def _strict(schema) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}}


def _assert_error_body(r: httpx.Response, status: int | None = None) -> dict:
    """An OpenAI error body, short, as JSON (never an event stream)."""
    assert status is None or r.status_code == status, (r.status_code, r.text[:300])
    assert r.headers["content-type"].startswith("application/json"), r.headers
    assert len(r.content) < 4096, r.text[:300]
    error = r.json()["error"]
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)
    return error


# The grammars a fuzzing run found answered 200 with "" (no string satisfies them) or 500 with
# llguidance's parser state (over its limits): (body, what the message says).
UNSERVABLE = {
    "schema_ref_self": (_strict({"$ref": "#"}), "no string satisfies it"),
    "schema_refs_mutual": (_strict({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                                    "$ref": "#/$defs/a"}), "no string satisfies it"),
    "lark_start_start": ({"guided_grammar": "start: start"}, "no string satisfies it"),
    "gbnf_root_root": ({"guided_grammar": "root ::= root"}, "no string satisfies it"),
    "empty_class": ({"guided_regex": "[^\\x00-\\U0010FFFF]"}, "no string satisfies it"),
    "schema_required_recursive_ref": (_strict({"type": "object", "properties": {"a": {"$ref": "#"}},
                                               "required": ["a"]}), "limits"),
    "regex_count_1e8": ({"guided_regex": "a{99999999}"}, "limits"),
    "regex_count_nested": ({"guided_regex": "a{1000}{1000}"}, "limits"),
    "regex_1mb": ({"guided_regex": "a" * 1_000_000}, "limits"),
    # An image token by id (<start_of_image>): the model never generates it.
    "lark_image_token": ({"guided_grammar": 'start: "a" | <[255999]>'}, "never generates"),
}


@pytest.mark.parametrize("name", list(UNSERVABLE))
def test_unservable_grammars_are_400_before_streaming(server, name):
    body, says = UNSERVABLE[name]
    param = next(iter(body))
    with httpx.Client(base_url=server.url, timeout=60) as c:
        for stream in (False, True):
            r = c.post("/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 8,
                                                 "stream": stream, **body})
            error = _assert_error_body(r, 400)
            assert error["param"] == param and error["type"] == "invalid_request_error", error
            assert says in error["message"] and "<state>" not in error["message"], error


def test_served_examples_keep_their_constraint(server):
    """The others of that run: a JSON-schema pattern (a search: any text, then a million 'a')
    that no budget here can finish leaves a valid prefix of a JSON string with "length", never
    "stop"; (a|b)*c{0,100000} gives a match; a choice of 10,000 duplicates or 50,000 values
    (past llguidance's 2,000 alternatives a rule) gives one of them."""
    with httpx.Client(base_url=server.url, timeout=60) as c:
        def complete(body, **kw):
            r = c.post("/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 8, **kw, **body})
            assert r.status_code == 200, r.text[:300]
            return r.json()["choices"][0]

        got = complete(_strict({"type": "string", "pattern": "a{1000000}"}))
        assert got["finish_reason"] == "length" and isinstance(json.loads(got["text"] + '"'), str), got
        for seed in range(3):
            got = complete({"guided_regex": "(a|b)*c{0,100000}"}, temperature=1.0, seed=seed)
            pattern = "(a|b)*c{0,100000}" if got["finish_reason"] == "stop" else "[ab]*c*"
            assert re.fullmatch(pattern, got["text"]), got
        assert complete({"guided_choice": ["x"] * 10_000})["text"] == "x"
        values = [f"v{i}" for i in range(50_000)]
        assert complete({"guided_choice": values}, max_tokens=12)["text"] in set(values)


# ---- the fuzz ----

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 150}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
    {"type": "string", "pattern": "^[a-z]{2,5}$"},
    {"type": "object", "properties": {"ok": {"type": "boolean"},
                                      "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2}},
     "required": ["ok"], "additionalProperties": False},
    {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 9}, {"const": "none"}]},
    {"$defs": {"node": {"type": "object", "properties": {"v": {"type": "integer"}, "next": {"$ref": "#/$defs/node"}},
                        "required": ["v"], "additionalProperties": False}}, "$ref": "#/$defs/node"},
]
REGEXES = [r"\d{3}-\d{4}", r"(yes|no)", r"[A-Z][a-z]{1,6}", r"(a|b)*c{0,9}", r"[0-9]+(\.[0-9]{1,2})?", r"x+y"]
CHOICES = [["red", "green", "blue"], ["yes", "no"], ["Paris", "Rome", "Tokyo", 'a "quoted" \\ one']]
# Lark and GBNF grammars, each with a Python regex of the same language.
GRAMMARS = [('start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]{1,3}/', r"\([0-9]{1,3}(\+[0-9]{1,3})*\)"),
            ('root ::= "a" | "b" "c"', r"a|bc"),
            ('start: WORD (" " WORD)?\nWORD: /[a-z]{1,5}/', r"[a-z]{1,5}( [a-z]{1,5})?")]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"]}}}
_META = "()[]{}|*+?.\\-"
_COUNTS = (0, 1, 3, 1000, 100_000, 99_999_999)


def _mutate_regex(rng: random.Random, rx: str) -> str:
    """A regex with one edit: a counted repetition (up to 10^8), a deleted or inserted character
    (often a syntax error), a nested count, an empty class, or many alternatives."""
    op = rng.randrange(7)
    at = rng.randrange(len(rx) + 1)
    if op == 0:
        return rx[:at] + "{%d}" % rng.choice(_COUNTS) + rx[at:]
    if op == 1 and rx:
        return rx[:at] + rx[at + 1:]
    if op == 2:
        return rx[:at] + rng.choice(_META) + rx[at:]
    if op == 3:
        return "(%s){%d}{%d}" % (rx, rng.choice(_COUNTS), rng.choice(_COUNTS))
    if op == 4:
        return rx + "[^\\x00-\\U0010FFFF]"
    if op == 5:
        return "|".join([rx] * rng.choice((2, 50, 3000)))
    return rx


def _mutate_schema(rng: random.Random, schema, depth: int = 0):
    """A schema with edits at random places (no deeper than it was: deep nesting is another
    test's): junk values, $refs to itself or nowhere, unsatisfiable bounds, mutated patterns."""
    if isinstance(schema, dict):
        out = {k: (_mutate_schema(rng, v, depth + 1) if rng.random() < 0.5 else v) for k, v in schema.items()}
        op = rng.randrange(10)
        if op == 0:
            out["$ref"] = rng.choice(["#", "#/$defs/missing", "#/properties"])
        elif op == 1:
            out.update(type="object", properties={"r": {"$ref": "#"}}, required=["r"])
        elif op == 2:
            out["pattern"] = _mutate_regex(rng, rng.choice(REGEXES))
            out["type"] = "string"
        elif op == 3:
            out.update(minLength=rng.choice((5, 1_000_000)), maxLength=rng.choice((2, 10)))
        elif op == 4:
            out["enum"] = rng.choice(([], [None], ["a"] * 3000, [1, "1", True]))
        elif op == 5:
            out["type"] = rng.choice(["nope", 5, ["string", "null"], None])
        elif op == 6:
            out.update(minItems=rng.choice((1, 5000)), maxItems=rng.choice((0, 3)), type="array")
        elif op == 7:
            out = {"allOf": [out, rng.choice([{"type": "string"}, {"type": "integer"}, {}])]}
        return out
    if isinstance(schema, list):
        return [_mutate_schema(rng, v, depth + 1) for v in schema]
    if rng.random() < 0.2:
        return rng.choice([None, -1, 0, 10 ** 6, "", "x", [], {}, True, 2.5])
    return schema


def _mutate_grammar(rng: random.Random, g: str) -> str:
    op = rng.randrange(6)
    at = rng.randrange(len(g) + 1)
    if op == 0:
        return g[:at] + g[at + 1:]
    if op == 1:
        return g[:at] + rng.choice(['"', "|", "(", ")", ":", "/", "start", "::=", "\n"]) + g[at:]
    if op == 2:
        return rng.choice(["start: start", "start: start \"a\"", "root ::= root", "start: undefined",
                           "start: /a{%d}/" % rng.choice(_COUNTS), "start: %json {\"$ref\": \"#\"}",
                           "start: %json {\"type\": \"integer\", \"minimum\": 5, \"maximum\": 3}"])
    if op == 3:
        return "start: " + " | ".join(json.dumps(f"w{i}") for i in range(rng.choice((10, 2500))))
    return g


class Case:
    """One request: its endpoint, its body (or raw bytes), and what its output must satisfy."""

    def __init__(self, path, body, check=None, raw: bytes | None = None):
        self.path, self.body, self.check, self.raw = path, body, check, raw


def _constraint(rng: random.Random) -> tuple[dict, tuple | None]:
    """(request fields, (kind, spec, python regex or None)) of a constraint, mutated half the time."""
    kind = rng.choice(["json", "regex", "choice", "grammar", "json_object"])
    mutate = rng.random() < 0.5
    if kind == "json":
        schema = rng.choice(SCHEMAS)
        schema = _mutate_schema(rng, schema) if mutate else schema
        body = _strict(schema) if rng.random() < 0.7 else {"guided_json": schema}
        return body, ("json", schema, None)
    if kind == "regex":
        rx = rng.choice(REGEXES)
        rx = _mutate_regex(rng, rx) if mutate else rx
        return {"guided_regex": rx}, ("regex", rx, rx)
    if kind == "choice":
        values = list(rng.choice(CHOICES))
        if mutate:
            values = rng.choice([values * 3000, values + [""], values + [5], [], "red", values + ["é\u2028☃"]])
        return {"guided_choice": values}, ("choice", values, None)
    if kind == "grammar":
        g, py = rng.choice(GRAMMARS)
        if mutate:
            g, py = _mutate_grammar(rng, g), None
        return {"guided_grammar": g}, ("grammar", g, py)
    return {"response_format": {"type": "json_object"}}, ("json_object", None, None)


_MALFORMED = [b"", b"{", b"null", b"[]", b'{"prompt": "x", "max_tokens": 4', b"\xff\xfe{}", b'"just a string"',
              b'{"prompt": "x", "max_tokens": 4}}',
              # Nesting past the parser's depth limit, integers past its digit limit.
              b'{"prompt": ' + b"[" * 1000 + b"]" * 1000 + b', "max_tokens": 2}',
              b'{"prompt": "x", "max_tokens": 2, "logit_bias": {"' + b"9" * 5000 + b'": 1}}',
              b'{"prompt": "x", "max_tokens": 2, "seed": ' + b"9" * 5000 + b"}"]
_BAD_FIELDS = [{"max_tokens": "8"}, {"max_tokens": -1}, {"max_tokens": 100_000}, {"temperature": -1},
               {"temperature": "hot"}, {"n": 0}, {"top_p": 2}, {"stream": "yes"}, {"stop": 5},
               {"logit_bias": {"a": 1}}, {"seed": "x"}, {"response_format": "json"},
               {"response_format": {"type": 5}}, {"response_format": {"type": "json_schema", "json_schema": 5}},
               {"guided_regex": 5}, {"guided_regex": ""}, {"guided_choice": "abc"}, {"guided_json": "{not json"},
               {"guided_regex": "a", "guided_choice": ["a"]}, {"unknown_field": 1},
               {"guided_json": "[" * 1000 + "]" * 1000}, {"guided_json": "9" * 5000}]


def _case(rng: random.Random) -> Case:
    chat = rng.random() < 0.5
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"model": MODEL, "max_tokens": rng.choice((2, 3, 4)), "temperature": rng.choice((0.0, 1.0)),
            "seed": rng.randrange(1000), "stream": rng.random() < 0.3}
    if chat:
        body["messages"] = [{"role": "user", "content": rng.choice(["Give JSON.", "Pick one.", "hi"])}]
    else:
        body["prompt"] = rng.choice(["The answer:", "JSON:", "x"])
    roll = rng.random()
    if roll < 0.08:
        return Case(path, None, raw=rng.choice(_MALFORMED))
    if roll < 0.2:
        return Case(path, {**body, **rng.choice(_BAD_FIELDS)})
    if chat and roll < 0.26:
        tool = json.loads(json.dumps(WEATHER))
        params = tool["function"]["parameters"]
        if rng.random() < 0.5:
            params["properties"] = _mutate_schema(rng, params["properties"])
        if rng.random() < 0.2:
            params["required"] = rng.choice([5, [["city"]], [{}], "city", [None]])
        body.update(tools=[tool], tool_choice=rng.choice(["required", {"type": "function", "function": {"name": "get_weather"}}]),
                    max_tokens=20)
        return Case(path, body, ("tools", params, None))
    fields, check = _constraint(rng)
    return Case(path, {**body, **fields}, check)


def _texts(r: httpx.Response, chat: bool, stream: bool) -> list[tuple[str, str, dict]]:
    """(text, finish_reason, message) of each choice; streamed, no event may be an error."""
    if not stream:
        out = []
        for c in r.json()["choices"]:
            out.append((c["message"]["content"] or "", c["finish_reason"], c["message"]) if chat
                       else (c["text"], c["finish_reason"], {}))
        return out
    assert r.headers["content-type"].startswith("text/event-stream")
    text, finish, calls = "", None, {}
    for line in r.text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        assert "error" not in event, event
        for c in event["choices"]:
            delta = c["delta"] if chat else {"content": c["text"]}
            text += delta.get("content") or ""
            for piece in delta.get("tool_calls") or []:  # a call's arguments come in pieces
                call = calls.setdefault(piece["index"], {"function": {"arguments": ""}})
                call["function"]["arguments"] += piece.get("function", {}).get("arguments") or ""
            finish = c["finish_reason"] or finish
    return [(text, finish, {"tool_calls": list(calls.values())} if calls else {})]


def _llg_valid(server, kind: str, spec, text: str, complete: bool) -> bool:
    """Whether a fresh matcher of the request's grammar takes the text (and, complete, accepts
    it): the check of a prefix cut by max_tokens, and of what no Python library can judge."""
    from serving import structured_output as so

    tok, eos = server.runner.tokenizer, server.runner.info.eos_ids
    g = so.build_grammar(kind, spec, "x", tok, eos)
    m = g.new_matcher()
    return m.consume_tokens(tok.encode(text)) and (not complete or m.is_accepting())


def _check_output(server, check, text: str, finish: str, message: dict) -> None:
    kind, spec, py = check
    assert finish in ("stop", "length", "tool_calls"), finish
    if finish == "length":
        if kind != "tools":
            source_kind = {"json": "json_schema"}.get(kind, kind)
            assert _llg_valid(server, source_kind, None if kind == "json_object" else spec, text, False), (check, text)
        return
    if kind == "tools":
        calls = message.get("tool_calls") or []
        assert calls, message
        for call in calls:  # the call grammar reads a schema leniently: jsonschema judges what it can
            _assert_validates(server, spec, call["function"]["arguments"], fallback=False)
        return
    if kind in ("json", "json_object"):
        value = json.loads(text)
        if kind == "json_object":
            assert isinstance(value, dict)
            return
        _assert_validates(server, spec, text)
    elif kind == "choice":
        assert text in spec, (spec, text)
    elif py is not None and _python_regex(py):
        assert re.fullmatch(py, text), (py, text)
    else:
        assert _llg_valid(server, kind, spec, text, True), (spec, text)


def _assert_validates(server, schema, text: str, fallback: bool = True) -> None:
    """The JSON text validates against the schema (jsonschema; with `fallback` the grammar
    engine judges a mutated schema jsonschema cannot read)."""
    value = json.loads(text)
    try:
        errors = list(jsonschema.validators.validator_for(schema)(schema).iter_errors(value))
    except Exception:
        assert not fallback or _llg_valid(server, "json_schema", schema, text, True), (schema, text)
        return
    assert not errors, (schema, text, errors[0].message)


def _python_regex(rx: str) -> bool:
    try:
        re.compile(rx)
    except (re.error, OverflowError, RecursionError):
        return False
    return "\\U" not in rx  # escapes Python reads otherwise than the grammar engine


def _send(c: httpx.Client, case: Case) -> tuple[Case, httpx.Response]:
    if case.raw is not None:
        return case, c.post(case.path, content=case.raw, headers={"content-type": "application/json"})
    return case, c.post(case.path, json=case.body)


def test_fuzz_constrained_requests(server):
    """200 seeded requests, max_tokens <= 20, one at a time (batches of several would compile
    step programs of their own, a minute here; test_structured_output batches grammar rows): no
    5xx, no hang (the client's timeout), every 4xx an OpenAI error body, every constrained output
    valid (or a valid prefix with finish_reason "length"); every 25 requests a greedy request
    answers exactly as the first time."""
    rng = random.Random(70)
    cases = [_case(rng) for _ in range(200)]
    probe = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    statuses: dict[int, int] = {}
    with httpx.Client(base_url=server.url, timeout=300) as c:
        expected = c.post("/v1/completions", json=probe).json()["choices"][0]["text"]
        for start in range(0, len(cases), 25):
            for case, r in (_send(c, k) for k in cases[start:start + 25]):
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                where = (case.path, case.raw or json.dumps(case.body)[:400])
                assert r.status_code < 500, (where, r.text[:500])
                if r.status_code != 200:
                    _assert_error_body(r)
                    continue
                if case.check is None:
                    continue
                chat, stream = case.path.endswith("chat/completions"), bool(case.body.get("stream"))
                for text, finish, message in _texts(r, chat, stream):
                    try:
                        _check_output(server, case.check, text, finish, message)
                    except AssertionError as e:
                        raise AssertionError(f"{where}: {e}") from None
            assert c.post("/v1/completions", json=probe).json()["choices"][0]["text"] == expected
        assert c.get("/health").status_code == 200
    assert statuses.get(200, 0) >= 50 and statuses.get(400, 0) >= 50, statuses
