"""Tool (function) calling on chat completions, in Gemma 3's prompt convention.

Gemma 3 has no tool tokens. Following Google's function-calling guide for Gemma and vLLM's Gemma 3
"pythonic" chat template, the tools are described as JSON in the first user turn with an
instruction to answer with a Python list of calls, and the model answers

    [get_weather(city="Paris", unit="celsius"), get_time(zone="CET")]

(argument values are JSON literals; Python's True/False/None and single-quoted strings are read
too). A model turn that called tools is rendered back the same way, and a tool's result becomes a
user turn wrapped in <tool_response>...</tool_response>.

tool_choice: "none" leaves the tools out of the prompt; "auto" describes them and parses calls out
of the free text (the whole answer must be a list of calls to known tools, possibly inside a
``` fence); "required" or a named function constrains generation with a grammar built from the
functions' parameter schemas (`call_grammar`), so even a base model returns valid calls.
"""
from __future__ import annotations

import ast
import dataclasses
import json
import re
import uuid

from serving import openai_schema
from serving.sampling import InvalidParameter

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
# Argument names the call format (and its reader) can carry: identifiers, also with - and .
_KEY = re.compile(r"[A-Za-z0-9_.-]+")
_FENCE = re.compile(r"^```[A-Za-z_]*\s*\n?(.*?)\n?```$", re.S)

PREAMBLE = (
    "Tools (functions) are available. If you decide to invoke one or more of the tools, you must "
    "respond with a python list of the function calls.\n"
    "Example Format: [func_name1(params_name1=params_value1, params_name2=params_value2...), "
    "func_name2(params)]\n"
    "Do not use variables. DO NOT USE MARKDOWN SYNTAX. You SHOULD NOT include any other text in the "
    "response if you call a function. If none of the functions can be used, point it out. If you lack "
    "the parameters required by the function, also point it out.\n"
    "Here is a list of functions in JSON format that you can invoke.\n")


@dataclasses.dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict  # a JSON schema of an object

    def as_json(self) -> dict:
        return {"name": self.name, "description": self.description, "parameters": self.parameters}


def parse_tools(tools) -> list[Tool]:
    """The request's `tools` (OpenAI: [{"type": "function", "function": {...}}]); 400 otherwise."""
    if not isinstance(tools, list) or not tools:
        raise InvalidParameter("tools", "tools must be a non-empty list")
    out, names = [], set()
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise InvalidParameter(f"tools.{i}", "each tool must be {'type': 'function', 'function': {...}}")
        f = t["function"]
        name = f.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise InvalidParameter(f"tools.{i}.function.name",
                                   "a function name must be 1-64 characters of a-z, A-Z, 0-9, _ or -")
        if name in names:
            raise InvalidParameter(f"tools.{i}.function.name", f"two tools are named {name!r}")
        names.add(name)
        params = f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise InvalidParameter(f"tools.{i}.function.parameters", "parameters must be a JSON schema of an object")
        _check_parameters(params, f"tools.{i}.function.parameters")
        desc = f.get("description", "")
        if not isinstance(desc, str):
            raise InvalidParameter(f"tools.{i}.function.description", "description must be a string")
        out.append(Tool(name, desc, params))
    return out


def _check_parameters(params: dict, param: str) -> None:
    """What `call_grammar` and the prompt read of a parameters schema: properties (an object of
    schemas), required (a list of names) and $defs / definitions (objects)."""
    props = params.get("properties", {})
    if not isinstance(props, dict):
        raise InvalidParameter(param, "parameters.properties must be an object")
    for k, schema in props.items():
        if not isinstance(schema, (dict, bool)):
            raise InvalidParameter(param, f"parameters.properties.{k} must be a JSON schema (an object)")
    required = params.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise InvalidParameter(param, "parameters.required must be a list of property names")
    for key in ("$defs", "definitions"):
        if not isinstance(params.get(key, {}), dict):
            raise InvalidParameter(param, f"parameters.{key} must be an object")


@dataclasses.dataclass(frozen=True)
class Named:
    """A named tool_choice: one call of this function. Not the bare name, which a function called
    "none", "auto" or "required" would turn into that keyword."""
    name: str


def tool_mode(tool_choice, tools: list[Tool]) -> str | Named:
    """"none", "auto", "required" or the function that must be called (`Named`)."""
    if tool_choice is None:
        return "auto" if tools else "none"
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise InvalidParameter("tool_choice", "tool_choice must be 'none', 'auto', 'required' or "
                                   "{'type': 'function', 'function': {'name': ...}}")
        if tool_choice != "none" and not tools:
            raise InvalidParameter("tool_choice", f"tool_choice {tool_choice!r} needs tools")
        return tool_choice
    name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) and \
        tool_choice.get("type") == "function" and isinstance(tool_choice.get("function"), dict) else None
    if not isinstance(name, str):
        raise InvalidParameter("tool_choice", "a named tool_choice is {'type': 'function', 'function': {'name': ...}}")
    if name not in {t.name for t in tools}:
        raise InvalidParameter("tool_choice", f"tool_choice names {name!r}, which is not among the tools")
    return Named(name)


