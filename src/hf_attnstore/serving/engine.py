"""The engine behind the HTTP handlers: admission, sessions, and the pipeline that runs the turns.

Handlers never run the model: they turn a request into a :class:`RequestTurn` (token ids and the session it
continues), submit it, and await the result; queueing, serialization of a session's turns, cancellation and
back-pressure live here and in the pipeline (one place, as in vLLM's AsyncLLM).

Sessions. An explicit id (the ``X-Session-ID`` header, or the session a Responses chain continues) names the
session. A key that several conversations may share (OpenAI's ``prompt_cache_key``, else ``user``) names the
session of the first conversation under it and is followed by that conversation only (`ChatEngine._place`).
Without either, the :class:`SessionIndex` finds the session whose conversation the request continues (its whole stored
conversation is a prefix of the request's), and a request that continues none starts a new session. A new
session still reuses the longest prefix any stored session shares with it (the store's prefix sharing): a
shared system prompt, a regenerated reply (the same messages again), an edited last message. It never
continues another conversation beyond their common prefix: the store compares the ids. Everything here is
scoped by the request's ``cache_salt``: sessions of another salt are neither found nor reused. The index holds each session's ids as the *client* will send them
next (prompt and reply), next to the ids the *model* saw: they differ once the context window truncated the
conversation, and the next turn then continues the model's ids (what the store holds) with the client's new
tokens.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import uuid
from concurrent.futures import Future
from dataclasses import dataclass

from ..cache import upstream
from ..cache.fingerprint import salted_fingerprint
from .pipeline import ChatPipeline, Reply
from .conversation import MessageTokens, ReplyMemo, SessionIndex
from .forced import CallLayout, ForcingUnsupported, call_layout, call_tags
from .shared_state import SharedState
from .structured import Grammars
from .tools import ReplyParser, call_key, named_template, recognise

logger = logging.getLogger(__name__)


def _ids(value) -> list[int]:
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


class ToolsUnsupported(ValueError):
    """The model cannot take the request's tools (its chat template ignores them, or no response template
    parses its calls): a client error naming ``tools``.

    Example:
        >>> isinstance(ToolsUnsupported("no tools"), ValueError)
        True
    """


class Overloaded(Exception):
    """The engine holds `max_pending` requests already: the client should retry later (HTTP 429).

    Example:
        >>> engine.admit()  # raises Overloaded when `max_pending` requests are in  # doctest: +SKIP
    """


@dataclass(frozen=True)
class Remembered:
    """A reply as the memo knows it: its text as the template renders it, its generated ids (without the end of
    turn), and for a reply with tool calls its `tools.call_key`.

    Example:
        >>> Remembered("Hi!", [5, 6], None).ids
        [5, 6]
    """

    text: str
    ids: list[int]
    calls_key: str | None


@dataclass
class RequestTurn:
    """A request's turn: the session it continues and its prompt ids, as the client's messages give them and as
    the model is fed them.

    Example:
        >>> RequestTurn("s1", [1, 2], [1, 2], explicit=True).scope
        ''
    """

    session_id: str
    client_ids: list[int]  # the prompt as the client's messages give it
    model_ids: list[int]  # the prompt the model is fed (the store's ids, continued by the client's new ones)
    explicit: bool  # the client named the session
    cache_salt: str | None = None  # the request's KV scope (AttnStoreCache's `cache_salt`)

    @property
    def scope(self) -> str:
        """The session index's scope of the salt: a digest, so the index never holds the secret itself."""
        return salted_fingerprint("", self.cache_salt) if self.cache_salt is not None else ""


