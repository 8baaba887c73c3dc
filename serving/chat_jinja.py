"""A checkpoint's own Jinja chat template, rendered and tokenized as transformers'
`apply_chat_template(..., tokenize=True, sanitize_control_tokens=True)` does.

The control tokens the template writes become their ids and no BOS is added; control tokens inside
the messages are marked before rendering and encoded as text, so a message cannot forge a turn. See
docs/usage.md, "Chat templates and streamed text"."""
from __future__ import annotations

import functools
import json
import re
from datetime import datetime
from typing import Any, Sequence

_START, _END = "\U000f0000", "\U000f0001"


@functools.lru_cache(maxsize=8)
def _compile(source: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` (marks assistant text for training masks in
        transformers): renders its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


@functools.lru_cache(maxsize=8)
def _patterns(tokens: tuple[str, ...]) -> tuple[re.Pattern, re.Pattern]:
    """(any control token; a marked control token or a lone marker), longest tokens first so a
    token wins over the tokens it contains."""
    alternatives = "|".join(map(re.escape, sorted(tokens, key=len, reverse=True))) or "(?!)"
    return re.compile(alternatives), re.compile(f"{_START}({alternatives}){_END}|[{_START}{_END}]")


def _mark(obj: Any, tokens: re.Pattern) -> Any:
    if isinstance(obj, str):
        obj = obj.replace(_START, "").replace(_END, "")  # markers cannot be forged either
        return tokens.sub(f"{_START}\\g<0>{_END}", obj)
    if isinstance(obj, dict):
        return {k: _mark(v, tokens) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_mark(v, tokens) for v in obj]
    return obj


def render_template(source: str, variables: dict, messages: Sequence[dict], tok, *,
                    add_generation_prompt: bool = True, **extra) -> list[int]:
    """Prompt ids of `messages` (dicts with role and content) under a Jinja chat template.
    `variables`: the special-token names (bos_token, ...); `extra`: more template variables
    (tools, ...). Raises ValueError when the template refuses the conversation."""
    import jinja2

    control = tok.control_tokens()
    tokens_re, markers_re = _patterns(tuple(control))
    try:
        text = _compile(source).render(
            messages=_mark([{k: v for k, v in m.items() if v is not None} for m in messages],
                           tokens_re),
            add_generation_prompt=add_generation_prompt,
            **{**variables, **_mark(extra, tokens_re)})
    except jinja2.exceptions.TemplateError as e:
        raise ValueError(f"the model's chat template refused the messages: {e}") from None
    # split: [text, marked token or None (lone marker), text, ...]
    pieces = markers_re.split(text)
    ids = _encode_with_control(pieces[0], tok, control, tokens_re)
    for i, piece in enumerate(pieces[1:], start=1):
        if not piece:
            continue
        ids += tok.encode(piece) if i % 2 == 1 else _encode_with_control(piece, tok, control,
                                                                         tokens_re)
    return ids


def _encode_with_control(text: str, tok, control: dict[str, int], tokens_re: re.Pattern) -> list[int]:
    ids, at = [], 0
    for m in tokens_re.finditer(text):
        if m.start() > at:
            ids += tok.encode(text[at:m.start()])
        ids.append(control[m.group()])
        at = m.end()
    if at < len(text):
        ids += tok.encode(text[at:])
    return ids
