"""The OpenAI chat-completions schema, as typed models (the subset this server implements).

Requests accept OpenAI's fields; fields this server does not implement are refused with a 400 naming them
when they would change the answer (``n > 1``, ``tools``, ``logprobs``), and ignored otherwise (OpenAI
clients send many optional fields). Responses carry OpenAI's fields, ``usage.prompt_tokens_details
.cached_tokens`` included (the prompt tokens whose KV was reused), plus an ``attnstore`` object with where
the KV came from.
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def as_template_message(self) -> dict:
        role = "system" if self.role == "developer" else self.role  # OpenAI's newer name for system
        return {"role": role, "content": self.text()}


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool = False
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    user: str | None = None
    tools: list | None = None
    logprobs: bool | None = None
    stream_options: dict | None = None

    @field_validator("messages")
    @classmethod
    def _last_is_user(cls, messages: list[ChatMessage]) -> list[ChatMessage]:
        if messages[-1].role not in ("user", "system", "developer"):
            raise ValueError("the last message must come from the user (the server writes the assistant's reply)")
        return messages

    def unsupported(self) -> tuple[str, str] | None:
        """The first requested feature this server does not implement, as (field, what), or None."""
        if self.n != 1:
            return "n", "`n` other than 1"
        if self.tools:
            return "tools", "`tools`"
        if self.logprobs:
            return "logprobs", "`logprobs`"
        return None

    def max_new_tokens(self, default: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default


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


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class Choice(BaseModel):
    index: int = 0
    message: ResponseMessage
    finish_reason: Literal["stop", "length"]


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


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: Literal["stop", "length"] | None = None


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
