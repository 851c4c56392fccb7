"""Tool-call formats by name (``attnstore serve --tool-call-parser NAME``, vLLM's flag), and the format of a chat
template recognised from how it renders calls.

A format is a response template (transformers' response-template format, as ``--response-template FILE`` gives
one) built for the served chat template: where the reply starts (its generation prompt) and what ends it (its end
of turn) are read from the template and the tokenizer, so one name serves every model that writes calls so.

``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, the format of Hermes, Qwen 2.5 and the
ChatML templates that render tools (examples/templates/chatml_tools.jinja); vLLM's parser of the same name reads it.
"""

from __future__ import annotations

import json
import re
from typing import Callable

HERMES = "hermes"
TOOL_CALL_PARSERS = (HERMES,)  # the names `--tool-call-parser` takes

_PROBE_CALL = {"name": "probe_call", "arguments": {"a": 1}}


def hermes_template(start: str, ends: list[str]) -> dict:
    """The response template of Hermes-style calls for a chat format whose reply starts after `start` (its
    generation prompt) and ends with one of `ends` (its end-of-turn texts).

    Example:
        >>> hermes_template("<|im_start|>assistant\\n", ["<|im_end|>"])["fields"]["tool_calls"]["close"]
        '</tool_call>'
    """
    if not ends:
        raise ValueError("the tokenizer has no end-of-turn token to end a reply's content with")
    template = {
        "defaults": {"role": "assistant"},
        "fields": {
            # The leading \s* takes the newline between two calls (and after content), so it opens no content.
            "tool_calls": {"open_pattern": r"\s*<tool_call>", "close": "</tool_call>", "repeats": True,
                           "content": "json", "transform": {"type": "function", "function": "{content}"}},
            "content": {"close_pattern": r"\s*(?:" + "|".join(re.escape(e) for e in dict.fromkeys(ends)) + ")",
                        "content": "text"},
        },
    }
    if start:  # the prompt's earlier replies are not this one's
        template["start_anchor"] = start
    return template


def recognise(render: Callable[[list[dict], list[dict]], str]) -> str | None:
    """The name of the format a chat template writes calls in, from `render(messages, tools)` (its text) of an
    assistant message with a probe call; None when it is none we know (or the template cannot render calls).

    Example:
        >>> recognise(lambda m, t: '<tool_call>{"name": "probe_call", "arguments": {"a": 1}}</tool_call>')
        'hermes'
    """
    tools = [{"type": "function", "function": {"name": _PROBE_CALL["name"], "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "probe"},
                {"role": "assistant", "content": "", "tool_calls": [{"id": "call_0", "type": "function",
                                                                     "function": dict(_PROBE_CALL)}]}]
    try:
        text = render(messages, tools)
    except Exception:  # noqa: BLE001 - a template that cannot render calls writes none we could read
        return None
    call = re.escape(json.dumps(_PROBE_CALL))
    return HERMES if re.search(r"<tool_call>\s*" + call + r"\s*</tool_call>", text) else None


def named_template(name: str, start: str, ends: list[str]) -> dict:
    """The response template of the format `name` (one of `TOOL_CALL_PARSERS`) for a chat format whose reply starts
    after `start` and ends with one of `ends`.

    Raises:
        ValueError: `name` is not a format this server knows.

    Example:
        >>> named_template("hermes", "", ["</s>"])["fields"]["content"]["close_pattern"]
        '\\\\s*(?:</s>)'
    """
    if name == HERMES:
        return hermes_template(start, ends)
    raise ValueError(f"unknown tool-call parser {name!r}: this server knows {', '.join(TOOL_CALL_PARSERS)}")