# ---- the prompt ----

def preamble(tools: list[Tool]) -> str:
    return PREAMBLE + json.dumps([t.as_json() for t in tools], indent=4, ensure_ascii=False) + "\n\n"


def format_calls(calls: list[tuple[str, dict]]) -> str:
    """[(name, arguments)] -> '[name(key=json, ...), ...]' (how a model turn that called tools reads)."""
    return "[" + ", ".join(f"{name}(" + ", ".join(f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in args.items())
                           + ")" for name, args in calls) + "]"


def assistant_calls_text(tool_calls, index: int) -> str:
    """An assistant message's `tool_calls` as the model would have written them."""
    if not isinstance(tool_calls, list):
        raise InvalidParameter(f"messages.{index}.tool_calls", "tool_calls must be a list")
    calls = []
    for j, c in enumerate(tool_calls):
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise InvalidParameter(f"messages.{index}.tool_calls.{j}", "a tool call needs function.name")
        args = f.get("arguments", "{}")
        try:
            args = openai_schema.loads(args, "the arguments' JSON") if isinstance(args, str) else args
        except openai_schema.JsonLimitError as e:
            raise InvalidParameter(f"messages.{index}.tool_calls.{j}.function.arguments", str(e)) from None
        except ValueError:  # json.JSONDecodeError, NaN
            raise InvalidParameter(f"messages.{index}.tool_calls.{j}.function.arguments",
                                   "arguments must be a JSON object (as a string)") from None
        if not isinstance(args, dict):
            raise InvalidParameter(f"messages.{index}.tool_calls.{j}.function.arguments",
                                   "arguments must be a JSON object")
        calls.append((f["name"], args))
    return format_calls(calls)


def tool_result_text(content: str) -> str:
    return "<tool_response>\n" + content.strip() + "</tool_response>"


# ---- the grammar of calls ----

def call_grammar(tools: list[Tool], mode: str | Named, parallel: bool = True) -> str:
    """A Lark grammar (llguidance's dialect, with %json for argument values) of a list of calls:
    one call of the named function (`Named`), or (required) one or more calls of any tool (one
    when not parallel). Arguments come in the schema's property order; required ones always,
    optional ones may be left out."""
    named = isinstance(mode, Named)
    chosen = [t for t in tools if t.name == mode.name] if named else tools
    rules = []
    alts = []
    for n, t in enumerate(chosen):
        props = list(t.parameters.get("properties", {}).items())
        required = set(t.parameters.get("required", []))
        defs = {key: t.parameters[key] for key in ("$defs", "definitions") if key in t.parameters}
        kv = [f'"{k}=" %json {json.dumps(_value_schema(s, defs))}' if _KEY.fullmatch(k) else None for k, s in props]
        # first_i: arguments from property i on, none written yet; rest_i: after one was written.
        for i in range(len(props), -1, -1):
            if i == len(props):
                rules += [f"first_{n}_{i}: \"\"", f"rest_{n}_{i}: \"\""]
                continue
            k = props[i][0]
            if kv[i] is None:  # a name the call format cannot carry: never written
                if k in required:
                    raise InvalidParameter("tools", f"{t.name}: required parameter {k!r} is not a name Gemma's "
                                           "call format can carry (letters, digits, _, - and .)")
                rules += [f"first_{n}_{i}: first_{n}_{i + 1}", f"rest_{n}_{i}: rest_{n}_{i + 1}"]
            elif k in required:
                rules += [f"first_{n}_{i}: {kv[i]} rest_{n}_{i + 1}", f"rest_{n}_{i}: \", \" {kv[i]} rest_{n}_{i + 1}"]
            else:
                rules += [f"first_{n}_{i}: {kv[i]} rest_{n}_{i + 1} | first_{n}_{i + 1}",
                          f"rest_{n}_{i}: \", \" {kv[i]} rest_{n}_{i + 1} | rest_{n}_{i + 1}"]
        rules.append(f"call_{n}: \"{t.name}(\" first_{n}_0 \")\"")
        alts.append(f"call_{n}")
    rules.append("call: " + " | ".join(alts))
    many = parallel and not named
    rules.insert(0, 'start: "[" call ("," " " call)* "]"' if many else 'start: "[" call "]"')
    return "\n".join(rules) + "\n"


def _value_schema(schema, defs: dict) -> dict:
    """A parameter's schema as a document of its own: the parameters' definitions come along (for
    its $refs), JSON compact."""
    schema = dict(schema) if isinstance(schema, dict) else {}
    for key, value in defs.items():
        schema.setdefault(key, value)
    schema.setdefault("x-guidance", {"whitespace_flexible": False})
    return schema


# ---- reading calls out of the model's text ----

