"""What every route's schema shares: the base of the request models (OpenAI's typing), the check that a
``tool_choice`` asks only for offered tools, the field a validation error names, the error object, and the parts
of requests and responses that chat completions, completions and Responses have in common.

The `openai` client's own types are the reference (``openai/types/chat/completion_create_params.py``,
``openai/types/completion_create_params.py``, ``openai/types/responses/response_create_params.py``):

- **An explicit null is "not given".** OpenAI's schema makes optional fields nullable, and clients and routers
  send ``null`` for what they leave unset (``"stream": null`` on every request): the field's default applies.
  A required field (``model``, ``messages``, ``prompt``, ``input``) stays required.
- **No coercion.** ``"5"`` is not an integer, ``5.0`` is not an integer either, ``true`` is not a number, and
  ``"yes"`` is not a boolean: a 400 naming the field, as OpenAI answers, rather than a guess at what was meant.
  JSON has one number type, so a whole number (``1``) is a valid ``number`` (``temperature``).
"""

from __future__ import annotations

import functools
import json
import re
import time
from typing import Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# A union member's tag in a validation error's location ("str", "list[int]", "literal['auto','none']",
# "function-after[...]", a model class's name): not a field of the request.
_TYPE_TAG = re.compile(r"[a-z][a-z-]*\[.*\]|str|int|float|bool|none|dict|list", re.DOTALL)
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names

# What `unsupported` says of a `tool_choice` object this server does not implement (chat completions and Responses).
OTHER_TOOL_CHOICE = ("a `tool_choice` object other than a named function (allowed tools, custom or built-in "
                     "tools): use \"auto\", \"none\", \"required\" or {\"type\": \"function\", ...}")


class OpenAIRequest(BaseModel):
    """The base of every request model and of their parts: strict JSON types, unknown fields ignored (clients
    send many optional fields this server has no use for), an explicit ``null`` for an optional field taken as
    the field not given.

    Example:
        >>> class Ask(OpenAIRequest):
        ...     stream: bool = False
        >>> Ask.model_validate({"stream": None}).stream
        False
        >>> Ask.model_validate({"stream": "false"})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        pydantic_core._pydantic_core.ValidationError: ...
    """

    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_not_given(cls, data):
        if isinstance(data, dict):
            optional = _optional_fields(cls)
            if any(data.get(name, 0) is None for name in optional):
                data = {key: value for key, value in data.items() if value is not None or key not in optional}
        return data


class SGLangFields(OpenAIRequest):
    """SGLang's extensions of OpenAI's requests, which `sglang-router` adds to every request it forwards, each at
    its default (a chat request gains ``no_stop_trim``, ``ignore_eos``, ``continue_final_message``,
    ``skip_special_tokens``, ``separate_reasoning``, ``stream_reasoning``, ``return_hidden_states``; a Responses
    request ``top_k: -1``, ``min_p``, ``repetition_penalty``, ``priority``). At those defaults they ask for what this
    server does anyway; a value that would change the answer is refused by name (`sglang_unsupported`), never
    silently ignored. ``top_k`` is honoured (-1 is SGLang's and vLLM's "disabled": not given). Two fields are
    accepted at any value: ``separate_reasoning`` and ``stream_reasoning`` act only where a server was started with a
    reasoning parser (SGLang: ``if self.reasoning_parser and request.separate_reasoning``), and this one has none;
    ``priority`` orders SGLang's queue, not the answer.

    Example:
        >>> class Ask(SGLangFields):
        ...     pass
        >>> Ask.model_validate({"top_k": -1, "ignore_eos": False}).sglang_unsupported() is None
        True
        >>> Ask.model_validate({"min_p": 0.1}).sglang_unsupported()
        ('min_p', '`min_p` other than 0.0 (min-p sampling)')
    """

    top_k: int | None = None  # vLLM's, llama.cpp's and SGLang's extension (sampling only); -1: disabled
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    no_stop_trim: bool | None = None
    continue_final_message: bool | None = None
    skip_special_tokens: bool | None = None
    return_hidden_states: bool | None = None
    separate_reasoning: bool | None = None
    stream_reasoning: bool | None = None
    priority: int | None = None

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value):
        if value == -1:
            return None
        if value is not None and value < 1:
            raise ValueError("`top_k` must be at least 1, or -1 for no top-k filtering")
        return value

    def sglang_unsupported(self) -> tuple[str, str] | None:
        """The first SGLang field whose value would change the answer, as (field, what), or None."""
        for name, default, what in _SGLANG_DEFAULTS:
            value = getattr(self, name)
            if value is not None and value != default:
                return name, f"`{name}` other than {default!r} ({what})"
        return None


