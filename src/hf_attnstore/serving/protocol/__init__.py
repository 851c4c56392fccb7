"""The OpenAI schema this server speaks, every route's in one package (vLLM's ``entrypoints/openai/protocol.py``):
requests and responses as typed models, one file per API.

- `common`: the base of every request model (OpenAI's typing: an explicit ``null`` is "not given", no value is
  coerced to another type, a 400 naming the field), the error object, and the parts the APIs share (``usage``,
  our ``attnstore`` object, ``stream_options``, ``/v1/models``).
- `chat`: ``POST /v1/chat/completions``; `completions`: ``POST /v1/completions``; `responses`: ``POST
  /v1/responses`` (and its translation into a chat request).
- `limits`: `RequestLimits`, every size a client gives bounded (from the context window and the server's
  configuration): over one, a 400 naming the field.

Example:
    >>> from hf_attnstore.serving.protocol import ChatCompletionRequest
    >>> ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
    ...                                       "stream": None}).stream
    False
"""

from .chat import (ChatCompletion, ChatCompletionChunk, ChatCompletionRequest, ChatMessage, Choice, ChunkChoice, Delta,
                   FunctionDef, FunctionDelta, NamedToolChoice, ResponseMessage, TextPart, ToolCallDelta, ToolCallIn,
                   ToolCallOut, ToolDef)
from .common import (OTHER_TOOL_CHOICE, TOOL_NAME, AttnStoreInfo, CompletionBase, FunctionCall, ModelCard, ModelList,
                     OpenAIRequest, PromptTokensDetails, SamplingDefaults, SGLangFields, StreamOptions, Usage, check_tool_choice, echo_problem,
                     error_body, error_field, error_tag, json_object_text, response_format_schema, stop_strings,
                     surrogate_at)
from .completions import DEFAULT_MAX_TOKENS, CompletionRequest, completion_logprobs, completion_object
from .limits import RequestLimits
from .responses import (CompactionItem, CompactRequest, FunctionCallItem, FunctionCallOutputItem, FunctionTool, FunctionToolChoice, InputText, Item,
                        MessageItem, ResponsesRequest, call_item, chat_request, message_item, output_items,
                        compaction_content, response_object)

__all__ = [
    "AttnStoreInfo", "ChatCompletion", "ChatCompletionChunk", "ChatCompletionRequest", "ChatMessage", "Choice",
    "ChunkChoice", "CompactRequest", "CompactionItem", "CompletionBase", "CompletionRequest", "DEFAULT_MAX_TOKENS", "Delta", "FunctionDelta", "OTHER_TOOL_CHOICE",
    "FunctionCall", "FunctionCallItem", "FunctionCallOutputItem", "FunctionDef", "FunctionTool", "FunctionToolChoice",
    "InputText", "Item", "MessageItem", "ModelCard", "ModelList", "NamedToolChoice", "OpenAIRequest",
    "PromptTokensDetails", "RequestLimits", "ResponseMessage", "ResponsesRequest", "SGLangFields", "SamplingDefaults", "StreamOptions", "TOOL_NAME",
    "TextPart", "ToolCallDelta", "ToolCallIn", "ToolCallOut", "ToolDef", "Usage", "call_item", "chat_request",
    "check_tool_choice", "compaction_content", "completion_logprobs", "completion_object", "echo_problem", "error_body", "error_field",
    "error_tag", "json_object_text", "message_item", "output_items", "response_format_schema", "response_object",
    "stop_strings", "surrogate_at",
]
