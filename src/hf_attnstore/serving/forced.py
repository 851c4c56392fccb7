"""Forced tool calls: ``tool_choice`` ``"required"`` or a named function, by constrained decoding (llguidance).

The reply is constrained to calls written in the model's own tool-call format, as its response template parses
them: the literal that opens a call, a JSON object ``{"name": ..., "arguments": ...}`` whose name is an offered
function (the named one, for a named choice) and whose arguments satisfy that function's JSON-schema
``parameters``, the literal that closes it. That is the Hermes/Qwen form (``<tool_call>{...}</tool_call>``) that
ChatML-style templates render; a response template that writes calls otherwise (the name in the opening tag,
XML arguments) cannot be forced, and such a request is a 400 naming ``tool_choice``.

The JSON is written compactly with OpenAI's (and Jinja's ``tojson``) separators, ``", "`` and ``": "``, so that a
template that renders calls with ``tojson`` renders the call back as it was generated, and the memo gives its
exact ids back (`conversation.ReplyMemo`). The whitespace around the JSON and between calls is the chat
template's own (`call_layout` renders a probe call once): Qwen's templates write ``<tool_call>\n{...}\n</tool_call>``,
and a call generated without those newlines would be rendered back otherwise, ending reuse at the call. A named
choice forces one call; ``"required"`` forces one, then allows more, unless ``parallel_tool_calls`` is false.

A forced turn ends after its calls (`ForcedCalls`): with several allowed, the model may end after any call, and
the turn ends for it after a call that repeats an earlier one of the same reply exactly (that repeat is not
returned: a model that writes the same call again is looping, as small models do when told to call a tool) or
after `MAX_FORCED_CALLS` calls.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Callable

import torch
from transformers import LogitsProcessor

from .structured import GrammarError, GrammarProcessor, Grammars
from .tools import JsonText

MAX_FORCED_CALLS = 8  # calls of one forced reply at most (parallel calls; OpenAI's models rarely make more)

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


@dataclass(frozen=True)
class CallLayout:
    """The text around a call's JSON and between two calls, as the chat template renders them.

    Example:
        >>> CallLayout("<tool_call>\\n", "\\n</tool_call>").between
        '\\n'
    """

    opening: str  # the opening tag and what follows it before the JSON
    closing: str  # what precedes the closing tag after the JSON, and the tag
    between: str = "\n"  # between one call's closing and the next one's opening


_PROBE_CALLS = ({"name": "probe_first", "arguments": {"a": 1}}, {"name": "probe_second", "arguments": {"b": 2}})


def call_layout(render: Callable[[list[dict], list[dict]], str], tags: tuple[str, str]) -> CallLayout:
    """How the chat template writes calls around `tags`, read from `render(messages, tools)` (the template's
    text) of a conversation whose assistant message holds two probe calls. Only whitespace is taken from the
    template; anything else (a template that formats calls its own way, or fails) gives the bare tags and a
    newline between calls: forcing still works, and reuse ends at a call the template renders otherwise.

    Example:
        >>> qwen = lambda messages, tools: '<tool_call>\\n{"name": "probe_first", "arguments": {"a": 1}}\\n</tool_call>\\n' \\
        ...     '<tool_call>\\n{"name": "probe_second", "arguments": {"b": 2}}\\n</tool_call>'
        >>> call_layout(qwen, ("<tool_call>", "</tool_call>"))
        CallLayout(opening='<tool_call>\\n', closing='\\n</tool_call>', between='\\n')
    """
    bare = CallLayout(tags[0], tags[1])
    tools = [{"type": "function", "function": {"name": c["name"], "parameters": {"type": "object"}}}
             for c in _PROBE_CALLS]
    calls = [{"id": f"call_{i}", "type": "function", "function": dict(c)} for i, c in enumerate(_PROBE_CALLS)]
    messages = [{"role": "user", "content": "probe"}, {"role": "assistant", "content": "", "tool_calls": calls}]
    try:
        text = render(messages, tools)
    except Exception:  # noqa: BLE001 - a template that cannot render the probe: the bare tags
        return bare
    found = []
    for call in _PROBE_CALLS:
        body = text.find(json.dumps(call))
        start = text.rfind(tags[0], 0, body) if body >= 0 else -1
        end = text.find(tags[1], body + len(json.dumps(call))) if body >= 0 else -1
        if start < 0 or end < 0:
            return bare
        found.append((start, body, body + len(json.dumps(call)), end + len(tags[1])))
    (start, body, after, end), (start2, *_rest) = found
    opening, closing, between = text[start:body], text[after:end], text[end:start2]
    if (opening[len(tags[0]):].strip() or closing[:-len(tags[1])].strip() or between.strip() or not between
            or not opening.startswith(tags[0]) or not closing.endswith(tags[1])):
        return bare
    return CallLayout(opening, closing, between)


def forced_call_grammar(layout: CallLayout, tools: list[dict], names: list[str], several: bool) -> str:
    """The Lark grammar (llguidance's dialect) of a reply that is one call (`several`: one or more, joined by
    ``layout.between``) of a function among `names` (`tools` in the template form): each ``layout.opening``,
    ``{"name": <the name>, "arguments": <JSON satisfying its parameters>}``, ``layout.closing``.

    Each function's ``parameters`` is a JSON-schema root of its own (``%json``), so its ``$ref``s (``#/$defs/...``,
    pydantic's nested models, a recursive ``#``) resolve within it, as they do for the client; a parameters schema
    without a ``type`` is an object's (OpenAI's function parameters are objects: other types are refused earlier).

    Example:
        >>> print(forced_call_grammar(CallLayout("<c>", "</c>"), [{"type": "function", "function": {"name": "f"}}],
        ...                           ["f"], False))  # doctest: +NORMALIZE_WHITESPACE
        start: call
        call: "<c>" body "</c>"
        body: body_0
        body_0: "{\\"name\\": \\"f\\", \\"arguments\\": " args_0 "}"
        args_0: %json {"x-guidance": {"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "},
                       "type": "object", "properties": {}}
    """
    functions = [tool["function"] for tool in tools if tool["function"]["name"] in names]
    lines = [f"start: call ({json.dumps(layout.between)} call)*" if several else "start: call",
             f"call: {json.dumps(layout.opening)} body {json.dumps(layout.closing)}",
             "body: " + " | ".join(f"body_{i}" for i in range(len(functions)))]
    for i, function in enumerate(functions):
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        schema = {"x-guidance": _COMPACT, **{k: v for k, v in parameters.items() if k != "x-guidance"}}
        schema.setdefault("type", "object")
        head = '{"name": ' + json.dumps(function["name"]) + ', "arguments": '
        lines += [f"body_{i}: {json.dumps(head)} args_{i} {json.dumps('}')}", f"args_{i}: %json {json.dumps(schema)}"]
    return "\n".join(lines)


class ForcedCalls(LogitsProcessor):
    """A forced reply of several calls (`grammar`, laid out as `layout`), ended for the model after a call that
    repeats an earlier one exactly, or after `max_calls` calls: only the end of turn is allowed then (the grammar
    allows it after any call). It reads the reply's bytes as the grammar does (`Grammars.token_bytes`).

    Example:
        >>> processor = ForcedCalls(grammar, grammars, CallLayout("<c>", "</c>"))  # doctest: +SKIP
    """

    def __init__(self, grammar: GrammarProcessor, grammars: Grammars, layout: CallLayout,
                 max_calls: int = MAX_FORCED_CALLS):
        self.grammar, self.grammars, self.max_calls = grammar, grammars, max_calls
        self._parts = [p.encode() for p in (layout.opening, layout.closing, layout.between)]
        self._bytes = bytearray()
        self._at = 0  # where the scan of the reply's bytes stands
        self._state, self._need = "opening", len(self._parts[0])  # the part being read, its bytes still to come
        self._json = JsonText()
        self._body_at, self._body = 0, b""
        self.calls: list[bytes] = []  # each complete call's JSON
        self.repeated = False  # the reply ended on a repeat of an earlier call
        self._start: int | None = None
        self._consumed = 0

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores = self.grammar(input_ids, scores)
        if self._start is None:
            self._start = int(input_ids.shape[1])
        reply = input_ids[0, self._start:].tolist()
        for token in reply[self._consumed:]:
            self._bytes += self.grammars.token_bytes(token)
        self._consumed = len(reply)
        self._scan()
        if not self.repeated and len(self.calls) < self.max_calls:
            return scores
        ends = self.grammar.end_ids
        allowed = torch.full_like(scores, float("-inf"))
        allowed[:, ends] = scores[:, ends]
        return allowed

    def _scan(self) -> None:
        """Reads the new bytes: the grammar's parts (literals of known lengths) and each call's JSON."""
        while self._at < len(self._bytes) and not self.repeated:
            if self._state == "body":
                self._json.step(chr(self._bytes[self._at]))  # JSON's structure is ASCII: a byte is enough
                self._at += 1
                if self._json.done:
                    self._body = bytes(self._bytes[self._body_at:self._at])
                    self._state, self._need = "closing", len(self._parts[1])
                continue
            step = min(self._need, len(self._bytes) - self._at)
            self._at += step
            self._need -= step
            if self._need:
                return
            if self._state == "opening":
                self._state, self._json, self._body_at = "body", JsonText(), self._at
            elif self._state == "closing":  # a call is complete: the turn may end here (the grammar allows it)
                self.repeated = self._body in self.calls
                self.calls.append(self._body)
                self._state, self._need = "between", len(self._parts[2])
            else:
                self._state, self._need = "opening", len(self._parts[0])


def forced_call_processor(grammars: Grammars, template: dict, tools: list[dict], names: list[str],
                          several: bool, layout: Callable[[tuple[str, str]], CallLayout] | None = None
                          ) -> LogitsProcessor:
    """A processor that constrains a reply to calls of the functions `names` among `tools` (template form) in the
    format of `template` (a response template), laid out as `layout(tags)` says (default: the bare tags); with
    `several`, ended after a repeated call or `MAX_FORCED_CALLS` calls (`ForcedCalls`).

    Raises:
        ForcingUnsupported: The format cannot be forced (`call_tags`).
        GrammarError: A function's ``parameters`` are not a schema llguidance compiles.

    Example:
        >>> processor = forced_call_processor(engine.grammars, engine.response_template, tools, ["f"], False)  # doctest: +SKIP
    """
    tags = call_tags(template)
    laid_out = layout(tags) if layout else CallLayout(*tags)
    grammar = forced_call_grammar(laid_out, tools, names, several)
    if len(grammar) > grammars.max_chars:
        raise GrammarError(f"the tools' parameters have more than {grammars.max_chars} characters of JSON")
    processor = grammars.compile(grammar, lark=True)
    return ForcedCalls(processor, grammars, laid_out, MAX_FORCED_CALLS) if several else processor
