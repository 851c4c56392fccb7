"""The Responses schema (``POST /v1/responses``): the request and its input items and tools, its translation
into a chat request (`chat_request`), and the response object and its output items.
"""

from __future__ import annotations

import base64
import binascii
import json
import uuid
from typing import Literal, Union

from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator

from .chat import ChatCompletionRequest, ChatMessage, ToolDef, check_parameters
from .common import OTHER_TOOL_CHOICE, OpenAIRequest, SGLangFields, check_tool_choice, json_object_text

MAX_METADATA = 16  # OpenAI's limits: 16 pairs, keys of 64 characters, values of 512
NOT_TEXT = ("input_image", "input_file", "input_audio", "input_video")  # content parts a text-only model cannot read
COMPACTION_PREFIX = "attnstore-compaction-v1:"  # what our compaction items' `encrypted_content` starts with


class InputText(OpenAIRequest):
    """A text part of an input message.

    Example:
        >>> InputText(type="input_text", text="hi").text
        'hi'
    """

    type: Literal["input_text", "output_text", "text"]
    text: str


class MessageItem(OpenAIRequest):
    """An input message item (its ``type`` may be left out).

    Example:
        >>> MessageItem(role="user", content=[{"type": "input_text", "text": "hi"}]).text()
        'hi'
    """

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]
    phase: Literal["commentary", "final_answer"] | None = None  # an assistant message's label: read, not rendered

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(OpenAIRequest):
    """A function call the model made, sent back as input.

    Example:
        >>> FunctionCallItem(type="function_call", call_id="c1", name="f", arguments="{}").call_id
        'c1'
    """

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, arguments: str) -> str:
        return json_object_text(arguments)


class FunctionCallOutputItem(OpenAIRequest):
    """A function's result, the answer to a call (``call_id``).

    Example:
        >>> FunctionCallOutputItem(type="function_call_output", call_id="c1", output="12").output
        '12'
    """

    type: Literal["function_call_output"]
    call_id: str
    output: str


class CompactionItem(OpenAIRequest):
    """A compaction item (`compaction_item`, from ``POST /v1/responses/compact``) sent back as input: it stands
    for the part of the conversation it summarizes, and is read as an assistant message holding the summary.

    Example:
        >>> CompactionItem(type="compaction", encrypted_content=compaction_content("We met.")).summary()
        'We met.'
    """

    type: Literal["compaction"]
    encrypted_content: str

    @field_validator("encrypted_content")
    @classmethod
    def _ours(cls, content: str) -> str:
        compaction_summary(content)  # a ValueError for one this server did not make
        return content

    def summary(self) -> str:
        return compaction_summary(self.encrypted_content)


Item = Union[MessageItem, FunctionCallItem, FunctionCallOutputItem, CompactionItem]


def readable(items):
    """`items` (a request's ``input``) unchanged, or a ValueError naming the first content part the model cannot
    read (an image, a file...) or compaction item this server did not make: said before the union's own
    complaints ("Input should be a valid string"), which would not say why.

    Example:
        >>> readable([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}])
        Traceback (most recent call last):
        ...
        ValueError: input.0.content.0 is `input_image` content, which is not supported: the model this server runs reads text only; send `input_text` parts
    """
    for i, item in enumerate(items if isinstance(items, list) else ()):
        if isinstance(item, dict) and item.get("type") == "compaction" and isinstance(item.get("encrypted_content"),
                                                                                      str):
            try:
                compaction_summary(item["encrypted_content"])
            except ValueError as exc:
                raise ValueError(f"input.{i}.encrypted_content: {exc}") from None
        content = item.get("content") if isinstance(item, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else ()):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in NOT_TEXT:
                raise ValueError(f"input.{i}.content.{j} is `{kind}` content, which is not supported: the model this "
                                 "server runs reads text only; send `input_text` parts")
    return items


def compaction_content(summary: str) -> str:
    """The ``encrypted_content`` of a compaction item holding `summary`: encoded, not encrypted (the summary is
    text the client could have sent as a message; nothing in it is secret from the client that sent the
    conversation), so it survives restarts and any replica reads it.

    Example:
        >>> compaction_summary(compaction_content("hi"))
        'hi'
    """
    return COMPACTION_PREFIX + base64.urlsafe_b64encode(json.dumps({"summary": summary}).encode()).decode()


