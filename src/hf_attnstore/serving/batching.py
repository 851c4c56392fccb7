"""Continuous batching of a ChatPipeline's turns: sessions decode together, joining and leaving between steps.

Each turn starts alone: its prompt is prefilled through its own :class:`AttnStoreCache` (reusing the stored
KV exactly as a solo turn does), which gives its first token. It then joins the running batch, whose
decoding steps feed one token of every member at once. Members have different history lengths: the batch
cache holds each member's KV left-padded to the longest, with an attention mask over the padding and each
member's own positions (its keys were rotated for them already, so padding shifts nothing). A member leaves
as soon as it is done (end of turn, `max_new_tokens`, a stop string, a cancelled request), and a queued turn
joins at the next step into a free row of the batch cache (see `BatchKV`).

A sparse session (``kv_budget``) joins with its kept tokens and re-selects before every step, as alone
(sparse_rows.py); the batch scores its rows' steps for the sessions that keep importance scores
(`importance.BatchScorer`).

A member's decoded KV is handed to its session's cache when it leaves (`AttnStoreCache.append_computed`),
so the store gets what a solo turn would have stored: the prompt, then every generated token that was fed
back. A reply cut by `max_new_tokens` stays one more step, so its last token is fed and stored too (the
solo path feeds it separately).

With ``max_batch_tokens`` a joining turn's new tokens are prefilled in chunks: each iteration of the loop
computes at most ``max_batch_tokens`` tokens (the running members' decoding step counts one each), so a long
prompt no longer stalls the running members' replies for its whole prefill (chunked prefill, as vLLM's and
SGLang's token budget). Without it a joining turn is prefilled in one forward, which on a CPU is the fastest:
chunks, and several sessions' prompts padded into one forward, both cost more there (`eval/bench_prefill.py`).

Two turns of one session never run together: a queued turn waits until its session's running turn leaves.

No turn can stop the loop: an exception from one member (its prefill, its token choice, its streamer, its
place in the batch cache, storing its KV) fails that member's future and the others go on; a failed
batched forward fails the members of that step only; a failure of the loop itself fails the turns in flight
and the loop goes on serving the queue.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from concurrent.futures import CancelledError, InvalidStateError
from dataclasses import dataclass, field

import torch

from ..cache import importance
from ..cache.cache import AttnStoreCache
from ..cache.layers import AttnStoreSparseLayer
from .batch_cache import BatchKV, token_bytes
from .jobs import Job, Prepared, Tee, TurnSource, quietly, token_logprobs
from .sparse_rows import SparseRow
from ..cache.upstream import cache_kwargs, decoding_plan

logger = logging.getLogger(__name__)


def _row(layer, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A solo cache layer's KV as the member's row of the batch cache.

    A sparse layer (``kv_budget``) gives its kept tokens: it selects now what its next forward would select
    (`AttnStoreSparseLayer.select_now`), so the row holds the budget of the session, not its history. Kept keys
    carry their own positions' rotation and each member's queries get their own positions, so a row needs no
    columns for the dropped tokens. In the batch the row re-selects before every step (sparse_rows.py).

    A sliding-window layer keeps only its window's tail, so its past is filled with zeros over all `length`
    tokens, which the batch's sliding mask never lets a query see (and zeros, not garbage: a masked NaN would
    still poison the softmax)."""
    if isinstance(layer, AttnStoreSparseLayer):
        return layer.select_now()
    keys, values = layer.keys, layer.values
    missing = length - keys.shape[2]
    if missing <= 0:
        return keys, values
    return (torch.cat([keys.new_zeros(*keys.shape[:2], missing, keys.shape[3]), keys], dim=2),
            torch.cat([values.new_zeros(*values.shape[:2], missing, values.shape[3]), values], dim=2))


