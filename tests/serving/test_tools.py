"""Tool calling on chat completions through the official `openai` client: with tool_choice
"required" or a named function the grammar makes even a random model return valid calls (checked
against the functions' schemas with `jsonschema`), whole and streamed; "auto" parses calls out of
free text; history with tool calls and tool results renders in Gemma's convention."""
import json

import httpx
import jsonschema
import pytest

from serving import tools as T
from serving.config import ServerConfig
from testkit import ServerThread

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "unit"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "parameters": {"type": "object", "properties": {
        "query": {"type": "string", "maxLength": 10}, "filters": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
        "required": ["query"]}}}
TOOLS = [WEATHER, SEARCH]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server():
    from models.gemma3 import load_model
    from serving.paged_runner import PagedRunner

    # Random weights: under "required" (any number of calls) such a model may go on adding
    # calls until max_tokens; with these weights every draw below ends its calls in time.
    # Not warmed up: only the step shapes these prompts use compile.
    engine = PagedRunner(load_model("random:tiny?max_len=4096", tp=1, dtype="float32", seed=9),
                         max_num_seqs=4, max_seq_len=4096)
    s = ServerThread(ServerConfig(model="random:tiny", served_model_name="tiny", max_num_seqs=4, max_seq_len=4096,
                                  compile_cache_dir=""), engine)
    yield s
    s.stop()


def _check(call, name=None):
    assert call.type == "function" and call.id.startswith("call_")
    assert name is None or call.function.name == name
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "search"}}])
def test_constrained_calls_are_valid(oai, choice):
    name = None if choice == "required" else "search"
    for seed, temperature in [(0, 0.0), (1, 1.0), (2, 1.0)]:
        r = oai.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                        temperature=temperature, seed=seed, max_tokens=120)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None and c.message.tool_calls, c
        for call in c.message.tool_calls:
            _check(call, name)


@pytest.mark.parametrize("name", ["none", "auto", "required"])
def test_a_function_named_like_a_mode_can_be_forced(oai, name):
    """A named tool_choice forces exactly that function (one call), also when its name is one of
    tool_choice's keywords."""
    fn = {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {"q": {"type": "string", "maxLength": 5}}, "required": ["q"]}}}
    r = oai.chat.completions.create(model="tiny", messages=MESSAGES, tools=[fn, SEARCH], temperature=1.0, seed=4,
                                    tool_choice={"type": "function", "function": {"name": name}}, max_tokens=60)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and [t.function.name for t in c.message.tool_calls or ()] == [name], c


def test_streamed_tool_call_deltas(oai):
    stream = oai.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                         temperature=1.0, seed=5, max_tokens=120, stream=True,
                                         parallel_tool_calls=False)
    calls, reasons, content = {}, [], ""
    for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or ():
                entry = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = d.id or entry["id"]
                if d.function:
                    entry["name"] += d.function.name or ""
                    entry["arguments"] += d.function.arguments or ""
            reasons.append(c.finish_reason)
    assert reasons[-1] == "tool_calls" and content == "" and len(calls) == 1
    call = calls[0]
    assert call["id"].startswith("call_") and call["name"] in SCHEMAS
    jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_auto_and_none_answer_with_text(oai):
    r = oai.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=8,
                                    temperature=0.0)  # greedy: an unseeded draw can end with EOS
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "length"
    r = oai.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=8, temperature=1.0,
                                    seed=3, logit_bias={str(107 + ord("x")): 100})
    assert r.choices[0].message.content == "x" * 8 and r.choices[0].message.tool_calls is None
    stream = oai.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=8, stream=True,
                                         logit_bias={str(107 + ord("x")): 100})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "x" * 8


