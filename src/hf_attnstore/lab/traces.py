"""Production request traces in Mooncake's format (FAST'25 release), read and validated; a second generator.

One JSON object a line: ``timestamp`` (arrival, ms), ``input_length`` and ``output_length`` (tokens) and
``hash_ids``, the prompt as a chain of 512-token prefix blocks: equal ids at the same place are reusable KV.
The last block of a prompt is usually partial (``input_length`` need not be a multiple of 512); it counts for
the tokens it holds (:func:`block_tokens`). Output blocks are not in the chain: a later turn that reuses a reply
carries it in its own ``hash_ids``, so the simulator caches input blocks only.

:func:`chat_trace` writes a trace of another structure (multi-turn conversations that grow turn by turn under a
few shared system prompts, no shared documents) to check that a policy tuned on one trace holds on another.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass

BLOCK_TOKENS = 512
MAX_TOKENS = 10_000_000  # a prompt longer than this is a corrupt line, not a request


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace.

    Args:
        timestamp_ms: Arrival time from the start of the trace, milliseconds.
        input_length, output_length: Prompt and reply tokens.
        hash_ids: The prompt's prefix blocks, first first.

    Example:
        >>> request = parse_request({"timestamp": 5, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]})
        >>> request
        TraceRequest(timestamp_ms=5.0, input_length=600, output_length=3, hash_ids=(1, 2))
        >>> block_tokens(request, 0), block_tokens(request, 1)  # a full block, then the partial last one
        (512, 88)
    """

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def block_tokens(request: TraceRequest, k: int, block: int = BLOCK_TOKENS) -> int:
    """Tokens of the prompt held by its `k`-th block (the last one may be partial).

    Example:
        >>> block_tokens(TraceRequest(0, 600, 1, (7, 8)), 1)
        88
    """
    return max(0, min(block, request.input_length - k * block))


