"""The OpenAI chat-completions schema, as typed models (the subset this server implements).

Requests accept OpenAI's fields; fields this server does not implement are refused with a 400 naming them
when they would change the answer (``n > 1`` with ``stream``, a ``tool_choice`` that forces a call, a
``response_format`` other than text), honoured when implemented (``tools``, ``tool_choice`` "auto" and "none",
``parallel_tool_calls``, assistant ``tool_calls`` and ``tool`` messages, ``n`` (each sample a turn that reuses
the first one's prompt), ``logprobs`` and ``top_logprobs``, ``frequency_penalty``, ``presence_penalty``,
``logit_bias``, ``seed``, ``stop``, ``top_k``), and ignored only when they do not change the answer (OpenAI
clients send many optional fields: ``metadata``, ``store``, ``service_tier``...). Fields are typed as OpenAI types
them (`openai_schema.OpenAIRequest`): an explicit ``null`` is the field not given, and no value is coerced to
another type (a 400 naming the field); a ``tool_choice`` must name a tool the request offers. Every size a client
gives is bounded by :class:`RequestLimits` (from the context window and the server's configuration): over one, a
400 naming the field. Responses carry OpenAI's fields, ``usage.prompt_tokens_details.cached_tokens`` included (the
prompt tokens whose KV was reused), plus an ``attnstore`` object with where the KV came from. ``cache_salt``
(vLLM's field) scopes a request's KV: it is reused only by, and only from, requests that send the same salt.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, Field, ValidationError, ValidationInfo, field_validator, model_validator

from ..cache.fingerprint import salted_fingerprint
from ..store.entry import MAX_SESSION_ID_BYTES
from .openai_schema import OpenAIRequest, check_tool_choice

if TYPE_CHECKING:
    from .pipeline import ChatPipeline


class TextPart(OpenAIRequest):
    type: Literal["text"]
    text: str


TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names


class FunctionCall(OpenAIRequest):
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, arguments: str) -> str:
        return json_object_text(arguments)


def json_object_text(arguments: str) -> str:
    """`arguments` if it is a JSON object as text (a tool call's arguments), else a ValueError saying so."""
    try:
        value = json.loads(arguments)
    except RecursionError:  # nested deeper than Python's stack: refused, not a 500
        raise ValueError("`arguments` is nested too deeply") from None
    except ValueError as exc:
        raise ValueError(f"`arguments` must be a JSON object as text: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError("`arguments` must be a JSON object as text")
    return arguments


class ToolCallIn(OpenAIRequest):
    """A tool call of an assistant message in the history (one the server returned, sent back)."""

    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDef(OpenAIRequest):
    name: str
    description: str | None = None
    parameters: dict | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        if not TOOL_NAME.fullmatch(name):
            raise ValueError("a function name must be 1 to 64 letters, digits, underscores or dashes")
        return name


class ToolDef(OpenAIRequest):
    """A tool the model may call (OpenAI's chat-completions form)."""

    type: Literal["function"]
    function: FunctionDef

    def as_template_tool(self) -> dict:
        """The form chat templates take (and `apply_chat_template`'s `tools`)."""
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}


class ChatMessage(OpenAIRequest):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    name: str | None = None

    @model_validator(mode="after")
    def _roles(self) -> "ChatMessage":
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry `tool_calls`")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the `tool_call_id` of the call it answers")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def as_template_message(self) -> dict:
        """The message as chat templates take it: a tool call's arguments as a mapping (templates iterate
        them), as transformers serve passes them."""
        role = "system" if self.role == "developer" else self.role  # OpenAI's newer name for system
        message = {"role": role, "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": call.id, "type": "function",
                 "function": {"name": call.function.name, "arguments": json.loads(call.function.arguments)}}
                for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None and role == "tool":
            message["name"] = self.name
        return message

    def size(self) -> int:
        """Characters the message carries (its text and its calls' arguments), for `RequestLimits`."""
        calls = sum(len(c.function.name) + len(c.function.arguments) for c in self.tool_calls or ())
        return len(self.text()) + calls


class StreamOptions(OpenAIRequest):
    """``stream_options`` (chat completions and completions)."""

    include_usage: bool = False  # a last chunk with the usage


class _FunctionName(OpenAIRequest):
    name: str


class NamedToolChoice(OpenAIRequest):
    """A ``tool_choice`` that names a function, in the chat-completions form."""

    type: Literal["function"]
    function: _FunctionName


# What `unsupported` says of a `tool_choice` that forces or restricts the calls (chat completions and Responses).
FORCING_TOOL_CHOICE = ("`tool_choice` other than \"auto\" or \"none\" (\"required\", a named function, allowed "
                       "tools) needs constrained decoding, which this server does not do: use \"auto\" or \"none\"")


