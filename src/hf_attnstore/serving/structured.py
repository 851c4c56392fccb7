"""Structured output: replies constrained to JSON, or to a JSON schema, with llguidance.

``response_format`` (chat completions: ``json_object``, ``json_schema``) and ``text.format`` (Responses) compile
to an llguidance grammar; at every decoding step a logits processor masks the tokens the grammar does not allow,
so the reply is valid by construction, and once the grammar is complete only the end of turn is allowed.

Why llguidance: it is the constrained-decoding engine vLLM, SGLang and llama.cpp use; it is a Rust core in one
3 MB wheel with no dependencies, and it bounds the work a hostile grammar can cause (`LLParserLimits`). xgrammar
requires torch, transformers and triton at given versions (a second GPU stack on a CPU machine), and outlines
caches with cloudpickle and diskcache (pickle on a read path, which this project does not allow).

The processor is one more entry of the turn's ``logits_processor``, so it runs through `generate`'s own
construction alone and batched (`upstream.decoding_plan`), and batched replies keep the tokens they would have
alone.
"""

from __future__ import annotations

import json
import threading

import torch
from transformers import LogitsProcessor

MAX_SCHEMA_CHARS = 65_536  # a schema's JSON text; llguidance bounds the grammar's work itself


class GrammarError(ValueError):
    """A format the grammar compiler refuses (its message says why): the client's mistake.

    Example:
        >>> isinstance(GrammarError("bad schema"), ValueError)
        True
    """


class Grammars:
    """Compiles formats to grammars for one tokenizer (its llguidance view is built once, on first use).

    Args:
        tokenizer: The model's (fast) tokenizer.
        end_ids: The tokens that end a reply (the chat template's end of turn first): the only ones allowed
            once the grammar is complete.
        vocab_size: The model's logits width (may exceed the tokenizer's vocabulary: the rest is masked).

    Example:
        >>> processor = engine.grammars.processor({"type": "object"})  # doctest: +SKIP
    """

    def __init__(self, tokenizer, end_ids: list[int], vocab_size: int):
        self.tokenizer, self.end_ids, self.vocab_size = tokenizer, list(end_ids), vocab_size
        self._lltok = None
        self._special: torch.Tensor | None = None
        self._lock = threading.Lock()

    max_chars = MAX_SCHEMA_CHARS

    def _tokenizer(self):
        import llguidance.hf

        with self._lock:
            if self._lltok is None:
                try:
                    self._lltok = llguidance.hf.from_tokenizer(self.tokenizer, eos_token=self.end_ids[0])
                except ValueError:  # a decoder llguidance cannot read (not byte-level, nor SentencePiece)
                    self._lltok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_TokenTexts(self.tokenizer,
                                                                                                 self.end_ids[0])))
            return self._lltok

    def special_tokens(self) -> torch.Tensor:
        """``[vocab]`` bool: the tokens llguidance takes as special (the end of turn and the like), found once."""
        lltok = self._tokenizer()
        with self._lock:
            if self._special is None:
                self._special = torch.tensor([lltok.is_special_token(i) for i in range(lltok.vocab_size)])
            return self._special

    def plain_ids(self, data: bytes) -> list[int]:
        """`data` tokenized as text, a special token's text included (``<|im_end|>`` as the characters it is made
        of, not as that token)."""
        text = data.decode("utf-8", "ignore")
        return self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"] if text else []

    def token_bytes(self, token: int) -> bytes:
        """The bytes of `token` as the grammar reads them (none for a special token)."""
        return self._tokenizer().decode_bytes([int(token)])

    def processor(self, schema: dict | None) -> "GrammarProcessor":
        """A processor constraining a reply to JSON matching `schema` (None: any JSON object).

        Raises:
            GrammarError: The schema is not one llguidance takes (or is too long).
        """
        import llguidance

        text = json.dumps(schema if schema is not None else {"type": "object"})
        if len(text) > MAX_SCHEMA_CHARS:
            raise GrammarError(f"the schema has {len(text)} characters of JSON; at most {MAX_SCHEMA_CHARS} are "
                               "accepted")
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(text)
        except (ValueError, TypeError, RuntimeError) as exc:
            raise GrammarError(f"the schema cannot be compiled: {exc}") from None
        return self.compile(grammar)

    def compile(self, grammar: str, lark: bool = False) -> "GrammarProcessor":
        """A processor constraining a reply to `grammar`: llguidance's grammar text, or (`lark`) a Lark grammar in
        llguidance's dialect (which embeds JSON schemas as ``%json {...}``).

        Raises:
            GrammarError: llguidance refuses the grammar (its message says why).

        Example:
            >>> processor = grammars.compile('start: "yes" | "no"', lark=True)  # doctest: +SKIP
        """
        import llguidance

        if lark:
            grammar = llguidance.LLMatcher.grammar_from_lark(grammar)
        lltok = self._tokenizer()
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, lltok)
        if failed:
            raise GrammarError(f"the schema cannot be compiled: {'; '.join(messages)[:500]}")
        matcher = llguidance.LLMatcher(lltok, grammar)
        if matcher.is_error():
            raise GrammarError(f"the schema cannot be compiled: {matcher.get_error()[:500]}")
        return GrammarProcessor(matcher, lltok.vocab_size, self.end_ids, self.vocab_size, self)


