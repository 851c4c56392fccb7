"""The store's side of a turn's writes: where a turn's KV goes (`TurnSink.append`), how a new turn rebases a
session on what it keeps (`TurnSink.start_turn`), and the end of a turn. The :class:`~.writer.TurnWriter` a turn
holds calls these and nothing else of the store (`writer.Sink`); the writer's own fields are its own to change.
"""

from __future__ import annotations

import time
import weakref
import torch

from .buffer import ranges
from .config import StoreConfig
from .entry import Entry, Write
from .eviction import Eviction
from .prefixes import BLOCK
from .state import SessionState
from .store_state import StoreState
from .tier import Tier
from .writer import TurnWriter


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
                        if time.monotonic() >= deadline or not any(
                                x is not e and x.host is not None and (x.write is Write.DEMOTE or x.pins)
                                for x in self.state.entries.values()):
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
                self.state.pool_prompt(e)  # the block pool keeps the prompt's blocks (block_pool.py)
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
                    # it (`RemoteTier.remove` deletes nothing of a session that is still indexed, save_thread.py).
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