def compaction_summary(content: str) -> str:
    """The summary a compaction item's ``encrypted_content`` holds (ValueError for one this server did not make).

    Example:
        >>> compaction_summary("gAAAA")
        Traceback (most recent call last):
        ...
        ValueError: this compaction item was not made by this server (POST /v1/responses/compact here): send the conversation instead
    """
    try:
        if not content.startswith(COMPACTION_PREFIX):
            raise ValueError
        summary = json.loads(base64.urlsafe_b64decode(content[len(COMPACTION_PREFIX):].encode()))["summary"]
        if not isinstance(summary, str):
            raise ValueError
        return summary
    except (ValueError, KeyError, TypeError, binascii.Error):
        raise ValueError("this compaction item was not made by this server (POST /v1/responses/compact here): "
                         "send the conversation instead") from None


class FunctionTool(OpenAIRequest):
    """A tool in the Responses form (flat: ``name`` beside ``type``).

    Example:
        >>> FunctionTool(type="function", name="f").as_chat_tool().function.name
        'f'
    """

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict | None = None

    @field_validator("parameters")
    @classmethod
    def _parameters(cls, parameters: dict | None) -> dict | None:
        return check_parameters(parameters)

    def as_chat_tool(self) -> ToolDef:
        return ToolDef(type="function", function={"name": self.name, "description": self.description,
                                                  "parameters": self.parameters})


class FunctionToolChoice(OpenAIRequest):
    """A ``tool_choice`` that names a function, in the Responses form (flat).

    Example:
        >>> FunctionToolChoice(type="function", name="f").name
        'f'
    """

    type: Literal["function"]
    name: str


class ResponsesRequest(SGLangFields):
    """``POST /v1/responses``: the fields this server reads. Fields that would change the answer and are not
    implemented are refused by name (`unsupported`).

    Example:
        >>> body = ResponsesRequest.model_validate({"model": "m", "input": [{"role": "user", "content": "hi"}]})
        >>> [m.role for m in body.input_messages()]
        ['user']
    """

    model: str
    input: str | list[Item] = Field(min_length=1)
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    # OpenAI's default, "disabled": a conversation over the context window is a 400; "auto": truncated (decoupled).
    truncation: Literal["auto", "disabled"] | None = None
    reasoning: dict | None = None
    safety_identifier: str | None = Field(default=None, max_length=64)
    service_tier: Literal["auto", "default", "flex", "priority", "scale"] | None = None
    tools: list[dict] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict | None = None
    parallel_tool_calls: bool | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    text: dict | None = None
    cache_salt: str | None = None  # vLLM's extension, as in chat completions
    prompt_cache_key: str | None = None  # OpenAI's, as in chat completions
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    background: bool | None = None
    conversation: str | dict | None = None
    prompt: dict | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    include: list[str] | None = None

    @model_validator(mode="before")
    @classmethod
    def _message_type(cls, data):
        # OpenAI takes input messages without a "type" ({"role", "content"}): they are messages.
        if isinstance(data, dict) and isinstance(data.get("input"), list):
            data = dict(data)
            data["input"] = [{**item, "type": "message"} if isinstance(item, dict) and "type" not in item
                             and "role" in item else item for item in data["input"]]
        return data

    _text_only = field_validator("input", mode="before")(classmethod(lambda cls, items: readable(items)))

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_offered(cls, choice, info: ValidationInfo):
        tools = info.data.get("tools")  # validated before it (declared before it)
        functions = [tool.get("name") for tool in tools or () if tool.get("type") == "function"]
        return check_tool_choice(choice, tools, [f for f in functions if isinstance(f, str)], _named)

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, metadata):
        if metadata is not None and (len(metadata) > MAX_METADATA or
                                     any(len(k) > 64 or len(v) > 512 for k, v in metadata.items())):
            raise ValueError(f"at most {MAX_METADATA} pairs, keys of at most 64 characters, values of at most 512")
        return metadata

    def unsupported(self) -> tuple[str, str] | None:
        """The first requested feature this server does not implement, as (field, what), or None."""
        sglang = self.sglang_unsupported()
        if sglang is not None:
            return sglang
        if self.background:
            return "background", "`background` responses"
        if self.conversation is not None:
            return "conversation", "`conversation` (the Conversations API; chain with `previous_response_id`)"
        if self.prompt is not None:
            return "prompt", "`prompt` (stored prompt templates)"
        if self.top_logprobs:
            return "top_logprobs", "`top_logprobs`"
        if self.max_tool_calls is not None:
            return "max_tool_calls", "`max_tool_calls`"
        if (self.reasoning or {}).get("effort") not in (None, "none") or (self.reasoning or {}).get("summary"):
            return "reasoning", "`reasoning` (the model this server runs does not reason before it answers)"
        for what in self.include or ():
            if "logprobs" in what:
                return "include", f"`include` of {what[:80]!r}"
        for i, tool in enumerate(self.tools or ()):
            if tool.get("type") != "function":
                return f"tools.{i}.type", f"tools of type {str(tool.get('type'))[:50]!r} (only functions)"
        if isinstance(self.tool_choice, dict) and self.tool_choice.get("type") != "function":
            return "tool_choice", OTHER_TOOL_CHOICE
        return None

    def chat_tools(self) -> list[ToolDef] | None:
        """The tools in the chat-completions form (raises ValueError naming a bad one)."""
        if not self.tools:
            return None
        out = []
        for i, tool in enumerate(self.tools):
            try:
                out.append(FunctionTool.model_validate(tool).as_chat_tool())
            except ValidationError as exc:
                raise ValueError(f"tools.{i}: {exc.errors()[0]['msg']}") from None
        return out

    def input_messages(self) -> list[ChatMessage]:
        """The request's input as chat messages: function calls join the assistant message before them, and
        function call outputs are tool messages (as transformers serve reads them)."""
        if isinstance(self.input, str):
            return [ChatMessage(role="user", content=self.input)]
        out: list[ChatMessage] = []
        for item in self.input:
            if isinstance(item, MessageItem):
                out.append(ChatMessage(role=item.role, content=item.text()))
            elif isinstance(item, CompactionItem):
                out.append(ChatMessage(role="assistant", content=item.summary()))
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                if out and out[-1].role == "assistant":
                    out[-1] = ChatMessage(role="assistant", content=out[-1].content,
                                          tool_calls=[*(c.model_dump() for c in out[-1].tool_calls or ()), call])
                else:
                    out.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
            else:
                out.append(ChatMessage(role="tool", tool_call_id=item.call_id, content=item.output))
        return out


