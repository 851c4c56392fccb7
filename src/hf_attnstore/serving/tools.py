"""Tool calls in replies: found with transformers' response parsing, whole or as the reply streams.

A reply is parsed with the model's response template (the tokenizer's ``response_template``, else the family
template `transformers serve` uses, else one given to ``attnstore serve --response-template``): the text between
its tool-call delimiters becomes OpenAI ``tool_calls``, the rest the message's content. What the parser cannot
take (a call whose JSON is broken, a function that was not offered, a malformed call) stays in the content,
as text, with a warning: a client is never handed a call it did not offer, and nothing the model wrote is lost.

Streamed, a call comes as OpenAI streams it (:class:`CallPiece`): its id and name once the name is written, then
its arguments as the model writes them, then the whole call when it closes. The arguments returned are the JSON
text the model wrote (as OpenAI returns them), so the streamed pieces add up to them exactly.

JSON-aware: the response template closes a call at the first closing tag it sees (`</tool_call>`), and a string
argument may hold that text (HTML, XML, code). While a call is open, the parser reads its JSON as it is fed
(:class:`JsonText`), and a closing tag inside a JSON string is fed to the template's parser escaped as JSON allows
(``\u003c/tool_call>``, the same string once parsed), so it never ends the call; the arguments given out are the
text the model wrote.

Formats by name (``attnstore serve --tool-call-parser NAME``, vLLM's flag): a response template built for the served
chat template (`named_template`: where the reply starts, its generation prompt, and what ends it, its end of turn,
are read from it and the tokenizer), so one name serves every model that writes calls so. ``hermes`` is
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, the format of Hermes, Qwen 2.5 and the ChatML templates
that render tools (vLLM's parser of the same name reads it); a chat template that renders calls so is recognised
(`recognise`) and needs no flag.

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
from typing import Callable

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


class JsonText:
    """Where a JSON text stands as it is fed: inside a string or not, and how deeply nested, so that a tag in
    a string is told from one after the JSON ends.

    A raw control character (a newline) cannot be inside a JSON string: a string "ends" there, so a broken free
    call is not read as one long string to its reply's end.

    Example:
        >>> text = JsonText()
        >>> text.feed('{"a": "</b')
        >>> text.in_string, text.depth
        (True, 1)
        >>> text.feed('"}')
        >>> text.in_string, text.done
        (False, True)
    """

    __slots__ = ("in_string", "escaped", "depth", "started")

    def __init__(self):
        self.in_string = self.escaped = self.started = False
        self.depth = 0

    def step(self, ch: str) -> None:
        """Takes one character."""
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"' or ch < " ":
                self.in_string = False
        elif ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
            self.started = True
        elif ch in "}]":
            self.depth -= 1

    def feed(self, text: str) -> None:
        """Takes `text`, character by character."""
        for ch in text:
            self.step(ch)

    @property
    def done(self) -> bool:
        """Whether a JSON value was opened and has closed."""
        return self.started and self.depth <= 0 and not self.in_string


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
        tags: The literal tags a call's JSON object stands between (`forced.call_tags`), when the template writes
            calls so: the parser is then JSON-aware (see the module's docstring). None: the text is fed as is.
        drop_repeats: A call whose text repeats an earlier call of the reply exactly is dropped (a forced reply
            ends after such a call: `forced.ForcedCalls`); its pieces are held back while it could be one.

    Example:
        >>> parser = ReplyParser(tok, template, prompt, tools)  # doctest: +SKIP
        >>> content, calls = parser.feed(text)  # doctest: +SKIP
        >>> content, calls = parser.finish()  # doctest: +SKIP
    """

    def __init__(self, tokenizer, template: dict, prompt_text: str, tools: list[dict], parallel: bool = True,
                 tags: tuple[str, str] | None = None, drop_repeats: bool = False):
        self._parser = tokenizer.get_response_parser(template, prefix=prompt_text, tools=tools)
        self._tags = tags
        # A closing tag inside a JSON string, as it is fed to the template's parser: its first character escaped.
        self._escaped = None if tags is None else f"\\u{ord(tags[1][0]):04x}" + tags[1][1:]
        self._in_call = False  # the template's parser has a call open (its events say so)
        self._json = JsonText()  # the open call's text, as the template's parser took it
        self._held = ""  # text inside a string that may be the start of a closing tag: fed once it is known
        self._tail = ""  # the end of the text fed so far (an opening tag's length)
        self._after_opening = False  # that text ends with an opening tag the parser has not taken yet
        self._drop_repeats = drop_repeats
        self._raws: list[str] = []  # the text of each call closed so far
        self._fed = ""  # all the text fed
        self._ended = False  # the reply ended at a repeated call: what follows is not read
        self._cut_call = False  # the reply was cut in a call
        self.kept_text: str | None = None  # the reply's text up to its last returned call, when a repeat followed
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
        if self._ended:
            return "", []
        if self.failed:
            return self._emit(text, [])
        self._since_call += text
        self._fed += text
        try:
            events = self._parser.feed(text) if self._tags is None else self._feed_json_aware(text)
        except (ValueError, TypeError, KeyError) as exc:
            return self._fail(exc)
        return self._take(events)

    def _feed_json_aware(self, text: str) -> list[dict]:
        """Feeds `text` to the template's parser in segments, each one's events read before the next is cut:
        outside a call, up to the end of each opening tag (a call may open there); inside one, up to the end of
        its JSON or to a closing tag inside a string, which is fed escaped."""
        opening, closing = self._tags
        text, self._held = self._held + text, ""
        events: list[dict] = []
        i = 0
        while i < len(text):
            if self._in_call:
                segment, i = self._call_segment(text, i, closing)
            else:
                # Up to the end of the next opening tag: a call may open there. A pattern that opens the call
                # (`\s*<tool_call>`) commits one character later, when it can no longer grow: that character
                # is fed alone, so what follows it is read inside the call.
                at = i if self._after_opening else text.find(opening[-1], i)
                end = len(text) if at < 0 else at + 1
                segment, i = text[i:end], end
            self._observe(new := self._parser.feed(segment))
            events += new
            self._tail = (self._tail + segment)[-len(opening):]
            self._after_opening = not self._in_call and self._tail.endswith(opening)
        return events

    def _call_segment(self, text: str, i: int, closing: str) -> tuple[str, int]:
        """The next segment of an open call's text from `i`, and where the one after starts (the rest of `text`
        may be held)."""
        state = JsonText()
        state.in_string, state.escaped, state.depth, state.started = \
            self._json.in_string, self._json.escaped, self._json.depth, self._json.started
        for j in range(i, len(text)):
            ch = text[j]
            if state.in_string and not state.escaped and ch == closing[0]:
                if text.startswith(closing, j):
                    return text[i:j] + self._escaped, j + len(closing)
                if closing.startswith(text[j:]):  # maybe a closing tag: known with the next text
                    self._held = text[j:]
                    return text[i:j], len(text)
            state.step(ch)
            if state.done:
                return text[i:j + 1], j + 1  # the JSON ended: what follows may close the call
        return text[i:], len(text)

    def _observe(self, events: list[dict]) -> None:
        """Follows whether a call is open, and its JSON, from the template's parser's events."""
        for event in events:
            if event.get("field") != "tool_calls":
                continue
            if event["type"] == "region_open":
                self._in_call, self._json = True, JsonText()
            elif event["type"] == "region_chunk":
                self._json.feed(event.get("text") or "")
            elif event["type"] == "region_close":
                self._in_call = False

    def _unescaped(self, raw: str) -> str:
        """A call's text as the model wrote it (the closing tags in its strings as they were)."""
        return raw if self._escaped is None else raw.replace(self._escaped, self._tags[1])

    def finish(self, cut: bool = False) -> tuple[str, list[CallPiece]]:
        """The content and the pieces of calls the end of the reply completes. `cut`: the reply was cut (its
        token limit): a call it was cut in is dropped (its complete calls stay calls), not returned as text."""
        if self.failed or self._ended:
            return "", []
        if cut and self._open is not None:
            logger.info("the reply was cut by its token limit in tool call %d: its %d complete call(s) are "
                        "returned, the cut one is dropped", self._open.index + 1, len(self.calls))
            self._open, self._cut_call = None, True
            return "", []
        held, self._held = self._held, ""
        try:
            events = self._parser.feed(held) if held else []
            _, final = self._parser.finalize()
            events += final
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
                self._open.raw += self._unescaped(event.get("text") or "")
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
                if self._drop_repeats and opened.raw in self._raws:
                    # The turn ends after it (forced.ForcedCalls): the reply is the calls before it.
                    logger.info("a forced reply repeated its call %d as call %d: the turn ended there, the repeat "
                                "is not returned", self._raws.index(opened.raw) + 1, len(self._raws) + 1)
                    at = self._fed.rfind(self._tags[0] + opened.raw) if self._tags is not None else -1
                    self.kept_text = self._fed[:at].rstrip() if at >= 0 else None
                    self._ended = True  # nothing after the repeat is read
                    break
                self._raws.append(opened.raw)
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
        if call.dropped or (self._drop_repeats and not call.started and
                            any(raw.startswith(call.raw) for raw in self._raws)):
            return []  # dropped, or maybe a repeat (dropped then): nothing is given out yet
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
        """The message's content as returned: None for a reply that is only calls (whitespace around them), the
        one it was cut in included."""
        return None if (self.calls or self._cut_call) and not self.content.strip() else self.content

    def arguments_of(self) -> list[tuple[str, dict]]:
        """The calls as (name, parsed arguments), for :func:`call_key`."""
        return [(call.function.name, json.loads(call.function.arguments)) for call in self.calls]


# -- formats by name ---------------------------------------------------------------------------------------
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
