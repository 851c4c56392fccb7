"""Loading a turn's reused KV into its layers: each layer's stored pre-RoPE keys re-rotated for their positions
this turn, as the layer first runs (`ReuseLoader.load_layer`, called by the layers through the turn).

Layout of every KV tensor here: ``[batch=1, kv_heads, seq, head_dim]``.
"""

from __future__ import annotations

import dataclasses
import weakref

import torch

from ..store import LoadError, SessionKV
from ..store.config import StoreConfig
from .cuda_prefetch import CudaLayerPrefetcher
from ..store.buffer import copy_into, dense
from .hooks import ReuseFailed
from .rope import RopeAdapter
from .truncation import ReusePlan


class ReuseLoader:
    """Hands each layer of a turn its reused KV, from the snapshot the turn's plan chose.

    Args:
        snapshot: The stored KV the turn reuses (pinned by the snapshot while this loader holds it).
        plan: Which of its tokens are reused, and the positions their keys are rotated to.
        rope: The model's rotary embedding.
        num_layers: KV layers of the model (the last one's load releases the snapshot).
        windows: KV slot -> sliding window, for the layers that keep one.
        config: The store's settings (layer-wise loading, the device read buffer).

    Example:
        >>> loader = ReuseLoader(snapshot, plan.reuse, RopeAdapter(model), 2, {}, store.config)  # doctest: +SKIP
        >>> keys, values = loader.load_layer(0, plan.reused, new_keys, new_values)  # doctest: +SKIP
    """

    def __init__(self, snapshot: SessionKV, plan: ReusePlan, rope: RopeAdapter, num_layers: int,
                 windows: dict[int, int], config: StoreConfig):
        self.snapshot: SessionKV | None = snapshot
        self._plan, self._rope, self._layers, self._windows, self._config = plan, rope, num_layers, windows, config
        self._keep_is_prefix = torch.equal(plan.keep, torch.arange(plan.reused))
        self._selected: SessionKV | None = None
        self._prefetcher: CudaLayerPrefetcher | None = None
        self._load_rope: dict[tuple, tuple[torch.Tensor, torch.Tensor, bool]] = {}
        if snapshot.loader is not None:
            # From now on the disk loader runs at most `read_buffer_layers` ahead of our layers; release it when
            # this loader goes away, even unused, so that the load never waits for a dead consumer.
            snapshot.loader.attach()
            weakref.finalize(self, snapshot.loader.release)

    def load_layer(self, idx: int, length: int, new_keys: torch.Tensor, new_values: torch.Tensor):
        """Layer `idx`'s reused KV followed by this forward's new KV, as the layer's cache tensors.

        The output is allocated once at its final size: reused keys are re-rotated for their positions this
        turn straight into it, and reused values copied into it (one pass each, where rotating and then
        concatenating took three). `new_*` are ``[1, kv_heads, n, head_dim]``.

        Raises:
            ReuseFailed: The stored KV could not be loaded (caught by the forward wrapper, see hooks.py).
        """
        if length == 0:
            return new_keys, new_values
        dtype, device = new_keys.dtype, new_keys.device
        try:
            if idx == 0 and self.snapshot.loader is not None and not self._config.layerwise_on(device):
                self.snapshot.loader.wait_all()  # wait for the whole session before computing (NO-PL)
            if device.type == "cuda":
                if self._prefetcher is None:
                    self._prefetcher = CudaLayerPrefetcher(self._host_parts, self.snapshot.loader, self._layers,
                                                           device, self._config.read_buffer_layers)
                parts = self._prefetcher.get(idx, length)
            else:
                parts = self._host_parts(idx, length)
        except LoadError as exc:
            raise ReuseFailed(str(exc)) from exc
        # A sliding-window layer gets the reused tokens its window still sees: the last `window - 1`.
        start = self.load_start(idx, length)
        kept = length - start
        _, heads, n, dim = new_keys.shape
        keys = torch.empty(1, heads, kept + n, dim, dtype=dtype, device=device)
        # Keys and values may differ in dtype (transformers' layers keep one dtype each since 5.24).
        values = torch.empty(1, heads, kept + new_values.shape[2], new_values.shape[3], dtype=new_values.dtype,
                             device=device)
        rotated = self._rope.layer_has_rope(idx)
        if rotated:
            # cos/sin are computed once per turn and rotary group (layer type), shared by the group's layers.
            group = self._rope.group(idx)
            rope_key = (start, length, n, device, dtype, group)
            if rope_key not in self._load_rope:
                positions = self._plan.key_positions[start:length].to(device)
                # Frequencies of this forward (length-dependent RoPE picks them by its length, not the keys').
                cos, sin = self._rope.cos_sin(positions, dtype, group, length=length + n)
                self._load_rope[rope_key] = cos, sin, RopeAdapter.halves_equal(cos, sin)
            cos, sin, halves_equal = self._load_rope[rope_key]
        pos = 0
        for k, v in parts:
            m = k.shape[2]
            # A part kept encoded (store/encoded.py) is dequantized here, on the device, just before its keys
            # are re-rotated: no full-precision copy of it exists in host memory or crosses to the device.
            k = dense(k, device, dtype)
            if rotated:
                self._rope.rotate_into(keys[:, :, pos : pos + m], k, cos[:, :, pos : pos + m],
                                       sin[:, :, pos : pos + m], halves_equal)
            else:
                keys[:, :, pos : pos + m].copy_(k)
            copy_into(values[:, :, pos : pos + m], v)
            pos += m
        keys[:, :, kept:].copy_(new_keys)
        values[:, :, kept:].copy_(new_values)
        if idx == self._layers - 1:
            if self.snapshot.loader is not None:
                self.snapshot.loader.release()
            self.snapshot = self._selected = self._prefetcher = None  # every layer is loaded: release the snapshot
        return keys, values

    def load_start(self, idx: int, length: int) -> int:
        """How many of the first `length` reused tokens KV slot `idx` does not load (a sliding window's past)."""
        window = self._windows.get(idx)
        return max(length - window + 1, 0) if window else 0

    def _host_parts(self, idx: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Views of layer `idx`'s reused pre-RoPE KV in host memory, the tokens it loads of the first `length`
        (waits if it is still loading)."""
        if not self._keep_is_prefix and self._selected is None:
            # A truncated history: the kept tokens, as views of the stored segments (no copy).
            self._selected = dataclasses.replace(self.snapshot, parts=tuple(self.snapshot.select(self._plan.keep)),
                                                 token_ids=self.snapshot.token_ids[self._plan.keep])
        parts = (self.snapshot if self._keep_is_prefix else self._selected).layer_parts(idx, length)
        skip, out = self.load_start(idx, length), []
        for k, v in parts:
            if skip < k.shape[2]:
                m = k.shape[2] - skip
                out.append((k.narrow(2, skip, m), v.narrow(2, skip, m)) if skip else (k, v))
            skip = max(skip - k.shape[2], 0)
        return out
