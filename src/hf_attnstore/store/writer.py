"""TurnWriter: how one turn appends its KV to a session (the store decides where it goes)."""

from __future__ import annotations

from typing import Protocol

import torch

from .buffer import SessionKV
from .entry import Key
from .format import KV_DTYPES
from .geometry import make_geometry
from .load_handle import LoadError
from .state import SessionState

class Sink(Protocol):
    """Where a writer's appends go: the store's side of the turn (`turn_sink.TurnSink`)."""

    def append(self, writer: "TurnWriter", token_ids: torch.Tensor, keys, values, inexact_at: int | None) -> bool: ...

    def end(self, writer: "TurnWriter", state: SessionState | None, ended: bool = True) -> None: ...

    def truncate(self, writer: "TurnWriter", length: int) -> None: ...


class TurnWriter:
    """Appends one turn's KV to a session. Created by :meth:`AttnStore.open_turn`.

    Example:
        >>> from hf_attnstore import AttnStore
        >>> store = AttnStore(host_bytes="1MiB")
        >>> kv = [torch.zeros(1, 2, 3, 4) for _ in range(2)]  # two layers of [1, kv_heads, 3 tokens, head_dim]
        >>> with store.open_turn("chat-1", "model-a", None, torch.empty(0)) as writer:
        ...     writer.append(torch.tensor([1, 2, 3]), kv, kv)
        True
        >>> writer.append(torch.tensor([4]), kv, kv)  # closed: later appends are dropped
        False
    """

    def __init__(self, sink: Sink, key: Key, turn: int, base: SessionKV | None, keep: torch.Tensor):
        self.sink, self.key, self.turn = sink, key, turn
        self.base, self.keep = base, keep.to(torch.long).cpu()
        self.started = False
        self.dead = False
        self.geometry: tuple | None = None  # geometry.py
        self.dtype: torch.dtype | None = None
        # A hybrid model's turn: a weak reference to what publishes its states (layers.TurnEnd), asked by the
        # store when it needs the states of a turn that is still open (`StoreState.publish_states`).
        self.state_source = None

    def start(self) -> tuple[SessionKV | None, torch.Tensor]:
        """The turn's first write begins (the sink, under the store's lock): the base and the positions it keeps;
        the snapshot is no longer needed here, so its memory may go.

        Example:
            >>> from hf_attnstore import AttnStore
            >>> store = AttnStore(host_bytes="1MiB")
            >>> kv = [torch.zeros(1, 2, 3, 4)]
            >>> writer = store.open_turn("chat-1", "model-a", None, torch.empty(0))
            >>> writer.started, writer.append(torch.tensor([1, 2, 3]), kv, kv), writer.started  # started by 1st append
            (False, True, True)
            >>> writer.close()
        """
        self.started = True
        base, self.base = self.base, None
        return base, self.keep

    def refuse(self) -> None:
        """The store refused the turn's writes (closed, taken over, no room): later appends are dropped.

        Example:
            >>> from hf_attnstore import AttnStore
            >>> store = AttnStore(host_bytes="1MiB")
            >>> kv = [torch.zeros(1, 2, 3, 4)]
            >>> with store.open_turn("chat-1", "model-a", None, torch.empty(0)) as writer:
            ...     writer.refuse()
            ...     writer.append(torch.tensor([1, 2, 3]), kv, kv)
            False
        """
        self.dead = True

    def append(self, token_ids: torch.Tensor, keys, values, inexact_at: int | None = None) -> bool:
        """Appends tokens with their pre-RoPE keys and values: per-layer lists of ``[1, kv_heads, n, head_dim]``
        tensors, or stacked ``[layers, 1, kv_heads, n, head_dim]`` tensors (one copy for all layers).

        `inexact_at`: the tokens from this index on (of the `n` appended) were computed under sparse attention
        (``kv_budget``: a forward that attended to a selection of the history): they are labelled so, and a cache
        that attends to the whole history never reuses them.

        Large CPU appends are kept without copying: do not modify the tensors afterwards.
        Returns whether the data was stored (False when the session is too large, was taken over, or the
        host tier had no room).

        Raises:
            TypeError: Keys or values of a dtype the store cannot keep, or of inconsistent shapes.

        Example:
            >>> from hf_attnstore import AttnStore
            >>> store = AttnStore(host_bytes="1MiB")
            >>> keys = torch.zeros(2, 1, 2, 3, 4)  # stacked: [layers, 1, kv_heads, tokens, head_dim]
            >>> with store.open_turn("chat-1", "model-a", None, torch.empty(0)) as writer:
            ...     writer.append(torch.tensor([1, 2, 3]), keys, keys.clone(), inexact_at=2)  # 3: sparse attention
            True
            >>> found = store.find("chat-1", "model-a", torch.tensor([1, 2, 3, 4]))
            >>> found.own.token_ids.tolist()  # a dense turn reuses the exact tokens only
            [1, 2]
        """
        if self.dead:
            return False
        keys, values = _storable(keys, "keys"), _storable(values, "values")
        n = int(token_ids.numel())
        layout, value_layout = _layout(keys), _layout(values)
        if len(layout[1]) != 4 or len(value_layout[1]) != 4 or layout[1][2] != n or value_layout[1][2] != n \
                or layout[0] != value_layout[0] or layout[1][0] != 1 or value_layout[1][0] != 1 \
                or layout[2] is None or layout[2] != value_layout[2]:
            raise TypeError(f"expected {layout[0]} keys and values of shape [1, kv_heads, {n}, head_dim] and one "
                            "dtype")
        geometry = make_geometry(layout[0], (layout[1][1], layout[1][3]), (value_layout[1][1], value_layout[1][3]))
        dtype = layout[2]
        if self.geometry is None:
            self.geometry, self.dtype = geometry, dtype
        elif (geometry, dtype) != (self.geometry, self.dtype):
            raise TypeError(f"this turn stores {self.geometry} {self.dtype}, got {geometry} {dtype}")
        if not self.started and self.base is not None and self.base.loader is not None:
            try:
                self.base.loader.wait_all()  # never wait under the store's lock
            except LoadError:
                self.base, self.keep = None, self.keep[:0]
        if inexact_at is not None and not 0 <= inexact_at <= n:
            raise ValueError(f"`inexact_at` must lie in [0, {n}], got {inexact_at}")
        return self.sink.append(self, token_ids.detach().to("cpu", torch.long).view(-1), keys, values,
                                inexact_at if inexact_at is None or inexact_at < n else None)

    def close(self, state: SessionState | None = None) -> None:
        """Ends the turn: the session may leave host memory again. Idempotent; later appends are dropped.

        Args:
            state: A hybrid model's states at the end of the turn (state.py). The store keeps them with the
                session if the turn owns it still and its stored KV covers exactly ``state.tokens`` tokens.

        Also runs when the writer is garbage-collected. It never takes the store's lock (a collection may run
        while this thread holds it): the store applies it at its next placement decision or lookup.

        Example:
            >>> from hf_attnstore import AttnStore
            >>> store = AttnStore(host_bytes="1MiB")
            >>> kv = [torch.zeros(1, 2, 3, 4)]
            >>> writer = store.open_turn("chat-1", "model-a", None, torch.empty(0))
            >>> writer.append(torch.tensor([1, 2, 3]), kv, kv)
            True
            >>> writer.close(); writer.close()  # idempotent
            >>> writer.append(torch.tensor([4]), [torch.zeros(1, 2, 1, 4)], [torch.zeros(1, 2, 1, 4)])
            False
        """
        # A turn that never wrote, or whose appends were refused (dead), has no state that matches its KV.
        self.sink.end(self, state if self.started and not self.dead else None)
        self.dead = True
        self.base = None

    def offer_state(self, state: SessionState) -> None:
        """Hands the store a hybrid model's states after the turn's last forward, the turn going on (the store
        keeps them like those of `close`, see there). Never takes the store's lock.

        Example:
            >>> from hf_attnstore import AttnStore
            >>> from hf_attnstore.store.state import SessionState
            >>> store = AttnStore(host_bytes="1MiB")
            >>> kv = [torch.zeros(1, 2, 3, 4)]
            >>> with store.open_turn("chat-1", "model-a", None, torch.empty(0)) as writer:
            ...     _ = writer.append(torch.tensor([1, 2, 3]), kv, kv)
            ...     writer.offer_state(SessionState.capture(3, {"L0000.r0": torch.ones(2, 4)}))  # the turn goes on
            >>> store.lookup("chat-1", "model-a").state.tokens
            3
        """
        if self.started and not self.dead:
            self.sink.end(self, state, ended=False)

    def publish_state(self) -> None:
        """Asks the turn's state source (if any, and alive) to offer its current states.

        Example:
            >>> from hf_attnstore import AttnStore
            >>> store = AttnStore(host_bytes="1MiB")
            >>> with store.open_turn("chat-1", "model-a", None, torch.empty(0)) as writer:
            ...     writer.publish_state()  # no state source (not a hybrid model's turn): nothing to publish
        """
        source = self.state_source() if self.state_source is not None else None
        if source is not None:
            source.publish()

    def __enter__(self) -> "TurnWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def truncate(self, length: int) -> None:
        """Cuts the session back to `length` tokens (e.g. after assisted decoding rejected tokens).

        Example:
            >>> from hf_attnstore import AttnStore
            >>> store = AttnStore(host_bytes="1MiB")
            >>> kv = [torch.zeros(1, 2, 4, 4)]
            >>> with store.open_turn("chat-1", "model-a", None, torch.empty(0)) as writer:
            ...     _ = writer.append(torch.tensor([1, 2, 3, 4]), kv, kv)
            ...     writer.truncate(2)  # assisted decoding rejected the last two tokens
            >>> store.token_ids("chat-1", "model-a").tolist()
            [1, 2]
        """
        self.sink.truncate(self, length)


