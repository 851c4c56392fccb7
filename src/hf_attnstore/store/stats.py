"""The store's counters (`StoreStats`, changed only by the index), and warnings logged once per kind (`OnceLogger`:
a store or a model may hit the same condition every turn).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import asdict, dataclass, fields
from typing import ClassVar


class OnceLogger:
    """Logs each kind of warning once (thread-safe).

    Example:
        >>> once = OnceLogger(logging.getLogger(__name__))
        >>> once.warning("full", "disk full: %s", "/tmp/kv")  # logged
        >>> once.warning("full", "disk full: %s", "/tmp/kv")  # not again
    """

    def __init__(self, logger: logging.Logger):
        self.logger = logger
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def warning(self, kind: str, message: str, *args) -> None:
        with self._lock:
            if kind in self._seen:
                return
            self._seen.add(kind)
        self.logger.warning(message, *args)


@dataclass
class StoreStats:
    """Counters of an :class:`AttnStore` (a copy is returned by :meth:`AttnStore.stats`).

    The figures a user reads first are in :meth:`summary` (one line) and the ``"usage"`` group; every field
    belongs to one group of :attr:`GROUPS` (:meth:`grouped` returns them so), listed in docs/options.md.

    Example:
        >>> from hf_attnstore import AttnStore
        >>> store = AttnStore(host_bytes="1MiB")
        >>> _ = store.lookup("chat-1", "model-a")
        >>> stats = store.stats()
        >>> stats.lookups, stats.hits, stats.misses, stats.host_bytes_limit
        (1, 0, 1, 1048576)
        >>> stats.summary()
        '0 sessions (0 in host memory, 0 on disk); 1 lookups: 0 hits (host 0, disk 0, remote 0), 1 misses; host 0.0 of 1.0 MiB; errors 0'
        >>> stats.grouped()["usage"]["misses"]
        1
    """

    #: Every field, by what it tells. "usage" comes first: what a user reads to see that the store works.
    GROUPS: ClassVar[dict[str, tuple[str, ...]]] = {
        "usage": ("sessions", "host_sessions", "disk_sessions", "lookups", "hits_host", "hits_disk", "hits_remote",
                  "misses", "prefix_hits", "host_bytes_used", "host_bytes_limit", "disk_bytes_used",
                  "disk_bytes_limit"),
        "errors": ("write_errors", "load_errors", "remote_errors", "stale_writes", "rejected_too_large",
                   "rejected_no_room"),
        "traffic": ("appended_tokens", "prefetches", "bytes_read", "read_seconds", "bytes_written", "write_seconds",
                    "remote_bytes_read", "remote_read_seconds", "remote_bytes_written", "loads_in_flight",
                    "saves_pending", "host_encoded_tokens", "states_kept", "states_refused"),
        "eviction": ("demotions", "host_drops", "disk_drops", "head_drops", "head_dropped_tokens", "ttl_expired",
                     "retained_dropped", "retained_sessions"),
        "remote": ("remote_down", "remote_restarts", "remote_restores"),
        "load_or_recompute": ("resume_decisions", "resume_recomputes", "resume_recomputed_tokens",
                              "resume_load_gbps", "resume_prefill_tokens_per_s", "resume_load_estimate_s",
                              "resume_chosen_estimate_s"),
        "block_pool": ("block_lookups", "block_hit_tokens", "blocks_inserted", "blocks_evicted", "pool_blocks"),
    }

    lookups: int = 0
    hits_host: int = 0
    hits_disk: int = 0
    hits_remote: int = 0  # found in the shared remote tier (not local, or longer there)
    misses: int = 0
    appended_tokens: int = 0
    demotions: int = 0  # host -> disk
    host_drops: int = 0  # evicted from host with no disk copy
    disk_drops: int = 0
    prefix_hits: int = 0  # lookups that found another session sharing a longer prefix (lookup_prefix)
    head_drops: int = 0  # leading chunks dropped from disk copies (partial_eviction)
    head_dropped_tokens: int = 0
    rejected_too_large: int = 0
    host_encoded_tokens: int = 0  # tokens whose host copy became the codec's (kv_codec_host, buffer.py)
    states_kept: int = 0  # hybrid models' end-of-turn states kept with their sessions
    states_refused: int = 0  # ... and those not kept (the turn lost its session, or did not store all its KV)
    stale_writes: int = 0
    write_errors: int = 0
    load_errors: int = 0
    rejected_no_room: int = 0  # appends refused: the host tier was full of pinned or unwritable sessions
    ttl_expired: int = 0
    retained_dropped: int = 0  # capacity evictions of sessions retained from expiry (`AttnStore.retain`)
    retained_sessions: int = 0  # sessions whose retention deadline is ahead (now)
    prefetches: int = 0
    bytes_read: int = 0
    read_seconds: float = 0.0
    bytes_written: int = 0
    write_seconds: float = 0.0
    remote_bytes_read: int = 0
    remote_read_seconds: float = 0.0
    remote_bytes_written: int = 0
    remote_errors: int = 0  # failed remote calls (lookups, loads, copies): each one a miss or a skipped copy
    remote_restarts: int = 0  # times the remote tier was found to have lost its data (saver.py): sessions rewritten
    remote_restores: int = 0  # local copies put back after the longer remote copy meant to replace them failed
    # 1 while the remote tier is down: not reachable since the store started (reconnected in the background), or
    # a call failed in the last few seconds (the circuit breaker); its lookups are misses meanwhile. 0 when it is
    # up or there is none (added up over replicas: how many have theirs down).
    remote_down: int = 0
    sessions: int = 0
    host_sessions: int = 0
    disk_sessions: int = 0
    host_bytes_used: int = 0
    host_bytes_limit: int = 0
    disk_bytes_used: int = 0
    disk_bytes_limit: int = 0
    # Load or recompute (`recompute_by_cost`): loads decided by measured cost, those that left leading chunks for
    # the turn to recompute, and those chunks' tokens; then the last decision's inputs (the tier's load rate in
    # GB/s of KV at the model's precision, the model's prefill rate) and estimates (loading every stored chunk,
    # and the choice made).
    resume_decisions: int = 0
    resume_recomputes: int = 0
    resume_recomputed_tokens: int = 0
    resume_load_gbps: float = 0.0
    resume_prefill_tokens_per_s: float = 0.0
    resume_load_estimate_s: float = 0.0
    resume_chosen_estimate_s: float = 0.0
    loads_in_flight: int = 0
    saves_pending: int = 0
    # The block pool (`block_pool`): its lookups, the prompt tokens they found in leading blocks present (a trace
    # simulator's hit: the turn reuses them but for a last token it must compute), blocks inserted and evicted,
    # and blocks held (now).
    block_lookups: int = 0
    block_hit_tokens: int = 0
    blocks_inserted: int = 0
    blocks_evicted: int = 0
    pool_blocks: int = 0

    @property
    def hits(self) -> int:
        return self.hits_host + self.hits_disk + self.hits_remote

    @property
    def read_gbps(self) -> float:
        return self.bytes_read / self.read_seconds / 1e9 if self.read_seconds else 0.0

    @property
    def errors(self) -> int:
        """Failed writes, loads and remote calls, and refused appends: 0 on a healthy store."""
        return sum(getattr(self, name) for name in self.GROUPS["errors"])

    def grouped(self) -> dict[str, dict[str, int | float]]:
        """The fields by group (see :attr:`GROUPS`), "usage" first."""
        values = asdict(self)
        return {group: {name: values[name] for name in names} for group, names in self.GROUPS.items()}

    def summary(self) -> str:
        """One line of what a user reads first: sessions, hits per tier, misses, memory, errors."""
        line = (f"{self.sessions} sessions ({self.host_sessions} in host memory, {self.disk_sessions} on disk); "
                f"{self.lookups} lookups: {self.hits} hits (host {self.hits_host}, disk {self.hits_disk}, remote "
                f"{self.hits_remote}), {self.misses} misses; host {self.host_bytes_used / 2**20:.1f} of "
                f"{self.host_bytes_limit / 2**20:.1f} MiB")
        if self.disk_sessions or self.disk_bytes_used:
            line += f", disk {self.disk_bytes_used / 2**20:.1f} of {self.disk_bytes_limit / 2**30:.1f} GiB"
        if self.remote_down:
            line += ", remote tier down"
        return f"{line}; errors {self.errors}"