def batchable(model, sparse=None) -> tuple[bool, str]:
    """Whether the model's turns can be batched here, and why not.

    Every model that AttnStoreCache supports is, sliding-window layers included: a sliding mask compares a
    query's column with a key's column, and left padding shifts both by the same amount in a row, so the
    distance is the positions' (tested: sliding models give their solo tokens batched, where dropping the
    window changes most turns' tokens). Chunked attention (llama4) is not: its chunks start at multiples of
    the chunk size, counted in columns, and left padding moves a row's positions off those boundaries; nor is
    length-dependent RoPE, whose frequencies follow the batch's longest row. With `sparse` (a pipeline's
    SparseConfig) every KV layer must be full attention (all kept sparse, so of one length), and the policy one
    that selects before the step (not query-aware).

    Example:
        >>> batchable(model)  # doctest: +SKIP
        (True, '')
    """
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    from ..cache.layout import LayerLayout

    layout = LayerLayout.of(model)
    if layout.has_state:
        return False, ("a hybrid model's linear-attention states are per session, and the batch cache holds "
                       "attention KV only")
    if getattr(sparse, "query_aware", False):
        return False, (f"policy {sparse.policy!r} selects per query inside a turn's own attention "
                       "(cache/query_aware.py); a batch row's decoding step would attend densely")
    if sparse is not None and not all(layout.full[i] for i in layout.kv_layers):
        return False, ("with `kv_budget` its full-attention layers keep a selection of the history and its "
                       "sliding-window layers a window: rows of different lengths per layer, where a batch row has "
                       "one length")
    if getattr(config, "attention_chunk_size", None):
        return False, "chunked attention's chunk boundaries count cache columns, which left padding shifts"
    from ..cache.rope import RopeAdapter

    if RopeAdapter(model).length_dependent:
        return False, ("length-dependent RoPE (longrope, dynamic) picks one set of frequencies per forward from "
                       "its longest row, so a batch would compute a short session with a long one's")
    return True, ""


@dataclass(eq=False)
class _Member:
    prep: Prepared
    tee: Tee
    max_new: int
    eos: set
    stops: list[str]
    sample: bool  # multinomial sampling (else greedy), after `processors` (which hold the warpers)
    processors: object = None  # the LogitsProcessorList `generate` builds for the turn's options (decoding_plan)
    generator: torch.Generator | None = None  # the turn's own random numbers (a `seed` option), else torch's
    criteria: object = None  # the turn's own stopping criteria (a `stopping_criteria` option), or None
    top_logprobs: int | None = None  # the `logprobs` option: alternatives per token (None: no log-probabilities)
    logprobs: list = field(default_factory=list)  # per generated token, `token_logprobs`'s answer
    generated: list[int] = field(default_factory=list)
    prefilled: int = 0  # new prompt tokens (after the reused ones) computed so far
    fed: int = 0  # generated tokens fed back through the model (their KV is in the batch cache)
    kv: list | None = None  # per layer (keys, values) [1, h, L, d], until the member joins the batch cache
    scorer: object = None  # its turn's importance scorer, fed by the batched steps (None: not scored)
    sparse: SparseRow | None = None  # a sparse session's kept columns, re-selected before each step
    done: bool = False
    drain: bool = False  # done, but its last token is fed in one more step so that the store gets it
    failed: bool = False  # its future holds an exception: it leaves without storing anything
    waited: bool = False  # it waited for room in the batch cache (`max_batch_kv_bytes`)

    @property
    def length(self) -> int:
        """Tokens whose KV exists: the prompt and the fed generated tokens."""
        return int(self.prep.prompt.shape[1]) + self.fed


