"""Structured output and tool calls on the real Gemma 3 270M (the base model, in bfloat16, the
server's default dtype) through the real HTTP app and the official `openai` client: nested
json_schema outputs validate, streamed and not, and "required" / named tool calls are valid
calls (eval/structured_check.py runs the larger count)."""
import json

import jsonschema
import openai
import pytest

from eval.bench_serving import SCHEMAS, TOOLS
from serving.config import ServerConfig
from testkit import ServerThread

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def oai():
    from models.gemma3 import load_model
    from serving.paged_runner import PagedRunner

    # Not warmed up: a program compiles on its first use, so only the few these requests need
    # are compiled (test_server_e2e covers the warm-up).
    engine = PagedRunner(load_model("gemma3-270m", tp=1, dtype="bfloat16"), max_num_seqs=4, max_seq_len=768)
    s = ServerThread(ServerConfig(model="gemma3-270m", served_model_name="gemma3-270m", max_num_seqs=4,
                                  max_seq_len=768, compile_cache_dir=""), engine)
    yield openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    s.stop()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_nested_json_schema_validates(oai, stream):
    schema = SCHEMAS[1]  # nested objects, arrays of objects, enums, patterns, numbers
    kwargs = dict(model="gemma3-270m", messages=[{"role": "user", "content": "Give an order as JSON."}],
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
            model="gemma3-270m", messages=[{"role": "user", "content": "Book a table for two at Luigi's at 19:30."}],
            tools=TOOLS, tool_choice=choice, max_tokens=100, temperature=0.0)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.tool_calls
        for call in c.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
