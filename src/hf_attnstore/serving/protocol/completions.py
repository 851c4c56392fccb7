"""The completions schema (``POST /v1/completions``, OpenAI's legacy text completions): the request and the
completion object (whole, or one chunk of a stream).
"""

from __future__ import annotations

import time

from pydantic import Field

from .common import SGLangFields, StreamOptions, stop_strings

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


class CompletionRequest(SGLangFields):
    """``POST /v1/completions``: a prompt (text or token ids) to continue; one prompt and one completion a request.

    Example:
        >>> CompletionRequest.model_validate({"model": "m", "prompt": [1, 2], "max_tokens": None}).one_prompt()
        [1, 2]
    """

    model: str
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    echo: bool = False
    n: int = 1
    best_of: int | None = None
    logprobs: int | None = Field(default=None, ge=0, le=5)  # OpenAI's range: alternatives per token
    suffix: str | None = None
    user: str | None = None
    cache_salt: str | None = None

    def unsupported(self) -> tuple[str, str] | None:
        sglang = self.sglang_unsupported()
        if sglang is not None:
            return sglang
        if self.n != 1:
            return "n", "`n` other than 1"
        if self.best_of not in (None, 1):
            return "best_of", "`best_of` other than 1"
        if self.suffix:
            return "suffix", "`suffix` (insertion)"
        return None

    def one_prompt(self) -> str | list[int]:
        """The prompt: text or ids (a list of one prompt is taken; several are refused, as `n` > 1 is)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ValueError("several prompts in one request are not supported: send one per request")
            prompt = prompt[0]
        if not prompt:
            raise ValueError("the prompt is empty")
        return prompt

    def stops(self) -> list[str]:
        """The stop strings, as a list (OpenAI takes one string or a list)."""
        return stop_strings(self.stop)


def completion_object(completion_id: str, model_name: str, text: str, finish: str | None, logprobs: dict | None = None) -> dict:
    """A completion object (whole, or one chunk of a stream): one choice of `text`.

    Example:
        >>> completion_object("cmpl-1", "m", "hi", "stop")["choices"]
        [{'index': 0, 'text': 'hi', 'logprobs': None, 'finish_reason': 'stop'}]
    """
    return {"id": completion_id, "object": "text_completion", "created": int(time.time()), "model": model_name,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}]}


def completion_logprobs(tokenizer, reply, offset: int) -> dict | None:
    """A reply's ``logprobs`` in the completions form (tokens, their log-probabilities, the alternatives by
    token text, each token's offset in the returned text), or None without them.

    Example:
        >>> completion_logprobs(tokenizer, reply, 0) is None  # a reply without log-probabilities  # doctest: +SKIP
        True
    """
    if reply.logprobs is None:
        return None
    special = set(tokenizer.all_special_ids)  # not in the text either
    kept = [entry for entry in reply.logprobs if entry[0] not in special]
    tokens = [tokenizer.decode([token]) for token, _, _ in kept]
    offsets, at = [], offset
    for text in tokens:
        offsets.append(at)
        at += len(text)
    return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in kept],
            "top_logprobs": [{tokenizer.decode([t]): lp for t, lp in top} for _, _, top in kept],
            "text_offset": offsets}