class ChatCompletionRequest(OpenAIRequest):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool = False
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)  # torch's generator range
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1)
    user: str | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None  # vLLM's: KV is shared only between requests with the same salt
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    top_k: int | None = Field(default=None, ge=1)  # vLLM's and llama.cpp's extension (sampling only)
    top_logprobs: int | None = Field(default=None, ge=0, le=20)  # OpenAI's range; needs `logprobs`
    response_format: dict | None = None
    # OpenAI's fields that would change the answer and are not implemented: typed, and refused (`unsupported`).
    functions: list[dict] | None = None  # deprecated function calling (`tools` replaced it)
    function_call: Literal["none", "auto"] | dict | None = None
    audio: dict | None = None  # audio output
    modalities: list[Literal["text", "audio"]] | None = None

    @field_validator("messages")
    @classmethod
    def _last_is_user(cls, messages: list[ChatMessage]) -> list[ChatMessage]:
        if messages[-1].role not in ("user", "system", "developer", "tool"):
            raise ValueError("the last message must come from the user or a tool (the server writes the "
                             "assistant's reply)")
        return messages

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_offered(cls, choice, info: ValidationInfo):
        tools = info.data.get("tools")  # validated before it (declared before it)
        return check_tool_choice(choice, tools, [tool.function.name for tool in tools or ()], _chat_named)

    def unsupported(self) -> tuple[str, str] | None:
        """The first requested feature this server does not implement, as (field, what), or None."""
        if self.n > 1 and self.stream:
            return "n", "`n` > 1 with `stream`"
        if self.tools and self.tool_choice not in (None, "auto", "none"):
            return "tool_choice", FORCING_TOOL_CHOICE
        if self.functions or self.function_call not in (None, "none", "auto"):
            field = "functions" if self.functions else "function_call"
            return field, f"`{field}` (deprecated function calling; send the functions as `tools`)"
        if self.audio is not None or "audio" in (self.modalities or ()):
            return ("audio" if self.audio is not None else "modalities"), "audio output"
        return None

    def json_schema(self) -> tuple[bool, dict | None]:
        """Whether the reply must be JSON (``response_format`` ``json_object`` or ``json_schema``) and its schema
        (None: any JSON object). Raises ValueError for another ``response_format``."""
        return response_format_schema(self.response_format)

    def template_tools(self) -> list[dict] | None:
        """The tools in the form chat templates take, or None."""
        return [tool.as_template_tool() for tool in self.tools] if self.tools else None

    def parses_tool_calls(self) -> bool:
        """Whether the reply is parsed for tool calls: tools are given and `tool_choice` is not "none" (then the
        tools are still rendered, as vLLM does, so the prompt stays the conversation's prefix)."""
        return bool(self.tools) and self.tool_choice != "none"

    def max_new_tokens(self, default: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default

    def stops(self) -> list[str]:
        """The stop strings, as a list (OpenAI takes one string or a list)."""
        if not self.stop:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


def _chat_named(choice: dict) -> str:
    """The function a chat-completions ``tool_choice`` names (ValueError for a malformed one)."""
    try:
        return NamedToolChoice.model_validate(choice).function.name
    except ValidationError:
        raise ValueError('a named `tool_choice` is {"type": "function", "function": {"name": ...}}') from None


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
        chars = len(json.dumps(body.template_tools())) if body.tools else 0
        for i, message in enumerate(body.messages):
            text = message.text()
            bad = _surrogate(text)
            if bad is not None:
                return "messages", (f"`messages[{i}].content` has a lone surrogate at {bad}: send valid Unicode "
                                    "text")
            chars += message.size()
        if chars > self.max_request_chars:
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
            if _surrogate(stop) is not None:
                return "stop", "`stop` strings must be valid Unicode text: one has a lone surrogate"
        if body.user:
            problem = self.session_id_problem(body.user, "user")
            if problem is not None:
                return "user", problem
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


def response_format_schema(fmt: dict | None) -> tuple[bool, dict | None]:
    """OpenAI's ``response_format`` (or the Responses API's ``text.format``, which has the schema at the top):
    (the reply must be JSON, its schema or None for any object). Raises ValueError naming what is wrong."""
    kind = (fmt or {}).get("type", "text")
    if kind == "text":
        return False, None
    if kind == "json_object":
        return True, None
    if kind == "json_schema":
        inner = fmt.get("json_schema", fmt)  # chat completions nest it; the Responses API does not
        schema = inner.get("schema") if isinstance(inner, dict) else None
        if not isinstance(schema, dict):
            raise ValueError("a `json_schema` format needs its `schema`, a JSON object")
        return True, schema
    raise ValueError(f"`response_format` of type {str(kind)[:50]!r} is not supported: use text, json_object or "
                     "json_schema")


def _vocab_size(model) -> int | None:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    size = getattr(config, "vocab_size", None)
    return size if isinstance(size, int) and size > 0 else None


def surrogate_at(text: str) -> int | None:
    """Where `text` has a lone surrogate (it cannot be encoded as UTF-8), or None."""
    return _surrogate(text)


def echo_problem(name: str, value) -> str | None:
    """Why a client's `value`, echoed back in a response as JSON, cannot be (a lone surrogate, NaN or an
    infinity), or None."""
    try:
        json.dumps(value, allow_nan=False, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return f"`{name}` has a lone surrogate: send valid Unicode text"
    except (ValueError, RecursionError):
        return f"`{name}` has NaN, an infinity, or is nested too deeply: send finite JSON"
    return None


def _surrogate(text: str) -> int | None:
    """Where `text` has a lone surrogate (it cannot be encoded as UTF-8), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class AttnStoreInfo(BaseModel):
    """Ours, beside OpenAI's fields: how the turn used the store."""

    session_id: str
    kv_source: str  # host, disk, remote, miss, truncated
    reused_tokens: int
    prefilled_tokens: int
    dropped_tokens: int  # tokens the context window dropped this turn
    ttft_ms: float
    queue_ms: float
    samples_reused_tokens: list[int] | None = None  # with `n` > 1: the prompt tokens each further sample reused


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


class Choice(BaseModel):
    index: int = 0
    message: ResponseMessage
    finish_reason: Literal["stop", "length", "tool_calls"]
    logprobs: dict | None = None


class _Completion(BaseModel):
    """What every response object and stream chunk carries."""

    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str


class ChatCompletion(_Completion):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[Choice]
    usage: Usage
    attnstore: AttnStoreInfo


class ToolCallDelta(BaseModel):
    index: int
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None
    logprobs: dict | None = None


class ChatCompletionChunk(_Completion):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChunkChoice]
    usage: Usage | None = None
    attnstore: AttnStoreInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "hf_attnstore"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """An OpenAI-style error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