class CompactRequest(OpenAIRequest):
    """``POST /v1/responses/compact``: the conversation to compact, as a Responses request gives one (its
    ``input``, after the chain ``previous_response_id`` names).

    Example:
        >>> CompactRequest.model_validate({"model": "m", "input": "hi"}).as_request("summarize").input[-1].text()
        'summarize'
    """

    model: str
    input: str | list[Item] | None = None
    previous_response_id: str | None = None
    instructions: str | None = None
    prompt_cache_key: str | None = None
    cache_salt: str | None = None  # vLLM's extension, as in every route

    _text_only = field_validator("input", mode="before")(classmethod(lambda cls, items: readable(items)))

    def unsupported(self) -> None:
        return None

    def as_request(self, prompt: str, **fields) -> ResponsesRequest:
        """The Responses request that asks for the summary: the conversation, then `prompt` as a user message."""
        items = [{"type": "message", "role": "user", "content": self.input}] if isinstance(self.input, str) else \
            [item.model_dump() for item in self.input or ()]
        return ResponsesRequest.model_validate({
            "model": self.model, "input": [*items, {"type": "message", "role": "user", "content": prompt}],
            "previous_response_id": self.previous_response_id, "instructions": self.instructions,
            "cache_salt": self.cache_salt, "store": False, **fields})


def _named(choice: dict) -> str:
    """The function a Responses ``tool_choice`` names (ValueError for a malformed one)."""
    try:
        return FunctionToolChoice.model_validate(choice).name
    except ValidationError:
        raise ValueError('a named `tool_choice` is {"type": "function", "name": ...}') from None


def chat_tool_choice(choice):
    """A Responses ``tool_choice`` in the chat-completions form (a named function nests its name).

    Example:
        >>> chat_tool_choice({"type": "function", "name": "f"})
        {'type': 'function', 'function': {'name': 'f'}}
    """
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": _named(choice)}}
    return choice


def chat_request(body: ResponsesRequest, history: list[dict]) -> ChatCompletionRequest:
    """The chat turn a Responses request asks for: `history` (the chain's messages), then its input, after its
    ``instructions`` as a system message (raises ValueError or ValidationError naming what is wrong).

    Example:
        >>> chat_request(ResponsesRequest(model="m", input="hi", instructions="be brief"), []).messages[0].role
        'system'
    """
    messages = [ChatMessage.model_validate(m) for m in history] + body.input_messages()
    if body.instructions:
        messages.insert(0, ChatMessage(role="system", content=body.instructions))
    return ChatCompletionRequest(
        model=body.model, messages=messages, max_completion_tokens=body.max_output_tokens,
        temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, frequency_penalty=body.frequency_penalty,
        presence_penalty=body.presence_penalty, tools=body.chat_tools(),
        tool_choice=chat_tool_choice(body.tool_choice),
        parallel_tool_calls=body.parallel_tool_calls, user=body.user, cache_salt=body.cache_salt,
        prompt_cache_key=body.prompt_cache_key, prompt_cache_retention=body.prompt_cache_retention,
        stream=body.stream, response_format=(body.text or {}).get("format"))