class SamplingDefaults(BaseModel):
    """The sampling fields a server fills in where a request leaves them out (``attnstore serve
    --sampling-defaults``; SGLang's ``--preferred-sampling-params``, vLLM's ``--override-generation-config``):
    what a request sends always wins, and Responses echo the values used. Only the fields a route's request has
    are filled. Unknown fields and values out of OpenAI's ranges are refused, so a typo is not a silent no-op.

    Why a server has them: a small model decoded greedily can loop (SmolLM2-135M answers "Count from 1 to 3." with
    ``1. 1. 1. 1. 2. 2. ...`` to the token cap); a presence penalty ends that for every client without each one
    asking for it.

    Example:
        >>> defaults = SamplingDefaults.model_validate({"presence_penalty": 0.5})
        >>> from hf_attnstore.serving.protocol import CompletionRequest
        >>> body = defaults.fill(CompletionRequest(model="m", prompt="hi", presence_penalty=0.1))
        >>> body.presence_penalty, defaults.fill(CompletionRequest(model="m", prompt="hi")).presence_penalty
        (0.1, 0.5)
        >>> SamplingDefaults.model_validate({"presence": 0.5})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        pydantic_core._pydantic_core.ValidationError: ...
    """

    model_config = ConfigDict(extra="forbid", strict=True)

    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=1)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)

    def fill(self, body):
        """`body` with each default set where the request has the field and left it out (a copy; `body` itself
        when there is nothing to fill). A ``null`` counts as left out (OpenAI's "the default"); ``top_k: -1`` is
        SGLang's explicit "no top-k filtering", so a request that sends it keeps it."""
        update = {name: value for name, value in self.model_dump(exclude_none=True).items()
                  if name in type(body).model_fields and getattr(body, name) is None
                  and not (name == "top_k" and name in body.model_fields_set)}
        return body.model_copy(update=update) if update else body

    @classmethod
    def parse(cls, text: str) -> "SamplingDefaults":
        """The defaults a JSON object gives (the command line's form).

        Raises:
            ValueError: Text that is not a JSON object, an unknown field, or a value out of its range: the
                message names the field and the fields there are.
        """
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"not JSON ({exc}): give an object, e.g. '{{\"presence_penalty\": 0.5}}'") from None
        return cls.of(data)

    @classmethod
    def of(cls, data) -> "SamplingDefaults":
        """The defaults a dict of fields gives.

        Raises:
            ValueError: Not a dict, an unknown field, or a value out of its range (as `parse`).
        """
        if not isinstance(data, dict):
            raise ValueError(f"give an object of sampling fields, not {type(data).__name__}")
        try:
            return cls.model_validate(data)
        except ValueError as exc:
            errors = getattr(exc, "errors", lambda: [])()
            first = errors[0] if errors else {"loc": (), "msg": str(exc)}
            where = ".".join(str(part) for part in first["loc"]) or "the object"
            raise ValueError(f"{where}: {first['msg']} (the fields: {', '.join(cls.model_fields)})") from None

# SGLang's fields that change the answer away from their default, with what they do (sglang's protocol.py defaults).
_SGLANG_DEFAULTS = (
    ("min_p", 0.0, "min-p sampling"),
    ("repetition_penalty", 1.0, "a repetition penalty: send `frequency_penalty` or `presence_penalty`"),
    ("ignore_eos", False, "generating past the end of the reply"),
    ("no_stop_trim", False, "keeping the stop string in the reply"),
    ("continue_final_message", False, "continuing the last assistant message"),
    ("skip_special_tokens", True, "special tokens in the reply's text"),
    ("return_hidden_states", False, "hidden states in the response"),
)


@functools.cache
def _optional_fields(model: type[BaseModel]) -> frozenset[str]:
    return frozenset(name for name, field in model.model_fields.items() if not field.is_required())


