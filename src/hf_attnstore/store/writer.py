"""The turn writer: how one running turn appends its KV to a session, and the store's side of it.

A turn holds a `TurnWriter` (from `AttnStore.open_turn`) and appends each forward's pre-RoPE KV through it; the
writer's fields are its own to change. Where the KV goes is the store's decision, made by its `TurnSink` under the
index's lock: the session's host buffer (room made first), how a new turn rebases a session on what it keeps
(`TurnSink.start_turn`: a truncated or branched history), and what the end of a turn leaves (its states, the
session marked for the save worker). The writer calls the sink and nothing else of the store.
"""

from __future__ import annotations

import time
import weakref

import torch

from .buffer import LoadError, SessionKV, ranges
from .config import StoreConfig
from .format import KV_DTYPES, make_geometry
from .index import BLOCK, Entry, Eviction, Key, StoreState
from .states import SessionState
from .tiers.base import Tier


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

    def __init__(self, sink: "TurnSink", key: Key, turn: int, base: SessionKV | None, keep: torch.Tensor):
        self.sink, self.key, self.turn = sink, key, turn
        self.base, self.keep = base, keep.to(torch.long).cpu()
        self.started = False
        self.dead = False
        self.geometry: tuple | None = None  # format.py
        self.dtype: torch.dtype | None = None
        # A hybrid model's turn: a weak reference to what publishes its states (record.TurnEnd), asked by the
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
            state: A hybrid model's states at the end of the turn (states.py). The store keeps them with the
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
            >>> from hf_attnstore.store.states import SessionState
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