def _layout(tensors) -> tuple[int, tuple, torch.dtype | None]:
    """(layers, per-layer shape, dtype) of a stacked tensor or a per-layer list; dtype None if mixed."""
    if isinstance(tensors, torch.Tensor):
        return tensors.shape[0], tuple(tensors.shape[1:]), tensors.dtype
    shapes, dtypes = {tuple(t.shape) for t in tensors}, {t.dtype for t in tensors}
    shape = shapes.pop() if len(shapes) == 1 else ()
    return len(tensors), shape, dtypes.pop() if len(dtypes) == 1 else None


def _storable(tensors, what: str):
    """Tensors the store may keep: detached (no autograd graph kept alive) and owning only their own bytes.

    `tensors` is a list with one ``[1, kv_heads, n, head_dim]`` tensor per layer, or one stacked
    ``[layers, 1, kv_heads, n, head_dim]`` tensor. Some models hand the cache views into a larger tensor
    (phi3 and gpt_neox: slices of the fused QKV projection). Keeping such a view would hold the whole
    projection output while accounting for the slice, so it is copied.
    """
    stacked = isinstance(tensors, torch.Tensor)
    out = []
    for t in [tensors] if stacked else tensors:
        if t.dtype not in KV_DTYPES:
            raise TypeError(f"{what} of dtype {t.dtype} cannot be stored: use one of "
                            f"{', '.join(str(d) for d in KV_DTYPES)}")
        t = t.detach()
        if t.untyped_storage().nbytes() > t.numel() * t.element_size():
            t = t.clone()
        out.append(t)
    return out[0] if stacked else out