def check_tool_choice(choice, tools: list | None, functions: list[str], named: Callable[[dict], str]):
    """`choice`, a request's ``tool_choice``, if it asks only for tools the request offers, else a ValueError
    saying what is wrong: a choice other than "auto" or "none" without `tools` (those two ask for what the request
    gets anyway), or a named function that is not among `functions` (the names of its function tools).

    Args:
        choice: The ``tool_choice`` as sent: "none", "auto", "required", an object, or None (not given).
        tools: The request's ``tools``.
        functions: The names of its function tools.
        named: The function a ``{"type": "function", ...}`` choice names, in the route's form; raises ValueError
            for a malformed one.

    Example:
        >>> check_tool_choice("auto", None, [], lambda c: c["name"])
        'auto'
        >>> check_tool_choice({"type": "function", "name": "f"}, None, [], lambda c: c["name"])
        Traceback (most recent call last):
        ValueError: a `tool_choice` other than "auto" or "none" needs `tools`: offer the functions it may call
    """
    if choice is None or choice in ("auto", "none"):
        return choice
    if not tools:
        raise ValueError('a `tool_choice` other than "auto" or "none" needs `tools`: offer the functions it may call')
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = named(choice)
        if name not in functions:
            offered = ", ".join(functions) or "none"
            raise ValueError(f"`tool_choice` names the function {name[:64]!r}, which is not among `tools` "
                             f"(offered: {offered[:500]})")
    return choice


def error_field(loc: tuple) -> tuple[str | None, bool]:
    """The field a validation error's location names, as OpenAI's ``param`` (``messages.0.content``): the path
    up to a union member's tag (the tags are pydantic's, not the client's fields), and whether there was one (the
    error is then one of several alternatives of that field).

    Example:
        >>> error_field(("messages", 0, "content", "str"))
        ('messages.0.content', True)
    """
    path = []
    for part in loc:
        if error_tag(part):
            return ".".join(path) or None, True
        path.append(str(part))
    return ".".join(path) or None, False


def error_tag(part) -> bool:
    """Whether `part` of a validation error's location is a union member's tag (pydantic's name of a type).

    Example:
        >>> error_tag("list[int]"), error_tag("messages")
        (True, False)
    """
    return isinstance(part, str) and (_TYPE_TAG.fullmatch(part) is not None or part in _model_names())


@functools.cache
def _model_names() -> frozenset[str]:
    """The request models' class names (a union of models tags its errors with them); every module that defines
    one is imported by the time a request is validated."""
    names, todo = set(), [OpenAIRequest]
    while todo:
        cls = todo.pop()
        for sub in cls.__subclasses__():
            names.add(sub.__name__)
            todo.append(sub)
    return frozenset(names)


class FunctionCall(OpenAIRequest):
    """A function call: its name and its arguments, a JSON object as text (as OpenAI sends them).

    Example:
        >>> FunctionCall(name="f", arguments='{"x": 1}').arguments
        '{"x": 1}'
    """

    name: str
    arguments: str  # JSON text, as OpenAI sends it

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, arguments: str) -> str:
        return json_object_text(arguments)


