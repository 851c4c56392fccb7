"""A session's KV in host memory: growable per-layer buffers and immutable snapshots of them.

Layout: keys and values of layer ``l`` are ``[1, kv_heads, capacity, head_dim]``; keys are pre-RoPE.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .loader import LoadHandle

_GROW_TOKENS = 16  # capacity grows by 1.25x, rounded to whole 16-token blocks, so decoding rarely reallocates


@dataclass(frozen=True)
class SessionKV:
    """A read-only view of a session's stored KV.

    Attributes:
        token_ids: The ids the KV covers, ``[seq]`` (int64, CPU).
        keys: Per layer, pre-RoPE keys ``[1, kv_heads, seq, head_dim]``.
        values: Per layer, values of the same shape.
        source: The buffer the views point into (used to append in place on the next turn).
        loader: Set while the session is still being loaded from disk: read layers through :meth:`layer`.
        tier: Where the KV came from: ``"host"`` or ``"disk"``.
        generation: The session's generation when the snapshot was taken (it changes when the session's
            history is cut or truncated), so that a later turn knows whether the snapshot's token
            positions still mean the same tokens in the store.
    """

    token_ids: torch.Tensor
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    source: "SessionBuffer"
    loader: LoadHandle | None = None
    tier: str = "host"
    generation: int = 0

    @property
    def length(self) -> int:
        return int(self.token_ids.numel())

    def layer(self, idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of layer `idx`, waiting for them if the session is still loading.

        Raises:
            LoadError: The load failed (damaged file, I/O error) or timed out.
        """
        if self.loader is not None:
            self.loader.wait_layer(idx)
        self.source.sync()
        return self.keys[idx], self.values[idx]


class SessionBuffer:
    """Per-layer KV buffers of one session that grow by appending.

    Snapshots are views of ``[0, length)``. Data below the high-water mark (the longest length ever reached)
    may be visible through a snapshot, so it is never overwritten: appending below it copies the buffer
    first (copy-on-write). Appending at the end writes in place.
    """

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, pin_memory: bool,
                 capacity: int = 0):
        self.geometry = (num_layers, kv_heads, head_dim)
        self.dtype = dtype
        self.pin_memory = pin_memory
        self.capacity = 0
        self.length = 0
        self.high_water = 0
        self.token_ids = torch.empty(0, dtype=torch.long)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self._event = None  # CUDA event of the last asynchronous device-to-host copy
        self._allocate(capacity)

    @property
    def bytes_per_token(self) -> int:
        layers, heads, dim = self.geometry
        return 2 * layers * heads * dim * torch.tensor([], dtype=self.dtype).element_size() + 8

    @property
    def nbytes(self) -> int:
        """Bytes held (capacity, not length: that is what occupies memory)."""
        return self.capacity * self.bytes_per_token

    def _allocate(self, capacity: int) -> None:
        layers, heads, dim = self.geometry
        old_ids, old_k, old_v, n = self.token_ids, self.keys, self.values, self.length

        def empty(*shape, dtype):
            return torch.empty(*shape, dtype=dtype, pin_memory=self.pin_memory)

        self.token_ids = empty(capacity, dtype=torch.long)
        self.keys = [empty(1, heads, capacity, dim, dtype=self.dtype) for _ in range(layers)]
        self.values = [empty(1, heads, capacity, dim, dtype=self.dtype) for _ in range(layers)]
        if n:
            self.token_ids[:n].copy_(old_ids[:n])
            for new, old in zip(self.keys + self.values, old_k + old_v):
                new[:, :, :n].copy_(old[:, :, :n])
        self.capacity = capacity
        # The copy is private: nothing can see the new storage yet.
        self.high_water = n

    def snapshot(self, loader: LoadHandle | None = None, tier: str = "host", generation: int = 0) -> SessionKV:
        n = self.length
        return SessionKV(
            token_ids=self.token_ids[:n],
            keys=[k[:, :, :n] for k in self.keys],
            values=[v[:, :, :n] for v in self.values],
            source=self,
            loader=loader,
            tier=tier,
            generation=generation,
        )

    def sync(self) -> None:
        """Waits for asynchronous copies from a GPU into this (pinned) buffer to land."""
        event, self._event = self._event, None
        if event is not None:
            event.synchronize()

    def bytes_after_append(self, tokens: int) -> int:
        """Bytes the buffer would hold after appending `tokens` tokens."""
        return self._capacity_for(self.length + tokens) * self.bytes_per_token

    def _capacity_for(self, needed: int) -> int:
        if needed <= self.capacity and self.length >= self.high_water:
            return self.capacity
        grown = max(needed, int(self.capacity * 1.25))
        return -(-grown // _GROW_TOKENS) * _GROW_TOKENS

    def append(self, token_ids: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Appends ``len(token_ids)`` tokens (device tensors are copied to host)."""
        n = int(token_ids.numel())
        layers, heads, dim = self.geometry
        assert len(keys) == len(values) == layers, "one key/value tensor per layer is required"
        capacity = self._capacity_for(self.length + n)
        if capacity != self.capacity or self.length < self.high_water:
            self._allocate(capacity)
        a, b = self.length, self.length + n
        self.token_ids[a:b].copy_(token_ids.view(-1))
        from_gpu = self.pin_memory and keys[0].is_cuda
        for dst, src in zip(self.keys + self.values, list(keys) + list(values)):
            assert src.shape == (1, heads, n, dim), f"expected {(1, heads, n, dim)}, got {tuple(src.shape)}"
            # Into pinned memory the copy is asynchronous: it is ordered on the current stream, and readers
            # of the buffer (the disk writer, a later turn) call sync() first.
            dst[:, :, a:b].copy_(src, non_blocking=from_gpu)
        if from_gpu:
            self._event = torch.cuda.Event()
            self._event.record()
        self.length = b
        self.high_water = max(self.high_water, b)

    def truncate(self, length: int) -> None:
        """Shortens the logical sequence; the data stays (snapshots may see it) until overwritten by a copy."""
        assert 0 <= length <= self.length, f"cannot truncate {self.length} tokens to {length}"
        self.length = length

    def fill(self, length: int) -> None:
        """Marks `length` tokens as present (the disk loader wrote them directly into the buffers)."""
        assert length <= self.capacity, "the loader never writes past the capacity"
        self.length = self.high_water = length

    @classmethod
    def gathered(cls, base: SessionKV, keep: torch.Tensor, pin_memory: bool) -> "SessionBuffer":
        """A new buffer holding ``base``'s tokens at indices ``keep``, in order."""
        layers = len(base.keys)
        _, heads, _, dim = base.keys[0].shape
        buf = cls(layers, heads, dim, base.keys[0].dtype, pin_memory)
        keep = keep.to(torch.long)
        assert base.loader is None or base.loader.done, "gather only fully loaded snapshots"
        base.source.sync()
        buf.append(
            base.token_ids.index_select(0, keep),
            [k.index_select(2, keep) for k in base.keys],
            [v.index_select(2, keep) for v in base.values],
        )
        return buf
