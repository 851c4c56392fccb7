"""The first requests of a prefix-block trace, scaled down, through the real store, against the simulator (issue 48).

`simulate_trace` (trace_sim.py) counts hits on block ids. Here the same requests run through a real
:class:`~hf_attnstore.AttnStore` with a block pool (``StoreConfig.block_pool``: capacity in blocks, a block policy)
and a real model: each block id becomes a deterministic run of token ids, each request a prompt of those runs,
each prompt a turn of an :class:`~hf_attnstore.AttnStoreCache` that reuses what the store finds, computes the rest
with the model, and stores it (directly, or submitted to a :class:`~hf_attnstore.serving.pipeline.ChatPipeline` as
`attnstore serve` does: ``through="pipeline"``). The store's own counters give each request's hit (``StoreStats.block_hit_tokens``:
the prompt's tokens held by the pool's leading blocks present); the simulator runs on the same scaled requests with
the same capacity and policy; they must agree request by request. Both evict through the same code: the policy
objects of ``store.policy`` driven by ``placement.choose_victims``.

Scaling: a block of 512 tokens becomes `block_tokens` tokens; a request's last, partial block keeps its share,
rounded, at least one token (a block id always holds the same tokens in the trace, so it does here too).

What differs, by construction: a turn computes at least its prompt's last token (the model must produce logits), so
a request whose every block is present reuses all its tokens but one (`reused`); its hit counts them all, as the
simulator's does.

Example:
    >>> from hf_attnstore.lab.traces import TraceRequest
    >>> reqs = [TraceRequest(0, 1024, 1, (1, 2)), TraceRequest(1, 1000, 1, (1, 3))]
    >>> result = replay_trace(reqs, ReplayConfig(capacity_blocks=4, block_tokens=8))
    >>> result.store_hits, result.sim_hits, result.equal  # the shared first block: 8 tokens
    ([0, 8], [0, 8], True)
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field

import torch

from ..cache import AttnStoreCache
from ..serving.pipeline import ChatPipeline
from ..cache.upstream import cache_kwargs
from ..store import AttnStore, StoreConfig
from .block_pool import BlockPoolConfig
from .trace_sim import TraceSimConfig, simulate_trace
from .traces import BLOCK_TOKENS, TraceRequest, block_tokens

VOCAB = 1024  # the tiny model's vocabulary, which block runs are drawn from


@dataclass(frozen=True)
class ReplayConfig:
    """One replay: the store's pool and the model's scale.

    Args:
        capacity_blocks: The pool's (and the simulator's) capacity in blocks.
        policy: A block policy name (``"lru"``, ``"lru-leaf"``, ``"slru"``, ...).
        block_tokens: Tokens per block after scaling (the trace's are 512).
        seed: Seeds the token runs and the tiny model's weights.
        check_exact: Also prefill every hit request without the store and compare the last position's logits (or,
            through the pipeline, the greedy token).
        through: ``"cache"``: each request is one `AttnStoreCache` turn and one forward; ``"pipeline"``: each is
            submitted to a `ChatPipeline` (`submit_prompt`, one generated token), as `attnstore serve` runs turns.

    Example:
        >>> ReplayConfig(capacity_blocks=200, policy="slru", block_tokens=16).block_tokens
        16
        >>> ReplayConfig(capacity_blocks=10, block_tokens=2)
        Traceback (most recent call last):
        ...
        ValueError: `block_tokens`=2 must be at least 4: shorter runs of ids could repeat between blocks
    """

    capacity_blocks: int
    policy: str = "lru"
    block_tokens: int = 16
    seed: int = 0
    check_exact: bool = True
    through: str = "cache"

    def __post_init__(self):
        if self.through not in ("cache", "pipeline"):
            raise ValueError(f"`through`={self.through!r} must be \"cache\" or \"pipeline\"")
        if not isinstance(self.block_tokens, int) or self.block_tokens < 4:
            raise ValueError(f"`block_tokens`={self.block_tokens!r} must be at least 4: shorter runs of ids could "
                             "repeat between blocks")
        BlockPoolConfig(self.capacity_blocks, self.block_tokens, self.policy)  # validates capacity and policy


@dataclass
class ReplayResult:
    """What one replay measured, per request in trace order (scaled tokens).

    Attributes:
        input_tokens: Each prompt's length.
        store_hits: The store's hit per request (its `block_hit_tokens` counter's increase).
        reused: The tokens each turn reused (`AttnStoreCache.reused_tokens`): its hit, but for a last token.
        sim_hits: The simulator's hit per request, same requests, capacity and policy.
        evictions: Blocks the store's pool evicted (`blocks_evicted`).
        max_logit_diff: Largest |difference| of the last position's logits between a hit request's turn and a
            prefill without the store (None: not checked, or no hit).
        greedy_equal: Whether every checked hit request's greedy next token is the same as without the store.
        checked: How many hit requests were checked so.
        wall_s: Seconds the replay through the store took (the simulator's is not counted).

    Example:
        >>> r = ReplayResult(ReplayConfig(capacity_blocks=4), [16, 16], [0, 16], [0, 15], [0, 16])
        >>> r.equal, r.store_hit_rate
        (True, 0.5)
    """

    config: ReplayConfig
    input_tokens: list[int] = field(default_factory=list)
    store_hits: list[int] = field(default_factory=list)
    reused: list[int] = field(default_factory=list)
    sim_hits: list[int] = field(default_factory=list)
    evictions: int = 0
    max_logit_diff: float | None = None
    greedy_equal: bool = True
    checked: int = 0
    wall_s: float = 0.0

    @property
    def equal(self) -> bool:
        """Whether the store and the simulator hit the same tokens in every request."""
        return self.store_hits == self.sim_hits

    @property
    def store_hit_rate(self) -> float:
        return sum(self.store_hits) / max(1, sum(self.input_tokens))

    @property
    def sim_hit_rate(self) -> float:
        return sum(self.sim_hits) / max(1, sum(self.input_tokens))


def scale_requests(requests: list[TraceRequest], block: int) -> list[TraceRequest]:
    """The requests with blocks of `block` tokens instead of 512: full blocks scaled, the last one its share.

    Example:
        >>> scale_requests([TraceRequest(0, 1000, 5, (1, 2))], 16)  # 512 + 488 tokens -> 16 + 15
        [TraceRequest(timestamp_ms=0, input_length=31, output_length=5, hash_ids=(1, 2))]
    """
    out = []
    for r in requests:
        n = len(r.hash_ids)
        if n == 0:
            raise ValueError(f"a request of {r.input_length} tokens has no blocks: nothing to replay")
        last = max(1, round(block_tokens(r, n - 1) * block / BLOCK_TOKENS))
        out.append(TraceRequest(r.timestamp_ms, (n - 1) * block + last, r.output_length, r.hash_ids))
    return out


class BlockRuns:
    """The token ids standing for each block id: a deterministic draw from the vocabulary, one run per block id.

    A block id always holds the same number of tokens in the trace (checked), so its run is drawn once, on first
    sight. Two blocks after the same parent must differ (their KV differs in the trace); a short last block of one
    or two tokens may draw a sibling's ids, so a draw that repeats a sibling's is drawn again (the next salt):
    distinct prefixes stay distinct, level by level, and the same trace always gets the same ids.

    Args:
        block: Tokens per (scaled) block.
        seed: Seeds the draws.
        vocab: Ids are drawn from ``[0, vocab)``.

    Example:
        >>> runs = BlockRuns(block=8)
        >>> r = TraceRequest(0, 12, 1, (1, 2))  # a whole block of 8, then 4 tokens
        >>> ids = runs.prompt(r)
        >>> ids.numel(), torch.equal(runs.prompt(r), ids), torch.equal(BlockRuns(8, seed=1).prompt(r), ids)
        (12, True, False)
    """

    def __init__(self, block: int, seed: int = 0, vocab: int = VOCAB):
        self.block, self.seed, self.vocab = block, seed, vocab
        self._runs: dict[int, torch.Tensor] = {}  # block id -> its ids
        self._taken: set[tuple] = set()  # (parent id, ids) of every block drawn

    def _draw(self, block_id: int, parent: int | None, n: int) -> torch.Tensor:
        for salt in range(1000):
            digest = hashlib.blake2b(f"{self.seed}:{block_id}:{salt}".encode(), digest_size=8).digest()
            gen = torch.Generator().manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))
            run = torch.randint(0, self.vocab, (n,), generator=gen)
            if (parent, tuple(run.tolist())) not in self._taken:
                self._taken.add((parent, tuple(run.tolist())))
                return run
        raise ValueError(f"block {block_id}: no run of {n} ids differs from its siblings'; use larger `block_tokens`")

    def prompt(self, request: TraceRequest) -> torch.Tensor:
        """A scaled request's prompt: its blocks' runs, the last one holding the tokens it holds."""
        out, parent = [], None
        for k, b in enumerate(request.hash_ids):
            n = block_tokens(request, k, self.block)
            run = self._runs.get(b)
            if run is None:
                run = self._runs[b] = self._draw(b, parent, n)
            elif run.numel() != n:
                raise ValueError(f"block {b} holds {run.numel()} tokens in one request and {n} in another: the "
                                 "trace must give a block id one length")
            out.append(run)
            parent = b
        return torch.cat(out)


def tiny_model(max_tokens: int, seed: int = 0):
    """A tiny random Llama (2 layers, fp32, CPU) whose positions reach `max_tokens`.

    Example:
        >>> tiny_model(64).config.max_position_embeddings
        64
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_tokens)
    return LlamaForCausalLM(config).eval()


