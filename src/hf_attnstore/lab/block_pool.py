"""Prefix blocks shared by every session, deduplicated, with a capacity in blocks (issue 48).

The session store keeps each session's KV whole: two prompts over one document hold the document twice, and a
session leaves host memory as a whole. A block pool is the other shape of a prefix cache (vLLM's block pool,
SGLang's radix tree, Mooncake's traces): a prompt is cut into blocks of `block_tokens`, each block keyed by a hash
chained over every token before it (prefixes.py), so a key names a whole prefix and a block's KV is stored once
whoever computed it. A prompt reuses its longest run of leading blocks present. The pool holds at most `blocks`
blocks and evicts them one at a time through a block policy (`store.policy.BLOCK_POLICIES`, keyed by
`BlockKey(block, parent)`) and `placement.choose_victims`: the code `lab/trace_sim.py` simulates with.

Semantics (the simulator's, so that a replay can compare them request by request):

* A lookup (`match`) reads; it changes no order. Its hit is the tokens of the leading blocks present whose ids
  equal the prompt's (compared, not trusted to the hash: exact or a miss).
* Storing a prompt (`store`) walks its blocks first to last: a block present is touched, a missing one inserted
  (a copy of its KV, so a block outlives the session that computed it); then the pool evicts down to `blocks`.
  The prompt's trailing partial block is a block too, keyed by its exact tokens: a later prompt reuses it only if
  it holds the same tokens there and no more (as a trace's last ``hash_id``).

Guarded by the store's lock; only `StoreState` calls it (one owner per index).

Example:
    >>> from hf_attnstore.store.buffer import SessionBuffer
    >>> buf = SessionBuffer((1, 1, 2), torch.float32, pin_memory=False)  # 1 layer, 1 KV head, head_dim 2
    >>> kv = [torch.arange(10.0).view(1, 1, 5, 2)]
    >>> buf.append(torch.tensor([1, 2, 3, 4, 5]), kv, kv)
    >>> pool = BlockPool(BlockPoolConfig(blocks=8, block_tokens=2), pin_memory=False)
    >>> pool.store("fp", buf.snapshot())  # blocks [1, 2], [3, 4] and the partial [5]: (inserted, evicted)
    (3, 0)
    >>> found, snap = pool.match("fp", torch.tensor([1, 2, 3, 4, 9]))
    >>> found, snap.token_ids.tolist()
    (4, [1, 2, 3, 4])
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
import torch

from .block_policy import BlockKey, make_block_policy
from ..store.buffer import Segment, SessionBuffer, SessionKV
from ..store.index import block_hashes
from ..store.policy import choose_victims


MAX_BLOCKS = 10**9  # beyond any host memory: a typo, not a capacity


@dataclass(frozen=True)
class BlockPoolConfig:
    """A block pool's settings (``StoreConfig.block_pool``).

    Args:
        blocks: Capacity in blocks.
        block_tokens: Tokens per block.
        policy: A block policy name (:data:`hf_attnstore.store.policy.BLOCK_POLICIES`: ``"lru"``, ``"lru-leaf"``,
            ``"slru"``, ...).

    Example:
        >>> BlockPoolConfig(blocks=1000, block_tokens=16, policy="lru-leaf")
        BlockPoolConfig(blocks=1000, block_tokens=16, policy='lru-leaf')
        >>> BlockPoolConfig(blocks=0)
        Traceback (most recent call last):
        ...
        ValueError: `blocks`=0 must be an integer in [1, 1000000000]: the pool's capacity in blocks
    """

    blocks: int
    block_tokens: int = 64
    policy: str = "lru"

    def __post_init__(self):
        if not isinstance(self.blocks, int) or isinstance(self.blocks, bool) or not 1 <= self.blocks <= MAX_BLOCKS:
            raise ValueError(f"`blocks`={self.blocks!r} must be an integer in [1, {MAX_BLOCKS}]: the pool's "
                             "capacity in blocks")
        if not isinstance(self.block_tokens, int) or isinstance(self.block_tokens, bool) or self.block_tokens < 1:
            raise ValueError(f"`block_tokens`={self.block_tokens!r} must be a positive integer")
        make_block_policy(self.policy)  # validates the name, saying which exist

    def build(self, pin_memory: bool) -> "BlockPool":
        """The pool a store holds for this config (`StoreConfig.block_pool`; the store calls it once)."""
        return BlockPool(self, pin_memory)


class BlockPool:
    """Deduplicated prefix blocks (see the module docstring). Not thread-safe: the store's lock guards it.

    Args:
        config: Capacity, block size and policy.
        pin_memory: Whether snapshots handed out say their memory is pinned (blocks are copies of a session's KV).

    Example:
        >>> pool = BlockPool(BlockPoolConfig(blocks=4, block_tokens=16), pin_memory=False)
        >>> len(pool), pool.match("fp", torch.arange(40))  # empty: a miss
        (0, (0, None))
    """

    def __init__(self, config: BlockPoolConfig, pin_memory: bool):
        self.config, self.pin_memory = config, pin_memory
        self.policy = make_block_policy(config.policy)
        self._blocks: dict[Hashable, Segment] = {}  # (fingerprint, chained hash) -> the block's KV and ids
        self._keys: dict[Hashable, BlockKey] = {}  # the same keys -> what the policy knows them by
        self._layouts: dict[str, tuple] = {}  # fingerprint -> (geometry, dtype) of its KV: one per model

    def _chain(self, fingerprint: str, ids: torch.Tensor) -> list[tuple[Hashable, int, int]]:
        """The prompt's blocks, first first: ``(key, start, end)``, the trailing partial one included."""
        size = self.config.block_tokens
        return [((fingerprint, h), k * size, min((k + 1) * size, ids.numel()))
                for k, h in enumerate(block_hashes(ids, size, partial=True))]

    def match(self, fingerprint: str, ids: torch.Tensor) -> tuple[int, SessionKV | None]:
        """The tokens of `ids` (1-D, CPU int64) held by the leading run of blocks present, and a snapshot of their
        KV (None when there are none). Reads only: no order changes (`store` touches what the prompt used)."""
        parts = []
        for key, a, b in self._chain(fingerprint, ids):
            seg = self._blocks.get(key)
            # The hash proposes; the ids decide (a collision costs a miss, never wrong KV).
            if seg is None or seg.filled != b - a or not torch.equal(seg.token_ids, ids[a:b]):
                break
            parts.append((seg, 0, b - a))
        if not parts:
            return 0, None
        geometry, dtype = self._layouts[fingerprint]
        buf = SessionBuffer(geometry, dtype, self.pin_memory, parts=parts)
        return buf.length, buf.snapshot(tier="host")

    def store(self, fingerprint: str, snapshot: SessionKV, end: int | None = None) -> tuple[int, int]:
        """Puts the blocks of the snapshot's first `end` tokens (None: all) in the pool, first to last: touches those
        present, copies those missing; then evicts down to capacity. Returns ``(inserted, evicted)``.

        The caller passes only tokens whose KV is exact (computed over the whole history, at full precision).
        """
        end = snapshot.length if end is None else end
        self._layouts[fingerprint] = (snapshot.source.geometry, snapshot.source.dtype)
        inserted, parent = 0, None
        for key, a, b in self._chain(fingerprint, snapshot.token_ids[:end]):
            if key in self._blocks:
                self.policy.touch(self._keys[key])
            else:
                ids, keys, values = snapshot.tensors(a, b)
                self._blocks[key] = Segment.adopt(ids, keys, values)  # its own copy: outlives the session
                self._keys[key] = BlockKey(key, parent)
                self.policy.insert(self._keys[key])
                inserted += 1
            parent = key
        return inserted, self._evict()

    def _evict(self) -> int:
        """Evicts down to capacity one block at a time (a leaf-first policy offers the parent next)."""
        evicted = 0
        while len(self._blocks) > self.config.blocks:
            # Nothing is pinned: a turn reading a block holds its segment, which outlives its eviction.
            chosen = choose_victims(self.policy.victims(), size=lambda key: 1, movable=lambda key: True, overflow=1)
            assert chosen, "a full pool must have a victim"
            for victim in chosen:
                del self._blocks[victim.block]
                self.policy.remove(self._keys.pop(victim.block))
                evicted += 1
        return evicted

    def __len__(self) -> int:
        return len(self._blocks)
