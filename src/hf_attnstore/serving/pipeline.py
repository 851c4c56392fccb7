"""ChatPipeline: session-aware chat over `generate()`, whose request queue drives the store.

One worker thread runs the queued turns in submission order (so the turns of a session are serialized).
Before each turn it gives the store its look-ahead hints (AttentionStore §3.3-3.4): the sessions of the
next `prefetch_window` jobs are fetched from disk to host memory while the current job runs, and the
sessions of the next `eviction_window` jobs are told to a scheduler-aware policy (`policy="lookahead"`).
"""

from __future__ import annotations

import contextlib

import logging
import threading
import time
import warnings
from collections import deque
from dataclasses import dataclass, fields, replace
from collections.abc import Iterator, MutableMapping
from concurrent.futures import Future

import torch
from transformers import DynamicCache, LogitsProcessorList, StoppingCriteriaList

from ..cache.cache import AttnStoreCache
from ..cache.chat import ChatTokens
from ..cache.config import LEGACY_TRUNCATION, SparseConfig, TruncationConfig, truncation_of
from ..cache.fingerprint import salted_fingerprint
from ..store import AttnStore, lookahead_windows, parse_bytes, validate_session_id
from .jobs import Cancelled, Job, PipelineClosed, Prepared, Reply, Tee, token_logprobs  # noqa: F401 (Reply, PipelineClosed: re-exported)
from .timing import FirstTokenTimer
from ..cache.truncation import tokens_to_drop
from ..cache.upstream import cache_kwargs

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PipelineTuning:
    """The scheduling and batching knobs of a :class:`ChatPipeline`; most users set none of them.

    Args:
        prefetch_window: Waiting jobs whose sessions are fetched ahead; default ``2 C_host / S_kv`` (twice
            the host capacity over the mean session KV size, measured as the store fills: an upper bound,
            since the store fetches in queue order only what fits).
        eviction_window: Waiting jobs told to the eviction policy; default ``(C_host + C_disk) / S_kv``.
        max_batch_tokens: With batching, the most tokens one iteration of the batch computes: the running
            members' decoding step (one token each) and chunks of joining turns' prompts. A long prompt is then
            prefilled in chunks between decoding steps, so running replies keep streaming (chunked prefill).
            ``None`` (default) prefills each joining prompt in one forward: the fastest on a CPU. Must exceed
            ``max_batch_size``.
        max_batch_kv_bytes: With batching, the most bytes of KV the batch cache may hold (``"2GiB"`` or a count):
            a turn joins only when every row, as wide as the widest, fits with the tokens the members may still
            decode; otherwise it waits, first in line, for members to leave (a turn alone always runs). What a GPU's
            memory bounds; with `kv_budget` rows are smaller, so more turns join. Not counted: while the batch cache
            grows, its old and new slabs coexist for the copy (up to about twice the bound), and a joining turn's
            own KV during its prefill. ``None`` (default): rows are bounded by `max_batch_size` alone.
        histories: Where each session's token ids are kept between turns (the conversation itself, not its
            KV): a fresh dict by default. Replicas behind a load balancer share one mapping (standing in for
            the conversation database, or for clients that send the whole conversation), so a turn that
            lands on another replica continues the same conversation; the KV then comes from the shared
            remote tier, or is recomputed. Replicas must share it: a pipeline that served a conversation
            before continues its own copy of it, even after another replica extended it. (A pipeline that
            never saw a conversation takes its ids from the store, the remote tier included.)

    Example:
        >>> PipelineTuning(max_batch_tokens=512).max_batch_tokens
        512
    """

    prefetch_window: int | None = None
    eviction_window: int | None = None
    max_batch_tokens: int | None = None
    max_batch_kv_bytes: int | str | None = None
    histories: MutableMapping[str, torch.Tensor] | None = None


def _tuning_of(tuning: PipelineTuning | None, generate_kwargs: dict) -> PipelineTuning:
    """`tuning`, with the knobs a caller passed as keywords of their own (the pre-PipelineTuning way, found among
    the `generate` keyword arguments) moved into it, with a ``FutureWarning``: one more release."""
    if tuning is not None and not isinstance(tuning, PipelineTuning):
        raise TypeError(f"`tuning` must be a PipelineTuning, got {type(tuning).__name__}")
    legacy = {f.name: generate_kwargs.pop(f.name) for f in fields(PipelineTuning) if f.name in generate_kwargs}
    if not legacy:
        return tuning or PipelineTuning()
    names = sorted(legacy)
    warnings.warn(f"passing {', '.join(f'`{n}`' for n in names)} to ChatPipeline directly is deprecated and will be "
                  f"removed in the next release: use `tuning=PipelineTuning({', '.join(f'{n}=...' for n in names)})`",
                  FutureWarning, stacklevel=3)
    return replace(tuning or PipelineTuning(), **legacy)


