"""OpenAI's `frequency_penalty` and `presence_penalty`, as a transformers logits processor.

transformers' own `repetition_penalty` is multiplicative and counts the prompt too; OpenAI's penalties (and
vLLM's, which follow them) subtract from a token's logit in proportion to how often the *reply* has used it.
Being a `LogitsProcessor`, it goes through `generate`'s construction like any other (`logits_processor=`), so the
batch runner applies it exactly as a solo turn does (serving/batching.py).
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessor


class OpenAIPenalties(LogitsProcessor):
    """Lowers each token's logit by `frequency` times the number of times the reply has produced it so far, and
    by `presence` once if it has (OpenAI's definition; both in [-2, 2]). Only the reply's tokens count: the first
    call sees the prompt alone and remembers its length, so one instance serves one turn.

    Example:
        >>> import torch
        >>> penalties = OpenAIPenalties(frequency=1.0, presence=0.5)
        >>> penalties(torch.tensor([[1, 2]]), torch.zeros(1, 4)).tolist()  # the prompt: nothing generated yet
        [[0.0, 0.0, 0.0, 0.0]]
        >>> penalties(torch.tensor([[1, 2, 3, 3]]), torch.zeros(1, 4)).tolist()  # the reply so far: 3, 3
        [[0.0, 0.0, 0.0, -2.5]]
    """

    def __init__(self, frequency: float = 0.0, presence: float = 0.0):
        self.frequency, self.presence = float(frequency), float(presence)
        self.start: int | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.start is None:
            self.start = int(input_ids.shape[1])
        generated = input_ids[:, self.start:]
        if generated.shape[1] == 0:
            return scores
        counts = torch.zeros_like(scores).scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)
