"""Continuous batching: every session in a batch produces the tokens it produces alone (fp32), the store ends
up as after solo turns, and turns join, leave, stream, cancel and fail independently."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from hf_attnstore import AttnStore, AttnStoreCache, SparseConfig
from hf_attnstore.serving.batching import batchable
from hf_attnstore.serving.pipeline import ChatPipeline

from ..conftest import char_tokenizer, make_tiny

# Six sessions of different lengths, three turns each: members join with different histories.
MESSAGES = {f"s{i}": [f"hello {i} " + "abc " * i, f"then {i} " + "xy" * (3 * i), "and the third"] for i in range(6)}


def run(model, store, batch, max_new=7, **kw):
    out = {}
    with ChatPipeline(model, char_tokenizer(), store, max_new_tokens=max_new, max_batch_size=batch, **kw) as pipe:
        for k in range(3):
            futures = {s: pipe.submit(s, m[k]) for s, m in MESSAGES.items()}
            for s, f in futures.items():
                out[(s, k)] = f.result(60)
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "phi3", "gpt_neox", "gpt2"])
def test_batched_turns_produce_the_tokens_of_solo_turns(arch):
    model = make_tiny(arch)
    assert batchable(model)[0]
    solo, batched = run(model, AttnStore("64MiB"), 1), run(model, AttnStore("64MiB"), 4)
    plain = run(model, None, 4)  # batched recomputation, no store
    for key, alone in solo.items():
        assert batched[key].generated_ids == alone.generated_ids == plain[key].generated_ids, key
        assert batched[key].greedy_ids == alone.greedy_ids == alone.generated_ids, key  # (batched: () before)
        # The store holds what a solo turn stores: the next turn reuses exactly as much.
        assert batched[key].reused_tokens == alone.reused_tokens, key
        assert batched[key].kv_source == alone.kv_source, key


@pytest.mark.parametrize("arch", ["mistral", "gemma3_text"])
def test_sliding_window_models_batch_with_their_solo_tokens(arch):
    """A sliding mask compares a query's column with a key's column, and left padding shifts both alike. The
    window matters here: the same weights without it change the tokens of most turns."""
    model, unwindowed = make_tiny(arch), make_tiny(arch)
    unwindowed.config.sliding_window = 10_000
    solo, batched = run(model, AttnStore("64MiB"), 1), run(model, AttnStore("64MiB"), 4)
    for key, alone in solo.items():
        assert batched[key].generated_ids == alone.generated_ids, key
    without = run(unwindowed, AttnStore("64MiB"), 1)
    assert sum(without[k].generated_ids != r.generated_ids for k, r in solo.items()) > len(solo) // 2


def test_a_model_that_cannot_be_batched_runs_one_turn_at_a_time(monkeypatch, caplog):
    import hf_attnstore.serving.batching as batching

    monkeypatch.setattr(batching, "batchable", lambda model, sparse=None: (False, "a reason"))
    with ChatPipeline(make_tiny("llama"), char_tokenizer(), AttnStore("16MiB"), max_batch_size=4) as pipe:
        assert pipe.max_batch_size == 1
        assert pipe.chat("s", "hi", timeout=60).generated_tokens > 0
    assert "one at a time: a reason" in caplog.text


def test_stored_sessions_after_batched_turns_resume_exactly_in_a_fresh_pipeline():
    """The KV a member stores when it leaves (prompt, fed tokens, a cut reply's last token) is what a solo
    turn would store: a pipeline that never saw the sessions continues them from the store alone."""
    model = make_tiny("llama")
    store = AttnStore("64MiB")
    with ChatPipeline(model, char_tokenizer(), store, max_new_tokens=5, max_batch_size=3) as pipe:
        firsts = {s: pipe.submit(s, m[0]) for s, m in MESSAGES.items()}
        lengths = {s: f.result(60).history_tokens + f.result(60).generated_tokens for s, f in firsts.items()}
    with ChatPipeline(model, char_tokenizer(), store, max_new_tokens=5) as fresh:
        for s, m in MESSAGES.items():
            assert fresh.chat(s, m[1], timeout=60).reused_tokens == lengths[s], s
    with ChatPipeline(model, char_tokenizer(), None, max_new_tokens=5) as alone:
        with ChatPipeline(model, char_tokenizer(), AttnStore("64MiB"), max_new_tokens=5, max_batch_size=3) as b:
            for s, m in list(MESSAGES.items())[:2]:
                assert b.chat(s, m[0], timeout=60).text == alone.chat(s, m[0], timeout=60).text


class Hold(LogitsProcessor):
    """Blocks the decoding steps of the batch until released (the first session's first step)."""

    def __init__(self):
        self.started, self.release = threading.Event(), threading.Event()

    def __call__(self, input_ids, scores):
        self.started.set()
        assert self.release.wait(30)
        return scores


def test_a_cancelled_member_leaves_and_the_others_finish():
    model = make_tiny("llama")
    hold, cancel = Hold(), threading.Event()
    with ChatPipeline(model, char_tokenizer(), AttnStore("64MiB"), max_new_tokens=12, max_batch_size=4,
                      eos_token_id=None, logits_processor=LogitsProcessorList([hold])) as pipe:
        a = pipe.submit_prompt("a", torch.arange(10, 40), cancel=cancel)
        b = pipe.submit_prompt("b", torch.arange(20, 60))
        assert hold.started.wait(30)  # "a" is running (its first token is being chosen)
        cancel.set()
        hold.release.set()
        ra, rb = a.result(60), b.result(60)
    assert ra.cancelled and ra.generated_tokens < 12
    assert rb.generated_tokens == 12 and not rb.cancelled


def test_turns_of_one_session_never_run_together_and_reuse_each_other():
    model = make_tiny("llama")
    with ChatPipeline(model, char_tokenizer(), AttnStore("64MiB"), max_new_tokens=4, max_batch_size=4) as pipe:
        futures = [pipe.submit("same", f"message {k}") for k in range(4)]
        replies = [f.result(60) for f in futures]
    lengths = [r.history_tokens for r in replies]
    assert lengths == sorted(lengths) and all(r.reused_tokens == prev.history_tokens + prev.generated_tokens
                                              for prev, r in zip(replies, replies[1:]))


def test_streaming_sampling_and_given_replies_in_a_batch():
    model = make_tiny("llama")
    tok = char_tokenizer()
    with ChatPipeline(model, tok, AttnStore("64MiB"), max_new_tokens=6, max_batch_size=4) as pipe:
        chunks, streamed = pipe.stream("st", "stream this")
        sampled = pipe.submit_prompt("sa", torch.arange(10, 30), do_sample=True, temperature=0.7, top_p=0.9)
        read = pipe.submit("rd", "a question", reply="a given answer")
        text = "".join(chunks)
        assert text == streamed.result(60).text
        assert sampled.result(60).generated_tokens == 6 and sampled.result(60).greedy_ids == ()
        assert read.result(60).text == "a given answer"


def test_a_failing_step_fails_its_members_and_the_worker_goes_on():
    class Boom(LogitsProcessor):
        armed = True

        def __call__(self, input_ids, scores):
            if Boom.armed and input_ids.shape[1] > 35:
                raise RuntimeError("boom")
            return scores

    model = make_tiny("llama")
    with ChatPipeline(model, char_tokenizer(), AttnStore("64MiB"), max_new_tokens=6, max_batch_size=2,
                      logits_processor=LogitsProcessorList([Boom()])) as pipe:
        failing = pipe.submit_prompt("f", torch.arange(5, 38))
        with pytest.raises(RuntimeError, match="boom"):
            failing.result(60)
        Boom.armed = False
        assert pipe.chat("ok", "still serving", timeout=60).generated_tokens == 6


@pytest.mark.parametrize("arch", ["llama", "phi3", "gpt2"])
def test_chunked_prefill_produces_the_tokens_of_whole_prefills(arch):
    """With a token budget, prompts are prefilled in several forwards between decoding steps; tokens and what
    the store keeps are those of whole prefills."""
    model = make_tiny(arch)
    whole = run(model, AttnStore("64MiB"), 4)
    with ChatPipeline(model, char_tokenizer(), AttnStore("64MiB"), max_new_tokens=7, max_batch_size=4,
                      max_batch_tokens=9) as pipe:
        chunked = {}
        for k in range(3):
            futures = {s: pipe.submit(s, m[k]) for s, m in MESSAGES.items()}
            chunked.update({(s, k): f.result(60) for s, f in futures.items()})
        chunks = pipe.batch_runner.prefill_chunks
    prefilled = sum(r.prefilled_tokens for r in chunked.values())
    assert chunks >= prefilled / 9 > len(chunked)  # really chunked: more forwards than turns
    for key, alone in whole.items():
        assert chunked[key].generated_ids == alone.generated_ids, key
        assert chunked[key].reused_tokens == alone.reused_tokens, key


class Recorder:
    """A streamer that logs `(name, what)` into a shared list: "prompt" first, then one "token" per put."""

    def __init__(self, name, log):
        self.name, self.log, self.seen_prompt = name, log, False

    def put(self, value):
        self.log.append((self.name, "token" if self.seen_prompt else "prompt"))
        self.seen_prompt = True

    def end(self):
        self.log.append((self.name, "end"))


@pytest.mark.parametrize("budget", [None, 6])
def test_a_token_budget_lets_running_replies_stream_while_a_long_prompt_prefills(budget):
    model = make_tiny("llama")
    log = []
    with ChatPipeline(model, char_tokenizer(), AttnStore("64MiB"), max_new_tokens=10, max_batch_size=2,
                      max_batch_tokens=budget, eos_token_id=None) as pipe:
        with pipe._cond:  # both queued before the worker looks (the condition's lock is re-entrant)
            short = pipe.submit_prompt("short", torch.arange(10, 14), Recorder("short", log))
            long = pipe.submit_prompt("long", torch.arange(120) % 90 + 10, Recorder("long", log))
        assert short.result(60).generated_tokens == long.result(60).generated_tokens == 10
    long_joined = log.index(("long", "prompt"))  # its prompt is streamed once its prefill is done
    short_tokens_before = log[:long_joined].count(("short", "token"))
    if budget is None:  # both prompts prefilled whole before the first decoding step
        assert short_tokens_before == 1
    else:  # 120 tokens at most 5 per iteration: the short reply is finished before the long one starts
        assert short_tokens_before == 10 and log.index(("short", "end")) < long_joined


def test_max_batch_tokens_must_leave_room_to_prefill():
    model = make_tiny("llama")
    for bad in (4, 0, 2.5, True):
        with pytest.raises(ValueError, match="max_batch_tokens"):
            ChatPipeline(model, char_tokenizer(), None, max_batch_size=4, max_batch_tokens=bad)


def test_members_of_different_reply_lengths_leave_from_any_row_and_others_join_in_place():
    """Replies of 1-9 tokens: members leave from the middle rows (the last row takes their place) and queued
    turns join the running batch cache; every turn still gets its solo tokens."""
    model = make_tiny("qwen2")
    prompts = {f"p{i}": torch.arange(3 * i + 5) % 97 + 11 for i in range(8)}
    lengths = {f"p{i}": (9, 1, 4, 7, 2, 9, 3, 5)[i] for i in range(8)}

    def replies(batch):
        with ChatPipeline(model, char_tokenizer(), AttnStore("64MiB"), max_batch_size=batch, eos_token_id=None) as pipe:
            futures = {s: pipe.submit_prompt(s, p, max_new_tokens=lengths[s]) for s, p in prompts.items()}
            return {s: f.result(60) for s, f in futures.items()}, pipe.batch_runner if batch > 1 else None

    solo, _ = replies(1)
    batched, runner = replies(3)
    for s, r in solo.items():
        assert batched[s].generated_ids == r.generated_ids and len(r.generated_ids) == lengths[s], s
    assert runner.steps < sum(lengths.values())  # decoded together


def test_every_running_member_leads_the_eviction_schedule():
    """The store keeps the sessions of the whole running batch (their write buffers) last in line for
    eviction, ahead of the waiting queue, not just one of them."""
    class Recording(AttnStore):
        schedules = []

        def set_schedule(self, sessions):
            Recording.schedules.append(list(sessions))
            return super().set_schedule(sessions)

    class Running(LogitsProcessor):  # what the pipeline calls running while the batch decodes
        seen = []

        def __call__(self, input_ids, scores):
            Running.seen.append(frozenset(pipe._running))
            return scores

    model = make_tiny("llama")
    with ChatPipeline(model, char_tokenizer(), Recording("64MiB"), max_new_tokens=6, max_batch_size=2,
                      eos_token_id=None, logits_processor=LogitsProcessorList([Running()])) as pipe:
        with pipe._cond:  # all four queued before the worker looks
            futures = [pipe.submit_prompt(f"s{i}", torch.arange(10, 20 + i)) for i in range(4)]
        for f in futures:
            f.result(60)
    assert {"s0", "s1"} in Running.seen and {"s2", "s3"} in Running.seen
    # Hints given while s2 and s3 decode put both first.
    assert any(set(s[:2]) == {"s2", "s3"} for s in Recording.schedules)


GENERATION_OPTIONS = {
    "penalties": dict(repetition_penalty=1.6, no_repeat_ngram_size=2, min_new_tokens=5),
    "bans": None,  # built from the replies without options: their own first tokens are banned
    "top-k sampling": dict(do_sample=True, temperature=0.8, top_k=5, seed=1234),
    "typical sampling": dict(do_sample=True, typical_p=0.9, min_p=0.02, repetition_penalty=1.3, seed=7),
}


@pytest.mark.parametrize("name", sorted(GENERATION_OPTIONS))
def test_batched_turns_honour_every_generation_option_as_solo_turns_do(name):
    """Each member decodes with the processors `generate` builds for its options (transformers' own code):
    penalties, bans, warpers, and a per-turn `seed` for sampling give the tokens of the same turn alone."""
    model = make_tiny("llama")
    plain = run(model, AttnStore("64MiB"), 1)
    options = GENERATION_OPTIONS[name]
    if options is None:
        firsts = sorted({r.generated_ids[0] for r in plain.values()})
        options = dict(bad_words_ids=[[t] for t in firsts[:2]], suppress_tokens=firsts[2:4],
                       begin_suppress_tokens=firsts[4:5])
    solo = run(model, AttnStore("64MiB"), 1, **options)
    batched = run(model, AttnStore("64MiB"), 4, **options)
    for key, alone in solo.items():
        assert batched[key].generated_ids == alone.generated_ids, key
    if "min_new_tokens" in options:
        assert all(r.generated_tokens >= 5 for r in solo.values())
    # And the options do change the replies.
    assert any(plain[key].generated_ids != alone.generated_ids for key, alone in solo.items())


def test_a_turn_the_batch_cannot_decode_runs_alone_with_its_options(caplog):
    """Beam search (and other modes, several returned sequences, unknown options) cannot share the batch's one
    sequence per turn: such a turn runs by itself with `generate`, as at batch size 1, with the reason logged. With
    a store, beam search is refused with the reason (a session's stored KV is one sequence); without one it runs."""
    model = make_tiny("llama")
    with ChatPipeline(model, char_tokenizer(), None, max_new_tokens=5, max_batch_size=1) as solo:
        want = solo.submit_prompt("b", torch.arange(10, 30), num_beams=3).result(60)
    with caplog.at_level("INFO", logger="hf_attnstore.serving.batching"):
        with ChatPipeline(model, char_tokenizer(), None, max_new_tokens=5, max_batch_size=4) as pipe:
            beams = pipe.submit_prompt("b", torch.arange(10, 30), num_beams=3)
            greedy = pipe.submit_prompt("g", torch.arange(10, 30))
            bad = pipe.submit_prompt("x", torch.arange(10, 30), not_an_option=1)
            assert beams.result(60).generated_ids == want.generated_ids
            assert greedy.result(60).generated_tokens == 5
            with pytest.raises(ValueError, match="not_an_option"):
                bad.result(60)
    assert "runs alone" in caplog.text and "beam" in caplog.text
    with ChatPipeline(model, char_tokenizer(), AttnStore("64MiB"), max_new_tokens=5, max_batch_size=4) as pipe:
        with pytest.raises(ValueError, match="num_beams=1"):
            pipe.submit_prompt("b", torch.arange(10, 30), num_beams=3).result(60)
        assert pipe.submit_prompt("g", torch.arange(10, 30)).result(60).generated_tokens == 5


# -- sparse sessions (kv_budget) and importance scores in a batch ---------------------------------------------
SPARSE_MESSAGES = {f"s{i}": [f"hello {i} " + "abc " * (3 * i + 5), f"then {i} " + "xy" * (3 * i), "and the third"]
                   for i in range(6)}


def run_sparse(model, batch, max_new, turns=3, **kw):
    out = {}
    with ChatPipeline(model, char_tokenizer(), AttnStore("64MiB"), max_new_tokens=max_new, max_batch_size=batch,
                      **kw) as pipe:
        for k in range(turns):
            futures = {s: pipe.submit(s, m[k]) for s, m in SPARSE_MESSAGES.items()}
            for s, f in futures.items():
                out[(s, k)] = f.result(60)
        peak = dict(pipe.batch_runner.peak) if hasattr(pipe, "batch_runner") else None
    return out, peak


def test_a_sparse_member_joins_the_batch_with_the_tokens_its_next_forward_keeps():
    """A member's row is its kept selection (`select_now`: what the solo turn's next forward keeps), so a reply of
    two tokens is the solo one exactly; its row is the budget of its history, not the history."""
    model = make_tiny("llama")
    solo, _ = run_sparse(model, 1, 2, turns=2, kv_budget=0.3)
    batched, peak = run_sparse(model, 6, 2, turns=2, kv_budget=0.3)
    dense, dense_peak = run_sparse(model, 6, 2, turns=2)
    # A first turn: the same selection at the join as at the solo turn's second forward. (Later turns resume with
    # the scores the turn before kept, which solo decoding steps add to and batched ones do not.)
    assert all(batched[k].generated_ids == r.generated_ids for k, r in solo.items() if k[1] == 0)
    assert sum(dense[k].generated_ids != r.generated_ids for k, r in solo.items()) > 0  # the budget matters here
    assert peak["rows"] == dense_peak["rows"] == 6
    # The longest prompt sets the width of every row: 30% of it (and its sinks) against all of it.
    longest = max(r.history_tokens for r in batched.values())
    assert peak["live"] < 0.45 * dense_peak["live"], (peak, dense_peak, longest)


@pytest.mark.parametrize("chunk", [3, 8])
def test_a_sparse_prompt_prefilled_in_chunks_attends_as_in_one_forward(chunk):
    """Chunked prefill (`max_batch_tokens`): the history is selected before the prompt's first chunk only, and
    every later chunk attends to all of the prompt so far, as the one forward of a solo turn does. Before, each
    chunk selected again and dropped tokens of the prompt itself: other tokens from the first on."""
    model = make_tiny("llama")
    solo, _ = run_sparse(model, 1, 2, turns=2, kv_budget=0.3)
    chunked, _ = run_sparse(model, 4, 2, turns=2, kv_budget=0.3, max_batch_tokens=chunk + 4)
    assert all(chunked[k].generated_ids == r.generated_ids for k, r in solo.items() if k[1] == 0)


@pytest.mark.parametrize("budget", [0.3, SparseConfig(0.3, policy="h2o"), SparseConfig(0.3, policy="streaming"), 12],
                         ids=["alisa", "h2o", "streaming", "count"])
def test_sparse_turns_in_a_batch_produce_their_solo_tokens(budget):
    """A sparse row re-selects before every step, as the solo turn's layers before every forward, by the scores
    the batch gives its steps: every turn's tokens are the solo ones, over turns (the stored KV too: the next
    turns reuse and decode alike). With a budget of 12 tokens the rows drop tokens they decoded: the session
    still stores them (the row's copies of each step)."""
    model = make_tiny("llama")
    solo, _ = run_sparse(model, 1, 12, kv_budget=budget)
    batched, peak = run_sparse(model, 4, 12, kv_budget=budget)
    assert peak["rows"] == 4
    for key, alone in solo.items():
        assert batched[key].generated_ids == alone.generated_ids, key
        assert batched[key].reused_tokens == alone.reused_tokens, key


def test_sparse_sessions_decode_in_a_batch_over_turns_and_keep_their_scores():
    """Every turn resumes its stored session, and the scores kept with it cover it (the batch scores its
    steps), so its next turn starts sparse."""
    model = make_tiny("llama")
    solo, _ = run_sparse(model, 1, 7, kv_budget=0.3)
    store = AttnStore("64MiB")
    with ChatPipeline(model, char_tokenizer(), store, max_new_tokens=7, max_batch_size=4, kv_budget=0.3) as pipe:
        for k in range(3):
            futures = {s: pipe.submit(s, m[k]) for s, m in SPARSE_MESSAGES.items()}
            batched = {s: f.result(60) for s, f in futures.items()}
            for s, reply in batched.items():
                assert reply.reused_tokens == solo[(s, k)].reused_tokens > (0 if k else -1)
                assert reply.generated_ids == solo[(s, k)].generated_ids
    from hf_attnstore import AttnStoreCache

    history = store.token_ids("s3", AttnStoreCache.fingerprint_of(model, store))
    cache = AttnStoreCache(model, store, "s3", torch.cat([history, torch.tensor([40, 41])]), save=False,
                           kv_budget=0.3)
    assert cache.reused_tokens == history.numel()
    assert cache.turn.scorer.has_scores  # stored with the session: its first forward attends to the budget
    stored = next(iter(cache.turn.scorer.scores.values()))
    assert stored.shape[1] == history.numel()  # every stored token
    assert bool((stored[:, -7:] > 0).all())  # the 7 tokens decoded (fed) in the batch: scored by its steps


def test_sparse_rows_label_the_kv_they_decode_as_solo_turns_do():
    """A row that attends to a selection decodes KV that is not the dense one: the session stores it labelled
    inexact from the same token as a solo turn does, so no dense turn reuses it."""
    model = make_tiny("llama")
    exact = {}
    for batch in (1, 4):
        store = AttnStore("64MiB")
        with ChatPipeline(model, char_tokenizer(), store, max_new_tokens=12, max_batch_size=batch,
                          kv_budget=12) as pipe:
            futures = {s: pipe.submit(s, m[0]) for s, m in SPARSE_MESSAGES.items()}
            replies = {s: f.result(60) for s, f in futures.items()}
        fingerprint = AttnStoreCache.fingerprint_of(model, store)
        exact[batch] = {s: store.lookup(s, fingerprint).exact_prefix() for s in replies}
        assert all(exact[batch][s] == r.history_tokens for s, r in replies.items())  # the prompt, not the reply
    assert exact[1] == exact[4]


def _stored_scores(model, store, session, **cache_kw) -> dict:
    from hf_attnstore import AttnStoreCache

    ids = store.token_ids(session, AttnStoreCache.fingerprint_of(model, store))
    cache = AttnStoreCache(model, store, session, torch.cat([ids, torch.tensor([40])]), save=False, **cache_kw)
    return {slot: s.clone() for slot, s in cache.turn.scorer.scores.items()}


@pytest.mark.parametrize("cache_kw", [{"kv_budget": 10_000}, {"kv_budget": SparseConfig(10_000, policy="h2o")},
                                      {"truncation": "importance", "context_window": 4096}],
                         ids=["alisa", "h2o", "importance-truncation"])
def test_a_batch_scores_its_steps_as_solo_steps_do(cache_kw):
    """Where the batch attends as a solo turn does (a budget that keeps everything; importance truncation without
    an overflow), the scores kept with each session after batched turns are the solo ones: the batch scores
    every row's decoding steps with the row's own keys and positions (`importance.BatchScorer`)."""
    model = make_tiny("llama")
    stores = {}
    for batch in (1, 4):
        store = stores[batch] = AttnStore("64MiB")
        with ChatPipeline(model, char_tokenizer(), store, max_new_tokens=6, max_batch_size=batch, **cache_kw) as pipe:
            for k in range(2):
                futures = [pipe.submit(s, m[k]) for s, m in SPARSE_MESSAGES.items()]
                for f in futures:
                    f.result(60)
    read_kw = {"kv_budget": cache_kw["kv_budget"]} if "kv_budget" in cache_kw else {"truncation": "importance"}
    for session in SPARSE_MESSAGES:
        solo, batched = _stored_scores(model, stores[1], session, **read_kw), \
            _stored_scores(model, stores[4], session, **read_kw)
        assert solo.keys() == batched.keys() and solo
        for slot in solo:
            assert solo[slot].shape == batched[slot].shape
            torch.testing.assert_close(batched[slot], solo[slot], rtol=1e-4, atol=1e-5)


def test_importance_truncation_runs_batched():
    """A scored turn in a batch ends with its KV appended from the batch: its end is the forward's, not the
    cache layers' (whose tensors the batch took over), which failed every batched turn before."""
    model = make_tiny("llama")
    out, _ = run_sparse(model, 3, 5, context_window=100, truncation="importance")
    assert all(r.generated_tokens == 5 for r in out.values())
    assert sum(r.dropped_tokens > 0 for r in out.values()) > 0 and sum(r.reused_tokens > 0 for r in out.values()) > 6


def test_kv_budget_is_checked_when_the_pipeline_is_made():
    with pytest.raises(ValueError, match="pass a store"):
        ChatPipeline(make_tiny("llama"), char_tokenizer(), None, kv_budget=0.2)
    with pytest.raises(ValueError, match="fraction must be in"):
        ChatPipeline(make_tiny("llama"), char_tokenizer(), AttnStore("16MiB"), kv_budget=1.5)
    with pytest.raises(ValueError, match="hybrid models"):
        ChatPipeline(make_tiny("lfm2"), char_tokenizer(), AttnStore("16MiB"), kv_budget=0.2)


def test_a_sparse_model_with_sliding_layers_runs_one_turn_at_a_time(caplog):
    """Its full-attention rows would hold a selection and its sliding rows a window: one row, two lengths."""
    model = make_tiny("gemma3_text")
    assert batchable(model)[0] and not batchable(model, object())[0]
    with ChatPipeline(model, char_tokenizer(), AttnStore("16MiB"), max_batch_size=4, max_new_tokens=3,
                      kv_budget=0.3) as pipe:
        assert pipe.max_batch_size == 1
        assert pipe.chat("s", "hello there", timeout=60).generated_tokens == 3
    assert "sliding-window layers" in caplog.text


def test_batch_memory_reports_the_rows_decoding_now():
    """`ChatPipeline.batch_memory` (and /metrics' attnstore_batch_*): the members and their KV bytes while they
    decode, zeros once the batch is empty."""
    seen = []

    class Probe:
        def __init__(self, pipe):
            self.pipe = pipe

        def put(self, value):
            seen.append(self.pipe.batch_memory())

        def end(self):
            pass

    with ChatPipeline(make_tiny("llama"), char_tokenizer(), AttnStore("64MiB"), max_new_tokens=12,
                      max_batch_size=4) as pipe:
        futures = [pipe.submit(f"s{i}", "hello " * (i + 1), Probe(pipe)) for i in range(4)]
        for f in futures:
            f.result(60)
        assert max(m["rows"] for m in seen) >= 2
        busy = max(seen, key=lambda m: m["live"])
        assert busy["live"] > 0 and busy["allocated"] >= busy["live"]
        pipe.close()
        assert pipe.batch_memory() == {"allocated": 0, "live": 0, "rows": 0}


# -- a memory-bounded batch (max_batch_kv_bytes) --------------------------------------------------------------
def _token_bytes(model) -> int:
    config = model.config
    dim = config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers * 2 * config.num_key_value_heads * dim * 4  # keys and values, fp32


def test_a_memory_bound_batch_admits_what_fits_and_gives_the_solo_tokens():
    """Rows as wide as the widest, with the tokens members may still decode: with room for two of the longest
    rows, the batch never holds more than that (three shorter ones fit); the tokens are the solo ones (a waiting
    turn only starts later)."""
    model = make_tiny("llama")
    prompt = max(len(m[0]) for m in SPARSE_MESSAGES.values()) + 10  # characters and the chat template's tokens
    limit = 2 * (prompt + 8) * _token_bytes(model) + 1
    solo, _ = run_sparse(model, 1, 7, turns=1)
    bound, peak = run_sparse(model, 6, 7, turns=1, max_batch_kv_bytes=limit)
    free, free_peak = run_sparse(model, 6, 7, turns=1)
    assert all(bound[k].generated_ids == r.generated_ids for k, r in solo.items())
    assert free_peak["rows"] == 6 and 2 <= peak["rows"] <= 3
    assert peak["live"] <= limit < free_peak["live"]
    assert peak["allocated"] <= limit < free_peak["allocated"]  # the slabs too: headroom is given up first


def test_sparse_rows_let_more_turns_join_in_the_same_memory():
    model = make_tiny("llama")
    prompt = max(len(m[0]) for m in SPARSE_MESSAGES.values()) + 10
    limit = 2 * (prompt + 8) * _token_bytes(model) + 1
    _, dense = run_sparse(model, 6, 7, turns=1, max_batch_kv_bytes=limit)
    _, sparse = run_sparse(model, 6, 7, turns=1, max_batch_kv_bytes=limit, kv_budget=0.3)
    assert sparse["rows"] > dense["rows"] and sparse["allocated"] <= limit


def test_a_turn_larger_than_the_bound_runs_alone_and_nothing_stalls():
    out, peak = run_sparse(make_tiny("llama"), 6, 5, turns=1, max_batch_kv_bytes=1024)
    assert all(r.generated_tokens == 5 for r in out.values()) and peak["rows"] == 1


def test_max_batch_kv_bytes_is_checked():
    for bad, error in (("lots", ValueError), (0, ValueError), (-5, ValueError), (True, TypeError)):
        with pytest.raises(error, match="max_batch_kv_bytes"):
            ChatPipeline(make_tiny("llama"), char_tokenizer(), AttnStore("16MiB"), max_batch_size=2,
                         max_batch_kv_bytes=bad)
    with pytest.raises(ValueError, match="max_batch_size"):
        ChatPipeline(make_tiny("llama"), char_tokenizer(), AttnStore("16MiB"), max_batch_kv_bytes="1MiB")


def test_a_turn_cancelled_while_it_waits_for_memory_leaves_at_once():
    """Claimed, looked up, waiting first in line for room: its cancel ends it before any prefill (CancelledError,
    as a turn cancelled while queued), and the turns behind it go on."""
    from concurrent.futures import CancelledError

    released = threading.Event()

    class Slow(LogitsProcessor):  # the running turn decodes slowly until the test releases it
        def __call__(self, input_ids, scores):
            released.wait(0.1)
            return scores

    tok = char_tokenizer()
    with ChatPipeline(make_tiny("llama"), tok, AttnStore("64MiB"), max_new_tokens=200, max_batch_size=4,
                      max_batch_kv_bytes=1024, eos_token_id=None) as pipe:
        ids = torch.tensor(tok("hello there " * 3)["input_ids"])
        running = pipe.submit_prompt("a", ids, logits_processor=LogitsProcessorList([Slow()]), max_new_tokens=200)
        cancel = threading.Event()
        waiting = pipe.submit_prompt("b", ids, cancel=cancel)
        behind = pipe.submit_prompt("c", ids[:10], max_new_tokens=3)
        for _ in range(600):
            if pipe.batch_runner.memory_waits:
                break
            threading.Event().wait(0.05)
        assert pipe.batch_runner.memory_waits == 1 and waiting.running()
        cancel.set()
        with pytest.raises(CancelledError):
            waiting.result(10)  # at once: the running turn still holds its row
        assert not running.done()  # (20 s of decoding left)
        released.set()
        assert running.result(60).generated_tokens == 200 and behind.result(60).generated_tokens == 3
        assert pipe.store.token_ids("b", AttnStoreCache.fingerprint_of(pipe.model, pipe.store)) is None


def test_a_prompt_prefilled_in_chunks_joins_within_the_bound():
    """The running rows grow a column per iteration while a joining prompt is prefilled in chunks: the fit counts
    those columns, so the slabs stay within the bound when it joins."""
    model = make_tiny("llama")
    bound = 330 * _token_bytes(model)
    g = torch.Generator().manual_seed(0)
    with ChatPipeline(model, char_tokenizer(), AttnStore("64MiB"), max_new_tokens=60, max_batch_size=2,
                      max_batch_tokens=5, max_batch_kv_bytes=bound, eos_token_id=None) as pipe:
        first = pipe.submit_prompt("a", torch.randint(10, 100, (100,), generator=g))
        second = pipe.submit_prompt("b", torch.randint(10, 100, (90,), generator=g))
        assert first.result(60).generated_tokens == second.result(60).generated_tokens == 60
        assert pipe.batch_runner.peak["allocated"] <= bound


def test_a_failure_of_the_loop_leaves_no_stale_batch_memory(monkeypatch):
    from hf_attnstore.serving.batching import BatchRunner

    settle, calls = BatchRunner._settle, []

    def failing(self):
        calls.append(1)
        if len(calls) == 2:  # members are in the batch cache by now
            raise RuntimeError("injected")
        return settle(self)

    monkeypatch.setattr(BatchRunner, "_settle", failing)
    with ChatPipeline(make_tiny("llama"), char_tokenizer(), AttnStore("64MiB"), max_new_tokens=4,
                      max_batch_size=4) as pipe:
        futures = [pipe.submit(f"s{i}", "hello " * (i + 1)) for i in range(3)]
        outcomes = []
        for f in futures:
            try:
                outcomes.append(f.result(60).generated_tokens)
            except RuntimeError as exc:
                outcomes.append(str(exc))
        assert "injected" in outcomes
        assert pipe.batch_memory() == {"allocated": 0, "live": 0, "rows": 0}
        assert pipe.chat("after", "still serving", timeout=60).generated_tokens == 4
