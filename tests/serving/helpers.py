"""A BPE tokenizer whose merges make re-tokenization differ ("a" "a" -> "aa"), a forced-reply processor, and a
tiny app over a store."""

from __future__ import annotations

import torch
from transformers import LogitsProcessor

from ..conftest import CHAT_TEMPLATE, VOCAB


def bpe_tokenizer():
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {t: i for i, t in enumerate(specials + chars + ["aa", "<unk>"])}
    assert len(vocab) <= VOCAB
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "a")], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<|end|>",
                                   additional_special_tokens=specials[2:])
    fast.chat_template = CHAT_TEMPLATE
    return fast


class ForceReply(LogitsProcessor):
    """Makes the model answer `reply` (ids) then the end token, whatever it would have said: the reply starts
    after the last `<|assistant|>` token of the sequence."""

    def __init__(self, tokenizer, reply: list[int]):
        self.start = tokenizer.convert_tokens_to_ids("<|assistant|>")
        self.end = tokenizer.convert_tokens_to_ids("<|end|>")
        self.reply = reply

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        seq = input_ids[0].tolist()
        done = len(seq) - 1 - seq[::-1].index(self.start)
        step = len(seq) - 1 - done
        token = self.reply[step] if step < len(self.reply) else self.end
        forced = torch.full_like(scores, float("-inf"))
        forced[:, token] = 0.0
        return forced


class Prefer(ForceReply):
    """Makes `reply` (ids) then the end token by far the likeliest choice, without forbidding the rest: a
    constraint that comes after it (a grammar, a forced turn's end) still decides among what it allows."""

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        forced = super().__call__(input_ids, scores)
        return scores + 1e4 * (forced == 0.0)
