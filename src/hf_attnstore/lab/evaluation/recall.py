"""Recall across turns with a session kept sparse: a fact stated in the first turn, asked for turns later.

Each trial is a chat: the user states a fact (an access code), the assistant acknowledges, `filler_turns`
real ShareGPT exchanges follow (each message cut to `filler_tokens` tokens), then the user asks for the code
and the assistant's answer is begun for it. Every turn resumes the stored session through an
:class:`~hf_attnstore.cache.AttnStoreCache` with the variant's `kv_budget`, so the question is answered from
whatever the policy kept of the fact since the turns that followed it. Two outcomes per variant: how often
the greedy answer contains the code, and the code tokens' mean negative log-likelihood (teacher forced), which
moves even where a small model's greedy answer does not.

Example:
    >>> recall_across_turns(model, tokenizer, {"dense": None, "alisa": SparseConfig(0.2)})  # doctest: +SKIP
    {'dense': RecallResult(correct=17, trials=20, nll=0.41), 'alisa': RecallResult(...)}
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from ...cache.cache import AttnStoreCache
from ...cache.chat import ChatTokens, clip_text
from ...cache.config import SparseConfig
from ...cache.upstream import cache_kwargs
from ...store import AttnStore
from ..data import load_sharegpt

NAMES = ("Alice", "Bruno", "Chiara", "Dmitri", "Esther", "Farid", "Greta", "Hiro", "Ines", "Jonas")


@dataclass(frozen=True)
class RecallResult:
    """How a variant recalled the fact over the trials.

    Attributes:
        correct: Trials whose greedy answer contains the code.
        trials: Trials run.
        nll: Mean negative log-likelihood of the code's tokens after the answer's start (nats per token).

    Example:
        >>> RecallResult(correct=17, trials=20, nll=0.4).accuracy
        0.85
    """

    correct: int
    trials: int
    nll: float

    @property
    def accuracy(self) -> float:
        return self.correct / self.trials if self.trials else 0.0


def recall_chats(tokenizer, trials: int, filler_turns: int, filler_tokens: int, seed: int = 0):
    """The trials' chats: ``(messages before the question, question, answer start, code)`` each."""
    rng = random.Random(seed)
    conversations = [c for c in load_sharegpt(limit=8 * trials * filler_turns) if len(c.turns) >= 1]
    pairs = [pair for c in conversations for pair in c.turns]
    if len(pairs) < trials * filler_turns:
        raise ValueError(f"ShareGPT gave {len(pairs)} exchanges; {trials * filler_turns} are needed")
    def cut(text: str) -> str:
        return clip_text(tokenizer, text, filler_tokens)

    chats = []
    for t in range(trials):
        name, code = NAMES[t % len(NAMES)], f"{rng.randrange(1000, 10000)}"
        messages = [{"role": "user", "content": f"Please remember this: the access code of {name} is {code}."},
                    {"role": "assistant", "content": f"Noted: the access code of {name} is {code}."}]
        for user, assistant in pairs[t * filler_turns : (t + 1) * filler_turns]:
            messages += [{"role": "user", "content": cut(user)}, {"role": "assistant", "content": cut(assistant)}]
        question = {"role": "user", "content": f"What is the access code of {name}? Answer with the code only."}
        chats.append((messages, question, f"The access code of {name} is", code))
    return chats


@torch.no_grad()
def recall_across_turns(model, tokenizer, variants: dict[str, SparseConfig | None], *, trials: int = 20,
                        filler_turns: int = 6, filler_tokens: int = 96, seed: int = 0) -> dict[str, RecallResult]:
    """Runs every trial's chat once per variant (its own store) and reports recall per variant.

    Args:
        model: A causal LM with a chat template that :class:`AttnStoreCache` can keep sparse.
        tokenizer: Its tokenizer.
        variants: Name to ``kv_budget`` (None: dense).
        trials: Chats (each with its own name and code).
        filler_turns: Exchanges between the fact and the question.
        filler_tokens: Tokens each filler message is cut to.
        seed: Seeds the codes.
    """
    chats = recall_chats(tokenizer, trials, filler_turns, filler_tokens, seed)
    chat = ChatTokens(tokenizer)  # token-level turns: the stored ids are never re-tokenized
    out = {}
    for name, config in variants.items():
        correct, nll = 0, 0.0
        for i, (messages, question, start, code) in enumerate(chats):
            store = AttnStore(host_bytes=2**62)
            try:
                session = f"recall-{i}"
                # One turn per user message, each saved to the session; the recorded replies are teacher forced.
                ids = chat.first_turn(messages[0]["content"])
                for reply, user in zip(messages[1::2], [*messages[2::2], question]):
                    with AttnStoreCache(model, store, session, ids, kv_budget=config) as cache:
                        model(cache.input_ids[:, cache.reused_tokens :], **cache_kwargs(cache))
                    ids = chat.next_turn(torch.cat([ids, chat.reply_ids(reply["content"])], dim=1), user["content"])
                prompt = torch.cat([ids, _ids(tokenizer, start)], dim=1)
                answer = _ids(tokenizer, f" {code}")
                scored = torch.cat([prompt, answer], dim=1)
                cache = AttnStoreCache(model, store, session, scored, kv_budget=config, save=False)
                logits = model(cache.input_ids[:, cache.reused_tokens :], **cache_kwargs(cache)).logits[0]
                n = answer.shape[1]
                nll += float(torch.nn.functional.cross_entropy(logits[-n - 1 : -1].float(), answer[0]))
                cache = AttnStoreCache(model, store, session, prompt, kv_budget=config, save=False)
                out_ids = model.generate(cache.input_ids, **cache_kwargs(cache), max_new_tokens=8, do_sample=False,
                                         pad_token_id=tokenizer.eos_token_id)
                correct += code in tokenizer.decode(out_ids[0, prompt.shape[1] :])
            finally:
                store.close()
        out[name] = RecallResult(correct, len(chats), nll / len(chats))
    return out


def _ids(tokenizer, text: str) -> torch.Tensor:
    """`text`'s ids without special tokens, ``[1, n]``."""
    return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long).view(1, -1)