class ChatPipeline:
    """Multi-turn chat with KV reuse across turns.

    Args:
        model, tokenizer: A causal LM and its tokenizer (with a chat template).
        store: The :class:`AttnStore` holding sessions between turns, or ``None`` to recompute the whole
            history every turn (the RE baseline: token truncation on overflow, no reuse).
        context_window: Maximum tokens the model sees; overflowing sessions are truncated (decoupled).
        truncation: See :class:`AttnStoreCache` (a mode, or a :class:`TruncationConfig`).
        kv_budget: Sparse window attention over every session (ALISA, see :class:`AttnStoreCache`): a fraction of
            the history (``0.2``: 80% sparsity), a token count, or a :class:`~hf_attnstore.cache.SparseConfig`.
            In a batch, a member's row holds only its budget, re-selected before every step (sparse_rows.py). Needs
            a store.
        system_prompt: A system message placed first in every session.
        max_new_tokens: Reply length limit; other `generate` keyword arguments are passed through. A turn's
            reply is also cut where the model's positions end (see :attr:`position_limit`): a prompt of ``P``
            tokens gets at most ``position_limit - P`` (at least one), whatever it asked.
        max_batch_size: Turns of different sessions decoded together (continuous batching: a turn joins or
            leaves between decoding steps; see `batching.py`). 1 runs one turn at a time with `generate`.
        tuning: The scheduling and batching knobs (:class:`PipelineTuning`: prefetch and eviction windows,
            chunked prefill, the batch's KV bound, shared histories). ``prefetch_window=`` and the others as
            keywords of their own still work for one release, with a ``FutureWarning``.

    Example:
        >>> pipe = ChatPipeline(model, tokenizer, AttnStore("2GiB"), max_new_tokens=64)  # doctest: +SKIP
        >>> pipe.chat("alice", "Hello!").text  # doctest: +SKIP
    """

    def __init__(self, model, tokenizer, store: AttnStore | None, *, context_window: int | None = None,
                 truncation: str | TruncationConfig = "decoupled", system_prompt: str | None = None,
                 max_new_tokens: int = 256, max_batch_size: int = 1,
                 kv_budget: float | int | SparseConfig | None = None, tuning: PipelineTuning | None = None,
                 **generate_kwargs):
        tuning = _tuning_of(tuning, generate_kwargs)  # old keywords: one more release, with a FutureWarning
        prefetch_window, eviction_window = tuning.prefetch_window, tuning.eviction_window
        max_batch_tokens, max_batch_kv_bytes = tuning.max_batch_tokens, tuning.max_batch_kv_bytes
        histories = tuning.histories
        legacy = {name: generate_kwargs.pop(name) for name in LEGACY_TRUNCATION if name in generate_kwargs}
        self.truncation = truncation_of(context_window, truncation, legacy, "ChatPipeline")
        truncation = self.truncation.mode
        if kv_budget is not None and store is None:
            raise ValueError("`kv_budget` keeps a stored session sparse: pass a store (without one, every turn "
                             "recomputes its whole history densely)")
        # Checked once here, as each turn's cache would: a model that cannot be kept sparse fails now, not per turn.
        self.sparse = AttnStoreCache.sparse_config(model, kv_budget, truncation) if store is not None else None
        for name, value in (("prefetch_window", prefetch_window), ("eviction_window", eviction_window)):
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(f"`{name}` must be a non-negative integer or None, got {value!r}")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"`max_new_tokens` must be a positive integer, got {max_new_tokens!r}")
        if not isinstance(max_batch_size, int) or isinstance(max_batch_size, bool) or max_batch_size < 1:
            raise ValueError(f"`max_batch_size` must be a positive integer, got {max_batch_size!r}")
        if max_batch_tokens is not None and (not isinstance(max_batch_tokens, int) or isinstance(max_batch_tokens, bool)
                                             or max_batch_tokens <= max_batch_size):
            raise ValueError(f"`max_batch_tokens` must be None or an integer above `max_batch_size` "
                             f"({max_batch_size}): each iteration decodes one token per member and needs room "
                             f"to prefill; got {max_batch_tokens!r}")
        if max_batch_kv_bytes is not None:
            max_batch_kv_bytes = parse_bytes(max_batch_kv_bytes, "max_batch_kv_bytes")
            if max_batch_size == 1:
                raise ValueError("`max_batch_kv_bytes` bounds the batch cache of `max_batch_size` > 1; one turn at a "
                                 "time has none (its KV is bounded by the context window)")
        self.model, self.tokenizer, self.store = model, tokenizer, store
        self.chat_tokens = ChatTokens(tokenizer, system_prompt)
        self.prefetch_window, self.eviction_window = prefetch_window, eviction_window
        self._prefill_key: str | None | bool = False  # AttnStoreCache.prefill_key_of, once known (prefetch_turn)
        self.generate_kwargs = {"do_sample": False, "pad_token_id": tokenizer.pad_token_id, **generate_kwargs,
                                "max_new_tokens": max_new_tokens}
        # Each session's source of truth: its token ids (a turn of a session runs on one pipeline at a time).
        self._history: MutableMapping[str, torch.Tensor] = {} if histories is None else histories
        self._queue: deque[Job] = deque()
        self._running: list[str] = []  # sessions whose turns run now (several when batching)
        self._cond = threading.Condition()
        self._closed = False
        run = self._run
        if max_batch_size > 1:
            from .batching import BatchRunner, batchable

            ok, why = batchable(model, self.sparse)
            if ok:
                self.batch_runner = BatchRunner(self, max_batch_size, max_batch_tokens, max_batch_kv_bytes)
                run = self.batch_runner.run
            else:
                logger.warning("turns of %s run one at a time: %s", type(model).__name__, why)
        self.max_batch_size = max_batch_size if run != self._run else 1
        self._worker = threading.Thread(target=run, name="attnstore-pipeline", daemon=True)
        self._worker.start()

    # -- public API ---------------------------------------------------------------------------------
    def submit(self, session_id: str, message: str, streamer=None, reply: str | None = None) -> Future:
        """Queues a user message; the future resolves to a :class:`Reply`. Turns run in submission order.

        Args:
            session_id: The conversation.
            message: The user's message.
            streamer: Optional `generate` streamer for the reply's text.
            reply: Take this text as the assistant's answer instead of generating one (replaying a recorded
                conversation, or importing one into the store). The model reads the prompt, then the reply
                in one forward (teacher forcing), so the session ends up exactly as if it had generated
                this reply; :attr:`Reply.greedy_ids` holds the token it would have chosen at each position.

        Raises:
            ValueError: An empty message, or one that alone does not fit the context window.
        """
        validate_session_id(session_id)
        if not isinstance(message, str) or not message.strip():
            raise ValueError("`message` must be a non-empty string")
        if reply is not None and not isinstance(reply, str):
            raise ValueError(f"`reply` must be a string or None, got {type(reply).__name__}")
        if reply is not None and streamer is not None:
            raise ValueError("a turn with a given `reply` generates nothing to stream: pass one or the other")
        window = self.truncation.context_window
        if window is not None:
            n = len(self.chat_tokens.message_ids(message))
            room = window - self.truncation.keep_first - 1
            if n > room:
                raise ValueError(f"the message has {n} tokens but at most {room} fit the context window "
                                 f"({window} minus {self.truncation.keep_first} kept tokens): shorten it")
        return self._enqueue(Job(session_id, message, Future(), streamer, time.perf_counter(), reply))

    def submit_prompt(self, session_id: str, prompt_ids, streamer=None, *, cancel: threading.Event | None = None,
                      cache_salt: str | None = None, **generate_options) -> Future:
        """Queues a turn whose whole prompt is given as token ids (a server that receives the conversation as
        a message list builds them: see `serving.conversation`). The session's stored KV is reused for the
        prompt's longest common prefix with it, whatever this pipeline remembers of the session; afterwards
        the session's history is the prompt and the reply.

        Args:
            session_id: The stored session to reuse (and to update).
            prompt_ids: ``[seq]`` or ``[1, seq]`` token ids, or a list of ints.
            streamer: Optional `generate` streamer for the reply.
            cancel: Set it to stop the turn after its current decoding step (or before it starts). The KV
                computed so far stays stored, a valid prefix of the session.
            cache_salt: The turn's KV is stored under, and reused from, this salt only (see
                :class:`~hf_attnstore.AttnStoreCache`): a tenant's turns never share KV with another's.
            generate_options: `generate` options for this turn (``max_new_tokens``, ``do_sample``,
                ``temperature``, ``top_p``, ``stop_strings`` ...), over the pipeline's. ``max_new_tokens`` must
                be a positive integer; the reply is cut where the model's positions end (:attr:`position_limit`).

        Raises:
            ValueError: An invalid session id, an empty prompt or a `max_new_tokens` that is not a positive
                integer; `PipelineClosed` (a ValueError) once the pipeline is closed.
        """
        validate_session_id(session_id)
        salted_fingerprint("", cache_salt)  # a bad salt is the caller's error now, not the worker's later
        if "max_new_tokens" in generate_options:
            n = generate_options["max_new_tokens"]
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ValueError(f"`max_new_tokens` must be a positive integer, got {n!r}")
        ids = torch.as_tensor(prompt_ids, dtype=torch.long).view(1, -1)
        if ids.shape[1] == 0:
            raise ValueError("`prompt_ids` is empty")
        return self._enqueue(Job(session_id, "", Future(), streamer, time.perf_counter(), prompt_ids=ids,
                                  cancel=cancel, options=generate_options, cache_salt=cache_salt))

    def _enqueue(self, job: "Job") -> Future:
        with self._cond:
            if self._closed:
                raise PipelineClosed("this ChatPipeline is closed: it takes no new turns")
            self._queue.append(job)
            self._cond.notify_all()
            waiting = [j.session_id for j in self._queue]
        try:
            self.give_hints(waiting)  # the queue changed: fetch ahead now, not only when the next job starts
        except Exception as exc:  # hints only speed things up; the turn is queued and will run
            logger.warning("look-ahead hints failed (%s); the turn runs without them", exc)
        return job.future

    @property
    def position_limit(self) -> int | None:
        """Positions a turn may use, its prompt and its reply together: the model's ``max_position_embeddings``
        (a context window set larger wins). A reply is cut there (vLLM's ``max_model_len``): past it an
        absolute-position model cannot run at all, and a RoPE model runs on positions it was not trained for.
        None when neither is known (no cut)."""
        known = [n for n in (self._model_positions(), self.truncation.context_window) if n is not None]
        return max(known) if known else None

    @property
    def max_reply_tokens(self) -> int | None:
        """The longest reply a turn can be asked for: the context window (without one, the model's
        ``max_position_embeddings``) less the ``keep_first`` tokens truncation always keeps and one prompt
        token. The bound a server gives clients (`serving.protocol.RequestLimits`); None when neither is known."""
        window = self.truncation.context_window or self._model_positions()
        return None if window is None else max(1, window - self.truncation.keep_first - 1)

    def _model_positions(self) -> int | None:
        """The model's ``max_position_embeddings`` (of its text config), or None where it declares none."""
        config = self.model.config
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        n = getattr(config, "max_position_embeddings", None)
        return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None

    def batch_memory(self) -> dict[str, int]:
        """The batch cache now: ``rows`` (decoding members), ``live`` (bytes of their KV, padding included) and
        ``allocated`` (bytes of the slabs, headroom included); zeros without batching or between batches."""
        runner = getattr(self, "batch_runner", None)
        return dict(runner.now) if runner is not None and self.max_batch_size > 1 else \
            {"allocated": 0, "live": 0, "rows": 0}

    def chat(self, session_id: str, message: str, timeout: float | None = None) -> Reply:
        """Sends a message and waits for the reply."""
        return self.submit(session_id, message).result(timeout)

    def stream(self, session_id: str, message: str, timeout: float = 600.0) -> tuple[Iterator[str], Future]:
        """Sends a message; returns an iterator over the reply's text as it is generated, and the future."""
        from transformers import TextIteratorStreamer

        streamer = TextIteratorStreamer(self.tokenizer, skip_prompt=True, skip_special_tokens=True, timeout=timeout)
        return iter(streamer), self.submit(session_id, message, streamer=streamer)

    def session_stats(self, session_id: str) -> dict:
        """Token count and tier of a known session. Raises KeyError for an unknown one."""
        with self._cond:
            if session_id not in self._history:
                raise KeyError(f"unknown session {session_id!r}")
            ids = self._history[session_id]
        if self.store is None:
            return {"session_id": session_id, "tokens": int(ids.shape[1]), "tier": None}
        tiers = (self.store.tier_of(session_id, fp) for fp in self._fingerprints())
        return {"session_id": session_id, "tokens": int(ids.shape[1]), "tier": next(filter(None, tiers), None)}

    def retain(self, session_id: str, seconds: float, cache_salt: str | None = None) -> None:
        """Keeps the session's KV (under `cache_salt`) from expiring by idleness for `seconds`
        (`AttnStore.retain`; capacity may still evict it). Without a store, nothing is kept anyway.

        Example:
            >>> pipe.retain("agent-7", 24 * 3600)  # doctest: +SKIP
        """
        if self.store is not None:
            for fingerprint in self._fingerprints(cache_salt):
                self.store.retain(session_id, fingerprint, seconds)

    def _fingerprints(self, cache_salt: str | None = None) -> list[str]:
        """The keys of this model's sessions in the store under `cache_salt` (two for longrope:
        AttnStoreCache.fingerprints_of)."""
        return AttnStoreCache.fingerprints_of(self.model, self.store, cache_salt)

    def reset(self, session_id: str) -> None:
        """Forgets a session: its history and its stored KV."""
        with self._cond:
            self._history.pop(session_id, None)
        if self.store is not None:
            self.store.delete(session_id)

    def close(self, timeout: float | None = 600.0) -> None:
        """Finishes the queued turns and stops the worker."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._worker.join(timeout)

    def __enter__(self) -> "ChatPipeline":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the worker -----------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                job = self._queue.popleft()
                self._running = [job.session_id]
                waiting = [j.session_id for j in self._queue]
            if not job.claim():
                continue
            try:
                self.give_hints(waiting)
            except Exception as exc:  # hints only speed things up: a failure must not stop the worker
                logger.warning("look-ahead hints failed (%s); the turn runs without them", exc)
            try:
                result = self.run_turn(job)
            except BaseException as exc:  # the caller sees it through the future; the worker goes on
                job.fail(exc)
            else:
                job.future.set_result(result)
            finally:
                with self._cond:
                    self._running = []  # idle: the next turn has a free slot (see `give_hints`)

    def _windows(self) -> tuple[int, int]:
        """The look-ahead windows for prefetching and eviction (see `placement.lookahead_windows`)."""
        s = self.store.stats()
        disk = s.disk_bytes_limit if self.store.config.disk_dir else 0
        return lookahead_windows(s.host_bytes_limit, disk, s.host_bytes_used, s.host_sessions, s.disk_bytes_used,
                                 s.disk_sessions, self.prefetch_window, self.eviction_window)

    def set_running(self, sessions: list[str]) -> None:
        """Records the sessions whose turns run now (first in the look-ahead schedule)."""
        with self._cond:
            self._running = list(sessions)

    def take_jobs(self, running: list[str], room: int, busy: bool,
                  timeout_s: float = 1.0) -> tuple[list[Job], list[str]] | None:
        """Queued turns that may join a batch now, in queue order: at most `room`, none of a session in
        `running` (the batch's sessions), each taking its session. Waits (in `timeout_s` slices) while there is
        nothing to take and the batch is idle (`busy` False).

        Returns:
            The turns taken and the sessions still waiting (for look-ahead hints), or None once the pipeline is
            closed and nothing is queued or running.
        """
        with self._cond:
            while True:
                seen, taken = set(running), []
                for job in list(self._queue):
                    if len(taken) >= room:
                        break
                    if job.session_id in seen:
                        continue
                    self._queue.remove(job)
                    seen.add(job.session_id)
                    taken.append(job)
                if taken or busy:
                    # Every member's session, the joining ones included, goes first in the schedule.
                    self._running = list(running) + [j.session_id for j in taken]
                    return taken, [j.session_id for j in self._queue]
                if self._closed and not self._queue:
                    return None
                self._cond.wait(timeout=timeout_s)

    # -- scheduling: the worker's steps, public for the batch runner (batching.py) ----------------------
    def turn_options(self, job: Job) -> dict:
        """The `generate` options of a turn: the pipeline's, with the turn's own on top (logits processors of both
        apply, the pipeline's first)."""
        options = {**self.generate_kwargs, **(job.options or {})}
        mine, theirs = self.generate_kwargs.get("logits_processor"), (job.options or {}).get("logits_processor")
        if mine and theirs:
            options["logits_processor"] = LogitsProcessorList([*mine, *theirs])
        return options

    def prefetch_turn(self, job: Job) -> None:
        """Starts loading a taken turn's session into host memory (it is looked up when its prefill comes, see
        batching.py). Best effort: a failure only costs the overlap."""
        if self.store is None:
            return
        try:
            # The turn runs next: its load is decided by cost (`recompute_by_cost`) as its own lookup's would be.
            self.store.prefetch([job.session_id], self._fingerprints(job.cache_salt), prefill_key=self._head_key())
        except Exception as exc:  # noqa: BLE001 - a prefetch only speeds the turn up
            logger.warning("prefetching session %r failed (%s); it loads when its turn starts", job.session_id, exc)

    def give_hints(self, waiting: list[str]) -> None:
        if self.store is None:
            return
        prefetch, eviction = self._windows()
        # The running turns' sessions come first: the store holds their write buffers (the paper keeps them on
        # the device), so they must be the last to be evicted.
        self.store.set_schedule(list(self._running) + waiting[:eviction])
        ahead = list(dict.fromkeys(waiting[:prefetch]))
        if not ahead:
            return
        with self._cond:  # a session's KV lies under its turn's salt: look each one up under its own
            salts = {job.session_id: job.cache_salt for job in self._queue}
        by_salt: dict[str | None, list[str]] = {}
        for session in ahead:
            by_salt.setdefault(salts.get(session), []).append(session)
        # With a free slot the head of the queue starts at the next step: its load is on its critical path and is
        # decided by cost (`recompute_by_cost`) as its own lookup's would be (`prefill_key` applies to the first
        # session of a prefetch); the rest are fetched whole, ahead, in order.
        key = self._head_key() if len(self._running) < self.max_batch_size else None
        for salt, sessions in by_salt.items():
            self.store.prefetch(sessions, self._fingerprints(salt), prefill_key=key if ahead[0] in sessions else None)

    def _head_key(self) -> str | None:
        """The `prefill_key` of this pipeline's turns (`AttnStoreCache.prefill_key_of`), or None when the store
        does not decide loads by cost or the model's heads cannot be recomputed alone. Found once: the model's
        weights do not change while it serves."""
        if not self.store.config.recompute_by_cost:
            return None
        if self._prefill_key is False:
            try:
                self._prefill_key = AttnStoreCache.prefill_key_of(self.model, self.store)
            except ValueError:  # a model whose KV cannot be reused: its turns say why
                self._prefill_key = None
        return self._prefill_key

    def prepare(self, job: Job) -> "Prepared":
        """A turn's prompt ids, its cache (the store's reuse plan) and its `generate` options."""
        started = time.perf_counter()
        with self._cond:
            history = self._history.get(job.session_id)
        if job.prompt_ids is not None:
            ids = job.prompt_ids
        else:
            if history is None and self.store is not None:
                # A session this pipeline has not seen may be in the store (a previous process, same disk_dir).
                # Its stored ids are the history but the last generated token (never fed to the model);
                # `next_turn` re-adds the end-of-turn tokens, so a reply that ended on one resumes exactly.
                found = (self.store.token_ids(job.session_id, fp) for fp in self._fingerprints(job.cache_salt))
                stored = next((ids for ids in found if ids is not None), None)
                history = stored.view(1, -1) if stored is not None else None
            ids = (self.chat_tokens.first_turn(job.message) if history is None
                   else self.chat_tokens.next_turn(history, job.message))
        options = self.turn_options(job)
        timer = FirstTokenTimer().start()
        if self.store is None:
            # With the config: a hybrid model's own cache has its linear-attention layers.
            cache, reused = DynamicCache(config=self.model.config), 0
            dropped = tokens_to_drop(ids.shape[1], self.truncation)
            k = self.truncation.keep_first
            prompt = torch.cat([ids[:, :k], ids[:, k + dropped :]], dim=1) if dropped else ids
            source = "truncated" if dropped else "recompute"
        else:
            cache = AttnStoreCache(self.model, self.store, job.session_id, ids, truncation=self.truncation,
                                   cache_salt=job.cache_salt, kv_budget=self.sparse)
            prompt, reused, dropped = cache.input_ids, cache.reused_tokens, cache.dropped_tokens
            source = "truncated" if dropped else cache.kv_source
        limit = self.position_limit
        if limit is not None and job.reply is None:
            # The reply ends where the model's positions do (the last generated token is fed too: see `run_turn`).
            room = max(1, limit - int(prompt.shape[1]))
            if int(options.get("max_new_tokens") or room) > room:
                options["max_new_tokens"] = room
        return Prepared(job, started, timer, cache, prompt.to(self.model.device), reused, dropped, source, options)

    def run_turn(self, job: Job) -> Reply:
        p = self.prepare(job)
        options = dict(p.options)
        seed = options.pop("seed", None)  # ours, not generate's: its random numbers (as the batch runner's)
        top = options.pop("logprobs", None)  # ours too: log-probabilities of the reply's tokens
        logprobs = None
        if job.cancel is not None:
            options["stopping_criteria"] = StoppingCriteriaList(
                [*(options.get("stopping_criteria") or []), Cancelled(job.cancel)])
        if "stop_strings" in options:
            options["tokenizer"] = self.tokenizer  # `generate` matches stop strings with it
        try:
            if job.reply is None:
                # An explicit mask: without one, `generate` masks every id equal to the pad id, and a pad token
                # inside a message or reply would break the positions of the whole session.
                beams = int(options.get("num_beams") or 1) > 1
                if isinstance(p.cache, AttnStoreCache) and (beams or int(options.get("num_return_sequences") or 1) > 1):
                    raise ValueError("beam search and several returned sequences decode several sequences per turn, "
                                     "and a session's stored KV is one: use num_beams=1 and num_return_sequences=1 "
                                     "(or a pipeline without a store)")
                if beams and job.streamer is not None:
                    raise ValueError("a beam search reply cannot be streamed (its tokens are known at the end)")
                recorder = LogprobRecorder(self.model, top) if top is not None else contextlib.nullcontext()
                with _seeded(seed, self.model.device), recorder:
                    out = self.model.generate(p.prompt, attention_mask=torch.ones_like(p.prompt),
                                              **cache_kwargs(p.cache),
                                              streamer=None if beams else Tee(p.timer, job.streamer), **options)
                if top is not None:
                    logprobs = recorder.finish(out[0, p.prompt.shape[1]:].tolist())
                # (beam search: `generate` takes no streamer; its first token is known with the whole reply)
                ttft = time.perf_counter() - p.timer.t0 if beams else p.timer.ttft
                generated = out[:, p.prompt.shape[1]:]
                if self.needs_last_token(generated):
                    # `generate` never feeds its last token, so the store would not know it, and a pipeline that
                    # resumes this session from the store (another replica, a restart) would lose it. A reply
                    # cut by `max_new_tokens` has its last token fed now (one decode step); one that ended on
                    # the end-of-turn token needs nothing: `next_turn` re-adds that token anyway.
                    with torch.no_grad():
                        self.model(generated[:, -1:], **cache_kwargs(p.cache), use_cache=True)
                text = self.chat_tokens.reply_text(generated)
                greedy = [] if options.get("do_sample") else generated.view(-1).tolist()
            else:
                out, greedy, ttft = self._read_reply(p.prompt, p.cache, p.reused, job.reply, p.timer.t0)
                generated, text = out[:, p.prompt.shape[1]:], job.reply
        finally:
            if isinstance(p.cache, AttnStoreCache):
                p.cache.close()  # the turn is over: its session may be demoted again
        return self.finish(p, out, generated, text, greedy, ttft, logprobs)

    def needs_last_token(self, generated: torch.Tensor) -> bool:
        """Whether a reply's last token must still be fed to store it (see `run_turn`)."""
        return self.store is not None and generated.shape[1] > 0 and int(generated[0, -1]) != self.chat_tokens.eot_ids[0]

    def finish(self, p: "Prepared", out: torch.Tensor, generated: torch.Tensor, text: str, greedy, ttft: float,
               logprobs: tuple | None = None) -> Reply:
        """The turn's Reply; the session's history becomes `out` (only a completed turn changes it)."""
        total = time.perf_counter() - p.timer.t0
        job = p.job
        with self._cond:
            self._history[job.session_id] = out.cpu()
        # A head the turn recomputed (partially evicted, or cheaper than loading) was computed, not reused: the
        # usage's cached tokens and the metrics count it as prefilled.
        head = min(p.cache.reused_recomputed, p.reused) if self.store is not None else 0
        return Reply(session_id=job.session_id, text=text,
                     history_tokens=int(p.prompt.shape[1]), reused_tokens=p.reused - head,
                     prefilled_tokens=int(p.prompt.shape[1]) - p.reused + head,
                     generated_tokens=int(generated.shape[1]),
                     dropped_tokens=p.dropped, ttft_s=ttft, total_s=total, kv_source=p.source,
                     queued_s=p.started - job.submitted,
                     tier=None if self.store is None else p.cache.kv_source,
                     greedy_ids=tuple(greedy), generated_ids=tuple(generated.view(-1).tolist()),
                     prompt_ids=tuple(p.prompt.view(-1).tolist()),
                     cancelled=job.cancel is not None and job.cancel.is_set(),
                     max_new_tokens=int(p.options.get("max_new_tokens") or 0), logprobs=logprobs)

    @torch.no_grad()
    def _read_reply(self, prompt: torch.Tensor, cache, reused: int, reply: str, t0: float):
        """A turn whose answer is given: prefill the prompt, then read the reply's tokens in one forward.

        Returns the turn's ids (prompt + reply + end of turn), the greedy choice at each reply position, and
        the TTFT (until the first token's logits are on the host, as `generate` would have them).
        """
        device = self.model.device
        reply_ids = self.chat_tokens.reply_ids(reply).to(device)
        prompt = prompt.to(device)
        logits = self.model(prompt[:, reused:], **cache_kwargs(cache), use_cache=True, logits_to_keep=1).logits
        first = logits[:, -1].argmax(-1).cpu()  # the copy to the host waits for the device, like a real TTFT
        ttft = time.perf_counter() - t0
        rest = self.model(reply_ids, **cache_kwargs(cache), use_cache=True).logits[0, :-1].argmax(-1).cpu()
        return torch.cat([prompt, reply_ids], dim=1), torch.cat([first, rest]).tolist(), ttft


class LogprobRecorder:
    """Records the log-probabilities of a `generate` call's tokens as it decodes, holding one step's logits at a
    time: the output embeddings' forward hook keeps the raw logits of the next token, and the model's next
    forward (whose input is the token chosen) turns them into `token_logprobs`. (`generate`'s own
    ``output_logits`` would keep every step's whole logits until the end: 5 GB for 8,192 tokens of a 152k
    vocabulary.) Hooks are public torch API; the worker runs one `generate` at a time.

    Example:
        >>> with LogprobRecorder(model, top=2) as rec:  # doctest: +SKIP
        ...     out = model.generate(ids)
        >>> rec.finish(out[0, ids.shape[1]:].tolist())  # doctest: +SKIP
    """

    def __init__(self, model: torch.nn.Module, top: int):
        self.model, self.top = model, top
        self.entries: list = []
        self._row: torch.Tensor | None = None
        self._handles: list = []

    def __enter__(self) -> "LogprobRecorder":
        head = self.model.get_output_embeddings()
        if head is None:
            raise ValueError("this model has no output embeddings to read log-probabilities from")
        self._handles = [self.model.register_forward_pre_hook(self._before, with_kwargs=True),
                         head.register_forward_hook(self._after)]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _before(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if self._row is not None and ids is not None:
            self._take(int(ids[0, -1]))

    def _after(self, module, inputs, output):
        self._row = output[0, -1].detach()

    def _take(self, token: int) -> None:
        self.entries.append(token_logprobs(self._row, token, self.top))
        self._row = None

    def finish(self, generated: list[int]) -> tuple:
        """The entries for `generated` (the last token's from the logits still held)."""
        if self._row is not None and len(self.entries) < len(generated):
            self._take(generated[len(self.entries)])
        if len(self.entries) != len(generated) or any(e[0] != t for e, t in zip(self.entries, generated)):
            raise RuntimeError(f"log-probabilities were recorded for {len(self.entries)} of {len(generated)} tokens: "
                               "this model's forward does not go through its output embeddings module")
        return tuple(self.entries)


@contextlib.contextmanager
def _seeded(seed: int | None, device: torch.device):
    """Runs `generate` with torch's random numbers seeded by a turn's `seed` (and restored after), so that a seeded
    sampled turn draws what the batch runner's per-turn generator draws (batching.py): the same tokens alone or
    batched. Without a seed, nothing changes."""
    if seed is None:
        yield
        return
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(int(seed))
        yield