def parse_request(obj: object, where: str = "request", block: int = BLOCK_TOKENS) -> TraceRequest:
    """Validates one decoded trace line; `where` names it in errors (``"trace.jsonl:12"``).

    Example:
        >>> parse_request({"timestamp": 5, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]}).hash_ids
        (1, 2)
    """
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    missing = [f for f in ("timestamp", "input_length", "output_length", "hash_ids") if f not in obj]
    if missing:
        raise ValueError(f"{where}: missing field(s) {', '.join(f'`{m}`' for m in missing)}")
    ts, n_in, n_out, ids = obj["timestamp"], obj["input_length"], obj["output_length"], obj["hash_ids"]
    if not isinstance(ts, (int, float)) or isinstance(ts, bool) or ts < 0 or ts != ts:
        raise ValueError(f"{where}: `timestamp`={ts!r} must be a non-negative number of milliseconds")
    for name, v in (("input_length", n_in), ("output_length", n_out)):
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= MAX_TOKENS:
            raise ValueError(f"{where}: `{name}`={v!r} must be an integer in [0, {MAX_TOKENS:,}]")
    if not isinstance(ids, list) or not all(isinstance(b, int) and not isinstance(b, bool) for b in ids):
        raise ValueError(f"{where}: `hash_ids` must be a list of integers")
    if len(ids) != -(-n_in // block):
        raise ValueError(f"{where}: {len(ids)} `hash_ids` for `input_length`={n_in}: expected "
                         f"{-(-n_in // block)} blocks of {block} tokens")
    return TraceRequest(float(ts), n_in, n_out, tuple(ids))


def load_trace(path: str | os.PathLike, limit: int | None = None, block: int = BLOCK_TOKENS) -> list[TraceRequest]:
    """Reads a Mooncake-format trace (JSON lines), in arrival order.

    Args:
        path: The ``.jsonl`` file.
        limit: Read only the first `limit` requests.
        block: Tokens per block of ``hash_ids``.

    Raises:
        ValueError: A malformed line (named by file and line number), timestamps out of order, or a block id
            seen under two different prefixes (the trace would not be prefix-addressed).

    Example:
        >>> load_trace("../shared/traces/mooncake_synthetic_trace.jsonl", limit=2)  # doctest: +SKIP
    """
    if limit is not None and limit < 1:
        raise ValueError(f"`limit`={limit!r} must be >= 1")
    requests: list[TraceRequest] = []
    parent: dict[int, int | None] = {}
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{os.fspath(path)}:{n}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not JSON ({e.msg})") from None
            r = parse_request(obj, where, block)
            if requests and r.timestamp_ms < requests[-1].timestamp_ms:
                raise ValueError(f"{where}: `timestamp` {r.timestamp_ms} is before the previous line's")
            prev = None
            for b in r.hash_ids:
                # Prefix semantics need a block to mean one prefix: the tree code relies on it.
                if parent.setdefault(b, prev) != prev:
                    raise ValueError(f"{where}: block {b} comes after block {prev} here but after {parent[b]} "
                                     "earlier: a block id must name one prefix")
                prev = b
            requests.append(r)
            if limit is not None and len(requests) >= limit:
                break
    if not requests:
        raise ValueError(f"`path`={os.fspath(path)!r} holds no requests")
    return requests


def chat_trace(conversations: int = 2000, seed: int = 0, rate: float = 4.0, think_s: float = 60.0,
               prompts: int = 20, block: int = BLOCK_TOKENS) -> list[TraceRequest]:
    """A trace of multi-turn chats in the same format, built differently from Mooncake's synthetic one.

    Conversations arrive as a Poisson process (`rate` per second); each opens with one of `prompts` system
    prompts (Zipf-popular, 1-4 blocks), has a geometric number of turns (mean 4) with exponential think times
    (mean `think_s`), and each turn's prompt is the whole previous prompt plus reply plus a new message, so
    turn t+1 reuses turn t's blocks but for its last, partial one. Lengths are log-normal; ids are fresh per
    prefix, so the result obeys prefix semantics.

    Example:
        >>> len(chat_trace(conversations=3, seed=1)) >= 3
        True
    """
    if conversations < 1 or rate <= 0 or think_s <= 0 or prompts < 1:
        raise ValueError("`conversations`, `rate`, `think_s` and `prompts` must be positive")
    rng = random.Random(seed)
    next_id = iter(range(1 << 62))
    prompt_tokens = [rng.randint(1, 4) * block for _ in range(prompts)]
    prompt_weights = [1 / (i + 1) for i in range(prompts)]
    ids: dict[tuple, int] = {}  # (parent id, content tag) -> id: equal prefixes get equal ids

    def chain(tags: list[tuple]) -> tuple[int, ...]:
        out, parent = [], None
        for tag in tags:
            parent = ids.setdefault((parent, tag), next(next_id))
            out.append(parent)
        return tuple(out)

    events = []
    t = 0.0
    for c in range(conversations):
        t += rng.expovariate(rate)
        p = rng.choices(range(prompts), prompt_weights)[0]
        tokens, turn_t = prompt_tokens[p], t
        tags = [("prompt", p, k) for k in range(prompt_tokens[p] // block)]
        while True:
            tokens += int(rng.lognormvariate(5.5, 1.0)) + 1  # the user's message
            n_out = int(rng.lognormvariate(5.0, 0.8)) + 1
            full, part = divmod(tokens, block)
            turn_tags = tags + [("conv", c, k) for k in range(len(tags), full)]
            last = [("tail", c, turn_t)] if part else []
            events.append((turn_t, tokens, n_out, turn_tags + last))
            tokens += n_out
            tags = turn_tags
            if rng.random() < 0.25 or tokens > 64 * block:
                break
            turn_t += rng.expovariate(1 / think_s)
    events.sort(key=lambda e: e[0])
    return [TraceRequest(round(ts * 1000, 3), n_in, n_out, chain(tags)) for ts, n_in, n_out, tags in events]


def write_trace(requests: list[TraceRequest], path: str | os.PathLike) -> None:
    """Writes requests in Mooncake's format (the inverse of :func:`load_trace`).

    Example:
        >>> write_trace(chat_trace(conversations=2), "/tmp/chat.jsonl")  # doctest: +SKIP
    """
    with open(path, "w", encoding="utf-8") as f:
        for r in requests:
            f.write(json.dumps({"timestamp": r.timestamp_ms, "input_length": r.input_length,
                                "output_length": r.output_length, "hash_ids": list(r.hash_ids)}) + "\n")