class ChatEngine:
    """Turns requests into pipeline turns and keeps the sessions' index.

    Args:
        pipeline: Runs the turns (its store holds the sessions' KV).
        max_pending: Requests admitted at once (running and queued); more are refused (`Overloaded`).
        session_block: Granularity of the session index's digests, in tokens.
        max_sessions: Conversations the index remembers (least recently used forgotten first).
        response_template: How to parse tool calls out of replies (transformers' response-template format);
            default: the tokenizer's, else the one `transformers serve` uses for the model's family
            (`upstream.response_template`), else that of the format the chat template writes calls in, when it is
            one we know (`tools.recognise`). Without one, requests with tools are refused.
        tool_call_parser: A format by name instead (`tools.TOOL_CALL_PARSERS`: ``"hermes"``), built for this
            chat template; one or the other of `response_template`.
        shared: The state replicas behind one load balancer share (`shared_state.SharedState`, in the Redis of
            the store's remote tier): where each session stands and the memo of generated replies, so that any
            replica continues a conversation another one served (found by its messages, or named). Default: this
            process's alone.

    Example:
        >>> engine = ChatEngine(ChatPipeline(model, tok, AttnStore("2GiB")), max_pending=64)  # doctest: +SKIP
        >>> turn = engine.prepare([{"role": "user", "content": "hi"}])  # doctest: +SKIP
    """

    def __init__(self, pipeline: ChatPipeline, *, max_pending: int = 64, session_block: int = 16,
                 max_sessions: int = 100_000, response_template: dict | None = None, shared: SharedState | None = None,
                 tool_call_parser: str | None = None):
        if max_pending < 1:
            raise ValueError(f"`max_pending` must be at least 1, got {max_pending}")
        if response_template is not None and tool_call_parser is not None:
            raise ValueError("give a response template or a tool-call parser, not both")
        self.pipeline = pipeline
        self.shared = shared
        self.tokens = MessageTokens(pipeline.tokenizer, ReplyMemo(max_sessions, shared))
        self.index = SessionIndex(session_block, max_sessions)
        self.max_pending = max_pending
        self._pending = 0
        self._lock = threading.Lock()
        self._special = set(pipeline.tokenizer.all_special_ids)
        self._grammars: Grammars | None = None
        self._layouts: dict[tuple[str, str], CallLayout] = {}
        self.response_template, source = self._template(response_template, tool_call_parser)
        logger.info("tool calls in replies are parsed with %s", source)
        if self.response_template is not None:
            try:  # a broken template is the server's configuration: refused now, not as every request's 400
                pipeline.tokenizer.get_response_parser(self.response_template, prefix="")
            except Exception as exc:  # noqa: BLE001 - transformers' message says what is wrong
                raise ValueError(f"the response template cannot parse replies: {exc}") from None

    def _template(self, given: dict | None, name: str | None) -> tuple[dict | None, str]:
        """The response template to parse replies with, and where it comes from (for the log)."""
        if given is not None:
            return given, "the response template given"
        tokenizer = self.pipeline.tokenizer
        if name is None:
            config = getattr(self.pipeline.model, "config", None)
            found = upstream.response_template(tokenizer, getattr(config, "model_type", None))
            if found is not None:
                return found, "the tokenizer's response template (or transformers serve's for its family)"
            name = recognise(self.tokens.render)
            if name is None:
                return None, "nothing: no response template is known, requests with tools are refused"
            how = f"the {name} format, recognised in the chat template"
        else:
            how = f"the {name} format (--tool-call-parser)"
        start = self.tokens.generation_prompt([{"role": "user", "content": "probe"}])
        ends = [tokenizer.decode(self.pipeline.chat_tokens.eot_ids[:1]), tokenizer.eos_token]
        ends = [end for end in ends if end and end.strip()]
        return named_template(name, start, ends), how

    # -- admission ------------------------------------------------------------------------------------
    def admit(self) -> None:
        """Reserves room for one request. Raises Overloaded when `max_pending` are in the engine."""
        with self._lock:
            if self._pending >= self.max_pending:
                raise Overloaded(f"the server holds {self._pending} requests (`--max-pending`): retry later")
            self._pending += 1

    def release(self) -> None:
        with self._lock:
            self._pending -= 1

    def pending(self) -> int:
        with self._lock:
            return self._pending

    # -- turns ------------------------------------------------------------------------------------------
    def prepare(self, messages: list[dict], session_id: str | None = None, cache_salt: str | None = None,
                tools: list[dict] | None = None, hint: str | None = None) -> RequestTurn:
        """The turn a request asks for: its prompt ids and its session (within `cache_salt`'s scope), rendered
        with `tools` (template form) when given. `hint` (with no `session_id`) is a key several conversations may
        share (OpenAI's `prompt_cache_key`, `user`): see :meth:`_place`.

        Raises:
            ToolsUnsupported: `tools` are given and the chat template ignores them.
            ValueError: The messages cannot be rendered, or the session id or salt is invalid.
        """
        turn = RequestTurn("", [], [], session_id is not None, cache_salt)
        scope = turn.scope  # a bad salt fails here, before anything is rendered
        if tools and not self.tokens.takes_tools(tools):
            raise ToolsUnsupported("this model's chat template does not render tools, so the model would never "
                                   "see them: serve it with a tool-capable template (attnstore serve "
                                   "--chat-template FILE) or send no tools")
        client = self.tokens.prompt_ids(messages, scope, tools)
        if not client:
            raise ValueError("the messages render to an empty prompt")
        return self._place(turn, client, session_id, hint)

    def prepare_ids(self, ids: list[int], session_id: str | None = None, cache_salt: str | None = None,
                    hint: str | None = None) -> RequestTurn:
        """The turn of a prompt given as token ids (completions): it continues the session that `session_id`
        names, else the stored session whose ids are the longest prefix of `ids`, else a new one."""
        if not ids:
            raise ValueError("the prompt is empty")
        turn = RequestTurn("", [], [], session_id is not None, cache_salt)
        turn.scope  # a bad salt fails here
        return self._place(turn, list(ids), session_id, hint)

    def _place(self, turn: RequestTurn, client: list[int], session_id: str | None,
               hint: str | None = None) -> RequestTurn:
        """`turn` with its session and the ids the model is fed for the client's `client` ids.

        A `hint` names a key that several conversations may share (OpenAI's `prompt_cache_key` is one per app or
        per user as often as one per conversation). It names the session of the first conversation under it, and
        that conversation keeps it: a request that continues the session's ids, or repeats a part of them (a
        retried or regenerated turn). Another conversation under the same key is placed as a request naming no
        session (the stored session it continues, else a new one), so the two never overwrite each other's KV
        turn after turn."""
        scope = turn.scope
        if session_id is None and hint:
            known = self._known(hint, scope)
            if known is None:
                session_id = hint
            else:
                ids, n = known[0], min(len(client), len(known[0]))
                if tuple(client[:n]) == tuple(ids[:n]):
                    session_id = hint
        if session_id is None:
            found = self.index.find(client, scope)
            if self.shared is not None:  # another replica may have served a longer part of it
                elsewhere = self.shared.find_session(scope, client, self.index.digests(client, scope),
                                                     self.index.block)
                if elsewhere is not None and (found is None or len(elsewhere[1]) > found[1]):
                    self.index.add(elsewhere[0], elsewhere[1], elsewhere[2], scope)
                    found = elsewhere[0], len(elsewhere[1])
            session_id = found[0] if found is not None else f"chat-{uuid.uuid4().hex}"
        model = client
        known = self._known(session_id, scope)
        if known is not None:
            ids, model_ids = known
            if tuple(client[: len(ids)]) == ids:
                model = list(model_ids) + client[len(ids):]
        turn.session_id, turn.client_ids, turn.model_ids = session_id, client, model
        return turn

    def submit(self, turn: RequestTurn, streamer=None, cancel: threading.Event | None = None, **options) -> Future:
        return self.pipeline.submit_prompt(turn.session_id, turn.model_ids, streamer, cancel=cancel,
                                           cache_salt=turn.cache_salt, **options)

    def _known(self, session_id: str, scope: str):
        """Where `session_id` stands: (client ids, model ids), from the shared state when there is one (another
        replica may have moved it on since this one last saw it), else this index's; None if neither knows it."""
        if self.shared is not None:
            known = self.shared.get_session(scope, session_id)
            if known is not None:
                if self.index.get(session_id, scope) != known:
                    self.index.add(session_id, known[0], known[1], scope)
                return known
        return self.index.get(session_id, scope)

    def _index(self, session_id: str, ids, model_ids, scope: str) -> None:
        self.index.add(session_id, ids, model_ids, scope)
        if self.shared is not None:
            self.shared.put_session(scope, session_id, ids, model_ids, self.index.digests(ids, scope)[-1])

    def session_ids(self, session_id: str, scope: str = "") -> tuple[list[int], list[int]] | None:
        """The ids the index holds for `session_id`: as the client sends them, and as the model saw them (they
        differ after truncation); None if it does not know the session."""
        known = self._known(session_id, scope)
        return None if known is None else (list(known[0]), list(known[1]))

    def restore_session(self, session_id: str, client_ids: list[int], model_ids: list[int], scope: str = "") -> None:
        """Tells the index where a session stands (a stored response's session after a restart), so the next
        turn continues the model's ids exactly as `finish` had recorded them."""
        self._index(session_id, client_ids, list(model_ids), scope)

    def session_point(self, session_id: str, scope: str = "") -> str | None:
        """A digest of where `session_id` stands (the ids the index holds for it), or None if the index does not
        know it: a stored response records it, and continues the session only while it still stands there."""
        known = self._known(session_id, scope)
        if known is None:
            return None
        return hashlib.blake2b(b"".join(int(t).to_bytes(8, "little", signed=True) for t in known[0]),
                               digest_size=16).hexdigest()

    @property
    def grammars(self) -> Grammars:
        """Structured output's grammar compiler for this model (built on first use)."""
        with self._lock:
            if self._grammars is None:
                chat = self.pipeline.chat_tokens
                ends = list(dict.fromkeys([*chat.eot_ids[:1], *_ids(self.pipeline.model.generation_config.eos_token_id)]))
                size = getattr(self.pipeline.model.config.get_text_config(), "vocab_size", None) or \
                    len(self.pipeline.tokenizer)
                self._grammars = Grammars(self.pipeline.tokenizer, ends, int(size))
            return self._grammars

    def call_layout(self, tags: tuple[str, str]) -> CallLayout:
        """How the chat template writes a tool call around `tags` and between calls (`forced.call_layout`: probed
        once), so that a forced call is generated as the template renders it back."""
        layout = self._layouts.get(tags)
        if layout is None:  # computing it twice in a race gives the same value
            layout = self._layouts[tags] = call_layout(self.tokens.render, tags)
        return layout

    def reply_parser(self, turn: RequestTurn, tools: list[dict], parallel: bool = True,
                     drop_repeats: bool = False) -> ReplyParser:
        """A parser of `turn`'s reply into content and tool calls (JSON-aware when the template's calls are a JSON
        object between two tags; `drop_repeats` for a forced reply of several calls: `tools.ReplyParser`).

        Raises:
            ToolsUnsupported: No response template is known for this model.
        """
        if self.response_template is None:
            raise ToolsUnsupported("this server knows no response template to parse this model's tool calls "
                                   "with (its tokenizer has none): start it with --response-template FILE, or "
                                   "send no tools")
        prompt = self.pipeline.tokenizer.decode(turn.model_ids)
        try:
            tags = call_tags(self.response_template)
        except ForcingUnsupported:  # calls written otherwise (XML arguments...): the template's parser alone
            tags = None
        return ReplyParser(self.pipeline.tokenizer, self.response_template, prompt, tools, parallel, tags,
                           drop_repeats)

    def finish(self, turn: RequestTurn, reply: Reply, parser: ReplyParser | None = None) -> Remembered | None:
        """Records a finished turn: the session's ids for the index, and the reply's exact ids for the memo
        (a reply with tool calls also under its calls, `tools.call_key`, as `parser` found them). Returns what
        the memo was given (None for a cancelled turn), which `remember` gives it again."""
        content = list(reply.generated_ids)
        while content and content[-1] in self._special:  # the end of turn: the template's closing adds it back
            content.pop()
        scope = turn.scope
        if reply.cancelled:  # the client never saw the whole reply and will not send it back
            self._index(turn.session_id, turn.client_ids, list(reply.prompt_ids), scope)
            return None
        if parser is not None and parser.kept_text is not None:
            # A forced reply that ended on a repeated call: the client is given the calls before it, and sends
            # those back; the memo's ids are theirs, so the repeat never enters the next prompt.
            content = self._prefix_of(content, parser.kept_text)
        if parser is not None and parser.calls:
            # As the template renders it: special tokens kept.
            remembered = Remembered(self.pipeline.tokenizer.decode(content), content,
                                    call_key(parser.message_content or "", parser.arguments_of()))
        else:
            remembered = Remembered(reply.text, content, None)
        self.remember(remembered, scope)
        self._index(turn.session_id, turn.client_ids + content, list(reply.prompt_ids) + content, scope)
        return remembered

    def _prefix_of(self, ids: list[int], text: str) -> list[int]:
        """The longest prefix of `ids` that decodes to `text` (all of `ids` when none does)."""
        decode = self.pipeline.tokenizer.decode
        for k in range(len(ids), -1, -1):
            decoded = decode(ids[:k])
            if decoded == text:
                return ids[:k]
            if len(decoded) < len(text):
                break
        return ids

    def remember(self, reply: Remembered, scope: str = "") -> None:
        """Gives the memo a reply's exact ids (again: a stored response's, after a restart)."""
        self.tokens.memo.add(reply.text, reply.ids, scope)
        if reply.calls_key is not None:
            self.tokens.memo.add_calls(reply.calls_key, reply.text, scope)

    @staticmethod
    def finish_reason(reply: Reply, max_new_tokens: int, parser: ReplyParser | None = None) -> str:
        """"length" for a reply cut at `max_new_tokens`, or earlier where the model's positions end (the
        pipeline's cut: `Reply.max_new_tokens`), calls or not (a reply cut in its third call must not pass for
        two complete ones, as OpenAI says); "tool_calls" for a reply whose calls `parser` found; "stop" for one
        that ended."""
        limit = min(max_new_tokens, reply.max_new_tokens) if reply.max_new_tokens else max_new_tokens
        if reply.generated_tokens >= limit:
            return "length"
        return "tool_calls" if parser is not None and parser.calls else "stop"