class BatchRunner:
    """The worker of a ChatPipeline with ``max_batch_size > 1`` (see the module docstring).

    Example:
        >>> pipe = ChatPipeline(model, tok, AttnStore('2GiB'), max_batch_size=8)  # runs a BatchRunner  # doctest: +SKIP
    """

    def __init__(self, pipe: TurnSource, max_batch_size: int, max_batch_tokens: int | None = None,
                 max_batch_kv_bytes: int | None = None):
        self.pipe, self.max, self.max_tokens, self.max_kv_bytes = pipe, max_batch_size, max_batch_tokens, \
            max_batch_kv_bytes
        self.memory_waits = 0  # turns that waited for members to leave before they joined (`max_batch_kv_bytes`)
        self._token_bytes: int | None = None  # one token's KV over every layer (known from the first member's)
        self.model = pipe.model
        self.members: list[_Member] = []  # decoding, in the batch cache
        # Joining, in order: their prompts are being prefilled. A turn is looked up in the store only when its
        # prefill comes (a `Job` until then): turns that arrive together over one system prompt then reuse the
        # first one's prompt, stored by its prefill (prefix sharing), instead of all planning a miss at once.
        self.prefilling: deque[_Member | Job] = deque()
        # Where the worker's time goes: prefills, decoding steps, members leaving (their KV handed to the store)
        # and putting joiners into the batch cache ("rebuild": writing their rows, reallocating if needed).
        self.seconds = {"prefill": 0.0, "step": 0.0, "leave": 0.0, "rebuild": 0.0}
        self.steps = 0
        self.prefill_chunks = 0  # forwards that prefilled (part of) a joining turn
        # The batch cache at its largest (after a join): bytes allocated, bytes of live KV, members then.
        self.peak = {"allocated": 0, "live": 0, "rows": 0}
        # The batch cache now, after the last iteration (read by /metrics from another thread: plain ints).
        self.now = {"allocated": 0, "live": 0, "rows": 0}
        self._hinted: list[str] | None = None  # the queue the last look-ahead hints were given for
        self.cache: BatchKV | None = None  # the decoding members' KV, row b for self.members[b]

    # -- the loop ---------------------------------------------------------------------------------------
    def run(self) -> None:
        while True:
            try:
                if not self._iteration():
                    return
            except BaseException as exc:  # a failure of the loop itself: fail the turns in flight, go on serving
                logger.exception("the batch loop failed; its running turns fail: %s", exc)
                failed, self.members, self.prefilling, self.cache = [*self.members, *self.prefilling], [], deque(), None
                self.now = {"allocated": 0, "live": 0, "rows": 0}  # before the futures wake their callers
                self.pipe.set_running([])
                for m in failed:
                    self._fail(m, exc) if isinstance(m, _Member) else m.fail(exc)
                time.sleep(0.1)  # should the failure repeat, do not spin

    def _iteration(self) -> bool:
        """One pass of the loop: take queued turns, prefill, settle the batch, one decoding step. False once
        the pipeline is closed and everything is done."""
        pipe = self.pipe
        jobs = self._take()
        if jobs is None:
            return False
        started = time.perf_counter()
        for job in jobs:
            try:
                self._start(job)
            except BaseException as exc:  # the caller sees it through the future; the worker goes on
                job.fail(exc)
        joined = self._prefill()
        self.seconds["prefill"] += time.perf_counter() - started
        if joined or any(m.done and not m.drain for m in self.members):
            self._settle()
        if self.members:
            started = time.perf_counter()
            try:
                self._step()
                self.steps += 1
            except BaseException as exc:  # a failed batched forward fails its members, never the worker
                logger.exception("a batched decoding step failed: %s", exc)
                for m in self.members:
                    self._fail(m, exc)
                self.members, self.cache = [], None
            self.seconds["step"] += time.perf_counter() - started
        allocated, live = self.cache.nbytes() if self.cache is not None else (0, 0)
        self.now = {"allocated": allocated, "live": live, "rows": self.cache.rows if self.cache is not None else 0}
        pipe.set_running(self._sessions())
        return True

    def _sessions(self) -> list[str]:
        """The sessions of the running turns: decoding, then joining."""
        return [(m.prep.job if isinstance(m, _Member) else m).session_id for m in (*self.members, *self.prefilling)]

    def _take(self) -> list | None:
        """Queued turns that may join now (room in the batch, their session not running), in queue order.
        Waits while there is nothing to do; None once the pipeline is closed and everything is done."""
        running = self._sessions()
        found = self.pipe.take_jobs(running, self.max - len(self.members) - len(self.prefilling),
                                    busy=bool(self.members or self.prefilling))
        if found is None:
            return None
        taken, waiting = found
        if taken or waiting != self._hinted:
            # Only when the queue changed: this runs between decoding steps, and a prefetch with a remote tier
            # costs a round trip per waiting session.
            self._hinted = waiting
            try:
                self.pipe.give_hints(waiting)
            except Exception as exc:  # hints only speed things up
                logger.warning("look-ahead hints failed (%s); the turn runs without them", exc)
        return taken

    # -- joining ----------------------------------------------------------------------------------------
    def _start(self, job: "Job") -> None:
        """Queues the turn for prefilling (a given reply is read at once)."""
        if not job.claim():
            return
        if job.reply is not None:  # reading a given reply is one forward: no decoding to batch
            job.future.set_result(self.pipe.run_turn(job))
            return
        alone = self._why_alone(self.pipe.turn_options(job))
        if alone is not None:  # nothing is dropped: the turn runs by itself, as `generate` runs it
            logger.info("a turn of %r runs alone, outside the batch: %s", job.session_id, alone)
            job.future.set_result(self.pipe.run_turn(job))
            return
        self.pipe.prefetch_turn(job)  # its session loads from disk while earlier turns prefill
        self.prefilling.append(job)

    def _why_alone(self, options: dict) -> str | None:
        """Why a turn with these `generate` options cannot decode in the batch (None: it can). The batch decodes
        one sequence per turn, greedy or sampled, with the turn's own processors: beam search, several returned
        sequences, assisted decoding and options `generate` does not know run the turn alone."""
        options = {k: v for k, v in options.items() if k not in ("seed", "logprobs")}
        unbatched = [k for k in ("assistant_model", "assistant_tokenizer", "negative_prompt_ids", "custom_generate")
                     if options.get(k) is not None]
        if unbatched:
            return f"`{unbatched[0]}` is set"
        config, _, rest = decoding_plan(self.model, torch.zeros(1, 1, dtype=torch.long, device=self.model.device),
                                        options)
        if rest:
            return f"`{sorted(rest)[0]}` is not a generation option (generate will say so)"
        mode = config.get_generation_mode()
        if getattr(mode, "value", mode) not in ("greedy_search", "sample"):
            return f"the generation mode is {getattr(mode, 'value', mode)}"
        if (config.num_return_sequences or 1) != 1:
            return f"`num_return_sequences` is {config.num_return_sequences}"
        return None

    def _member(self, job: "Job") -> _Member:
        """Looks the turn up in the store (its reuse plan) as its prefill begins, and builds what `generate`
        would decode it with: transformers' own logits processors and warpers for its options, its length and
        end tokens (`decoding_plan`), so that a turn in a batch picks the tokens it would pick alone."""
        prep = self.pipe.prepare(job)
        options = dict(prep.options)
        seed = options.pop("seed", None)
        top = options.pop("logprobs", None)
        config, processors, _ = decoding_plan(self.model, prep.prompt, options)
        stops = options.get("stop_strings") or []
        stops = [stops] if isinstance(stops, str) else list(stops)
        generator = None
        if seed is not None:
            generator = torch.Generator(device=self.model.device).manual_seed(int(seed))
        max_new = int(config.max_length) - int(prep.prompt.shape[1])
        return _Member(prep, Tee(prep.timer, job.streamer), max_new, _id_set(config.eos_token_id), stops,
                       bool(config.do_sample), processors, generator, options.get("stopping_criteria"), top)

    def _prefill(self) -> bool:
        """Prefills joining turns in order, within this iteration's token budget; returns whether one finished
        (it then joins the batch with its first token chosen)."""
        budget = None if self.max_tokens is None else self.max_tokens - len(self.members)
        joined = False
        self._drop_cancelled()
        while self.prefilling and (budget is None or budget > 0):
            m = self.prefilling[0]
            if not isinstance(m, _Member):
                try:
                    m = self.prefilling[0] = self._member(m)
                except BaseException as exc:  # the caller sees it through the future; the others go on
                    self.prefilling.popleft().fail(exc)
                    continue
            prep = m.prep
            if not m.prefilled and not self._fits(m):
                self.memory_waits += not m.waited
                m.waited = True
                break  # it waits, first in line, for members to leave (`max_batch_kv_bytes`)
            start = prep.reused + m.prefilled
            left = int(prep.prompt.shape[1]) - start
            n = left if budget is None else min(left, budget)
            try:
                with torch.no_grad():
                    logits = self.model(prep.prompt[:, start : start + n], **cache_kwargs(prep.cache),
                                        use_cache=True, logits_to_keep=1).logits[:, -1]
                self.prefill_chunks += 1
                m.prefilled += n
                if n == left:
                    m.tee.put(prep.prompt.cpu())  # streamers expect the prompt first (skip_prompt)
                    self._accept(m, logits)
                    m.kv = [_row(layer, int(prep.prompt.shape[1])) for layer in prep.cache.layers]
                    if self._token_bytes is None:
                        self._token_bytes = token_bytes(m.kv)
                    if isinstance(prep.cache, AttnStoreCache):
                        m.scorer, columns, slot_of = prep.cache.batch_row()
                        if prep.cache.sparse is not None:
                            m.sparse = SparseRow(prep.cache.sparse, m.scorer, columns, slot_of)
            except BaseException as exc:  # this turn fails; the others go on
                self.prefilling.popleft()
                self._fail(m, exc)
                continue
            if budget is not None:
                budget -= n
            if n == left:
                self.prefilling.popleft()
                self.members.append(m)
                joined = True
        return joined

    def _drop_cancelled(self) -> None:
        """Ends the joining turns cancelled before their prefill began (one waiting for memory, those behind it):
        their futures raise CancelledError, as a turn cancelled while queued does, and nothing is stored."""
        for m in [m for m in self.prefilling if isinstance(m, Job) or not m.prefilled]:
            job = m if isinstance(m, Job) else m.prep.job
            if job.cancel is not None and job.cancel.is_set():
                self.prefilling.remove(m)
                error = CancelledError("the turn was cancelled before it started")
                self._fail(m, error) if isinstance(m, _Member) else m.fail(error)

    def _fits(self, m: _Member) -> bool:
        """Whether the batch cache stays within `max_batch_kv_bytes` with `m` in it, until every member's reply
        may end: each row as wide as the widest (rows end at one column) plus the columns the members may still
        add (`_room`). A turn joins an empty batch whatever it needs (nothing would ever make room for it)."""
        if self.max_kv_bytes is None or not self.members or self._token_bytes is None:
            return True
        rows = [self._row_tokens(m)] + [int(kv[0][0].shape[2]) for kv in (x.kv for x in self.members) if kv]
        width = max([*rows, self.cache.width if self.cache is not None else 0])
        # A prompt prefilled in chunks joins iterations later, the running rows a column wider for each.
        if self.max_tokens is not None:
            left = int(m.prep.prompt.shape[1]) - m.prep.reused
            width += -(-left // max(self.max_tokens - self.max, 1))
        needed = (len(self.members) + 1) * (width + self._room(self.members + [m])) * self._token_bytes
        return needed <= self.max_kv_bytes

    @staticmethod
    def _row_tokens(m: _Member) -> int:
        """The columns `m`'s row takes when it joins: its prompt, or for a sparse turn the budget of it (what
        `select_now` keeps: at most the budget of the whole prompt)."""
        tokens = int(m.prep.prompt.shape[1])
        sparse = getattr(m.prep.cache, "sparse", None)
        return min(tokens, sparse.budget(tokens)) if sparse is not None else tokens

    # -- a decoding step ---------------------------------------------------------------------------------
    def _step(self) -> None:
        members = self.members
        device = self.model.device
        tokens = torch.tensor([[m.generated[-1]] for m in members], device=device)
        positions = torch.tensor([[m.length] for m in members], device=device)
        for b, m in enumerate(members):
            if m.sparse is not None:  # keeps its budget, as the solo turn's layers before each forward
                m.sparse.before_step(self.cache, b, m.length)
        width = self.cache.width
        mask = torch.ones(len(members), width + 1, dtype=torch.long, device=device)
        for b in range(len(members)):
            mask[b, : self.cache.pad(b)] = 0
        # Scored sessions (kv_budget, importance truncation) get their rows' attention as a solo step would.
        scorer = importance.BatchScorer(
            [(m.scorer, self.cache.pad(b), m.sparse.columns_of if m.sparse else _in_order, m.length + 1)
             for b, m in enumerate(members)], device) if any(m.scorer for m in members) else None
        with torch.no_grad(), importance.scoring(scorer):
            logits = self.model(tokens, attention_mask=mask, position_ids=positions, **cache_kwargs(self.cache),
                                use_cache=True, logits_to_keep=1).logits[:, -1]
        for b, m in enumerate(members):
            if m.sparse is not None:
                m.sparse.after_step(self.cache, b)
            m.fed += 1
            if m.drain:
                m.drain = False  # its last token is fed: it leaves now
            elif not m.done:
                try:
                    self._accept(m, logits[b : b + 1])
                except BaseException as exc:  # its logits processor, stop strings or streamer: it alone fails
                    logger.warning("a batched turn of %r failed: %s: %s", m.prep.job.session_id,
                                   type(exc).__name__, exc)
                    self._fail(m, exc)

    def _accept(self, m: _Member, logits: torch.Tensor) -> None:
        """Chooses the member's next token from its logits ``[1, vocab]``, streams it, and decides whether the
        member is done."""
        # The sequence so far, as `generate` passes it to processors and criteria: built only when one needs it
        # (a step of a long prompt's turn would otherwise copy the prompt for nothing).
        seq = torch.cat([m.prep.prompt, m.prep.prompt.new_tensor([m.generated])], 1) \
            if m.processors or m.criteria else None
        scores = m.processors(seq, logits.float()) if m.processors else logits.float()
        if m.sample:  # as `generate` samples: softmax of the processed scores, one multinomial draw
            token = int(torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=m.generator))
        else:
            token = int(scores.argmax(-1))
        m.generated.append(token)
        if m.top_logprobs is not None:  # of the raw logits, as the solo path reports them
            m.logprobs.append(token_logprobs(logits, token, m.top_logprobs))
        m.tee.put(torch.tensor([token]))
        job = m.prep.job
        text = self.pipe.chat_tokens.reply_text(torch.tensor(m.generated)) if m.stops else ""
        stopped = bool(m.criteria) and bool(m.criteria(torch.cat([seq, seq.new_tensor([[token]])], 1), scores).all())
        if token in m.eos or len(m.generated) >= m.max_new or any(s in text for s in m.stops) or stopped or (
                job.cancel is not None and job.cancel.is_set()):
            m.done = True
            m.tee.end()
            # A reply that did not end on the end-of-turn token has its last token fed one more step (stored).
            m.drain = self.pipe.needs_last_token(torch.tensor([m.generated]))

    # -- membership --------------------------------------------------------------------------------------
    def _settle(self) -> None:
        """Finishes the members that are done and puts the joining ones into the batch cache."""
        started = time.perf_counter()
        in_cache = [m for m in self.members if m.kv is None]  # row b of the batch cache is in_cache[b]
        joining = [m for m in self.members if m.kv is not None]
        for b in range(len(in_cache) - 1, -1, -1):  # from the last row: a removed row is filled by the last
            m = in_cache[b]
            if m.done and not m.drain:
                if not m.failed:  # a failed turn stores nothing (its future holds the exception)
                    self._leave_safely(m, b)
                self.cache.remove(b)
                in_cache[b] = in_cache[-1]
                in_cache.pop()
        for m in joining:
            if m.done and not m.drain and not m.failed:  # done at its first token: nothing decoded to store
                self._leave_safely(m, None)
        joining = [m for m in joining if not (m.done and not m.drain)]
        self.seconds["leave"] += time.perf_counter() - started
        started = time.perf_counter()
        if joining:
            joining = self._admit(in_cache, joining)
            allocated, live = self.cache.nbytes()
            if live > self.peak["live"]:
                self.peak.update(live=live, rows=self.cache.rows)
            self.peak["allocated"] = max(self.peak["allocated"], allocated)
        self.members = in_cache + joining
        if not self.members:
            self.cache = None  # free the slab: the store holds the sessions
        self.seconds["rebuild"] += time.perf_counter() - started

    @staticmethod
    def _room(members: list[_Member]) -> int:
        """Columns the batch cache needs right of its end: every token the members may still feed (their
        remaining replies, and a drained last one). Bounded: a reply is cut where the model's positions end."""
        return max(m.max_new - len(m.generated) + 1 for m in members)

    def _admit(self, in_cache: list[_Member], joining: list[_Member]) -> list[_Member]:
        """Puts the joining members' KV into the batch cache; returns those admitted. If the cache cannot take
        them all at once (no memory for a reallocation), each is tried alone and one that still does not fit
        fails alone. A failed admission leaves the cache's rows as they were (it allocates before it writes, and
        rows it wrote before failing are dropped)."""
        self.cache = self.cache or BatchKV()
        rows = self.cache.rows
        try:
            self.cache.admit([m.kv for m in joining], self.max, self._room(in_cache + joining), self.max_kv_bytes)
            admitted = joining
        except BaseException as exc:
            logger.warning("%d turns could not join the batch cache together (%s: %s); trying each alone",
                           len(joining), type(exc).__name__, exc)
            self.cache.keep_rows(rows)
            admitted = []
            for m in joining:
                try:
                    self.cache.admit([m.kv], self.max, self._room(in_cache + admitted + [m]), self.max_kv_bytes)
                except BaseException as alone:
                    self.cache.keep_rows(rows + len(admitted))
                    logger.warning("a turn of %r could not join the batch cache: %s: %s", m.prep.job.session_id,
                                   type(alone).__name__, alone)
                    self._fail(m, alone)
                    continue
                admitted.append(m)
        for m in admitted:
            m.kv = None
            if m.prep.cache is not None and hasattr(m.prep.cache, "layers"):
                for layer in m.prep.cache.layers:  # the batch cache holds them now: free the copy
                    layer.keys = layer.values = None
        return admitted

    def _leave_safely(self, m: _Member, b: int | None) -> None:
        try:
            self._leave(m, b)
        except BaseException as exc:
            self._fail(m, exc)

    def _leave(self, m: _Member, b: int | None) -> None:
        """Stores the member's decoded KV (row `b` of the batch cache) in its session and resolves its future."""
        prep = m.prep
        try:
            if isinstance(prep.cache, AttnStoreCache) and m.fed and b is not None:
                prompt_len = int(prep.prompt.shape[1])
                if m.sparse is not None:  # its row dropped tokens as it went: the copies it kept of each step
                    keys, values = m.sparse.decoded_kv()
                else:
                    keys = [layer.keys[b : b + 1, :, -m.fed:] for layer in self.cache.layers]
                    # Copies: the store may adopt long value tensors as they are, and a view would keep the whole
                    # batch cache alive with them.
                    values = [layer.values[b : b + 1, :, -m.fed:].clone() for layer in self.cache.layers]
                positions = torch.arange(prompt_len, prompt_len + m.fed, device=keys[0].device)
                prep.cache.append_computed(torch.tensor(m.generated[: m.fed]), positions, keys, values,
                                           m.sparse.sparse_from if m.sparse is not None else None)
        finally:
            if isinstance(prep.cache, AttnStoreCache):
                prep.cache.close()
        generated = torch.tensor([m.generated], dtype=torch.long)
        out = torch.cat([prep.prompt.cpu(), generated], dim=1)
        text = self.pipe.chat_tokens.reply_text(generated)
        greedy = [] if m.sample else list(m.generated)  # as the solo path: the generated ids of a greedy turn
        reply = self.pipe.finish(prep, out, generated, text, greedy, prep.timer.ttft,
                                 tuple(m.logprobs) if m.top_logprobs is not None else None)
        prep.job.future.set_result(reply)

    def _fail(self, m: _Member, exc: BaseException) -> None:
        """Fails one member's turn: its future gets `exc`, its stream ends, it leaves at the next settle
        without storing. Never raises (a client's streamer may: the loop must go on)."""
        ended = m.done
        m.done, m.drain, m.failed = True, False, True
        m.kv = None
        if isinstance(m.prep.cache, AttnStoreCache):
            quietly(m.prep.cache.close, "closing a failed turn's cache")
        if not ended:
            quietly(m.tee.end, "ending the stream of a failed turn")
        future = m.prep.job.future
        if not future.done():
            try:
                future.set_exception(exc)
            except InvalidStateError:
                pass


def _in_order(slot: int) -> None:
    """A dense row's keys: every position of its session, in order (`importance.BatchScorer`)."""
    return None


def _id_set(ids) -> set:
    """`eos_token_id` as generate takes it (an id, a list of ids, or None) as a set."""
    return set(ids if isinstance(ids, (list, tuple)) else [] if ids is None else [ids])




