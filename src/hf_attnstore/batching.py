"""Continuous batching of a ChatPipeline's turns: sessions decode together, joining and leaving between steps.

Each turn starts alone: its prompt is prefilled through its own :class:`AttnStoreCache` (reusing the stored
KV exactly as a solo turn does), which gives its first token. It then joins the running batch, whose
decoding steps feed one token of every member at once. Members have different history lengths: the batch
cache holds each member's KV left-padded to the longest, with an attention mask over the padding and each
member's own positions (its keys were rotated for them already, so padding shifts nothing). A member leaves
as soon as it is done (end of turn, `max_new_tokens`, a stop string, a cancelled request), and a queued turn
joins at the next step; the batch cache is rebuilt when members change.

A member's decoded KV is handed to its session's cache when it leaves (`AttnStoreCache.append_computed`),
so the store gets what a solo turn would have stored: the prompt, then every generated token that was fed
back. A reply cut by `max_new_tokens` stays one more step, so its last token is fed and stored too (the
solo path feeds it separately).

Two turns of one session never run together: a queued turn waits until its session's running turn leaves.
Models with sliding-window attention run one turn at a time (their window masks count cache columns, which
padding shifts).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from .cache import AttnStoreCache
from .pipeline import Prepared, _Tee

if TYPE_CHECKING:
    from .pipeline import ChatPipeline, _Job

logger = logging.getLogger(__name__)


class _SlabLayer(DynamicLayer):
    """A batch cache layer preallocated for the tokens its members may still add: each decoding step writes
    one column in place, where `DynamicLayer` would concatenate (copy) the whole batch's KV at every step.
    `keys` / `values` are views of the filled columns."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, capacity: int):
        super().__init__()
        batch, heads, width, dim = keys.shape
        self._k = keys.new_empty(batch, heads, max(capacity, width), dim)
        self._v = values.new_empty(batch, values.shape[1], max(capacity, width), values.shape[3])
        self._k[:, :, :width] = keys
        self._v[:, :, :width] = values
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True
        self._set(width)

    def _set(self, length: int) -> None:
        self.length = length
        self.keys, self.values = self._k[:, :, :length], self._v[:, :, :length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        n = key_states.shape[2]
        if self.length + n > self._k.shape[2]:  # more than planned (should not happen): grow once, by doubling
            grow = max(self._k.shape[2], n)
            self._k = torch.cat([self._k, self._k.new_empty(*self._k.shape[:2], grow, self._k.shape[3])], dim=2)
            self._v = torch.cat([self._v, self._v.new_empty(*self._v.shape[:2], grow, self._v.shape[3])], dim=2)
        self._k[:, :, self.length : self.length + n] = key_states
        self._v[:, :, self.length : self.length + n] = value_states
        self._set(self.length + n)
        return self.keys, self.values


def batchable(model) -> tuple[bool, str]:
    """Whether the model's turns can be batched here, and why not."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if getattr(config, "sliding_window", None) or "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        return False, "sliding-window attention counts cache columns, which left padding shifts"
    return True, ""


@dataclass(eq=False)
class _Member:
    prep: Prepared
    tee: _Tee
    max_new: int
    eos: set
    stops: list[str]
    sample: dict | None  # temperature / top_p, or None for greedy
    generated: list[int] = field(default_factory=list)
    fed: int = 0  # generated tokens fed back through the model (their KV is in the batch cache)
    kv: list | None = None  # per layer (keys, values) [1, h, L, d], until the member joins the batch cache
    done: bool = False
    drain: bool = False  # done, but its last token is fed in one more step so that the store gets it

    @property
    def length(self) -> int:
        """Tokens whose KV exists: the prompt and the fed generated tokens."""
        return int(self.prep.prompt.shape[1]) + self.fed


class BatchRunner:
    """The worker of a ChatPipeline with ``max_batch_size > 1`` (see the module docstring)."""

    def __init__(self, pipe: "ChatPipeline", max_batch_size: int):
        self.pipe, self.max = pipe, max_batch_size
        self.model = pipe.model
        self.members: list[_Member] = []
        # Where the worker's time goes: prefills, decoding steps, members leaving (their KV handed to the store)
        # and rebuilding the batch cache.
        self.seconds = {"prefill": 0.0, "step": 0.0, "leave": 0.0, "rebuild": 0.0}
        self.steps = 0
        self._hinted: list[str] | None = None  # the queue the last look-ahead hints were given for
        self.cache: DynamicCache | None = None
        self.pads: list[int] = []  # left padding of each member in the batch cache
        gen = self.model.generation_config
        default_eos = gen.eos_token_id
        self.default_eos = set(default_eos if isinstance(default_eos, (list, tuple)) else
                               [default_eos] if default_eos is not None else [])

    # -- the loop ---------------------------------------------------------------------------------------
    def run(self) -> None:
        pipe = self.pipe
        while True:
            jobs = self._take()
            if jobs is None:
                return
            joined = False
            for job in jobs:
                started = time.perf_counter()
                try:
                    joined |= self._start(job)
                except BaseException as exc:  # the caller sees it through the future; the worker goes on
                    job.future.set_exception(exc)
                    if job.streamer is not None:
                        job.streamer.end()
                self.seconds["prefill"] += time.perf_counter() - started
            if joined or any(m.done and not m.drain for m in self.members):
                self._settle()
            if self.members:
                started = time.perf_counter()
                try:
                    self._step()
                    self.steps += 1
                except BaseException as exc:  # a failed step fails its members, never the worker
                    logger.exception("a batched decoding step failed: %s", exc)
                    for m in self.members:
                        self._fail(m, exc)
                    self.members, self.cache, self.pads = [], None, []
                self.seconds["step"] += time.perf_counter() - started
            with pipe._cond:
                pipe._running = None if not self.members else self.members[0].prep.job.session_id

    def _take(self) -> list | None:
        """Queued turns that may join now (room in the batch, their session not running), in queue order.
        Waits while there is nothing to do; None once the pipeline is closed and everything is done."""
        pipe = self.pipe
        with pipe._cond:
            while True:
                running = {m.prep.job.session_id for m in self.members}
                room = self.max - len(self.members)
                taken = []
                for job in list(pipe._queue):
                    if len(taken) >= room:
                        break
                    if job.session_id in running:
                        continue
                    pipe._queue.remove(job)
                    running.add(job.session_id)
                    taken.append(job)
                if taken or self.members:
                    waiting = [j.session_id for j in pipe._queue]
                    break
                if pipe._closed and not pipe._queue:
                    return None
                pipe._cond.wait(timeout=1.0)
        if taken or waiting != self._hinted:
            # Only when the queue changed: this runs between decoding steps, and a prefetch with a remote tier
            # costs a round trip per waiting session.
            self._hinted = waiting
            try:
                pipe._give_hints(waiting)
            except Exception as exc:  # hints only speed things up
                logger.warning("look-ahead hints failed (%s); the turn runs without them", exc)
        return taken

    # -- joining ----------------------------------------------------------------------------------------
    def _start(self, job: "_Job") -> bool:
        """Prefills a turn alone; returns whether it joins the batch (False: it is already finished)."""
        if job.cancel is not None and job.cancel.is_set():
            job.future.cancel()
        if not job.future.set_running_or_notify_cancel():
            if job.streamer is not None:
                job.streamer.end()
            return False
        if job.reply is not None:  # reading a given reply is one forward: no decoding to batch
            job.future.set_result(self.pipe._turn(job))
            return False
        prep = self.pipe._prepare(job)
        options = prep.options
        eos = options.get("eos_token_id", ...)
        eos = self.default_eos if eos is ... else set(eos if isinstance(eos, (list, tuple)) else
                                                     [eos] if eos is not None else [])
        stops = options.get("stop_strings") or []
        stops = [stops] if isinstance(stops, str) else list(stops)
        sample = ({"temperature": float(options.get("temperature") or 1.0), "top_p": float(options.get("top_p") or 1.0)}
                  if options.get("do_sample") else None)
        member = _Member(prep, _Tee(prep.timer, job.streamer), int(options.get("max_new_tokens", 20)), eos, stops,
                         sample)
        try:
            with torch.no_grad():
                logits = self.model(prep.prompt[:, prep.reused:], past_key_values=prep.cache, use_cache=True,
                                    logits_to_keep=1).logits[:, -1]
            member.tee.put(prep.prompt.cpu())  # streamers expect the prompt first (skip_prompt)
            self._accept(member, logits)
            member.kv = [(layer.keys, layer.values) for layer in prep.cache.layers]
        except BaseException:
            if isinstance(prep.cache, AttnStoreCache):
                prep.cache.close()
            raise
        self.members.append(member)
        return True

    # -- a decoding step ---------------------------------------------------------------------------------
    def _step(self) -> None:
        members = self.members
        device = self.model.device
        width = self.cache.get_seq_length()
        tokens = torch.tensor([[m.generated[-1]] for m in members], device=device)
        positions = torch.tensor([[m.length] for m in members], device=device)
        mask = torch.ones(len(members), width + 1, dtype=torch.long, device=device)
        for b, pad in enumerate(self.pads):
            mask[b, :pad] = 0
        with torch.no_grad():
            logits = self.model(tokens, attention_mask=mask, position_ids=positions, past_key_values=self.cache,
                                use_cache=True, logits_to_keep=1).logits[:, -1]
        for b, m in enumerate(members):
            m.fed += 1
            if m.drain:
                m.drain = False  # its last token is fed: it leaves now
            elif not m.done:
                self._accept(m, logits[b : b + 1])

    def _accept(self, m: _Member, logits: torch.Tensor) -> None:
        """Chooses the member's next token from its logits ``[1, vocab]``, streams it, and decides whether the
        member is done."""
        options = m.prep.options
        scores = logits.float()
        processors = options.get("logits_processor")
        if processors:
            seq = torch.tensor([m.prep.prompt[0].tolist() + m.generated], device=logits.device)
            scores = processors(seq, scores)
        if m.sample is None:
            token = int(scores.argmax(-1))
        else:
            token = _sample(scores, **m.sample)
        m.generated.append(token)
        m.tee.put(torch.tensor([token]))
        job = m.prep.job
        text = self.pipe.chat_tokens.reply_text(torch.tensor(m.generated)) if m.stops else ""
        if token in m.eos or len(m.generated) >= m.max_new or any(s in text for s in m.stops) or (
                job.cancel is not None and job.cancel.is_set()):
            m.done = True
            m.tee.end()
            # A reply that did not end on the end-of-turn token has its last token fed one more step (stored).
            m.drain = self.pipe.needs_last_token(torch.tensor([m.generated]))

    # -- membership --------------------------------------------------------------------------------------
    def _settle(self) -> None:
        """Finishes the members that are done and rebuilds the batch cache for those that stay."""
        staying = []
        started = time.perf_counter()
        for b, m in enumerate(self.members):
            if m.done and not m.drain:
                try:
                    self._leave(m, b)
                except BaseException as exc:
                    self._fail(m, exc)
            else:
                staying.append((b, m))
        self.seconds["leave"] += time.perf_counter() - started
        started = time.perf_counter()
        kvs = []
        for b, m in staying:
            if m.kv is None:  # in the batch cache: its columns after the padding
                pad = self.pads[b]
                m.kv = [(layer.keys[b : b + 1, :, pad:], layer.values[b : b + 1, :, pad:]) for layer in self.cache.layers]
            kvs.append(m.kv)
        self.members = [m for _, m in staying]
        # Room for every token the members may still feed (their remaining replies, and a drained last one).
        room = max((m.max_new - len(m.generated) + 1 for m in self.members), default=0)
        self.cache, self.pads = self._build(kvs, room) if kvs else (None, [])
        for m in self.members:
            m.kv = None
            if m.prep.cache is not None and hasattr(m.prep.cache, "layers"):
                for layer in m.prep.cache.layers:  # the batch cache holds them now: free the copy
                    layer.keys = layer.values = None
        self.seconds["rebuild"] += time.perf_counter() - started

    def _build(self, kvs: list, room: int) -> tuple[DynamicCache, list[int]]:
        """A batch cache of the members' KV, left-padded to the longest, with `room` more columns."""
        width = max(kv[0][0].shape[2] for kv in kvs)
        pads = [width - kv[0][0].shape[2] for kv in kvs]
        layers = []
        for layer in range(len(kvs[0])):
            k0, v0 = kvs[0][layer]
            keys = k0.new_empty(len(kvs), k0.shape[1], width, k0.shape[3])
            values = v0.new_empty(len(kvs), v0.shape[1], width, v0.shape[3])
            for b, kv in enumerate(kvs):
                keys[b : b + 1, :, pads[b]:] = kv[layer][0]
                values[b : b + 1, :, pads[b]:] = kv[layer][1]
                # Padding is masked out, but must hold finite numbers: 0 * NaN would still be NaN.
                keys[b, :, : pads[b]] = 0
                values[b, :, : pads[b]] = 0
            layers.append(_SlabLayer(keys, values, width + room))
        cache = DynamicCache()
        cache.layers = layers
        return cache, pads

    def _leave(self, m: _Member, b: int) -> None:
        """Stores the member's decoded KV in its session and resolves its future."""
        prep = m.prep
        try:
            if isinstance(prep.cache, AttnStoreCache) and m.fed:
                prompt_len = int(prep.prompt.shape[1])
                keys = [layer.keys[b : b + 1, :, -m.fed:] for layer in self.cache.layers]
                # Copies: the store may adopt long value tensors as they are, and a view would keep the whole
                # batch cache alive with them.
                values = [layer.values[b : b + 1, :, -m.fed:].clone() for layer in self.cache.layers]
                positions = torch.arange(prompt_len, prompt_len + m.fed, device=keys[0].device)
                prep.cache.append_computed(torch.tensor(m.generated[: m.fed]), positions, keys, values)
        finally:
            if isinstance(prep.cache, AttnStoreCache):
                prep.cache.close()
        generated = torch.tensor([m.generated], dtype=torch.long)
        out = torch.cat([prep.prompt.cpu(), generated], dim=1)
        text = self.pipe.chat_tokens.reply_text(generated)
        greedy = [] if m.sample is not None else list(m.generated)
        reply = self.pipe._finish(prep, out, generated, text, greedy, prep.timer.ttft)
        prep.job.future.set_result(reply)

    def _fail(self, m: _Member, exc: BaseException) -> None:
        if isinstance(m.prep.cache, AttnStoreCache):
            m.prep.cache.close()
        if not m.done:
            m.tee.end()
        if not m.prep.job.future.done():
            m.prep.job.future.set_exception(exc)


def _sample(scores: torch.Tensor, temperature: float, top_p: float) -> int:
    probs = torch.softmax(scores / max(temperature, 1e-5), dim=-1)[0]
    if top_p < 1.0:
        ordered, index = probs.sort(descending=True)
        keep = ordered.cumsum(0) - ordered < top_p  # the smallest set whose mass reaches top_p
        probs = torch.zeros_like(probs).scatter(0, index[keep], ordered[keep])
    return int(torch.multinomial(probs / probs.sum(), 1))
