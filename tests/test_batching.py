"""Continuous batching: every session in a batch produces the tokens it produces alone (fp32), the store ends
up as after solo turns, and turns join, leave, stream, cancel and fail independently."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from hf_attnstore import AttnStore
from hf_attnstore.batching import batchable
from hf_attnstore.pipeline import ChatPipeline

from .conftest import char_tokenizer, make_tiny

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
        # The store holds what a solo turn stores: the next turn reuses exactly as much.
        assert batched[key].reused_tokens == alone.reused_tokens, key
        assert batched[key].kv_source == alone.kv_source, key


def test_sliding_window_models_run_one_turn_at_a_time(caplog):
    model = make_tiny("mistral")
    assert not batchable(model)[0]
    with ChatPipeline(model, char_tokenizer(), AttnStore("16MiB"), max_batch_size=4) as pipe:
        assert pipe.max_batch_size == 1
        assert pipe.chat("s", "hi", timeout=60).generated_tokens > 0
    assert "one at a time" in caplog.text


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
