"""Tool calls in replies: found with transformers' response parsing, whole or as the reply streams.

A reply is parsed with the model's response template (the tokenizer's ``response_template``, else the family
template `transformers serve` uses, else one given to ``attnstore serve --response-template``): the text between
its tool-call delimiters becomes OpenAI ``tool_calls``, the rest the message's content. What the parser cannot
take (a call whose JSON is broken, a function that was not offered, a malformed call) stays in the content,
as text, with a warning: a client is never handed a call it did not offer, and nothing the model wrote is lost.

A reply with tool calls is remembered by :class:`~hf_attnstore.serving.conversation.ReplyMemo` under
:func:`call_key` (its content and calls, without the call ids the server made up), so that when the client sends
the assistant message back its generated ids are reused exactly, whenever the chat template renders the calls as
the model wrote them.
"""

from __future__ import annotations

import json
import logging
import uuid

from .protocol import FunctionCall, ToolCallOut

logger = logging.getLogger(__name__)


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

    def feed(self, text: str) -> tuple[str, list[ToolCallOut]]:
        """New content and new calls after `text`."""
        if self.failed:
            return self._emit(text, [])
        self._since_call += text
        try:
            events = self._parser.feed(text)
        except (ValueError, TypeError, KeyError) as exc:
            return self._fail(exc)
        return self._take(events)

    def finish(self) -> tuple[str, list[ToolCallOut]]:
        """The content and calls the end of the reply completes."""
        if self.failed:
            return "", []
        try:
            _, events = self._parser.finalize()
        except (ValueError, TypeError, KeyError, RuntimeError) as exc:
            return self._fail(exc)
        content, calls = self._take(events)
        if content.strip() == "" and not self.content.strip() and self.calls:
            return "", calls  # only whitespace around the calls: no content, as OpenAI returns
        return content, calls

    def _take(self, events: list[dict]) -> tuple[str, list[ToolCallOut]]:
        content, calls = "", []
        for event in events:
            field = event.get("field")
            if event["type"] == "region_chunk" and field == "content" and not event.get("dirty"):
                content += event.get("text") or ""
                self._content_since_call += event.get("text") or ""
            elif event["type"] == "region_close" and field == "tool_calls":
                call = self._call(event.get("value"))
                if call is None:
                    return self._fail(ValueError(f"not a call to an offered function: {str(event.get('value'))[:200]}"),
                                      content, calls)
                if self._parallel or not (self.calls or calls):
                    calls.append(call)
                else:
                    logger.warning("a reply made several tool calls with parallel_tool_calls=false: only the first "
                                   "is returned")
                self._since_call, self._content_since_call = "", ""
        return self._emit(content, calls)

    def _call(self, value) -> ToolCallOut | None:
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
        return ToolCallOut(id=f"call_{uuid.uuid4().hex[:24]}",
                           function=FunctionCall(name=name, arguments=json.dumps(arguments)))

    def _fail(self, exc: Exception, content: str = "", calls: list | None = None) -> tuple[str, list[ToolCallOut]]:
        """The parser could not take the reply: the text it had not given out yet (from where the content given
        since the last call ends), and all that follows, is content."""
        logger.warning("a tool call in the reply could not be parsed (%s): it is returned as text", exc)
        self.failed = True
        given = self._content_since_call
        at = self._since_call.rfind(given) if given else 0
        rest = self._since_call[at + len(given):] if at >= 0 else self._since_call
        return self._emit(content + rest, calls or [])

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
