"""Load decisions: which sessions to load from a lower tier, into which buffers, and which leading chunks a turn
recomputes rather than loads (`recompute_by_cost`). Under the state's lock; the reading itself is the load
thread's (load_thread.py), which reports each end through a callback.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .config import StoreConfig
from .costs import ResumeCosts
from .entry import Entry
from .eviction import Eviction
from .format import Manifest
from .geometry import bytes_per_token
from .load_handle import LoadHandle
from .load_thread import DEMAND, PREFETCH, LoadJob, LoadThread
from .placement import choose_recompute
from .store_state import StoreState
from .tier import Tier


@dataclass(frozen=True)
class ResumeDecision:
    """A load-or-recompute decision (`LoadPlanner.choose`), for the stats (``resume_*``) and the metrics.

    Example:
        >>> d = ResumeDecision(chunks=2, tokens=512, load_gbps=1.5, prefill_tokens_per_s=8000.0, load_s=0.30,
        ...                    chosen_s=0.22)
        >>> round(d.load_s - d.chosen_s, 2)  # seconds the turn saves by recomputing its first 512 tokens
        0.08
    """

    chunks: int  # leading chunks recomputed instead of loaded
    tokens: int  # their tokens
    load_gbps: float  # the tier's measured rate, GB/s of KV at the model's precision
    prefill_tokens_per_s: float  # the model's measured prefill rate
    load_s: float  # the estimate of loading every chunk
    chosen_s: float  # the estimate of the choice made



class LoadPlanner:
    """The store's load decisions, over the store's state (under `StoreState.lock`): which sessions to load and into which
    buffers; the :class:`LoadThread` it owns only reads them and reports each end through `done`.

    Example (through the store: a session demoted to disk is loaded back by a lookup)::

        >>> import tempfile, torch
        >>> from hf_attnstore import AttnStore
        >>> kv = [torch.zeros(1, 2, 3, 4) for _ in range(2)]
        >>> with AttnStore(host_bytes="1MiB", disk_dir=tempfile.mkdtemp()) as store:
        ...     with store.open_turn("chat-1", "model-a", None, torch.empty(0)) as turn:
        ...         _ = turn.append(torch.tensor([5, 6, 7]), kv, kv)
        ...     store.evict("chat-1")  # written to disk first, then out of host memory
        ...     store.flush()
        ...     snapshot = store.lookup("chat-1", "model-a")  # starts the load; layers arrive one by one
        ...     snapshot.tier, snapshot.token_ids.tolist()
        ('disk', [5, 6, 7])
    """

    def __init__(self, state: StoreState, eviction: Eviction, config: StoreConfig, lower: Tier, remote: Tier | None,
                 done: Callable[[LoadJob, BaseException | None], None], costs: ResumeCosts | None = None):
        self.state, self.eviction, self.config, self.lower, self.remote = state, eviction, config, lower, remote
        self.costs = costs if costs is not None else ResumeCosts()
        self.wanted: list[tuple[str | None, str]] = []  # the last prefetch request, in order
        self.wanted_key: str | None = None  # its `prefill_key`: the first session's load is decided by cost
        self.loader = LoadThread(done, config.io_timeout_s)

    def retry_prefetch(self) -> int:
        """Starts the wanted loads that fit now, in order (called by `prefetch`, and when a write-out frees room)."""
        started = 0
        first = self.wanted[0][1] if self.wanted else None  # the session whose turn runs next, when keyed
        for fingerprint, sid in self.wanted:
            for e in [e for k, e in self.state.entries.items() if k[1] == sid and (fingerprint is None or k[0] == fingerprint)]:
                if e.host is None and (e.manifest or e.remote) is not None:
                    if not self.start(e, must_fit=True, prefill_key=self.wanted_key if sid == first else None):
                        return started  # in order: a later session must not take the room of an earlier one
                    started += 1
                    self.state.count(prefetches=1)
        return started

    def start(self, e: Entry, must_fit: bool = False, prefill_key: str | None = None) -> bool:
        """Starts loading a session found only below host memory (on disk, else in the remote tier). A
        prefetch (`must_fit`) is skipped rather than overshooting the host limit; a load a turn waits for may
        overshoot by this one session. With `prefill_key` (a turn about to run can recompute a head, and its
        model's prefill rate is measured under that key) and `recompute_by_cost`, the leading chunks that are
        cheaper to recompute are not read (:meth:`choose`)."""
        assert e.host is None and (e.manifest or e.remote) is not None, "only sessions below host are loaded"
        origin, tier = (e.manifest, self.lower) if e.manifest is not None else (e.remote, self.remote)
        if tier is self.remote and not tier.available():
            return False  # the remote tier failed moments ago: a miss now rather than a wait on a dead server
        geometry, dtype = e.layout
        length = origin.length
        # Exactly the session's size: the next turn appends in a new segment, without copying this one.
        buf = self.state.host.for_load(geometry, dtype, length)
        if buf.nbytes > self.config.host_bytes:
            self.state.once.warning("load_too_large", "session %r does not fit the host tier: served as a miss", e.key[1])
            return False
        manifest, decision = origin, None
        if prefill_key is not None and self.config.recompute_by_cost:
            manifest, decision = self.choose(origin, tier.name, prefill_key, bytes_per_token(geometry, dtype.itemsize))
        position = self.state.host.position(e.key) if must_fit else None
        if not self.eviction.make_host_room(buf.nbytes, exclude=e, keep_sooner_than=position) and must_fit:
            return False
        buf.parts[0][0].token_ids[:length].copy_(manifest.token_ids)
        buf.missing_head = manifest.head  # a partially evicted head: left for the turn to recompute
        if manifest.exact is not None:  # KV computed under sparse attention from there on (Segment.inexact_from)
            buf.parts[0][0].mark_inexact(manifest.exact)
        handle = LoadHandle(geometry[0], self.config.read_buffer_layers, self.config.io_timeout_s)
        job = LoadJob(e.key, handle, manifest, buf, PREFETCH if must_fit else DEMAND, tier=tier, entry=e,
                      codec=self.config.codec, keep_encoded=self.config.kv_codec_host, origin=origin,
                      sparse_copies=self.config.sparse_copies)
        self.state.start_load(e, buf, job)
        self.loader.submit(job)
        if decision is not None:  # counted once the load has started (a refused prefetch decided nothing)
            self.state.count(resume_decisions=1, resume_recomputes=decision.chunks > 0,
                             resume_recomputed_tokens=decision.tokens)
            self.state.record(resume_load_gbps=decision.load_gbps,
                              resume_prefill_tokens_per_s=decision.prefill_tokens_per_s,
                              resume_load_estimate_s=decision.load_s, resume_chosen_estimate_s=decision.chosen_s)
        return True

    def choose(self, manifest: Manifest, tier: str, prefill_key: str,
               token_bytes: int) -> tuple[Manifest, ResumeDecision | None]:
        """The manifest to read (lock held): `manifest`, or it less the leading chunks that the turn recomputes
        faster than the tier delivers them (:func:`~hf_attnstore.store.placement.choose_recompute`, by the
        measured rates of `ResumeCosts`; nothing is chosen before both are measured). Only chunks computed in
        this history may be recomputed (not rebased ones), and at least the last chunk is read. With it, the
        decision for the stats (``resume_*``, counted once the load starts), or None when nothing was decided.

        `token_bytes` is one token's KV at the model's precision: the rate is measured in those bytes whatever
        the chunks' codec, so a tier that stores fewer bytes per token is measured faster.
        """
        load, prefill = self.costs.load_bytes_per_s(tier), self.costs.prefill_units_per_s(prefill_key)
        if load is None or prefill is None or not manifest.spans or manifest.state is not None:
            return manifest, None
        units, pos = [], manifest.head
        for span in manifest.spans:
            units.append((pos, pos + span.length, span.length * token_bytes))
            pos += span.length
        eligible = 0
        while eligible < len(manifest.spans) - 1 and not manifest.spans[eligible].rebased:
            eligible += 1
        if manifest.dropped and any(span.rebased for span in manifest.dropped):
            eligible = 0  # a recomputed head must be this history's own KV from position 0
        chunks, chosen_s, load_s = choose_recompute(units, manifest.head, eligible, 1 / load, 1 / prefill)
        for _ in range(chunks):
            manifest = manifest.drop_head_span()
        tokens = units[chunks - 1][1] - units[0][0] if chunks else 0
        return manifest, ResumeDecision(chunks, tokens, load / 1e9, prefill, load_s, chosen_s)

    def finish(self, job: LoadJob, error: BaseException | None) -> None:
        """The load thread finished a job (load_thread.py)."""
        if error is None:
            geometry, dtype = job.buf.geometry, job.buf.dtype
            tokens = job.manifest.length - job.manifest.head
            self.costs.observe_load(job.tier.name, tokens * bytes_per_token(geometry, dtype.itemsize),
                                    job.read_seconds)
        with self.state.cond:
            e = job.entry
            self.state.end_load(e, job.handle)
            remote = job.tier is self.remote
            if remote:
                self.state.count(remote_bytes_read=job.nbytes, remote_read_seconds=job.seconds)
            else:
                self.state.count(bytes_read=job.nbytes, read_seconds=job.seconds)
            if e.host is job.buf:
                self.state.account(e)  # a state read with the KV counts now
                if error is None:
                    self.state.keep_encoded(e, job.encoded)  # applied now, or when the turn reading it ends
            if error is not None:
                self.state.count(load_errors=1, remote_errors=remote)
                self.state.once.warning("load", "%s tier: session %r could not be loaded (%s); it is removed and will "
                                   "be recomputed", job.tier.name, e.key[1], error)
                if self.state.entries.get(e.key) is e:
                    if e.manifest is None and e.predecessor is not None:
                        self.state.give_up_remote(e)  # adopted over an unsaved new history: the older copy stays
                    else:
                        self.state.drop(e)
            elif (job.origin or job.manifest) is e.remote and self.state.entries.get(e.key) is e:
                # Found remotely, local now: written to disk behind the turn, like a session the turn computed.
                # Not while leading chunks left to the turn are missing from the buffer: `AttnStore.fill_head`
                # marks it for writing once they are there (writing it now would store whatever the buffer held).
                self.state.loaded_remote(e, dirty=not job.buf.missing_head)
            self.state.cond.notify_all()
