"""Forced tool calls: ``tool_choice`` ``"required"`` or a named function, by constrained decoding (llguidance).

The reply is constrained to calls written in the model's own tool-call format, as its response template parses
them: the literal that opens a call, a JSON object ``{"name": ..., "arguments": ...}`` whose name is an offered
function (the named one, for a named choice) and whose arguments satisfy that function's JSON-schema
``parameters``, the literal that closes it. That is the Hermes/Qwen form (``<tool_call>{...}</tool_call>``) that
ChatML-style templates render; a response template that writes calls otherwise (the name in the opening tag,
XML arguments) cannot be forced, and such a request is a 400 naming ``tool_choice``.

The JSON is written compactly with OpenAI's (and Jinja's ``tojson``) separators, ``", "`` and ``": "``, so that a
template that renders calls with ``tojson`` renders the call back as it was generated, and the memo gives its
exact ids back (`conversation.ReplyMemo`). A named choice forces one call; ``"required"`` forces one, then allows
more, separated by a newline, unless ``parallel_tool_calls`` is false.
"""

from __future__ import annotations

import json
import re

from .structured import GrammarError, GrammarProcessor, Grammars

# llguidance's JSON options (`x-guidance`): no free whitespace (a random model would fill replies with it), and
# the separators `json.dumps` and Jinja's `tojson` write.
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_LEADING_SPACE = re.compile(r"^(?:\\s[*+?])+")  # `\s*` before an opening tag: the parser skips the whitespace


class ForcingUnsupported(ValueError):
    """The model's tool-call format cannot be forced (its response template writes calls otherwise than as a JSON
    object between two literal tags): the client's request is refused, naming ``tool_choice``.

    Example:
        >>> isinstance(ForcingUnsupported("no"), ValueError)
        True
    """


def call_tags(template: dict) -> tuple[str, str]:
    """The literals that open and close a tool call in `template` (a response template), when its calls are a
    JSON object ``{"name", "arguments"}`` between them.

    Raises:
        ForcingUnsupported: The template's calls are written otherwise.

    Example:
        >>> call_tags({"fields": {"tool_calls": {"open_pattern": r"\\s*<tool_call>", "close": "</tool_call>",
        ...            "content": "json", "transform": {"type": "function", "function": "{content}"}}}})
        ('<tool_call>', '</tool_call>')
    """
    field = (template.get("fields") or {}).get("tool_calls") or {}
    transform = field.get("transform") or {}
    if field.get("content") != "json" or transform.get("function") != "{content}" or field.get("content_args"):
        raise ForcingUnsupported("this model's tool-call format (its response template) is not a JSON object "
                                 "{\"name\", \"arguments\"} between two tags, so its calls cannot be forced: use "
                                 "`tool_choice` \"auto\", or serve it with a Hermes-style response template")
    opening = field.get("open")
    if opening is None and isinstance(field.get("open_pattern"), str):
        opening = _literal(_LEADING_SPACE.sub("", field["open_pattern"]))
    closing = field.get("close")
    if not isinstance(opening, str) or not opening or not isinstance(closing, str) or not closing:
        raise ForcingUnsupported("this model's response template opens or closes tool calls with a pattern, not a "
                                 "literal tag, so its calls cannot be forced: use `tool_choice` \"auto\"")
    return opening, closing


def _literal(pattern: str) -> str | None:
    """The one string a regex `pattern` matches when it is a literal (escaped punctuation only), else None."""
    if re.search(r"(?<!\\)[.*+?()\[\]{}|^$]", pattern) or re.search(r"\\[A-Za-z0-9]", pattern):
        return None
    return re.sub(r"\\(.)", r"\1", pattern)


def call_schema(tools: list[dict], names: list[str]) -> dict:
    """The JSON schema of one call of a function among `names` (`tools` in the template form): its name, then
    arguments that satisfy its ``parameters``.

    Example:
        >>> call_schema([{"type": "function", "function": {"name": "f"}}], ["f"])["properties"]["name"]
        {'const': 'f'}
    """
    choices = []
    for tool in tools:
        function = tool["function"]
        if function["name"] not in names:
            continue
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        choices.append({"type": "object", "properties": {"name": {"const": function["name"]}, "arguments": parameters},
                        "required": ["name", "arguments"], "additionalProperties": False})
    schema = choices[0] if len(choices) == 1 else {"anyOf": choices}
    return {"x-guidance": _COMPACT, **schema}


def forced_call_grammar(tags: tuple[str, str], schema: dict, several: bool) -> str:
    """The Lark grammar (llguidance's dialect) of a reply that is one call (`several`: one or more, a newline
    between them), each the opening tag, JSON matching `schema`, the closing tag.

    Example:
        >>> print(forced_call_grammar(("<c>", "</c>"), {"type": "object"}, False))
        start: call
        call: "<c>" body "</c>"
        body: %json {"type": "object"}
    """
    start = 'start: call ("\\n" call)*' if several else "start: call"
    return "\n".join([start, f"call: {json.dumps(tags[0])} body {json.dumps(tags[1])}",
                      f"body: %json {json.dumps(schema)}"])


def forced_call_processor(grammars: Grammars, template: dict, tools: list[dict], names: list[str],
                          several: bool) -> GrammarProcessor:
    """A processor that constrains a reply to calls of the functions `names` among `tools` (template form) in the
    format of `template` (a response template).

    Raises:
        ForcingUnsupported: The format cannot be forced (`call_tags`).
        GrammarError: A function's ``parameters`` are not a schema llguidance compiles.

    Example:
        >>> processor = forced_call_processor(engine.grammars, engine.response_template, tools, ["f"], False)  # doctest: +SKIP
    """
    tags = call_tags(template)
    schema = call_schema(tools, names)
    if len(json.dumps(schema)) > grammars.max_chars:
        raise GrammarError(f"the tools' parameters have more than {grammars.max_chars} characters of JSON")
    return grammars.compile(forced_call_grammar(tags, schema, several), lark=True)
