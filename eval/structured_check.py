"""Validity of structured output and tool calls against a running server, through the official
`openai` client: N json_schema requests over a few schemas (nested objects, enums, arrays,
numbers, strings with patterns), half streamed, each parsed and validated with `jsonschema`; then
tool calls with tool_choice "required" and a named function, validated against their schemas.

    gemma3-serve --model gemma3-270m --max-seq-len 1024 --port 8000 &
    python -m eval.structured_check --url http://127.0.0.1:8000 --requests 50
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import time

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
PROMPTS = ["Give a person record as JSON.", "Give an order as JSON.", "Describe a film as JSON."]
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


def main(argv=None) -> None:
    import jsonschema
    import openai

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--requests", type=int, default=50)
    p.add_argument("--tool-requests", type=int, default=10)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=8)
    args = p.parse_args(argv)
    client = openai.OpenAI(base_url=args.url.rstrip("/") + "/v1", api_key="unused", max_retries=0, timeout=600)
    model = client.models.list().data[0].id

    def schema_request(i: int) -> dict:
        k = i % len(SCHEMAS)
        kwargs = dict(model=model, messages=[{"role": "user", "content": PROMPTS[k]}], max_tokens=args.max_tokens,
                      temperature=[0.0, 0.7, 1.0][i % 3], seed=i,
                      response_format={"type": "json_schema", "json_schema": {"name": f"s{k}", "schema": SCHEMAS[k],
                                                                               "strict": True}})
        stream = i % 2 == 1
        if stream:
            text, reason = "", None
            for chunk in client.chat.completions.create(stream=True, **kwargs):
                for c in chunk.choices:
                    text += c.delta.content or ""
                    reason = c.finish_reason or reason
        else:
            c = client.chat.completions.create(**kwargs).choices[0]
            text, reason = c.message.content, c.finish_reason
        try:
            jsonschema.validate(json.loads(text), SCHEMAS[k])
            ok = True
        except Exception as e:  # noqa: BLE001 - report any failure
            ok = False
            print(f"request {i} (schema {k}, {'streamed' if stream else 'whole'}) invalid: {e!s:.200}\n  {text!r:.300}")
        return {"ok": ok, "stream": stream, "finish_reason": reason}

    def tool_request(i: int) -> bool:
        choice = "required" if i % 2 == 0 else {"type": "function", "function": {"name": "book_table"}}
        r = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Book a table for two at Luigi's at 19:30."}],
            tools=TOOLS, tool_choice=choice, max_tokens=args.max_tokens, temperature=[0.0, 1.0][i % 2], seed=i)
        c = r.choices[0]
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
        try:
            assert c.finish_reason == "tool_calls" and c.message.tool_calls
            for call in c.message.tool_calls:
                assert isinstance(choice, str) or call.function.name == "book_table"
                jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
            return True
        except Exception as e:  # noqa: BLE001
            print(f"tool request {i} invalid: {e!s:.200} {c}")
            return False

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
        results = list(pool.map(schema_request, range(args.requests)))
        tools_ok = list(pool.map(tool_request, range(args.tool_requests)))
    report = {
        "json_schema_valid": f"{sum(r['ok'] for r in results)}/{len(results)}",
        "streamed_valid": f"{sum(r['ok'] for r in results if r['stream'])}/{sum(r['stream'] for r in results)}",
        "finish_reasons": {k: sum(r["finish_reason"] == k for r in results) for k in {r["finish_reason"] for r in results}},
        "tool_calls_valid": f"{sum(tools_ok)}/{len(tools_ok)}",
        "seconds": round(time.perf_counter() - t0, 1),
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
