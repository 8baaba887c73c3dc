"""Gemma's built-in chat format, built as token ids:
`<bos><start_of_turn>user\n{text}<end_of_turn>\n<start_of_turn>model\n...`.

"assistant" becomes "model"; system and developer messages are prepended to the first user turn
(Gemma has no system role). Turn markers are inserted as ids, never parsed from text, so a message
cannot forge a turn. A checkpoint's own Jinja template replaces this format (serving.chat_jinja)."""
from __future__ import annotations

from typing import Protocol, Sequence


class ChatTokenizer(Protocol):
    bos_id: int
    start_of_turn_id: int
    end_of_turn_id: int

    def encode(self, text: str) -> list[int]: ...


_ROLES = {"user": "user", "assistant": "model"}
_SYSTEM_ROLES = ("system", "developer")


def render_chat(messages: Sequence[tuple[str, str]], tok: ChatTokenizer) -> list[int]:
    """(role, text) pairs -> prompt ids ending with the model's turn opening. Raises ValueError
    (with the message index) for an unknown role or a conversation without a user turn.
    A tokenizer that carries its checkpoint's own template (`chat_template`) is rendered with
    that instead (serving.chat_jinja), as transformers would."""
    template = getattr(tok, "chat_template", None)
    if template is not None:
        from serving.chat_jinja import render_template

        return render_template(template.source, template.variables,
                               [{"role": role, "content": text} for role, text in messages], tok)
    system = [text for role, text in messages if role in _SYSTEM_ROLES]
    turns = []
    for i, (role, text) in enumerate(messages):
        if role in _SYSTEM_ROLES:
            continue
        if role not in _ROLES:
            raise ValueError(f"messages[{i}].role must be one of system, developer, user, assistant; got {role!r}")
        turns.append((_ROLES[role], text))
    if not turns or turns[0][0] != "user":
        raise ValueError("the conversation must start with a user message (after any system message)")
    if system:
        turns[0] = ("user", "\n\n".join(system) + "\n\n" + turns[0][1])
    ids = [tok.bos_id]
    newline = tok.encode("\n")
    for role, text in turns:
        ids += [tok.start_of_turn_id, *tok.encode(f"{role}\n{text}"), tok.end_of_turn_id, *newline]
    ids += [tok.start_of_turn_id, *tok.encode("model\n")]
    return ids