def parse_calls(text: str, tools: list[Tool]) -> list[tuple[str, dict]] | None:
    """The calls in `text` when the whole (stripped, possibly fenced) text is a list of calls to
    known tools, else None."""
    s = text.strip()
    m = _FENCE.match(s)
    if m:
        s = m.group(1).strip()
    if not s.startswith("["):
        return None
    names = {t.name for t in tools}
    try:
        calls, end = _Reader(s).calls()
    except (ValueError, RecursionError):
        return None
    if end != len(s) or not calls or any(name not in names for name, _ in calls):
        return None
    return calls


class _Reader:
    """`[name(key=value, ...), ...]` with JSON (or Python literal) values."""

    _json = json.JSONDecoder()

    def __init__(self, s: str):
        self.s, self.i = s, 0

    def _ws(self):
        while self.i < len(self.s) and self.s[self.i] in " \t\r\n":
            self.i += 1

    def _eat(self, ch: str) -> bool:
        self._ws()
        if self.s.startswith(ch, self.i):
            self.i += len(ch)
            return True
        return False

    def _name(self, pattern=re.compile(r"[A-Za-z0-9_.-]+")) -> str:
        self._ws()
        m = pattern.match(self.s, self.i)
        if not m:
            raise ValueError("name expected")
        self.i = m.end()
        return m.group(0)

    def _value(self):
        self._ws()
        for word, value in (("True", True), ("False", False), ("None", None)):
            if self.s.startswith(word, self.i) and not self.s[self.i + len(word):self.i + len(word) + 1].isalnum():
                self.i += len(word)
                return value
        if self.s.startswith("'", self.i):
            m = re.compile(r"'(?:[^'\\]|\\.)*'").match(self.s, self.i)
            if not m:
                raise ValueError("unterminated string")
            self.i = m.end()
            return ast.literal_eval(m.group(0))
        value, self.i = self._json.raw_decode(self.s, self.i)
        return value

    def calls(self) -> tuple[list[tuple[str, dict]], int]:
        if not self._eat("["):
            raise ValueError("[ expected")
        calls = []
        while True:
            name = self._name()
            if not self._eat("("):
                raise ValueError("( expected")
            args = {}
            if not self._eat(")"):
                while True:
                    key = self._name()
                    if not self._eat("="):
                        raise ValueError("= expected")
                    args[key] = self._value()
                    if self._eat(")"):
                        break
                    if not self._eat(","):
                        raise ValueError(", expected")
            calls.append((name, args))
            if self._eat("]"):
                self._ws()
                return calls, self.i
            if not self._eat(","):
                raise ValueError(", expected")


def openai_calls(calls: list[tuple[str, dict]]) -> list[dict]:
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}
            for name, args in calls]


class ToolStream:
    """Streaming with tools: text that may be a list of calls ('[' or a ``` fence first) is held
    back until the choice ends, then sent as tool_calls deltas (OpenAI's format: index, id, type
    and name first, then the arguments) or, if it was no call after all, as content."""

    def __init__(self, tools: list[Tool], constrained: bool):
        self.tools, self.constrained = tools, constrained
        self.held = ""
        self.holding = constrained
        self.decided = constrained
        self.calls: list[tuple[str, dict]] | None = None

    def feed(self, text: str, finish_reason: str | None) -> tuple[list[dict], str | None]:
        """-> (delta dicts to send, the finish reason to send)."""
        out: list[dict] = []
        if not self.decided:
            self.held += text
            text = ""
            head = self.held.lstrip()
            if head:
                if head[0] == "[" or head.startswith("`"):
                    self.holding, self.decided = True, True
                elif len(head) >= 1:
                    self.decided = True
                    text, self.held = self.held, ""
            elif finish_reason is None:
                return out, None
        if self.holding:
            self.held += text
            if finish_reason is None:
                return out, None
            self.calls = parse_calls(self.held, self.tools)
            if self.calls:
                for i, c in enumerate(openai_calls(self.calls)):
                    out.append({"tool_calls": [{"index": i, "id": c["id"], "type": "function",
                                                "function": {"name": c["function"]["name"], "arguments": ""}}]})
                    out.append({"tool_calls": [{"index": i, "function": {"arguments": c["function"]["arguments"]}}]})
                return out, "tool_calls" if finish_reason == "stop" else finish_reason
            text, self.held = self.held, ""
        if text or (self.held and finish_reason):
            out.append({"content": text + self.held})
            self.held = ""
        return out, finish_reason

    def finish_choice(self, body: dict) -> None:
        """A whole (not streamed) chat choice: its text becomes tool_calls when it is a list of
        calls (finish_reason "tool_calls")."""
        message = body["message"]
        calls = parse_calls(message.get("content") or "", self.tools)
        if calls:
            message["content"] = None
            message["tool_calls"] = openai_calls(calls)
            if body["finish_reason"] == "stop":
                body["finish_reason"] = "tool_calls"
