"""Tool calls in replies: found with transformers' response parsing, whole or as the reply streams.

A reply is parsed with the model's response template (the tokenizer's ``response_template``, else the family
template `transformers serve` uses, else one given to ``attnstore serve --response-template``): the text between
its tool-call delimiters becomes OpenAI ``tool_calls``, the rest the message's content. What the parser cannot
take (a call whose JSON is broken, a function that was not offered, a malformed call) stays in the content,
as text, with a warning: a client is never handed a call it did not offer, and nothing the model wrote is lost.

Streamed, a call comes as OpenAI streams it (:class:`CallPiece`): its id and name once the name is written, then
its arguments as the model writes them, then the whole call when it closes. The arguments returned are the JSON
text the model wrote (as OpenAI returns them), so the streamed pieces add up to them exactly.

A reply with tool calls is remembered by :class:`~hf_attnstore.serving.conversation.ReplyMemo` under
:func:`call_key` (its content and calls, without the call ids the server made up), so that when the client sends
the assistant message back its generated ids are reused exactly, whenever the chat template renders the calls as
the model wrote them.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from dataclasses import dataclass

from .protocol import FunctionCall, ToolCallOut

logger = logging.getLogger(__name__)
# The start of a call's JSON as templates write it: its name, then the arguments' object (streamed as written).
_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGUMENTS = re.compile(r'\s*\{\s*"name"\s*:\s*"(?:[^"\\]|\\.)*"\s*,\s*"arguments"\s*:\s*(?=\{)')


@dataclass
class CallPiece:
    """A piece of a streamed tool call: the first has its `id` and `name`; later ones add `arguments` text; the
    last has the whole call (`done`), whose arguments the pieces' add up to.

    Example:
        >>> CallPiece(0, id="call_1", name="f").arguments
        ''
    """

    index: int  # the call's place among the reply's calls
    id: str | None = None
    name: str | None = None
    arguments: str = ""
    done: ToolCallOut | None = None


@dataclass
class _OpenCall:
    """A call being written: its raw JSON so far, and what of it was given out."""

    index: int
    id: str
    dropped: bool  # a later call with parallel_tool_calls=false: never given out
    raw: str = ""
    started: bool = False  # its id and name were given out
    arguments_at: int | None = None  # where its arguments' object starts in `raw`
    sent: str = ""  # the arguments' text given out


def call_key(content: str, calls: list[tuple[str, dict]]) -> str:
    """The memo key of an assistant message with tool calls: its content and its calls (name, parsed
    arguments), canonical JSON, so the arguments' spacing and key order do not matter.

    Example:
        >>> call_key("", [("f", {"b": 1, "a": 2})]) == call_key("", [("f", {"a": 2, "b": 1})])
        True
    """
    return "\x00tool-calls\x00" + json.dumps([content, [[name, args] for name, args in calls]], sort_keys=True)


def message_call_key(message: dict) -> str | None:
    """:func:`call_key` of a template message (`ChatMessage.as_template_message`), or None without calls.

    Example:
        >>> message_call_key({"role": "assistant", "content": ""}) is None
        True
    """
    calls = message.get("tool_calls")
    if not calls:
        return None
    return call_key(message.get("content") or "", [(c["function"]["name"], c["function"]["arguments"])
                                                   for c in calls])


class ReplyParser:
    """Parses one reply into content and tool calls, fed its text (special tokens included: templates close
    regions on them) as it is generated.

    Args:
        tokenizer: The model's tokenizer (`get_response_parser` is transformers' public API).
        template: The response template.
        prompt_text: The prompt, decoded: templates that open the reply in the prompt need it.
        tools: The offered tools (template form); a call to any other function stays content.
        parallel: ``False``: only the first call is returned (OpenAI's ``parallel_tool_calls=false``); later
            ones are dropped, with a warning.

    Example:
        >>> parser = ReplyParser(tok, template, prompt, tools)  # doctest: +SKIP
        >>> content, calls = parser.feed(text)  # doctest: +SKIP
        >>> content, calls = parser.finish()  # doctest: +SKIP
    """

    def __init__(self, tokenizer, template: dict, prompt_text: str, tools: list[dict], parallel: bool = True):
        self._parser = tokenizer.get_response_parser(template, prefix=prompt_text, tools=tools)
        self._names = {tool["function"]["name"] for tool in tools}
        # The reply is fed with its special tokens (templates close regions on them); content never shows them,
        # as a reply without tools skips them.
        self._specials = [t for t in tokenizer.all_special_tokens if t]
        self._parallel = parallel
        self._since_call = ""  # text fed since the last call was given out
        self._content_since_call = ""  # the content given out since then
        self.failed = False  # the parser gave up: the rest of the reply is content
        self.content = ""  # all the content so far
        self.calls: list[ToolCallOut] = []  # all the calls so far
        self._open: _OpenCall | None = None  # the call being written

    def feed(self, text: str) -> tuple[str, list[CallPiece]]:
        """New content, and the pieces of calls (:class:`CallPiece`), after `text`."""
        if self.failed:
            return self._emit(text, [])
        self._since_call += text
        try:
            events = self._parser.feed(text)
        except (ValueError, TypeError, KeyError) as exc:
            return self._fail(exc)
        return self._take(events)

    def finish(self) -> tuple[str, list[CallPiece]]:
        """The content and the pieces of calls the end of the reply completes."""
        if self.failed:
            return "", []
        try:
            _, events = self._parser.finalize()
        except (ValueError, TypeError, KeyError, RuntimeError) as exc:
            return self._fail(exc)
        content, pieces = self._take(events)
        if content.strip() == "" and not self.content.strip() and self.calls:
            return "", pieces  # only whitespace around the calls: no content, as OpenAI returns
        return content, pieces

    def _take(self, events: list[dict]) -> tuple[str, list[CallPiece]]:
        content, calls, pieces = "", [], []
        for event in events:
            field = event.get("field")
            if event["type"] == "region_chunk" and field == "content" and not event.get("dirty"):
                content += event.get("text") or ""
                self._content_since_call += event.get("text") or ""
            elif event["type"] == "region_open" and field == "tool_calls":
                given = len(self.calls) + len(calls)
                self._open = _OpenCall(given, f"call_{uuid.uuid4().hex[:24]}", dropped=not self._parallel and given > 0)
            elif event["type"] == "region_chunk" and field == "tool_calls" and self._open is not None:
                self._open.raw += event.get("text") or ""
                pieces += self._advance(self._open)
            elif event["type"] == "region_close" and field == "tool_calls":
                opened = self._open or _OpenCall(len(self.calls) + len(calls), f"call_{uuid.uuid4().hex[:24]}",
                                                 dropped=not self._parallel and bool(self.calls or calls))
                self._open = None
                call = self._call(event.get("value"), opened.id)
                if call is None:
                    content, _ = self._fail(ValueError("not a call to an offered function: "
                                                       f"{str(event.get('value'))[:200]}"), content, calls)
                    return content, pieces
                if opened.dropped:
                    logger.warning("a reply made several tool calls with parallel_tool_calls=false: only the first "
                                   "is returned")
                else:
                    calls.append(call)
                    pieces += self._close(opened, call)
                self._since_call, self._content_since_call = "", ""
        content, _ = self._emit(content, calls)
        return content, pieces

    def _advance(self, call: _OpenCall) -> list[CallPiece]:
        """The pieces a call's new text gives: its id and name once the name is written (and offered), then its
        arguments' text, all but the closing braces and spaces at its end (some may close the call's object)."""
        if call.dropped:
            return []
        out = []
        if not call.started:
            found = _NAME.match(call.raw)
            try:
                name = json.loads(f'"{found.group(1)}"') if found else None
            except ValueError:
                name = None
            if name not in self._names:
                return []  # not written yet, or not offered: the call's close decides
            call.started = True
            out.append(CallPiece(call.index, id=call.id, name=name))
        if call.arguments_at is None:
            found = _ARGUMENTS.match(call.raw)
            if found is None:
                return out
            call.arguments_at = found.end()
        safe = call.raw[call.arguments_at:].rstrip("} \t\r\n")
        if len(safe) > len(call.sent):
            out.append(CallPiece(call.index, arguments=safe[len(call.sent):]))
            call.sent = safe
        return out

    def _close(self, opened: _OpenCall, call: ToolCallOut) -> list[CallPiece]:
        """The last pieces of a call that closed: its arguments as the model wrote them when they are the
        arguments parsed (else as JSON, with a warning when pieces of other text were given out)."""
        if opened.arguments_at is not None:
            written = opened.raw[opened.arguments_at:].rstrip()
            written = written[:-1].rstrip() if written.endswith("}") else written
            try:
                same = json.loads(written) == json.loads(call.function.arguments)
            except ValueError:
                same = False
            if same:
                call.function.arguments = written
        out = [] if opened.started else [CallPiece(opened.index, id=call.id, name=call.function.name)]
        rest = call.function.arguments
        if opened.sent and not rest.startswith(opened.sent):
            logger.warning("a streamed tool call's arguments were not the text it was written as: the pieces "
                           "given out do not add up to them")
        elif len(rest) > len(opened.sent):
            out.append(CallPiece(opened.index, arguments=rest[len(opened.sent):]))
        out.append(CallPiece(opened.index, done=call))
        return out

    def _call(self, value, call_id: str) -> ToolCallOut | None:
        function = value.get("function") if isinstance(value, dict) else None
        if not isinstance(function, dict):
            return None
        name, arguments = function.get("name"), function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if name not in self._names or not isinstance(arguments, dict):
            return None
        return ToolCallOut(id=call_id, function=FunctionCall(name=name, arguments=json.dumps(arguments)))

    def _fail(self, exc: Exception, content: str = "", calls: list | None = None) -> tuple[str, list[CallPiece]]:
        """The parser could not take the reply: the text it had not given out yet (from where the content given
        since the last call ends), and all that follows, is content."""
        logger.warning("a tool call in the reply could not be parsed (%s): it is returned as text", exc)
        self.failed = True
        given = self._content_since_call
        at = self._since_call.rfind(given) if given else 0
        rest = self._since_call[at + len(given):] if at >= 0 else self._since_call
        return self._emit(content + rest, calls or [])[0], []

    def _emit(self, content: str, calls: list[ToolCallOut]) -> tuple[str, list[ToolCallOut]]:
        for special in self._specials:
            content = content.replace(special, "")
        self.content += content
        self.calls += calls
        return content, calls

    @property
    def message_content(self) -> str | None:
        """The message's content as returned: None for a reply that is only calls (whitespace around them)."""
        return None if self.calls and not self.content.strip() else self.content

    def arguments_of(self) -> list[tuple[str, dict]]:
        """The calls as (name, parsed arguments), for :func:`call_key`."""
        return [(call.function.name, json.loads(call.function.arguments)) for call in self.calls]
