"""`RequestLimits`: the most one request may ask for, every size a client gives bounded in one place (a 400
naming the field over one).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...cache.fingerprint import salted_fingerprint
from ...store import MAX_SESSION_ID_BYTES
from .chat import ChatCompletionRequest
from .common import surrogate_at, tools_text_problem
from .completions import CompletionRequest

if TYPE_CHECKING:
    from ..pipeline import ChatPipeline

# Default request limits that do not come from the context window.
MAX_MESSAGES = 256  # rendering is per message (conversation.MessageTokens): 256 messages of 1 kB take ~0.7 s
MAX_STOP = 4  # OpenAI's limit
MAX_STOP_CHARS = 256  # transformers' stop-string tables cost ~0.4 s per 256 characters on a 49k vocabulary
MAX_LOGIT_BIAS = 300  # entries of `logit_bias` (OpenAI's limit)
MAX_TOOLS = 128  # OpenAI's limit
MAX_N = 8  # samples per request: each is a turn (a decoding slot and its KV)
CHARS_PER_WINDOW_TOKEN = 32  # the messages' text may be this many characters per token of the context window
BODY_BYTES_PER_CHAR = 12  # JSON's worst escape of one character (a surrogate pair "\ud83d\ude00")
BODY_OVERHEAD_BYTES = 1 << 20


@dataclass(frozen=True)
class RequestLimits:
    """The most one request may ask for: every size a client gives, in one place, checked before its turn is
    queued. Over one: a 400 naming the field (a body over :attr:`body_bytes`: a 413, before it is parsed).

    Attributes:
        max_tokens: The longest reply (``max_tokens`` / ``max_completion_tokens``): the pipeline's
            `max_reply_tokens`, i.e. the context window (without one, the model's ``max_position_embeddings``)
            less the ``keep_first`` tokens truncation keeps and one prompt token. ``None``: not bounded (a model
            that declares no position limit, served without a window).
        max_messages: Messages in one request.
        max_request_chars: Characters of all the messages' text together (default: 32 per token of the context
            window; conversations longer than the window are truncated, so clients may send more than it).
        max_stop: Stop strings (OpenAI's limit: 4).
        max_stop_chars: Characters of one stop string.
        max_session_id_bytes: Length of ``user`` / ``X-Session-ID`` (the store's limit for session ids).
        max_body_bytes: Bytes of the request body; default: 12 per character allowed (JSON's worst escape)
            plus 1 MiB.

    Example:
        >>> limits = RequestLimits(max_tokens=64, max_stop=1)
        >>> limits.check(ChatCompletionRequest.model_validate(
        ...     {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stop": ["a", "b"]}))
        ('stop', '`stop` has 2 strings; at most 1 are accepted')
    """

    max_tokens: int | None
    max_messages: int = MAX_MESSAGES
    max_request_chars: int = 262_144
    max_stop: int = MAX_STOP
    max_stop_chars: int = MAX_STOP_CHARS
    max_session_id_bytes: int = MAX_SESSION_ID_BYTES
    max_body_bytes: int | None = None
    vocab_size: int | None = None  # token ids `logit_bias` may name: [0, vocab_size)
    max_logit_bias: int = MAX_LOGIT_BIAS
    max_tools: int = MAX_TOOLS
    max_n: int = MAX_N

    def __post_init__(self):
        for name in ("max_messages", "max_request_chars", "max_stop", "max_stop_chars", "max_session_id_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"`{name}` must be a positive integer, got {value!r}")
        for name in ("max_tokens", "max_body_bytes"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"`{name}` must be a positive integer or None, got {value!r}")

    @classmethod
    def for_pipeline(cls, pipeline: "ChatPipeline", **overrides) -> "RequestLimits":
        """The limits of a server over `pipeline`: from its context window (or the model's positions), with
        `overrides` (any attribute) on top."""
        window = pipeline.truncation.context_window or pipeline.position_limit
        derived = {"max_tokens": pipeline.max_reply_tokens, "vocab_size": _vocab_size(pipeline.model)}
        if window:
            derived["max_request_chars"] = CHARS_PER_WINDOW_TOKEN * window
        return cls(**{**derived, **overrides})

    @property
    def body_bytes(self) -> int:
        """The largest request body accepted."""
        if self.max_body_bytes is not None:
            return self.max_body_bytes
        return BODY_BYTES_PER_CHAR * self.max_request_chars + BODY_OVERHEAD_BYTES

    def check(self, body: ChatCompletionRequest) -> tuple[str, str] | None:
        """The first size of `body` over a limit, as (field, what to do), or None."""
        asked = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        n = body.max_completion_tokens or body.max_tokens
        if n is not None and self.max_tokens is not None and n > self.max_tokens:
            return asked, (f"`{asked}` is {n}, but a reply must fit the context window beside the prompt: "
                           f"use at most {self.max_tokens}")
        if len(body.messages) > self.max_messages:
            return "messages", (f"the request has {len(body.messages)} messages; at most {self.max_messages} are "
                                "accepted: send fewer (older turns are truncated away by the server anyway)")
        if body.top_logprobs and not body.logprobs:
            return "top_logprobs", "`top_logprobs` needs `logprobs: true`"
        if body.n > self.max_n:
            return "n", f"`n` is {body.n}; at most {self.max_n} samples are accepted per request"
        if body.tools and len(body.tools) > self.max_tools:
            return "tools", f"the request has {len(body.tools)} tools; at most {self.max_tools} are accepted"
        problem = tools_text_problem(body.template_tools(), nested=True)
        if problem is not None:
            return problem
        tool_chars = chars = len(json.dumps(body.template_tools())) if body.tools else 0
        for i, message in enumerate(body.messages):
            text = message.text()
            bad = surrogate_at(text)
            if bad is not None:
                return "messages", (f"`messages[{i}].content` has a lone surrogate at {bad}: send valid Unicode "
                                    "text")
            chars += message.size()
        if chars > self.max_request_chars:
            if tool_chars:  # the tools' definitions are rendered into the prompt too: name what is larger
                field = "tools" if tool_chars >= chars - tool_chars else "messages"
                return field, (f"the messages and tools have {chars} characters together ({tool_chars} in the tools' "
                               f"definitions); at most {self.max_request_chars} are accepted: shorten them or send "
                               "fewer")
            return "messages", (f"the messages have {chars} characters together; at most {self.max_request_chars} "
                                "are accepted: shorten them or send fewer")
        stops = body.stops()
        if len(stops) > self.max_stop:
            return "stop", f"`stop` has {len(stops)} strings; at most {self.max_stop} are accepted"
        for stop in stops:
            if not stop:
                return "stop", "`stop` strings must not be empty (an empty one would end every reply at once)"
            if len(stop) > self.max_stop_chars:
                return "stop", (f"a `stop` string has {len(stop)} characters; at most {self.max_stop_chars} "
                                "characters are accepted")
            if surrogate_at(stop) is not None:
                return "stop", "`stop` strings must be valid Unicode text: one has a lone surrogate"
        for field in ("prompt_cache_key", "user"):
            value = getattr(body, field)
            problem = self.session_id_problem(value, field) if value else None
            if problem is not None:
                return field, problem
        if body.logit_bias:
            problem = self.logit_bias_problem(body.logit_bias)
            if problem is not None:
                return "logit_bias", problem
        if body.cache_salt is not None:
            try:
                salted_fingerprint("", body.cache_salt)
            except ValueError as exc:
                return "cache_salt", str(exc)
        return None

    def check_completion(self, body: CompletionRequest) -> tuple[str, str] | None:
        """The first size of a completions request over a limit (those it shares with chat requests), as (field,
        what to do), or None. Its prompt is checked when it is read (`CompletionsServing`)."""
        if body.max_tokens is not None and self.max_tokens is not None and body.max_tokens > self.max_tokens:
            return "max_tokens", f"`max_tokens` is {body.max_tokens}; use at most {self.max_tokens}"
        stops = body.stops()
        if len(stops) > self.max_stop or any(not s or len(s) > self.max_stop_chars or surrogate_at(s) is not None
                                             for s in stops):
            return "stop", (f"`stop` takes at most {self.max_stop} strings, each of 1 to {self.max_stop_chars} "
                            "characters of valid Unicode")
        if body.logit_bias:
            problem = self.logit_bias_problem(body.logit_bias)
            if problem is not None:
                return "logit_bias", problem
        return None

    def logit_bias_problem(self, bias: dict) -> str | None:
        """Why a `logit_bias` is refused (OpenAI's rules: token ids as keys, biases in [-100, 100]), or None."""
        if len(bias) > self.max_logit_bias:
            return f"`logit_bias` has {len(bias)} entries; at most {self.max_logit_bias} are accepted"
        for key, value in bias.items():
            if not (key.isascii() and key.isdigit()) or (self.vocab_size is not None and int(key) >= self.vocab_size):
                limit = f" below {self.vocab_size}" if self.vocab_size is not None else ""
                return f"`logit_bias` keys must be token ids (integers from 0{limit}), got {key[:50]!r}"
            if not -100 <= value <= 100:
                return f"`logit_bias` values must be between -100 and 100, got {value} for token {key}"
        return None

    def session_id_problem(self, value: str, name: str) -> str | None:
        """Why `value`, a client's session id given as `name` (``user`` or ``X-Session-ID``), is refused, or None.

        A session id is echoed in the ``X-Session-ID`` response header, so it must be something a header
        carries back unchanged: printable ASCII (space to ``~``), not starting or ending with a space, at most
        `max_session_id_bytes` long. Longer or other ids: send a hash of them."""
        for i, ch in enumerate(value):
            if " " <= ch <= "~":
                continue
            if "\ud800" <= ch <= "\udfff":
                what = f"a lone surrogate (U+{ord(ch):04X})"
            elif ch < " " or ch == "\x7f":
                what = f"the control character U+{ord(ch):04X}"
            else:
                what = f"the non-ASCII character U+{ord(ch):04X}"
            return (f"`{name}` must be printable ASCII (it names the session and is echoed in the X-Session-ID "
                    f"header), but it has {what} at {i}: send a hash of the id")
        if len(value) > self.max_session_id_bytes:
            return (f"`{name}` is {len(value)} characters long; at most {self.max_session_id_bytes} are accepted: "
                    "send a shorter id (e.g. a hash of it)")
        if value != value.strip(" "):
            return f"`{name}` must not start or end with a space (HTTP strips them from the X-Session-ID header)"
        return None


def _vocab_size(model) -> int | None:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    size = getattr(config, "vocab_size", None)
    return size if isinstance(size, int) and size > 0 else None
