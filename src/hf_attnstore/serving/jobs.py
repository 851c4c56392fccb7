"""The units of work the pipeline queues and the batch runner runs: a turn (`Job`), a turn ready to run
(`Prepared`), its answer (`Reply`), what the batch runner asks of the pipeline (`TurnSource`), and the small
helpers both share. Kept apart from pipeline.py so that the pipeline and the batch runner import it, and not each
other (not even for type hints: the runner names the pipeline by `TurnSource`).
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import StoppingCriteria

from .timing import FirstTokenTimer

logger = logging.getLogger(__name__)


class PipelineClosed(ValueError):
    """The pipeline is closed and takes no new turns (a server answers 503: it is shutting down).

    A `ValueError`: what it was before it had its own class, and what Python raises for an operation on a closed
    file.

    Example:
        >>> isinstance(PipelineClosed("closed"), ValueError)
        True
    """


MAX_TOP_LOGPROBS = 20  # OpenAI's limit


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> tuple[int, float, tuple[tuple[int, float], ...]]:
    """A chosen token's log-probability under the model's raw distribution (the logits before any processor or
    warper: vLLM's default, `raw_logprobs`) and the `top` most likely tokens with theirs.

    Example:
        >>> token_logprobs(torch.tensor([[0.0, 0.0]]), 1, 1)
        (1, -0.6931471824645996, ((0, -0.6931471824645996),))
    """
    logprobs = torch.log_softmax(logits.float().view(-1), dim=-1)
    best = torch.topk(logprobs, min(top, logprobs.numel())) if top else None
    alternatives = tuple(zip(best.indices.tolist(), best.values.tolist())) if best is not None else ()
    return token, float(logprobs[token]), alternatives


def quietly(call, what: str) -> None:
    """Runs a clean-up step that must not stop the worker (a client's streamer, a cache's close): a failure is
    logged and the worker goes on.

    Example:
        >>> quietly(lambda: 1 / 0, "a streamer's end")  # logged, not raised
    """
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the turn is failing or over already; the worker must not
        logger.warning("%s failed: %s: %s", what, type(exc).__name__, exc)


@dataclass(frozen=True)
class Reply:
    """One turn's answer and what it cost.

    Attributes:
        text: The reply: generated, or the given one for a turn submitted with ``reply=``.
        ttft_s: Seconds from the start of the turn (cache lookup included) to the first token's logits.
        total_s: Seconds of the whole turn (prefill and decoding, or prefill and reading a given reply).
        kv_source: Where the reused KV came from: ``"host"``, ``"disk"``, ``"remote"``, ``"miss"`` (nothing reused),
            ``"truncated"`` (the context overflowed and was truncated this turn), or ``"recompute"``
            (a pipeline without a store).

    Example:
        >>> pipe.chat("s1", "hi").kv_source  # doctest: +SKIP
        'miss'
    """

    session_id: str
    text: str
    history_tokens: int  # prompt tokens of this turn (history + new message, after truncation)
    reused_tokens: int
    prefilled_tokens: int
    generated_tokens: int
    dropped_tokens: int
    ttft_s: float
    total_s: float
    kv_source: str
    queued_s: float = 0.0  # from submit() until the turn started
    tier: str | None = None  # where reused KV came from even when truncated: "host", "disk", "miss"; None: no store
    # Generated ids (greedy decoding), or for a given reply the greedy choice at each of its positions.
    greedy_ids: tuple[int, ...] = ()
    generated_ids: tuple[int, ...] = ()  # the reply's ids as generated (or read), sampled or not
    prompt_ids: tuple[int, ...] = ()  # the ids the model saw this turn (after truncation)
    cancelled: bool = False  # stopped early by `cancel` (submit_prompt)
    # The most tokens this turn could generate: its `max_new_tokens`, or less where the model's positions end
    # (ChatPipeline.position_limit); a reply that reached it was cut ("length"), not ended.
    max_new_tokens: int = 0
    # With the `logprobs` option (a count of alternatives): per generated token, `token_logprobs`'s answer.
    logprobs: tuple | None = None


@dataclass
class Prepared:
    """A turn ready to run: its prompt (after truncation), its cache and what it reuses.

    Example:
        >>> prepared = pipe.prepare(job)  # the batch runner's first step of a turn  # doctest: +SKIP
    """

    job: "Job"
    started: float
    timer: FirstTokenTimer
    cache: object  # AttnStoreCache, or a DynamicCache without a store
    prompt: torch.Tensor  # [1, seq] on the model's device
    reused: int
    dropped: int
    source: str
    options: dict


@dataclass
class Job:
    """A queued turn: its session, message (or whole prompt), the future it resolves and its options.

    Example:
        >>> from concurrent.futures import Future
        >>> Job("s1", "hi", Future(), None, 0.0).claim()
        True
    """

    session_id: str
    message: str
    future: Future
    streamer: object | None
    submitted: float
    reply: str | None = None
    prompt_ids: torch.Tensor | None = None  # the whole prompt, given (submit_prompt): no history is consulted
    cancel: threading.Event | None = None  # set: the turn stops after its current step (a client went away)
    options: dict | None = None  # per-turn `generate` options over the pipeline's
    cache_salt: str | None = None  # the KV space of the turn (AttnStoreCache's `cache_salt`)

    def claim(self) -> bool:
        """Marks the turn as running; False if it was cancelled while queued (its reader is then released)."""
        if self.cancel is not None and self.cancel.is_set():
            self.future.cancel()
        if self.future.set_running_or_notify_cancel():
            return True
        if self.streamer is not None:  # nothing runs: the reader must not hang
            quietly(self.streamer.end, "ending the stream of a cancelled turn")
        return False

    def fail(self, exc: BaseException) -> None:
        """Fails the turn with `exc` and releases its reader; never raises, so the worker goes on."""
        if not self.future.done():
            try:
                self.future.set_exception(exc)
            except InvalidStateError:  # resolved meanwhile (cancelled while queued)
                pass
        if self.streamer is not None:
            quietly(self.streamer.end, "ending the stream of a failed turn")


class Tee:
    """Forwards `generate`'s streamer calls to several streamers (our TTFT timer and the caller's).

    Example:
        >>> Tee(None).streamers
        []
    """

    def __init__(self, *streamers):
        self.streamers = [s for s in streamers if s is not None]

    def put(self, value):
        for s in self.streamers:
            s.put(value)

    def end(self):
        for s in self.streamers:
            s.end()


class Cancelled(StoppingCriteria):
    """Stops `generate` once the turn is cancelled (checked after every decoding step).

    Example:
        >>> import threading, torch
        >>> stop = threading.Event(); stop.set()
        >>> Cancelled(stop)(torch.zeros(1, 3, dtype=torch.long), None).tolist()
        [True]
    """

    def __init__(self, event: threading.Event):
        self.event = event

    def __call__(self, input_ids, scores, **kwargs) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device)


class TurnSource(Protocol):
    """What the batch runner (batching.py) asks of the pipeline that owns it: its turns, their preparation and
    the finishing of their replies. `ChatPipeline` is one; the runner never imports it, so the two modules do not
    import each other.

    Example:
        >>> from hf_attnstore.serving.pipeline import ChatPipeline
        >>> all(hasattr(ChatPipeline, name) for name in ("take_jobs", "prepare", "run_turn", "finish"))
        True
    """

    model: object
    chat_tokens: object  # `cache.chat.ChatTokens`: the reply's text (`reply_text`)

    def set_running(self, sessions: list[str]) -> None: ...

    def take_jobs(self, running: list[str], room: int, busy: bool,
                  timeout_s: float = 1.0) -> tuple[list[Job], list[str]] | None: ...

    def give_hints(self, waiting: list[str]) -> None: ...

    def turn_options(self, job: Job) -> dict: ...

    def prefetch_turn(self, job: Job) -> None: ...

    def prepare(self, job: Job) -> Prepared: ...

    def run_turn(self, job: Job) -> Reply: ...

    def needs_last_token(self, generated: torch.Tensor) -> bool: ...

    def finish(self, p: Prepared, out: torch.Tensor, generated: torch.Tensor, text: str, greedy, ttft: float,
               logprobs: tuple | None = None) -> Reply: ...
