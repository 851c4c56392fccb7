"""ChatPipeline: queueing, look-ahead hints, correctness against recomputation, bad input."""

from __future__ import annotations

import shutil
import threading

import pytest
import torch
from transformers import DynamicCache, PreTrainedTokenizerFast
from tokenizers import Regex, Tokenizer, models, pre_tokenizers

from hf_attnstore import AttnStore, AttnStoreCache
from hf_attnstore.serving.pipeline import ChatPipeline

from ..conftest import VOCAB, make_tiny
from hf_attnstore.cache.upstream import cache_kwargs

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def tiny_tokenizer():
    """A word-level tokenizer over a 128-id vocabulary with a chat template (no download)."""
    specials = ["<pad>", "<s>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]
    words = [f"w{i}" for i in range(VOCAB - len(specials) - 1)]
    vocab = {t: i for i, t in enumerate(specials + words + ["<unk>"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\s+"), behavior="removed")  # special tokens split first
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<|end|>",
                                   additional_special_tokens=specials[2:])
    fast.chat_template = TEMPLATE
    return fast


def words(seed: int, n: int = 6) -> str:
    g = torch.Generator().manual_seed(seed)
    return " ".join(f"w{int(i)}" for i in torch.randint(0, 100, (n,), generator=g))


@pytest.fixture
def setup():
    model, tok = make_tiny("llama"), tiny_tokenizer()
    return model, tok


def test_turns_equal_recomputation(setup):
    model, tok = setup
    with ChatPipeline(model, tok, AttnStore(host_bytes="64MiB"), max_new_tokens=6, eos_token_id=None) as pipe:
        ids = None
        for turn in range(3):
            reply = pipe.chat("a", words(turn), timeout=60)
            ids = pipe.chat_tokens.first_turn(words(turn)) if ids is None else pipe.chat_tokens.next_turn(ids, words(turn))
            ref = model.generate(ids, **cache_kwargs(DynamicCache()), max_new_tokens=6, do_sample=False,
                                 pad_token_id=0, eos_token_id=None)
            assert reply.text == tok.decode(ref[0, ids.shape[1]:], skip_special_tokens=True)
            assert reply.generated_tokens == 6 and reply.history_tokens == ids.shape[1]
            assert reply.kv_source == ("miss" if turn == 0 else "host")
            assert reply.reused_tokens + reply.prefilled_tokens == reply.history_tokens
            ids = ref


def test_without_a_store_every_turn_is_recomputed_with_token_truncation(setup):
    model, tok = setup
    kwargs = dict(max_new_tokens=6, eos_token_id=None, context_window=40, keep_first=2)
    with ChatPipeline(model, tok, None, **kwargs) as re, \
            ChatPipeline(model, tok, AttnStore(host_bytes="64MiB"), truncation="recompute", **kwargs) as ref:
        for turn in range(5):
            a, b = re.chat("s", words(turn), timeout=60), ref.chat("s", words(turn), timeout=60)
            assert a.text == b.text and a.history_tokens == b.history_tokens
            assert a.reused_tokens == 0 and a.kv_source in ("recompute", "truncated")
            assert a.dropped_tokens == b.dropped_tokens and a.queued_s >= 0
        assert a.dropped_tokens > 0  # the window overflowed on the way
        assert re.session_stats("s")["tier"] is None
        re.reset("s")


def test_given_replies_are_read_exactly_and_equal_recomputation(setup):
    """A turn with a given reply leaves the session as if it had generated it; greedy_ids is the argmax at
    every reply position, the same with reuse, without a store, and by one forward over the whole turn."""
    model, tok = setup
    kwargs = dict(context_window=60, keep_first=2)
    with ChatPipeline(model, tok, AttnStore(host_bytes="64MiB"), **kwargs) as pipe, \
            ChatPipeline(model, tok, None, **kwargs) as re:
        ids = None
        for turn in range(3):
            a = pipe.submit("s", words(turn), reply=words(50 + turn, 5)).result(60)
            b = re.submit("s", words(turn), reply=words(50 + turn, 5)).result(60)
            ids = pipe.chat_tokens.first_turn(words(turn)) if ids is None else pipe.chat_tokens.next_turn(ids, words(turn))
            reply = pipe.chat_tokens.reply_ids(words(50 + turn, 5))
            assert reply.shape[1] == 6  # five words and the end-of-turn token
            full = torch.cat([ids, reply], dim=1)
            logits = model(full).logits[0, ids.shape[1] - 1 : -1]
            assert a.greedy_ids == b.greedy_ids == tuple(logits.argmax(-1).tolist())
            assert a.text == words(50 + turn, 5) and a.generated_tokens == 6 and a.dropped_tokens == 0
            assert a.tier == ("miss" if turn == 0 else "host") and b.tier is None
            assert a.reused_tokens == (0 if turn == 0 else ids.shape[1] - len(pipe.chat_tokens.message_ids(words(turn))))
            assert 0 < a.ttft_s <= a.total_s
            assert pipe.session_stats("s")["tokens"] == full.shape[1]
            ids = full
        # The whole turn, reply included, is in the store: the next turn reuses all of it.
        stored = pipe.store.token_ids("s", AttnStoreCache.fingerprint_of(model))
        assert torch.equal(stored.view(-1), ids.view(-1))


def test_a_given_reply_needs_text_and_no_streamer(setup):
    with ChatPipeline(*setup, None) as pipe:
        with pytest.raises(ValueError, match="reply"):
            pipe.submit("s", "w1 w2", reply=3)
        with pytest.raises(ValueError, match="stream"):
            pipe.submit("s", "w1 w2", reply="w3", streamer=object())
        assert pipe.submit("s", "w1 w2", reply="").result(60).generated_tokens == 1  # just the end of turn


def test_prefetch_fetches_the_window_before_the_jobs_run(setup, tmp_path):
    model, tok = setup
    store = AttnStore(host_bytes="64MiB", disk_dir=str(tmp_path), fsync=False, idle_flush_s=0.05)
    with ChatPipeline(model, tok, store, max_new_tokens=3, eos_token_id=None, prefetch_window=2) as pipe:
        for sid in "ABCD":
            pipe.chat(sid, words(1), timeout=60)
        store.flush()
        for sid in "BCD":
            store.evict(sid)
        store.flush()
        assert [store.tier_of(s, model_fp(pipe)) for s in "ABCD"] == ["host", "disk", "disk", "disk"]
        # Hold the worker on A's turn so B, C and D are queued behind it.
        gate, started = threading.Event(), threading.Event()
        original = pipe.run_turn

        def held(job):
            if job.session_id == "A":
                started.set()
                assert gate.wait(30)
            return original(job)

        pipe.run_turn = held
        futures = [pipe.submit(s, words(2)) for s in "ABCD"]
        assert started.wait(30)
        # The hints were given when A started with [B, C, D] waiting: B and C (the window) are fetched.
        for _ in range(200):
            if store.stats().loads_in_flight == 0:
                break
            threading.Event().wait(0.01)
        assert [store.tier_of(s, model_fp(pipe)) for s in "BCD"] == ["host", "host", "disk"]
        gate.set()
        replies = [f.result(60) for f in futures]
        assert [r.kv_source for r in replies[1:3]] == ["host", "host"]
    store.close()


def model_fp(pipe):
    from hf_attnstore import AttnStoreCache

    return AttnStoreCache.fingerprint_of(pipe.model)


def test_turns_of_a_session_run_in_submission_order(setup):
    model, tok = setup
    with ChatPipeline(model, tok, AttnStore(host_bytes="64MiB"), max_new_tokens=2, eos_token_id=None) as pipe:
        futures = [pipe.submit("s", words(i)) for i in range(5)]
        replies = [f.result(60) for f in futures]
        lengths = [r.history_tokens for r in replies]
        assert lengths == sorted(lengths) and len(set(lengths)) == 5
        # Everything before reuses: replies cut by max_new_tokens have their last token fed (and stored) too.
        assert all(r.reused_tokens == prev.history_tokens + prev.generated_tokens
                   for prev, r in zip(replies, replies[1:]))


def test_streaming(setup):
    model, tok = setup
    with ChatPipeline(model, tok, AttnStore(host_bytes="64MiB"), max_new_tokens=4, eos_token_id=None) as pipe:
        chunks, future = pipe.stream("s", words(3))
        text = "".join(chunks)
        assert text.strip() == future.result(60).text.strip()


class TestBadInput:
    def test_empty_message(self, setup):
        with ChatPipeline(*setup, AttnStore()) as pipe:
            for bad in ("", "   ", None):
                with pytest.raises(ValueError, match="message"):
                    pipe.submit("s", bad)

    def test_unknown_session_stats(self, setup):
        with ChatPipeline(*setup, AttnStore()) as pipe:
            with pytest.raises(KeyError, match="unknown session"):
                pipe.session_stats("nobody")

    def test_message_longer_than_the_window(self, setup):
        model, tok = setup
        with ChatPipeline(model, tok, AttnStore(), context_window=16, max_new_tokens=2, eos_token_id=None) as pipe:
            pipe.chat("other", words(1, 3), timeout=60)
            with pytest.raises(ValueError, match="fit the context window"):
                pipe.submit("s", words(2, 40))
            assert pipe.session_stats("other")["tokens"] > 0  # nothing lost elsewhere

    def test_a_failing_turn_reaches_the_caller_and_keeps_the_history(self, setup):
        model, tok = setup
        with ChatPipeline(model, tok, AttnStore(), max_new_tokens=2, eos_token_id=None) as pipe:
            pipe.chat("s", words(1), timeout=60)
            before = pipe.session_stats("s")["tokens"]
            original = model.generate

            def boom(*args, **kwargs):
                raise RuntimeError("injected")

            model.generate = boom
            try:
                with pytest.raises(RuntimeError, match="injected"):
                    pipe.chat("s", words(2), timeout=60)
            finally:
                model.generate = original
            assert pipe.session_stats("s")["tokens"] == before
            assert pipe.chat("s", words(3), timeout=60).reused_tokens > 0  # the session goes on

    def test_bad_options(self, setup):
        with pytest.raises(ValueError, match="prefetch_window"):
            ChatPipeline(*setup, AttnStore(), prefetch_window=-1)
        with pytest.raises(ValueError, match="max_new_tokens"):
            ChatPipeline(*setup, AttnStore(), max_new_tokens=0)


def test_a_new_pipeline_resumes_sessions_from_the_disk_tier(setup, tmp_path):
    model, tok = setup
    with AttnStore(host_bytes="64MiB", disk_dir=str(tmp_path), fsync=False) as store:
        with ChatPipeline(model, tok, store, max_new_tokens=4, eos_token_id=None) as pipe:
            pipe.chat("a", words(1), timeout=60)
            pipe.chat("a", words(2), timeout=60)
    with AttnStore(host_bytes="64MiB", disk_dir=str(tmp_path), fsync=False) as store:
        stored = store.token_ids("a", model_fp_of(model))
        with ChatPipeline(model, tok, store, max_new_tokens=4, eos_token_id=None, prefetch_window=0) as pipe:
            reply = pipe.chat("a", words(3), timeout=60)
        assert reply.kv_source == "disk" and reply.reused_tokens == stored.numel()
        assert store.stats().bytes_read > 0 and store.stats().hits_disk == 1


def test_a_cancelled_request_is_skipped_and_the_worker_goes_on(setup):
    model, tok = setup
    with ChatPipeline(model, tok, AttnStore(host_bytes="64MiB"), max_new_tokens=3, eos_token_id=None) as pipe:
        gate, original = threading.Event(), model.generate

        def slow(*args, **kwargs):  # holds the worker on the first turn while we cancel the second
            assert gate.wait(60)
            return original(*args, **kwargs)

        model.generate = slow
        try:
            first = pipe.submit("a", words(1))
            second = pipe.submit("b", words(2))
            assert second.cancel()
            gate.set()
            assert first.result(60).generated_tokens == 3
        finally:
            model.generate = original
        assert second.cancelled()
        assert pipe.chat("c", words(3), timeout=60).generated_tokens == 3  # the worker is alive
        with pytest.raises(KeyError):
            pipe.session_stats("b")  # the cancelled turn never ran


def test_a_pad_token_inside_messages_and_replies_is_just_a_token(setup):
    """The tokenizer's pad id differs from eos; a `<pad>` typed in a message, or read in a reply, is content."""
    model, tok = setup
    assert tok.pad_token_id != tok.eos_token_id
    messages = [words(1) + " <pad> " + words(2), words(3), "<pad> " + words(4)]
    with ChatPipeline(model, tok, AttnStore(host_bytes="64MiB"), max_new_tokens=4, eos_token_id=None) as pipe, \
            ChatPipeline(model, tok, None, max_new_tokens=4, eos_token_id=None) as reference:
        pipe.chat("s", messages[0], timeout=60)
        reference.chat("s", messages[0], timeout=60)
        pipe.submit("s", words(5), reply="w1 <pad> w2").result(60)
        reference.submit("s", words(5), reply="w1 <pad> w2").result(60)
        for message in messages[1:]:
            got, want = pipe.chat("s", message, timeout=60), reference.chat("s", message, timeout=60)
            assert got.reused_tokens > 0 and got.text == want.text


def model_fp_of(model):
    from hf_attnstore import AttnStoreCache

    return AttnStoreCache.fingerprint_of(model)


def test_a_lossy_store_keeps_chatting_sessions_encoded_between_turns(setup, tmp_path):
    """With kv_codec, the save after each turn leaves the session's whole chunks encoded in host memory (the
    disk copy's blobs); the next turn resumes from them and the replies match a store that keeps host memory
    exact, turn after turn, within the codec's error (here: the same greedy tokens)."""
    model, tok = setup
    replies, encoded = {}, {}
    for host in (True, False):
        with AttnStore(host_bytes="64MiB", disk_dir=str(tmp_path / str(host)), fsync=False, chunk_tokens=8,
                       kv_codec="int8", kv_codec_host=host) as store:
            with ChatPipeline(model, tok, store, max_new_tokens=4, eos_token_id=None) as pipe:
                replies[host] = []
                for turn in range(4):
                    reply = pipe.chat("a", words(turn, 12), timeout=60)
                    replies[host].append(reply.text)
                    assert reply.kv_source == ("miss" if turn == 0 else "host")
                    store.flush()
            encoded[host] = store.stats().host_encoded_tokens
    assert encoded[False] == 0 and encoded[True] >= 3 * 8
    assert replies[True] == replies[False]


def test_a_recomputed_head_is_reported_as_prefilled_not_cached(setup, tmp_path):
    """`recompute_by_cost` (here a slow disk tier): the batch runner's prefetch of a turn about to run is decided by
    cost as the turn's own lookup would be, the turn recomputes the leading chunks left out, and its reply counts
    them as prefilled, not reused (the usage's cached tokens); its text is that of loading everything."""
    model, tok = setup
    options = dict(host_bytes="64MiB", chunk_tokens=8, fsync=False, idle_flush_s=0.05)
    with ChatPipeline(model, tok, AttnStore(disk_dir=str(tmp_path / "first"), **options), max_new_tokens=6,
                      eos_token_id=None) as pipe:
        pipe.chat("a", words(0, 30), timeout=60)
        pipe.store.close()
    replies, heads = {}, {}
    for by_cost in (False, True):  # a restarted server: the session is on disk only
        shutil.copytree(tmp_path / "first", tmp_path / str(by_cost))
        store = AttnStore(disk_dir=str(tmp_path / str(by_cost)), recompute_by_cost=by_cost, **options)
        store.costs.observe_load("disk", 1, 1000.0)
        store.costs.observe_prefill(AttnStoreCache.fingerprint_of(model, store), 0, 10**6, 1e-3)
        with ChatPipeline(model, tok, store, max_new_tokens=6, eos_token_id=None) as pipe:
            replies[by_cost] = pipe.chat("a", words(1), timeout=60)
        heads[by_cost] = store.stats().resume_recomputed_tokens
        store.close()
    assert heads[False] == 0 and heads[True] > 0
    off, on = replies[False], replies[True]
    assert off.reused_tokens > 0 and on.text == off.text and on.history_tokens == off.history_tokens
    assert on.reused_tokens == off.reused_tokens - heads[True] and on.prefilled_tokens == off.prefilled_tokens + heads[True]


@pytest.mark.parametrize("batch", [1, 2])
def test_every_turn_of_a_restarted_server_is_decided_by_cost(setup, tmp_path, batch):
    """One turn at a time or batched, each turn's load is decided by cost (the worker's slot frees after each turn,
    so the next submitted turn's prefetch is its own); and a turn truncated inside the recomputed head reports
    only the kept tokens it recomputed, never a negative count."""
    model, tok = setup
    options = dict(host_bytes="64MiB", chunk_tokens=8, fsync=False, idle_flush_s=0.05)
    with ChatPipeline(model, tok, AttnStore(disk_dir=str(tmp_path / "first"), **options), max_new_tokens=6,
                      eos_token_id=None) as pipe:
        for session in "abc":
            pipe.chat(session, words(0, 30), timeout=60)
        pipe.store.close()
    store = AttnStore(disk_dir=str(tmp_path / "first"), recompute_by_cost=True, **options)
    store.costs.observe_load("disk", 1, 1000.0)
    store.costs.observe_prefill(AttnStoreCache.fingerprint_of(model, store), 0, 10**6, 1e-3)
    with ChatPipeline(model, tok, store, max_new_tokens=6, eos_token_id=None, max_batch_size=batch,
                      context_window=44) as pipe:
        for n, session in enumerate("abc", start=1):
            reply = pipe.chat(session, words(1), timeout=60)
            assert store.stats().resume_decisions == n and reply.dropped_tokens > 0
            assert 0 <= reply.reused_tokens and reply.reused_tokens + reply.prefilled_tokens == reply.history_tokens
    store.close()