class TurnSink:
    """The store's side of a turn's :class:`~.writer.TurnWriter` (see the module docstring).

    Example (through the store, which creates the writer)::

        >>> import torch
        >>> from hf_attnstore import AttnStore
        >>> store = AttnStore(host_bytes="1MiB")
        >>> kv = [torch.zeros(1, 2, 3, 4) for _ in range(2)]
        >>> with store.open_turn("chat-1", "model-a", None, torch.empty(0)) as turn:
        ...     turn.append(torch.tensor([1, 2, 3]), kv, kv)
        True
        >>> store.token_ids("chat-1", "model-a").tolist()
        [1, 2, 3]
    """

    def __init__(self, state: StoreState, eviction: Eviction, config: StoreConfig, disk: Tier | None, lower: Tier | None):
        self.state, self.eviction, self.config, self.disk, self.lower = state, eviction, config, disk, lower

    def end(self, writer: TurnWriter, state: SessionState | None, ended: bool = True) -> None:
        """The turn ended (or, with ``ended=False``, offers a hybrid model's states and goes on). Never takes the
        lock: a writer's finalizer may run while this thread holds it; the index applies it at its next
        decision (`StoreState.apply_ended_turns`)."""
        self.state.queue_ended_turn(writer.key, writer.turn, state, ended)

    def truncate(self, writer: TurnWriter, length: int) -> None:
        """Cuts the session back to `length` tokens, if the writer's turn owns it still."""
        with self.state.lock:
            e = self.state.entries.get(writer.key)
            if writer.started and e is not None and e.owner == writer.turn and e.host is not None \
                    and length < e.host.length:
                self.state.cut(e, length)

    def append(self, writer: TurnWriter, token_ids, keys, values, inexact_at: int | None = None) -> bool:
        with self.state.cond:
            if self.state.closed:  # closed during a turn (shutdown): the turn goes on, it is just not stored
                writer.refuse()
                return False
            e = self.state.entries.get(writer.key)
            first = not writer.started  # the turn's first forward: its prompt
            if first:
                e = self.start_turn(writer, e)
            elif e is None or e.owner != writer.turn:
                self.state.count(stale_writes=1)
                self.state.once.warning("stale", "session %r was taken over by a newer turn (or removed); writes of the "
                                "older turn are dropped", writer.key[1])
                return False
            buf = e.host
            if buf is None:  # evicted explicitly mid-turn: what was written is durable, the rest is dropped
                self.state.count(stale_writes=1)
                writer.refuse()
                return False
            needed = buf.bytes_after_append(int(token_ids.numel()))
            if needed > self.config.host_bytes:
                # Outgrown the host tier: the rest of the session is not stored. What is durable stays (a valid
                # prefix that a later turn reuses): deleting data a flush() acknowledged would be a surprise.
                self.state.count(rejected_too_large=1)
                self.state.once.warning("too_large", "session %r needs %d bytes, more than the host tier's %d: the rest of "
                                "it is not stored (raise `host_bytes` to keep it)", writer.key[1], needed,
                                self.config.host_bytes)
                writer.refuse()
                self.state.writer_refused(e, writer.turn)
                return False
            room = needed - buf.nbytes
            if not self.eviction.make_host_room(room, exclude=e):
                # Backpressure: victims are being written to disk and leave host memory when that completes.
                # Wait (bounded) for them rather than overshoot the limit. While it waits, the save thread must
                # not yield to compute (this append *is* the compute): see `SavePlanner.yield_for_save`.
                deadline = time.monotonic() + self.config.io_timeout_s
                self.state.room_wait(+1)
                self.state.cond.notify_all()
                try:
                    while not self.eviction.make_host_room(room, exclude=e):
                        if time.monotonic() >= deadline or not self.state.room_coming(e):
                            break  # nothing is being written out or loaded: waiting would only stall the turn
                        self.state.cond.wait(timeout=0.05)
                        if self.state.entries.get(writer.key) is not e or e.owner != writer.turn or e.host is not buf:
                            self.state.count(stale_writes=1)
                            return False
                finally:
                    self.state.room_wait(-1)
                if not self.eviction.make_host_room(room, exclude=e):
                    # Everything else is pinned (running turns, loads) or cannot be written: refuse to save the
                    # rest of this turn rather than exceed `host_bytes`. What is stored stays a valid prefix.
                    self.state.count(rejected_no_room=1)
                    self.state.once.warning("no_room", "host tier full of sessions that cannot move (running turns, "
                                    "loads, failed writes): the rest of session %r's turn is not stored",
                                    writer.key[1])
                    writer.refuse()
                    return False
            buf.append(token_ids, keys, values, inexact_at)
            if self.config.share_prefixes and buf.length // BLOCK > e.prefix_blocks and not buf.missing_head:
                # Offered for sharing as soon as a whole new block is stored, not only when the turn ends: turns
                # that arrive together (a batch over one system prompt) share the first one's prompt once it is
                # prefilled. Safe while this turn goes on appending: a segment never changes below its fill mark,
                # and the reader compares ids under the lock (`AttnStore.lookup_prefix`).
                self.state.offered_prefix(e, buf.snapshot().token_ids, buf.length // BLOCK)
            self.state.appended(e, int(token_ids.numel()))
            if first:
                self.state.pool_prompt(e)  # the block pool keeps the prompt's blocks (lab/block_pool.py)
            if self.lower is not None and e.dirty:
                self.state.mark_dirty(e)
                if e.length - e.persisted >= self.config.chunk_tokens:
                    self.state.cond.notify_all()
            return True

    def start_turn(self, writer: TurnWriter, e: Entry | None) -> Entry:
        """The first write of a turn: rebases the session on ``base[keep]`` (copy-free when possible)."""
        base, keep = writer.start()
        n = int(keep.numel())
        # The same lineage: a base taken from this very session at its current generation. A base from another
        # session (a shared prefix, `AttnStore.lookup_prefix`) starts a new history that refers to its segments.
        same_lineage = e is not None and base is not None and base.key == writer.key \
            and base.generation == e.generation and n > 0
        if same_lineage and e.host is not None and base.source is e.host and n <= e.host.length \
                and torch.equal(keep, torch.arange(n)):
            if n < e.host.length:
                self.state.cut(e, n)
            # else the common case: append after the history, in place
        elif same_lineage:
            buf = self.state.host.selected(base, keep)
            self.state.set_host(e, buf)
            self.state.new_history(e)
            if e.manifest is not None:
                # The kept tokens that were durable stay durable: only the manifest changes, no data is rewritten.
                durable = keep[keep < e.persisted]
                self.state.set_manifest(e, e.manifest.select(ranges(durable)), e.chunks)
        else:
            old = e
            if old is not None:
                if self.disk is not None:
                    # Another history replaces the session (a recomputed turn, an edited conversation): its disk
                    # copy stays until the new one is durable (`StoreState.hand_over`), so a crash in between, or a failed
                    # write, still leaves the older copy rather than nothing. Also while a load or a save of the old
                    # entry is in flight: a load leaves files alone when it finds its entry gone, and a save hands
                    # what it made durable to the new entry (`SavePlanner.finish_save`).
                    self.state.unindex(old)
                else:
                    # No disk tier: the old entry's copy in the remote tier stays until the new manifest replaces
                    # it (`RemoteTier.remove` deletes nothing of a session that is still indexed, saver.py).
                    self.state.drop(old)
                    old = None
            if base is not None and n:
                buf = self.state.host.selected(base, keep)
            else:
                buf = self.state.host.new_buffer(writer.geometry, writer.dtype)
            e = Entry(key=writer.key, layout=(buf.geometry, buf.dtype), last_access=time.monotonic())
            if old is not None:
                self.state.hand_over(old, e)
            self.state.add(e)
            self.state.set_host(e, buf)
        self.state.owned_by(e, writer.turn, weakref.ref(writer) if writer.state_source is not None else None)
        return e