def test_history_with_tool_calls_and_results(oai, server):
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                             "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    r = oai.chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=4)
    assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")
    with httpx.Client(base_url=server.url, timeout=60) as http:
        ids = http.post("/tokenize", json={"messages": history, "return_token_strs": True}).json()["tokens"]
        text = http.post("/detokenize", json={"tokens": ids}).json()["prompt"]
        assert '[get_weather(city="Paris", unit="celsius")]' in text
        assert '<tool_response>\n{"temperature": 21}</tool_response>' in text
        for body, param in [({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.0.function.name"),
                            ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
                            ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
                            ({"tool_choice": "required"}, "tool_choice"),
                            ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
                             "response_format")]:
            r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4, **body})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_parse_calls_and_stream_units():
    tools = T.parse_tools(TOOLS)
    assert T.parse_calls('[get_weather(city="Oslo", unit="celsius"), search(query=\'x\', filters=["a"])]', tools) == [
        ("get_weather", {"city": "Oslo", "unit": "celsius"}), ("search", {"query": "x", "filters": ["a"]})]
    assert T.parse_calls("```tool_code\n[search(query=\"q\", filters=None)]\n```", tools) == [("search", {"query": "q", "filters": None})]
    for text in ("Sorry, I can't.", "[unknown(a=1)]", "[search(query=\"q\")] and more", "[search(query=)]", "["):
        assert T.parse_calls(text, tools) is None
    ts = T.ToolStream(tools, constrained=False)
    out = ts.feed("[sear", None)[0] + ts.feed('ch(query="q")]', "stop")[0]
    assert out[0]["tool_calls"][0]["function"] == {"name": "search", "arguments": ""}
    assert json.loads(out[1]["tool_calls"][0]["function"]["arguments"]) == {"query": "q"}
    ts = T.ToolStream(tools, constrained=False)
    assert ts.feed("Hello", None) == ([{"content": "Hello"}], None)
    ts = T.ToolStream(tools, constrained=False)
    assert ts.feed("[not a call", None) == ([], None) and ts.feed("", "stop") == ([{"content": "[not a call"}], "stop")


def test_call_grammar_names_and_refs():
    """Argument names with - or . and $refs into the parameters' $defs compile; a required name
    the call format cannot carry is a 400."""
    from models.gemma3.byte_tokenizer import ByteTokenizer
    from serving import structured_output as so
    from serving.sampling import InvalidParameter

    fn = {"name": "f", "parameters": {"type": "object", "$defs": {"U": {"enum": ["a", "b"]}},
                                      "properties": {"user-id": {"type": "integer"}, "u": {"$ref": "#/$defs/U"}},
                                      "required": ["user-id", "u"]}}
    tools = T.parse_tools([{"type": "function", "function": fn}])
    grammar = so.build_grammar("tool_call", T.call_grammar(tools, T.Named("f")), "tools", ByteTokenizer(512), (1, 106))
    matcher = grammar.new_matcher()
    assert matcher.consume_tokens(ByteTokenizer(512).encode('[f(user-id=3, u="b")]')) and matcher.is_stopped()
    assert T.parse_calls('[f(user-id=3, u="b")]', tools) == [("f", {"user-id": 3, "u": "b"})]
    bad = T.parse_tools([{"type": "function", "function": {"name": "g", "parameters": {
        "type": "object", "properties": {"a b": {"type": "string"}}, "required": ["a b"]}}}])
    with pytest.raises(InvalidParameter):
        T.call_grammar(bad, "required")


def test_a_named_choice_grammar_takes_that_function_only():
    """The grammar of a named choice whose name is a keyword ("required") takes one call of that
    function, not a call of any tool nor several."""
    from models.gemma3.byte_tokenizer import ByteTokenizer
    from serving import structured_output as so

    tok = ByteTokenizer(512)
    tools = T.parse_tools([{"type": "function", "function": {"name": "required"}}, SEARCH])
    mode = T.tool_mode({"type": "function", "function": {"name": "required"}}, tools)
    grammar = so.build_grammar("tool_call", T.call_grammar(tools, mode), "tools", tok, (1, 106))

    def takes(text):
        matcher = grammar.new_matcher()
        return bool(matcher.consume_tokens(tok.encode(text))) and matcher.is_stopped()

    assert takes("[required()]")
    assert not takes('[search(query="q")]') and not takes("[required(), required()]")


def test_mask_timer_sees_each_mask_job():
    """StructuredOutputs reports the seconds of every mask job it runs (what bench_grammar
    measures as the host work of a constrained step), and only when the matcher moved."""
    from models.gemma3.byte_tokenizer import ByteTokenizer
    from serving import SamplingParams, Sequence, StructuredOutputs, build_grammar

    tok, eos = ByteTokenizer(512), (1, 106)
    grammar = build_grammar("json_schema", {"enum": ["ab"]}, "response_format", tok, eos)
    seconds: list[float] = []
    structured = StructuredOutputs(512, eos, tokenizer=tok, mask_timer=seconds.append)
    try:
        seq = Sequence(1, [2], SamplingParams(max_tokens=8, grammar=grammar), seed=0)
        structured.add(seq)
        structured.masks([seq.id]).result()
        assert len(seconds) == 1 and seconds[0] >= 0
        structured.masks([seq.id]).result()  # nothing moved: the same mask, no new job
        assert len(seconds) == 1
        structured.accept(seq.id, tok.encode('"')[0])
        structured.masks([seq.id]).result()
        assert len(seconds) == 2
    finally:
        structured.close()