def output_items(content: str | None, calls: list, status: str = "completed") -> tuple[list[dict], dict]:
    """A reply's output items and the reply as a chat message (what a chain keeps), from its content (None: only
    calls) and its tool calls (`protocol.chat.ToolCallOut`); a message cut short is `status` ``incomplete``.

    Example:
        >>> items, message = output_items("hi", [])
        >>> items[0]["content"][0]["text"], message
        ('hi', {'role': 'assistant', 'content': 'hi'})
    """
    items = []
    if content is not None or not calls:
        items.append(message_item(f"msg_{uuid.uuid4().hex}", content or "", status))
    for call in calls:
        items.append(call_item(call, "completed"))
    message = ChatMessage(role="assistant", content=content, tool_calls=[c.model_dump() for c in calls] or None)
    return items, message.model_dump(exclude_none=True)


def message_item(item_id: str, text: str, status: str) -> dict:
    """An output message item of a response (its text as one ``output_text`` part once completed, or cut short:
    ``incomplete``).

    Example:
        >>> message_item("msg_1", "hi", "completed")["content"][0]["text"]
        'hi'
    """
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}] if status != "in_progress" else []}


def call_item(call, status: str) -> dict:
    """A function call output item of a response, from a reply's tool call (`ToolCallOut`).

    Example:
        >>> from hf_attnstore.serving.protocol import ToolCallOut
        >>> call_item(ToolCallOut(id="call_1", function={"name": "f", "arguments": "{}"}), "completed")["id"]
        'fc_1'
    """
    return {"type": "function_call", "id": f"fc_{call.id.removeprefix('call_')}", "call_id": call.id,
            "name": call.function.name, "arguments": call.function.arguments, "status": status}


def response_object(body: ResponsesRequest, response_id: str, model_name: str, status: str, output: list[dict],
                    usage: dict | None = None, incomplete: str | None = None, info: dict | None = None, *,
                    created_at: int, used: dict, completed_at: int | None = None) -> dict:
    """A response object as the spec's schema has it (OpenAI's): every field, the request's settings echoed as
    they were applied (`used`: the ``temperature``, ``top_p`` and ``max_output_tokens`` the turn ran with, the
    server's defaults where the request set none), created at `created_at` (the same in every event of the
    response and when it is read back), `completed_at` once done; with our ``attnstore`` object when given.

    Example:
        >>> used = {"temperature": 0.0, "top_p": 1.0, "max_output_tokens": 16}
        >>> r = response_object(ResponsesRequest(model="m", input="hi"), "resp_1", "m", "completed", [],
        ...                     created_at=1, used=used, completed_at=2)
        >>> r["status"], r["max_output_tokens"], r["truncation"]
        ('completed', 16, 'disabled')
    """
    out = {"id": response_id, "object": "response", "created_at": created_at, "completed_at": completed_at,
           "model": model_name, "status": status, "error": None,
           "incomplete_details": {"reason": incomplete} if incomplete else None,
           "instructions": body.instructions, "output": output, "previous_response_id": body.previous_response_id,
           "parallel_tool_calls": body.parallel_tool_calls is not False, "store": body.store, "background": False,
           "temperature": used["temperature"], "top_p": used["top_p"],
           "presence_penalty": body.presence_penalty or 0.0, "frequency_penalty": body.frequency_penalty or 0.0,
           "top_logprobs": body.top_logprobs or 0, "reasoning": {"effort": None, "summary": None},
           "tool_choice": body.tool_choice or "auto",
           "tools": [{"description": None, "parameters": None, "strict": None, **tool} for tool in body.tools or ()],
           "max_output_tokens": used["max_output_tokens"], "max_tool_calls": None, "metadata": body.metadata or {},
           "text": {"format": (body.text or {}).get("format") or {"type": "text"}},
           "truncation": body.truncation or "disabled", "service_tier": "default",
           "safety_identifier": body.safety_identifier, "prompt_cache_key": body.prompt_cache_key, "user": body.user,
           "usage": usage}
    if info is not None:
        out["attnstore"] = info
    return out