def replay_trace(requests: list[TraceRequest], config: ReplayConfig, model=None) -> ReplayResult:
    """Replays `requests` (unscaled, as read from the trace) through a real store and through the simulator.

    Args:
        requests: The trace's requests (their 512-token blocks are scaled to ``config.block_tokens``).
        config: Capacity, policy, scale.
        model: A causal LM whose vocabulary holds :data:`VOCAB` ids and whose positions reach the longest scaled
            prompt; None: :func:`tiny_model`.

    Returns:
        A :class:`ReplayResult`.

    Example:
        >>> from hf_attnstore.lab.traces import load_trace
        >>> reqs = load_trace("../shared/traces/mooncake_synthetic_trace.jsonl", limit=100)  # doctest: +SKIP
        >>> replay_trace(reqs, ReplayConfig(capacity_blocks=400, policy="slru")).equal  # doctest: +SKIP
        True
    """
    b = config.block_tokens
    scaled = scale_requests(requests, b)
    runs = BlockRuns(b, config.seed)
    if model is None:
        model = tiny_model(max(r.input_length for r in scaled) + 1, config.seed)
    if model.get_input_embeddings().num_embeddings < VOCAB:
        raise ValueError(f"`model` has {model.get_input_embeddings().num_embeddings} ids in its vocabulary; the "
                         f"replay draws from {VOCAB}")
    # Only the pool shares KV between requests: no session table (`share_prefixes`), and each request is a session
    # of its own, deleted after its turn.
    store = AttnStore(config=StoreConfig(host_bytes="4GiB", share_prefixes=False, block_pool=BlockPoolConfig(
        config.capacity_blocks, b, config.policy)))
    pipe = ChatPipeline(model, tiny_tokenizer(), store, max_new_tokens=1) if config.through == "pipeline" else None
    result = ReplayResult(config)
    started = time.perf_counter()
    try:
        for i, r in enumerate(scaled):
            ids = runs.prompt(r)
            before = store.stats().block_hit_tokens
            if pipe is None:
                reused, logits = _through_cache(model, store, f"request-{i}", ids)
                token = int(logits.argmax())
            else:
                # The serving path: the worker's queue, `generate` (one token), the turn's Reply.
                reply = pipe.submit_prompt(f"request-{i}", ids).result(timeout=600)
                reused, logits, token = reply.reused_tokens, None, reply.generated_ids[0]
            result.input_tokens.append(r.input_length)
            result.store_hits.append(store.stats().block_hit_tokens - before)
            result.reused.append(reused)
            if config.check_exact and reused:
                with torch.no_grad():
                    fresh = model(ids.view(1, -1), logits_to_keep=1).logits[0, -1]
                if logits is not None:
                    diff = float((logits - fresh).abs().max())
                    result.max_logit_diff = max(diff, result.max_logit_diff or 0.0)
                result.greedy_equal &= token == int(fresh.argmax())
                result.checked += 1
            store.delete(f"request-{i}")
        result.evictions = store.stats().blocks_evicted
    finally:
        if pipe is not None:
            pipe.close()
        store.close()
    result.wall_s = time.perf_counter() - started
    sim = simulate_trace(scaled, TraceSimConfig(host_tokens=config.capacity_blocks * b, policy=config.policy, block=b))
    result.sim_hits = sim.host_hits
    return result


