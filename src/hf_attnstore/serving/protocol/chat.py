"""The chat-completions schema (``POST /v1/chat/completions``): the request, its messages and tools, the
completion and its stream chunks.

Requests accept OpenAI's fields; fields this server does not implement are refused with a 400 naming them
when they would change the answer (``n > 1`` with ``stream``, a ``tool_choice`` of allowed tools, a
``response_format`` other than text), honoured when implemented (``tools``, every ``tool_choice`` but allowed
tools ("required" and a named function by constrained decoding, forced.py),
``parallel_tool_calls``, assistant ``tool_calls`` and ``tool`` messages, ``n`` (each sample a turn that reuses
the first one's prompt), ``logprobs`` and ``top_logprobs``, ``frequency_penalty``, ``presence_penalty``,
``logit_bias``, ``seed``, ``stop``, ``top_k``), and ignored only when they do not change the answer (OpenAI
clients send many optional fields: ``metadata``, ``store``, ``service_tier``...). Responses carry OpenAI's fields,
``usage.prompt_tokens_details.cached_tokens`` included (the prompt tokens whose KV was reused), plus an
``attnstore`` object with where the KV came from. ``cache_salt`` (vLLM's field) scopes a request's KV: it is
reused only by, and only from, requests that send the same salt.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, Field, ValidationError, ValidationInfo, field_validator, model_validator

from .common import (OTHER_TOOL_CHOICE, TOOL_NAME, AttnStoreInfo, CompletionBase, FunctionCall, OpenAIRequest,
                     SGLangFields, StreamOptions, Usage, check_tool_choice, response_format_schema, stop_strings)


class TextPart(OpenAIRequest):
    """A text part of a message's content.

    Example:
        >>> TextPart(type="text", text="hi").text
        'hi'
    """

    type: Literal["text"]
    text: str


class ToolCallIn(OpenAIRequest):
    """A tool call of an assistant message in the history (one the server returned, sent back).

    Example:
        >>> ToolCallIn.model_validate({"id": "c1", "function": {"name": "f", "arguments": "{}"}}).type
        'function'
    """

    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


def check_parameters(parameters: dict | None) -> dict | None:
    """A function's ``parameters``: a JSON schema of an object (OpenAI's rule: the arguments are a JSON object),
    so a schema of another ``type`` is refused rather than forced into calls no client can take.

    Example:
        >>> check_parameters({"type": "string"})
        Traceback (most recent call last):
        ValueError: a function's `parameters` must be a JSON schema of type "object" (its arguments are a JSON object), got type "string"
    """
    if parameters is not None and parameters.get("type", "object") != "object":
        raise ValueError('a function\'s `parameters` must be a JSON schema of type "object" (its arguments are a '
                         f'JSON object), got type {json.dumps(parameters.get("type"))}')
    return parameters


class FunctionDef(OpenAIRequest):
    """A function a tool offers: its name (OpenAI's rule), description and JSON-schema parameters.

    Example:
        >>> FunctionDef(name="get_weather").name
        'get_weather'
    """

    name: str
    description: str | None = None
    parameters: dict | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        if not TOOL_NAME.fullmatch(name):
            raise ValueError("a function name must be 1 to 64 letters, digits, underscores or dashes")
        return name

    @field_validator("parameters")
    @classmethod
    def _parameters(cls, parameters: dict | None) -> dict | None:
        return check_parameters(parameters)


class ToolDef(OpenAIRequest):
    """A tool the model may call (OpenAI's chat-completions form).

    Example:
        >>> ToolDef(type="function", function={"name": "f"}).as_template_tool()
        {'type': 'function', 'function': {'name': 'f'}}
    """

    type: Literal["function"]
    function: FunctionDef

    def as_template_tool(self) -> dict:
        """The form chat templates take (and `apply_chat_template`'s `tools`)."""
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}


class ChatMessage(OpenAIRequest):
    """A message of a chat request: its role, its text (a string or text parts), an assistant's tool calls, a tool
    message's call id.

    Example:
        >>> ChatMessage(role="developer", content=[{"type": "text", "text": "be brief"}]).as_template_message()
        {'role': 'system', 'content': 'be brief'}
    """

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


class _FunctionName(OpenAIRequest):
    name: str


class NamedToolChoice(OpenAIRequest):
    """A ``tool_choice`` that names a function, in the chat-completions form.

    Example:
        >>> NamedToolChoice(type="function", function={"name": "f"}).function.name
        'f'
    """

    type: Literal["function"]
    function: _FunctionName


class ChatCompletionRequest(SGLangFields):
    """``POST /v1/chat/completions``: the fields this server reads (see the module's docstring); those that would
    change the answer and are not implemented are refused by name (`unsupported`).

    Example:
        >>> body = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
        ...                                             "n": 2, "stream": True})
        >>> body.unsupported()
        ('n', '`n` > 1 with `stream`')
    """

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
    prompt_cache_key: str | None = None  # OpenAI's: a session key, as X-Session-ID (scoped by the salt)
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None  # OpenAI's: how long the session is kept
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
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
        sglang = self.sglang_unsupported()
        if sglang is not None:
            return sglang
        if self.n > 1 and self.stream:
            return "n", "`n` > 1 with `stream`"
        if isinstance(self.tool_choice, dict) and self.tool_choice.get("type") != "function":
            return "tool_choice", OTHER_TOOL_CHOICE
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

    def forced_functions(self) -> list[str] | None:
        """The functions the reply must call, when ``tool_choice`` forces a call: the named one, or every offered
        one for "required"; None when the model may answer in text.

        Example:
            >>> ChatCompletionRequest.model_validate({
            ...     "model": "m", "messages": [{"role": "user", "content": "hi"}],
            ...     "tools": [{"type": "function", "function": {"name": "f"}}],
            ...     "tool_choice": {"type": "function", "function": {"name": "f"}}}).forced_functions()
            ['f']
        """
        if not self.tools or self.tool_choice in (None, "auto", "none"):
            return None
        if self.tool_choice == "required":
            return [tool.function.name for tool in self.tools]
        return [_chat_named(self.tool_choice)]

    def max_new_tokens(self, default: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default

    def stops(self) -> list[str]:
        """The stop strings, as a list (OpenAI takes one string or a list)."""
        return stop_strings(self.stop)


def _chat_named(choice: dict) -> str:
    """The function a chat-completions ``tool_choice`` names (ValueError for a malformed one)."""
    try:
        return NamedToolChoice.model_validate(choice).function.name
    except ValidationError:
        raise ValueError('a named `tool_choice` is {"type": "function", "function": {"name": ...}}') from None


class ToolCallOut(BaseModel):
    """A tool call of a reply (the server's answer).

    Example:
        >>> ToolCallOut(id="call_1", function={"name": "f", "arguments": "{}"}).type
        'function'
    """

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ResponseMessage(BaseModel):
    """The assistant's message of a chat completion.

    Example:
        >>> ResponseMessage(content="hi").role
        'assistant'
    """

    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


class Choice(BaseModel):
    """One sample of a chat completion.

    Example:
        >>> Choice(message={"content": "hi"}, finish_reason="stop").index
        0
    """

    index: int = 0
    message: ResponseMessage
    finish_reason: Literal["stop", "length", "tool_calls"]
    logprobs: dict | None = None


class ChatCompletion(CompletionBase):
    """A whole chat completion: its samples, OpenAI's usage and our ``attnstore`` object.

    Example:
        >>> ChatCompletion.model_fields["object"].default
        'chat.completion'
    """

    object: Literal["chat.completion"] = "chat.completion"
    choices: list[Choice]
    usage: Usage
    attnstore: AttnStoreInfo


class FunctionDelta(BaseModel):
    """What a stream chunk adds to a call's function: its name (first), then pieces of its arguments' text.

    Example:
        >>> FunctionDelta(arguments='{"ci').model_dump(exclude_none=True)
        {'arguments': '{"ci'}
    """

    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    """A tool call in a stream chunk, as OpenAI streams it: the first chunk of a call has its ``id``, ``type`` and
    name (with empty arguments), later ones only pieces of its arguments, under the same ``index``.

    Example:
        >>> ToolCallDelta(index=0, function={"arguments": "{}"}).model_dump(exclude_none=True)
        {'index': 0, 'function': {'arguments': '{}'}}
    """

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDelta


class Delta(BaseModel):
    """What a stream chunk adds to the reply.

    Example:
        >>> Delta(content="hi").model_dump(exclude_none=True)
        {'content': 'hi'}
    """

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChunkChoice(BaseModel):
    """One sample's piece of a stream chunk.

    Example:
        >>> ChunkChoice(delta={"content": "hi"}).finish_reason is None
        True
    """

    index: int = 0
    delta: Delta
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None
    logprobs: dict | None = None


class ChatCompletionChunk(CompletionBase):
    """One chunk of a streamed chat completion (the last ones carry the finish reason, ``attnstore`` and, when
    asked, the usage).

    Example:
        >>> ChatCompletionChunk(id="c", model="m", choices=[]).object
        'chat.completion.chunk'
    """

    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChunkChoice]
    usage: Usage | None = None
    attnstore: AttnStoreInfo | None = None