class _TokenTexts:
    """llguidance's view of a tokenizer whose decoder it cannot read (a word-level or character-level one): each
    token's bytes are its text decoded alone, a special token's are its name after 0xFF (llguidance's mark of
    special tokens, which grammars name as ``<|...|>``)."""

    def __init__(self, tokenizer, eos_token_id: int):
        specials = set(tokenizer.all_special_ids)
        self.eos_token_id, self.bos_token_id = eos_token_id, tokenizer.bos_token_id
        self.special_token_ids = sorted(specials)
        self.tokens = [b"\xff" + str(tokenizer.convert_ids_to_tokens(i)).encode() if i in specials
                       else tokenizer.decode([i]).encode() for i in range(len(tokenizer))]
        self._tokenizer = tokenizer

    def __call__(self, text) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        return self._tokenizer(text, add_special_tokens=False)["input_ids"]


class GrammarProcessor(LogitsProcessor):
    """Masks the tokens a grammar does not allow next (one turn: it follows that turn's tokens).

    The first call sees the prompt: what follows it is the reply, fed to the matcher token by token as later
    calls see it. Once the grammar is complete, only the end tokens are allowed; before, no special token is
    (an end of turn would cut the reply where the grammar is not complete). A string the grammar forces that
    spells a special token (``"<|im_end|>"`` in an ``enum``) is written as its characters: llguidance's mask
    offers the special token alone there, which its own matcher then refuses.

    Example:
        >>> options["logits_processor"] = LogitsProcessorList([grammars.processor(schema)])  # doctest: +SKIP
    """

    def __init__(self, matcher, tokenizer_vocab: int, end_ids: list[int], vocab_size: int,
                 grammars: Grammars | None = None):
        import llguidance.torch

        self.matcher, self.end_ids, self.grammars = matcher, end_ids, grammars
        self.tokenizer_vocab, self.vocab_size = tokenizer_vocab, vocab_size
        self._bitmask = llguidance.torch.allocate_token_bitmask(1, tokenizer_vocab)
        self._start: int | None = None
        self._consumed = 0

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        import llguidance.torch

        if input_ids.shape[0] != 1:
            raise ValueError("a grammar constrains one sequence per turn")
        if self._start is None:
            self._start = int(input_ids.shape[1])
        reply = input_ids[0, self._start:].tolist()
        for token in reply[self._consumed:]:
            if not self.matcher.is_stopped() and not self.matcher.consume_token(int(token)):
                raise RuntimeError(f"the grammar refused a token it had allowed: {self.matcher.get_error()}")
        self._consumed = len(reply)
        if self.matcher.is_stopped():
            allowed = torch.full_like(scores, float("-inf"))
            allowed[:, self.end_ids] = scores[:, self.end_ids]
            return allowed
        llguidance.torch.fill_next_token_bitmask(self.matcher, self._bitmask, 0)
        width = min(self.tokenizer_vocab, scores.shape[-1])
        allowed = allowed_tokens(self._bitmask, width)[0]
        if self.grammars is not None and not self.matcher.is_accepting():
            allowed &= ~self.grammars.special_tokens()[:width]
            if not allowed.any():
                allowed = self._forced_as_text(width)
        masked = scores[:, :width].contiguous().clone()
        masked.masked_fill_(~allowed.to(scores.device).unsqueeze(0), float("-inf"))
        if scores.shape[-1] == width:
            return masked
        # The model's logits past the tokenizer's vocabulary (padding) are never allowed.
        return torch.cat([masked, scores.new_full((1, scores.shape[-1] - width), float("-inf"))], dim=-1)


    def _forced_as_text(self, width: int) -> torch.Tensor:
        """The one token allowed where the grammar forces bytes and llguidance offers only a special token for
        them: the first token of those bytes tokenized as text."""
        plain = self.grammars.plain_ids(self.matcher.compute_ff_bytes())
        if not plain or plain[0] >= width or self.matcher.validate_tokens(plain[:1]) != 1:
            raise RuntimeError(f"the grammar allows no token here: {self.matcher.get_error() or 'nothing but a special token'}")
        allowed = torch.zeros(width, dtype=torch.bool)
        allowed[plain[0]] = True
        return allowed


def allowed_tokens(bitmask: torch.Tensor, width: int) -> torch.Tensor:
    """llguidance's token bitmask (int32 words, token ``32 * i + j`` allowed when bit ``j`` of word ``i`` is set)
    as a boolean mask over the first `width` tokens.

    Why not ``llguidance.torch.apply_token_bitmask_inplace``: it is ``torch.compile``d, so a server's first
    constrained reply would compile a kernel (seconds, a C++ compiler at run time, files under /tmp); unpacking
    the bits eagerly costs microseconds for a 50k vocabulary.

    Example:
        >>> allowed_tokens(torch.tensor([[0b101, -2**31]], dtype=torch.int32), 64).nonzero()[:, 1].tolist()
        [0, 2, 63]
    """
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # arithmetic shift: the sign bit of a word is its token 31
    return bits.reshape(bitmask.shape[0], -1)[:, :width].bool()