def _through_cache(model, store: AttnStore, session_id: str, ids: torch.Tensor) -> tuple[int, torch.Tensor]:
    """One request as one turn of an `AttnStoreCache` and one forward: its reused tokens and last logits."""
    cache = AttnStoreCache(model, store, session_id, input_ids=ids.view(1, -1))
    with torch.no_grad():
        logits = model(cache.input_ids[:, cache.get_seq_length():], **cache_kwargs(cache), use_cache=True,
                       logits_to_keep=1).logits[0, -1]
    return cache.reused_tokens, logits


def tiny_tokenizer():
    """A word-level tokenizer over the tiny model's ids, with a chat template (`ChatPipeline` needs one; the replay
    submits ids, so only its pad and end tokens matter).

    Example:
        >>> tiny_tokenizer().pad_token_id
        1
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["[UNK]", "<pad>", "<eot>", "user:", "bot:"]
    words = specials + [f"t{i}" for i in range(VOCAB - len(specials))]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    core.pre_tokenizer, core.decoder = pre_tokenizers.WhitespaceSplit(), decoders.WordPiece()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", pad_token="<pad>", eos_token="<eot>")
    tokenizer.chat_template = ("{% for m in messages %}{{ 'user: ' if m.role == 'user' else 'bot: ' }}"
                               "{{ m.content }} <eot> {% endfor %}{% if add_generation_prompt %}bot: {% endif %}")
    return tokenizer


def format_replay(results: list[ReplayResult]) -> str:
    """The markdown table of replays, one row each.

    Example:
        >>> r = ReplayResult(ReplayConfig(capacity_blocks=4), [16, 16], [0, 16], [0, 15], [0, 16], wall_s=1.0)
        >>> print(format_replay([r]).splitlines()[2])
        | 2 | 16 | 4 | lru | 50.00% | 50.00% | yes | 0 | - | 1.0 s |
    """
    lines = ["| requests | block tokens | capacity (blocks) | policy | store hit rate | simulator hit rate | equal "
             "| evictions | max abs logit diff (hits) | wall |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        c = r.config
        if r.max_logit_diff is not None:  # through the cache: the logits themselves
            diff = f"{r.max_logit_diff:.1e}" + ("" if r.greedy_equal else " (argmax differs)")
        else:  # through the pipeline: the token it generated (or nothing checked)
            diff = "-" if not r.checked else f"same argmax ({r.checked})" if r.greedy_equal else "argmax differs"
        lines.append(f"| {len(r.input_tokens)} | {c.block_tokens} | {c.capacity_blocks} | {c.policy} | "
                     f"{r.store_hit_rate:.2%} | {r.sim_hit_rate:.2%} | {'yes' if r.equal else 'NO'} | {r.evictions} | "
                     f"{diff} | {r.wall_s:.1f} s |")
    return "\n".join(lines)