def json_object_text(arguments: str) -> str:
    """`arguments` if it is a JSON object as text (a tool call's arguments), else a ValueError saying so.

    Example:
        >>> json_object_text('{"x": 1}')
        '{"x": 1}'
    """
    try:
        value = json.loads(arguments)
    except RecursionError:  # nested deeper than Python's stack: refused, not a 500
        raise ValueError("`arguments` is nested too deeply") from None
    except ValueError as exc:
        raise ValueError(f"`arguments` must be a JSON object as text: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError("`arguments` must be a JSON object as text")
    return arguments


class StreamOptions(OpenAIRequest):
    """``stream_options`` (chat completions and completions).

    Example:
        >>> StreamOptions.model_validate({"include_usage": None}).include_usage
        False
    """

    include_usage: bool = False  # a last chunk with the usage


def response_format_schema(fmt: dict | None) -> tuple[bool, dict | None]:
    """OpenAI's ``response_format`` (or the Responses API's ``text.format``, which has the schema at the top):
    (the reply must be JSON, its schema or None for any object). Raises ValueError naming what is wrong.

    Example:
        >>> response_format_schema({"type": "json_schema", "json_schema": {"schema": {"type": "object"}}})
        (True, {'type': 'object'})
    """
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


def stop_strings(stop: str | list[str] | None) -> list[str]:
    """A request's ``stop`` as a list (OpenAI takes one string or a list).

    Example:
        >>> stop_strings("\\n"), stop_strings(None)
        (['\\n'], [])
    """
    if not stop:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def surrogate_at(text: str) -> int | None:
    """Where `text` has a lone surrogate (it cannot be encoded as UTF-8), or None.

    Example:
        >>> surrogate_at("ok"), surrogate_at("a\\ud800")
        (None, 1)
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None


def tools_text_problem(tools: list[dict] | None, nested: bool) -> tuple[str, str] | None:
    """The first field of `tools` that is not valid Unicode text (a lone surrogate: no tokenizer can take it), as
    (``param``, what to do), or None. `nested`: chat completions' form (the function under ``"function"``), else
    Responses' flat one.

    Example:
        >>> tools_text_problem([{"type": "function", "function": {"name": "f", "description": "a\\ud800"}}], True)[0]
        'tools.0.function.description'
    """
    for i, tool in enumerate(tools or ()):
        function = tool.get("function") if nested else tool
        if not isinstance(function, dict):
            continue
        where = f"tools.{i}.function" if nested else f"tools.{i}"
        for key in ("name", "description", "parameters"):
            value = function.get(key)
            if value is None:
                continue
            try:
                text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
            except (ValueError, TypeError, RecursionError):
                continue  # not text: what renders it says what is wrong
            bad = surrogate_at(text)
            if bad is not None:
                shown = where.replace(f"tools.{i}", f"tools[{i}]")
                what = "a string or key of the schema" if key == "parameters" else "its text"
                return f"{where}.{key}", (f"`{shown}.{key}` has a lone surrogate in {what} (at {bad}): it is not "
                                          "Unicode text a tokenizer can take; send valid UTF-8 text")
    return None


def echo_problem(name: str, value) -> str | None:
    """Why a client's `value`, echoed back in a response as JSON, cannot be (a lone surrogate, NaN or an
    infinity), or None.

    Example:
        >>> echo_problem("metadata", {"a": float("nan")})
        '`metadata` has NaN, an infinity, or is nested too deeply: send finite JSON'
    """
    try:
        json.dumps(value, allow_nan=False, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return f"`{name}` has a lone surrogate: send valid Unicode text"
    except (ValueError, RecursionError):
        return f"`{name}` has NaN, an infinity, or is nested too deeply: send finite JSON"
    return None


class PromptTokensDetails(BaseModel):
    """OpenAI's ``prompt_tokens_details``: ``cached_tokens`` are the prompt tokens whose KV was reused.

    Example:
        >>> PromptTokensDetails(cached_tokens=3).cached_tokens
        3
    """

    cached_tokens: int = 0


class Usage(BaseModel):
    """OpenAI's ``usage`` of a chat completion or completion.

    Example:
        >>> Usage(prompt_tokens=4, completion_tokens=2, total_tokens=6, prompt_tokens_details={"cached_tokens": 3}).total_tokens
        6
    """

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class AttnStoreInfo(BaseModel):
    """Ours, beside OpenAI's fields: how the turn used the store.

    Example:
        >>> AttnStoreInfo(session_id="s", kv_source="host", reused_tokens=3, prefilled_tokens=1, dropped_tokens=0,
        ...               ttft_ms=1.0, queue_ms=0.0).kv_source
        'host'
    """

    session_id: str
    kv_source: str  # host, disk, remote, miss, truncated
    reused_tokens: int
    prefilled_tokens: int
    dropped_tokens: int  # tokens the context window dropped this turn
    ttft_ms: float
    queue_ms: float
    samples_reused_tokens: list[int] | None = None  # with `n` > 1: the prompt tokens each further sample reused


class CompletionBase(BaseModel):
    """What every response object and stream chunk carries.

    Example:
        >>> CompletionBase(id="x", model="m").created > 0
        True
    """

    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str


class ModelCard(BaseModel):
    """A model this server serves (``GET /v1/models``).

    Example:
        >>> ModelCard(id="m").owned_by
        'hf_attnstore'
    """

    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "hf_attnstore"


class ModelList(BaseModel):
    """``GET /v1/models``'s answer.

    Example:
        >>> ModelList(data=[ModelCard(id="m")]).data[0].id
        'm'
    """

    object: Literal["list"] = "list"
    data: list[ModelCard]


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """An OpenAI-style error object.

    Example:
        >>> error_body("no", param="model")
        {'error': {'message': 'no', 'type': 'invalid_request_error', 'param': 'model', 'code': None}}
    """
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
