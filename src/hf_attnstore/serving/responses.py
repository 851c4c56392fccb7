"""OpenAI's Responses API over the session store: the request's schema, its translation into a chat turn, and
the stored responses that ``previous_response_id`` chains from.

A response id names a point in a conversation: the messages up to its reply. A request with
``previous_response_id`` sends only what is new; the server rebuilds the conversation from the chain (each
stored response keeps only its own messages, its input and reply, beside the ids of its session at that point,
4 bytes a token: a chain's text costs n, its ids n squared over n steps, bounded by `ResponseStore`'s limits) and
runs it as a chat turn. The conversation's ids are rendered piece by piece and its replies get back the ids they were
generated as (`ReplyMemo`, re-seeded from the stored response, so this holds after a restart too): the turn
continues the session whose KV holds that point, or, after a restart or from an older response (a branch),
starts a session that reuses the longest stored prefix (the store's prefix sharing). ``instructions`` are not
carried over from the previous response, as OpenAI defines them.

Stored responses live in memory (the most recent `max_responses`) and, with a folder, one JSON file each
(written atomically; read back through the same validation as a request, never unpickled), so a chain survives a
restart. Ids are ``resp_`` and 32 hex digits; any other id is unknown.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import os
import re
import sys
import threading
import time
import uuid
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Union

from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator

from ..store.entry import validate_session_id
from .openai_schema import OpenAIRequest, check_tool_choice
from .protocol import FORCING_TOOL_CHOICE, ChatCompletionRequest, ChatMessage, ToolDef, json_object_text

logger = logging.getLogger(__name__)
RESPONSE_ID = re.compile(r"resp_[0-9a-f]{32}")
MAX_METADATA = 16  # OpenAI's limits: 16 pairs, keys of 64 characters, values of 512
FORMAT = 1


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


class InputText(OpenAIRequest):
    type: Literal["input_text", "output_text", "text"]
    text: str


class MessageItem(OpenAIRequest):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(OpenAIRequest):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, arguments: str) -> str:
        return json_object_text(arguments)


class FunctionCallOutputItem(OpenAIRequest):
    type: Literal["function_call_output"]
    call_id: str
    output: str


Item = Union[MessageItem, FunctionCallItem, FunctionCallOutputItem]


class FunctionTool(OpenAIRequest):
    """A tool in the Responses form (flat: ``name`` beside ``type``)."""

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict | None = None

    def as_chat_tool(self) -> ToolDef:
        return ToolDef(type="function", function={"name": self.name, "description": self.description,
                                                  "parameters": self.parameters})


class FunctionToolChoice(OpenAIRequest):
    """A ``tool_choice`` that names a function, in the Responses form (flat)."""

    type: Literal["function"]
    name: str


class ResponsesRequest(OpenAIRequest):
    """``POST /v1/responses``: the fields this server reads. Fields that would change the answer and are not
    implemented are refused by name (`unsupported`)."""

    model: str
    input: str | list[Item] = Field(min_length=1)
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    tools: list[dict] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict | None = None
    parallel_tool_calls: bool | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    text: dict | None = None
    cache_salt: str | None = None  # vLLM's extension, as in chat completions
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
        for what in self.include or ():
            if "logprobs" in what:
                return "include", f"`include` of {what[:80]!r}"
        for i, tool in enumerate(self.tools or ()):
            if tool.get("type") != "function":
                return f"tools.{i}.type", f"tools of type {str(tool.get('type'))[:50]!r} (only functions)"
        if self.tools and self.tool_choice not in (None, "auto", "none"):
            return "tool_choice", FORCING_TOOL_CHOICE
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


def _named(choice: dict) -> str:
    """The function a Responses ``tool_choice`` names (ValueError for a malformed one)."""
    try:
        return FunctionToolChoice.model_validate(choice).name
    except ValidationError:
        raise ValueError('a named `tool_choice` is {"type": "function", "name": ...}') from None


@dataclass
class StoredResponse:
    """A response kept for ``previous_response_id`` and ``GET``: its own input and reply (the chain gives the
    rest), what the memo needs to give the reply its exact ids again, and the response object as returned."""

    id: str
    scope: str  # the request's cache_salt scope: a chain continues within its salt only
    session_id: str  # the session the reply was stored in
    point: str  # where that session stood after it (`ChatEngine.session_point`)
    client_ids: array  # the session's ids after the reply, as the client sends them ('i': int32)
    model_ids: array  # and as the model saw them (they differ after truncation)
    previous_id: str | None
    input: list[dict]  # this request's new messages (chat form, as `ChatMessage.model_dump`)
    output: dict  # the reply as an assistant message (chat form)
    raw: str  # the reply's text as generated (special tokens kept when it has calls)
    content_ids: list[int]  # the reply's ids as generated, without the closing end of turn
    calls: bool  # the reply has tool calls (memo'd under `tools.call_key`)
    body: dict  # the response object
    created: float = field(default_factory=time.time)

    def to_json(self) -> dict:
        return {"format": FORMAT, "id": self.id, "scope": self.scope, "session_id": self.session_id,
                "point": self.point, "client_ids": _ids_text(self.client_ids), "model_ids": _ids_text(self.model_ids),
                "previous_id": self.previous_id,
                "input": self.input, "output": self.output, "raw": self.raw, "content_ids": self.content_ids,
                "calls": self.calls, "body": self.body, "created": self.created}

    @classmethod
    def from_json(cls, data: dict) -> "StoredResponse":
        """Validated as a request would be (messages through `ChatMessage`); raises ValueError otherwise."""
        try:
            if data.get("format") != FORMAT or not RESPONSE_ID.fullmatch(str(data.get("id"))):
                raise ValueError("not a stored response of this format")
            previous = data["previous_id"]
            if previous is not None and not RESPONSE_ID.fullmatch(str(previous)):
                raise ValueError("bad previous id")
            messages = [ChatMessage.model_validate(m).model_dump(exclude_none=True) for m in data["input"]]
            output = ChatMessage.model_validate(data["output"]).model_dump(exclude_none=True)
            ids = data["content_ids"]
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                    for t in ids):
                raise ValueError("bad content ids")
            for name, kind in (("scope", str), ("session_id", str), ("point", str), ("raw", str), ("calls", bool),
                               ("body", dict), ("created", float)):
                if not isinstance(data[name], kind):
                    raise ValueError(f"bad {name}")
            validate_session_id(data["session_id"])
            return cls(data["id"], data["scope"], data["session_id"], data["point"], _ids_array(data["client_ids"]),
                       _ids_array(data["model_ids"]), previous, messages, output, data["raw"], ids, data["calls"],
                       data["body"], data["created"])
        except (KeyError, TypeError, AttributeError, ValidationError, binascii.Error) as exc:
            raise ValueError(f"damaged stored response: {exc}") from None


def ids_array(ids) -> array:
    """Token ids, compactly (4 bytes each: a stored response keeps its session's ids)."""
    return array("i", ids)


def _ids_text(ids: array) -> str:
    ids = array("i", ids)
    if sys.byteorder != "little":
        ids.byteswap()  # stored little-endian, whatever the machine
    return base64.b64encode(ids.tobytes()).decode("ascii")


def _ids_array(text: str) -> array:
    data = base64.b64decode(text.encode("ascii"), validate=True)
    if len(data) % 4:
        raise ValueError("bad ids")
    ids = array("i")
    ids.frombytes(data)
    if sys.byteorder != "little":
        ids.byteswap()
    if any(t < 0 for t in ids):
        raise ValueError("bad ids")
    return ids


class ResponseStore:
    """Stored responses: the most recent `max_responses`, in memory (at most `max_memory_bytes` of them, counted
    as their JSON) and, with `folder`, on disk (one JSON file each, so they survive a restart; the oldest files go
    beyond `max_responses`). Without a folder, a response pushed out of memory is gone.

    Example:
        >>> responses = ResponseStore(max_responses=2)
        >>> responses.get("resp_" + "0" * 32) is None
        True
    """

    def __init__(self, folder: str | os.PathLike | None = None, max_responses: int = 10_000,
                 max_memory_bytes: int = 256 << 20):
        for name, value in (("max_responses", max_responses), ("max_memory_bytes", max_memory_bytes)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"`{name}` must be a positive integer, got {value!r}")
        self.folder = Path(folder) if folder is not None else None
        self.max_responses, self.max_memory_bytes = max_responses, max_memory_bytes
        self._memory: OrderedDict[str, StoredResponse] = OrderedDict()
        self._sizes: dict[str, int] = {}  # bytes of each response in memory (its JSON)
        self._bytes = 0
        self._on_disk: OrderedDict[str, None] = OrderedDict()  # ids with a file, oldest first
        self._lock = threading.Lock()
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)
            files = sorted(self.folder.glob("resp_*.json"), key=lambda p: p.stat().st_mtime)
            for path in files:
                if RESPONSE_ID.fullmatch(path.stem):
                    self._on_disk[path.stem] = None
            for leftover in self.folder.glob(".tmp-*"):  # a crash's half-written file
                leftover.unlink(missing_ok=True)

    def put(self, record: StoredResponse) -> None:
        """Keeps `record` (replacing one with its id). A failed write to disk is logged: the response is then
        kept in memory only."""
        text = json.dumps(record.to_json())
        with self._lock:
            self._keep(record, len(text))
            if self.folder is None:
                return
            try:
                self._write(record.id, text)
            except OSError as exc:
                logger.warning("stored response %s kept in memory only: %s", record.id, exc)
                return
            self._on_disk[record.id] = None
            self._on_disk.move_to_end(record.id)
            while len(self._on_disk) > self.max_responses:
                old, _ = self._on_disk.popitem(last=False)
                (self.folder / f"{old}.json").unlink(missing_ok=True)

    def _keep(self, record: StoredResponse, size: int) -> None:
        """Holds `record` in memory; the least recently used go beyond the count or the bytes (not the newest)."""
        self._bytes -= self._sizes.pop(record.id, 0)
        self._memory[record.id] = record
        self._memory.move_to_end(record.id)
        self._sizes[record.id] = size
        self._bytes += size
        while len(self._memory) > 1 and (len(self._memory) > self.max_responses or
                                         self._bytes > self.max_memory_bytes):
            old, _ = self._memory.popitem(last=False)
            self._bytes -= self._sizes.pop(old, 0)

    def _write(self, response_id: str, text: str) -> None:
        tmp = self.folder / f".tmp-{response_id}"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.folder / f"{response_id}.json")

    def get(self, response_id: str) -> StoredResponse | None:
        """The stored response, or None (unknown, deleted, malformed id, or a damaged file: logged)."""
        if not isinstance(response_id, str) or not RESPONSE_ID.fullmatch(response_id):
            return None
        with self._lock:
            record = self._memory.get(response_id)
            if record is not None or self.folder is None or response_id not in self._on_disk:
                return record
            try:
                with open(self.folder / f"{response_id}.json", encoding="utf-8") as f:
                    text = f.read()
                record = StoredResponse.from_json(json.loads(text))
            except (OSError, ValueError, RecursionError) as exc:
                logger.warning("stored response %s cannot be read (%s): treated as unknown", response_id, exc)
                return None
            if record.id != response_id:
                return None
            self._keep(record, len(text))
            return record

    def delete(self, response_id: str) -> bool:
        """Forgets a response; False if it was unknown. Responses chained from it can no longer be continued."""
        if self.get(response_id) is None:
            return False
        with self._lock:
            self._memory.pop(response_id, None)
            self._bytes -= self._sizes.pop(response_id, 0)
            if self.folder is not None and response_id in self._on_disk:
                del self._on_disk[response_id]
                (self.folder / f"{response_id}.json").unlink(missing_ok=True)
            return True

    def chain(self, record: StoredResponse, max_steps: int) -> list[StoredResponse] | None:
        """`record` and the responses it continues, oldest first; None when one of them is gone or the chain is
        longer than `max_steps` (or loops)."""
        out = [record]
        while out[-1].previous_id is not None:
            if len(out) >= max_steps:
                return None
            previous = self.get(out[-1].previous_id)
            if previous is None:
                return None
            out.append(previous)
        return out[::-1]


def chat_request(body: ResponsesRequest, history: list[dict]) -> ChatCompletionRequest:
    """The chat turn a Responses request asks for: `history` (the chain's messages), then its input, after its
    ``instructions`` as a system message (raises ValueError or ValidationError naming what is wrong)."""
    messages = [ChatMessage.model_validate(m) for m in history] + body.input_messages()
    if body.instructions:
        messages.insert(0, ChatMessage(role="system", content=body.instructions))
    return ChatCompletionRequest(
        model=body.model, messages=messages, max_completion_tokens=body.max_output_tokens,
        temperature=body.temperature, top_p=body.top_p, tools=body.chat_tools(), tool_choice=body.tool_choice,
        parallel_tool_calls=body.parallel_tool_calls, user=body.user, cache_salt=body.cache_salt,
        stream=body.stream, response_format=(body.text or {}).get("format"))
