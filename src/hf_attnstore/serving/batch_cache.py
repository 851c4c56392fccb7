"""The batch cache of continuous batching (batching.py): every member's KV in one row of a preallocated slab per
layer, left-padded so that all rows end at the same column.

A decoding step writes one column in place; a joiner is written into a free row, right-aligned; a leaver's row
is filled by the last row; the slabs are reallocated (one copy of the live KV) only when a joiner does not fit.
With a byte bound (`max_batch_kv_bytes`) the slabs give up their headroom before exceeding it (`_bounded`).
"""

from __future__ import annotations

import torch

from ..cache.upstream import DynamicCache, DynamicLayer


class _SlabLayer(DynamicLayer):
    """One layer of the batch cache: a preallocated slab ``[rows, kv_heads, columns, head_dim]`` whose rows
    ``[:n]`` (the members) and columns ``[start:end]`` are live; `keys` / `values` are views of that region.

    A decoding step writes one column in place (where `DynamicLayer` concatenates, copying the whole batch's
    KV at every step); a joining member is written into a free row, right-aligned at `end`; a leaving one is
    replaced by the last row. The masked padding left of a member's first column must hold finite numbers
    (0 * NaN would still be NaN): it is zeroed when it becomes live, not the whole slab up front (that would
    touch every page of a large allocation twice)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, rows: int, columns: int, start: int):
        super().__init__()
        self._k = keys.new_empty(rows, keys.shape[1], columns, keys.shape[3])
        self._v = values.new_empty(rows, values.shape[1], columns, values.shape[3])
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True
        self.n, self.start, self.end = 0, start, start
        self._views()

    def _views(self) -> None:
        self.keys = self._k[: self.n, :, self.start : self.end]
        self.values = self._v[: self.n, :, self.start : self.end]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        n = key_states.shape[2]
        if self.end + n > self._k.shape[2]:
            raise RuntimeError("the batch cache has no room left (the runner plans it): this is a bug")
        self._k[: self.n, :, self.end : self.end + n] = key_states
        self._v[: self.n, :, self.end : self.end + n] = value_states
        self.end += n
        self._views()
        return self.keys, self.values

    def extend_left(self, start: int) -> None:
        """Makes columns from `start` live: the existing rows' new columns are padding (zeroed)."""
        if start < self.start:
            self._k[: self.n, :, start : self.start] = 0
            self._v[: self.n, :, start : self.start] = 0
            self.start = start

    def put(self, row: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Writes a member's KV ``[1, h, L, d]`` into `row`, ending at `end`; its padding is zeroed."""
        first = self.end - keys.shape[2]
        self._k[row, :, first : self.end] = keys[0]
        self._v[row, :, first : self.end] = values[0]
        self._k[row, :, self.start : first] = 0
        self._v[row, :, self.start : first] = 0

    def keep_in_row(self, row: int, first: int, picked: torch.Tensor) -> None:
        """Keeps row `row`'s columns ``first + picked`` (per head) right-aligned at `end`; zeroes the rest."""
        keep = picked.shape[1]
        index = picked.to(self._k.device)[:, :, None]
        for slab in (self._k, self._v):
            kept = slab[row, :, first : self.end].gather(1, index.expand(-1, -1, slab.shape[-1]))
            slab[row, :, self.end - keep : self.end] = kept
            slab[row, :, first : self.end - keep] = 0

    def move(self, src: int, dst: int) -> None:
        self._k[dst, :, self.start : self.end] = self._k[src, :, self.start : self.end]
        self._v[dst, :, self.start : self.end] = self._v[src, :, self.start : self.end]

    def copy_from(self, old: "_SlabLayer") -> None:
        """Takes over the live region of a smaller slab, keeping its `end` aligned with ours."""
        width = old.end - old.start
        self._k[: old.n, :, self.end - width : self.end] = old.keys
        self._v[: old.n, :, self.end - width : self.end] = old.values


class BatchKV(DynamicCache):
    """The batch cache: each member's KV in one row, left-padded so that all rows end at the same column.

    Members join and leave without rebuilding it: a joiner takes the next free row (the columns left of its
    first one are masked), a leaver's row is filled by the last row, and the slab is reallocated (one copy of
    the live KV) only when a joiner is longer than the free columns on the left, or the members' remaining
    tokens would not fit on the right.

    Example:
        >>> kv = BatchKV(...)  # the batch runner builds it from its members' rows  # doctest: +SKIP
    """

    def __init__(self):
        super().__init__()
        self.layers: list[_SlabLayer] = []
        self.first: list[int] = []  # each row's first live column (the padding is left of it)

    @property
    def width(self) -> int:
        return self.layers[0].end - self.layers[0].start if self.layers else 0

    def pad(self, row: int) -> int:
        return self.first[row] - self.layers[0].start

    def admit(self, kvs: list[list[tuple[torch.Tensor, torch.Tensor]]], rows: int, room: int,
              max_bytes: int | None = None) -> None:
        """Adds members' KV (each per layer ``[1, h, L, d]``) as the last rows; `rows` is the most rows the batch
        may have, `room` the columns its members may still add, `max_bytes` (if given) the most bytes the slabs
        may take (then headroom is given up before it is exceeded)."""
        length = max(kv[0][0].shape[2] for kv in kvs)
        old = self.layers[0] if self.layers else None
        if old is None or old.n + len(kvs) > old._k.shape[0] or old.end < length or old._k.shape[2] - old.end < room:
            # Reallocate once for all joiners, with headroom on both sides: on the left a session's next turn
            # is longer; on the right every decoding step takes a column, and a later joiner needs `room` more.
            width = max(length, self.width)
            end, columns = width // 2 + width, width // 2 + width + room + width // 2
            if max_bytes is not None:
                rows, end, columns = _bounded(kvs[0], rows, (old.n if old is not None else 0) + len(kvs), width,
                                              room, end, columns, max_bytes)
            layers = []
            for i, (k, v) in enumerate(kvs[0]):
                layer = _SlabLayer(k, v, rows, columns, end)
                if old is not None:
                    layer.copy_from(self.layers[i])
                    layer.n, layer.start = old.n, end - self.width
                layers.append(layer)
            if old is not None:
                self.first = [f + end - old.end for f in self.first]
            self.layers = layers
        for kv in kvs:
            length, row = kv[0][0].shape[2], self.layers[0].n
            for layer, (k, v) in zip(self.layers, kv):
                layer.extend_left(layer.end - length)
                layer.put(row, k, v)
                layer.n = row + 1
                layer._views()
            self.first.append(self.layers[0].end - length)

    @property
    def rows(self) -> int:
        return self.layers[0].n if self.layers else 0

    def nbytes(self) -> tuple[int, int]:
        """Bytes of the slabs as allocated (every row, with headroom), and of the members' live KV (their rows'
        columns, padding included)."""
        allocated = sum(layer._k.nbytes + layer._v.nbytes for layer in self.layers)
        live = sum(layer.keys.nbytes + layer.values.nbytes for layer in self.layers)
        return allocated, live

    def keep_rows(self, rows: int) -> None:
        """Drops every row from `rows` on: undoes an `admit` that failed after writing some of its rows. The
        columns it made live on the left stay live, in every layer alike, as zeroed (masked) padding."""
        start = min((layer.start for layer in self.layers), default=0)
        for layer in self.layers:
            layer.n = min(layer.n, rows)
            layer.extend_left(start)
            layer._views()
        del self.first[rows:]

    def keep_in_row(self, row: int, picks: list[torch.Tensor]) -> None:
        """Keeps, in every layer, the row's keys and values at `picks[layer]` (``[kv_heads, keep]`` indices into
        the row's live columns, ascending), right-aligned; the columns freed on its left become masked padding
        (a sparse row's re-selection, sparse_rows.py)."""
        first, keep = self.first[row], picks[0].shape[1]
        for layer, picked in zip(self.layers, picks):
            layer.keep_in_row(row, first, picked)
        self.first[row] = self.layers[0].end - keep
        start = min(self.first)
        for layer in self.layers:
            layer.start = start
            layer._views()

    def remove(self, row: int) -> None:
        """Drops a row; the last row takes its place."""
        last = self.layers[0].n - 1
        for layer in self.layers:
            if row != last:
                layer.move(last, row)
            layer.n = last
        self.first[row] = self.first[last]
        self.first.pop()
        # The columns no member uses any more are left of the earliest first column.
        start = min(self.first, default=self.layers[0].end)
        for layer in self.layers:
            layer.start = start
            layer._views()


def token_bytes(kv: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
    """One token's KV over every layer, in bytes (of a member's per-layer ``[1, h, L, d]`` keys and values).

    Example:
        >>> import torch
        >>> token_bytes([(torch.zeros(1, 2, 5, 4), torch.zeros(1, 2, 5, 4))])  # 2 heads x 4 dims x 4 bytes, twice
        64
    """
    return sum(k.shape[1] * k.shape[3] * k.element_size() + v.shape[1] * v.shape[3] * v.element_size() for k, v in kv)


def _bounded(kv: list[tuple[torch.Tensor, torch.Tensor]], rows: int, needed: int, width: int, room: int, end: int,
             columns: int, max_bytes: int) -> tuple[int, int, int]:
    """The slab's (rows, end, columns) within `max_bytes`: the usual headroom if it fits, else rows for the
    members only, else no headroom on the left either (exactly the `needed` rows of `width` plus `room`, which
    the runner admitted only if they fit)."""
    token = token_bytes(kv)
    for r, e, c in ((rows, end, columns), (needed, end, columns), (needed, width, width + room)):
        if r * c * token <= max_bytes:
            return r, e, c
    return needed, width, width + room  # a turn alone larger than the bound: it runs anyway (`BatchRunner._fits`)
