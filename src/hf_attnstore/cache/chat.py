"""Token-level chat turns: a session's history is its token ids, never re-tokenized text.

Re-tokenizing a rendered conversation can change tokens (a generated "ĊĊ" comes back as two "Ċ"), which
would break the prefix match with the stored KV. So each turn appends to the ids: the generated ids, the
template's end-of-turn tokens, then the next user message rendered by the tokenizer's own chat template.
The pieces are found by rendering small probe conversations and taking differences of the text.
"""

from __future__ import annotations

import torch

_PROBE_USER, _PROBE_REPLY = "\x00u\x00", "\x00a\x00"


class ChatTokens:
    """Builds the ids of successive chat turns with a tokenizer's chat template.

    Args:
        tokenizer: A tokenizer with a chat template.
        system_prompt: Optional system message placed first.

    Example (a word-level tokenizer with a tiny chat template; any chat model's tokenizer works alike):
        >>> from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        >>> from transformers import PreTrainedTokenizerFast
        >>> words = ["[UNK]", "<eot>", "user:", "bot:", "hi", "hello", "how", "are", "you", "fine"]
        >>> core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
        >>> core.pre_tokenizer, core.decoder = pre_tokenizers.WhitespaceSplit(), decoders.WordPiece()
        >>> tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]")
        >>> tokenizer.chat_template = ("{% for m in messages %}{{ 'user: ' if m.role == 'user' else 'bot: ' }}"
        ...     "{{ m.content }} <eot> {% endfor %}{% if add_generation_prompt %}bot: {% endif %}")
        >>> chat = ChatTokens(tokenizer)
        >>> ids = chat.first_turn("hi")  # "user: hi <eot> bot:"
        >>> ids.tolist(), chat.eot_ids
        ([[2, 4, 1, 3]], [1])
        >>> out = torch.cat([ids, torch.tensor([[9]])], dim=1)  # the model replied "fine"
        >>> chat.reply_text(out[0, ids.shape[1]:])
        'fine'
        >>> chat.next_turn(out, "how are you").tolist()  # the history's ids are kept as they are, never re-tokenized
        [[2, 4, 1, 3, 9, 1, 2, 6, 7, 8, 1, 3]]
        >>> chat.message_ids("how are you"), chat.reply_ids("hello").tolist()
        ([2, 6, 7, 8, 1, 3], [[5, 1]])
        >>> clip_text(tokenizer, "how are you", 2)
        'how are'
    """

    def __init__(self, tokenizer, system_prompt: str | None = None):
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("the tokenizer has no chat template: ChatTokens needs one to render turns")
        self.tokenizer = tokenizer
        self.system = [{"role": "system", "content": system_prompt}] if system_prompt else []
        render = self._render
        user = {"role": "user", "content": _PROBE_USER}
        reply = {"role": "assistant", "content": _PROBE_REPLY}
        t0 = render([user], generation_prompt=True)
        t1 = render([user, reply], generation_prompt=False)
        t2 = render([user, reply, user], generation_prompt=True)
        if not t1.startswith(t0) or not t2.startswith(t1) or _PROBE_REPLY not in t1[len(t0):]:
            raise ValueError("this chat template rewrites earlier turns, so turns cannot be appended as tokens")
        # What closes an assistant turn (e.g. "<|im_end|>\n"), and what opens a user turn up to the reply.
        self.end_of_turn = t1[len(t0) + len(_PROBE_REPLY):]
        before, after = t2[len(t1):].split(_PROBE_USER)
        self.user_prefix, self.user_suffix = before, after
        self.eot_ids: list[int] = self._encode(self.end_of_turn)  # what closes an assistant turn

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            self.system + messages, tokenize=False, add_generation_prompt=generation_prompt
        )

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def first_turn(self, message: str) -> torch.Tensor:
        """Ids of the conversation's first prompt, ``[1, seq]``."""
        text = self._render([{"role": "user", "content": message}], generation_prompt=True)
        return torch.tensor([self._encode(text)], dtype=torch.long)

    def next_turn(self, history_ids: torch.Tensor, message: str) -> torch.Tensor:
        """Appends the end of the assistant's turn and a new user message to ``history_ids`` (``[1, seq]``).

        If generation stopped on the end-of-turn token itself, it is not repeated.
        """
        history = history_ids.view(-1).tolist()
        eot = self.eot_ids
        overlap = next((n for n in range(len(eot), 0, -1) if history[-n:] == eot[:n]), 0)
        return torch.tensor([history + eot[overlap:] + self.message_ids(message)], dtype=torch.long)

    def message_ids(self, message: str) -> list[int]:
        """The ids a user message adds to a conversation (its template wrapping included)."""
        return self._encode(self.user_prefix + message + self.user_suffix)

    def reply_ids(self, reply: str) -> torch.Tensor:
        """Ids of a given assistant reply closed by the end-of-turn tokens, ``[1, n]`` (for teacher forcing)."""
        return torch.tensor([self._encode(reply) + self.eot_ids], dtype=torch.long)

    def reply_text(self, generated_ids: torch.Tensor) -> str:
        """Decodes a reply without special tokens."""
        return self.tokenizer.decode(generated_ids.view(-1), skip_special_tokens=True)


def clip_text(tokenizer, text: str, max_tokens: int) -> str:
    """`text` cut to its first `max_tokens` tokens (decoded back); a text that fits is returned unchanged.

    Used to keep long ShareGPT messages short in demos, evaluations and replays.
    """
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return text if len(ids) <= max_tokens else tokenizer.decode(ids[:max_tokens])
