"""No turn can stop the pipeline's worker: an exception from one member fails that member's turn, the other
members of its batch finish with their own tokens, and later turns run (batch runner and solo worker).

Regression tests for an adversarial run's fault: a huge `max_new_tokens` made `BatchKV.admit` fail, the
exception escaped the runner loop, and every later turn waited forever.
"""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

import hf_attnstore.serving.batching as batching
from hf_attnstore import AttnStore
from hf_attnstore.serving.pipeline import ChatPipeline

from ..conftest import char_tokenizer, make_tiny

WAIT = 30  # a turn that would never finish fails the test in seconds
BAD = 77  # the first prompt token of the turn a test makes fail


def prompt(first: int, n: int) -> torch.Tensor:
    return torch.cat([torch.tensor([first]), torch.arange(n - 1) % 60 + 10])


def solo_ids(model, prompts: dict, **options) -> dict:
    with ChatPipeline(model, char_tokenizer(), AttnStore("16MiB"), max_batch_size=1, eos_token_id=None,
                      **options) as pipe:
        return {s: pipe.submit_prompt(s, p).result(WAIT).generated_ids for s, p in prompts.items()}


class FailOne(LogitsProcessor):
    """Raises when the turn whose prompt starts with BAD chooses its `at`-th token."""

    def __init__(self, at: int, prompt_len: int):
        self.at, self.prompt_len, self.raised = at, prompt_len, 0

    def __call__(self, input_ids, scores):
        seq = input_ids[0]
        if int(seq[0]) == BAD and seq.shape[0] - self.prompt_len == self.at - 1:
            self.raised += 1
            raise RuntimeError("injected failure of one member")
        return scores


def test_one_members_failing_token_choice_fails_only_that_member():
    model = make_tiny("llama")
    prompts = {"good1": prompt(20, 12), "bad": prompt(BAD, 15), "good2": prompt(30, 9)}
    expected = solo_ids(model, {s: p for s, p in prompts.items() if s != "bad"}, max_new_tokens=8)
    fail = FailOne(at=3, prompt_len=15)
    with ChatPipeline(model, char_tokenizer(), AttnStore("16MiB"), max_new_tokens=8, max_batch_size=4,
                      eos_token_id=None, logits_processor=LogitsProcessorList([fail])) as pipe:
        with pipe._cond:  # all three join the same batch
            futures = {s: pipe.submit_prompt(s, p) for s, p in prompts.items()}
        with pytest.raises(RuntimeError, match="injected"):
            futures["bad"].result(WAIT)
        for s in ("good1", "good2"):
            assert futures[s].result(WAIT).generated_ids == expected[s], s
        assert fail.raised == 1
        assert pipe.submit_prompt("later", prompt(40, 10)).result(WAIT).generated_tokens == 8


def test_a_member_that_cannot_join_the_batch_cache_fails_alone(monkeypatch):
    """The batch cache cannot be (re)allocated for one joiner (what a huge reply length did): that joiner
    fails, the members already decoding and the one joining with it finish, later turns run."""
    real = batching.BatchKV.admit

    def admit(self, kvs, rows, room, max_bytes=None):
        if any(kv[0][0].shape[2] == 23 for kv in kvs):  # the "bad" prompt's length
            raise MemoryError("injected: no memory for the batch cache")
        return real(self, kvs, rows, room, max_bytes)

    monkeypatch.setattr(batching.BatchKV, "admit", admit)
    model = make_tiny("llama")
    prompts = {"running": prompt(20, 11), "bad": prompt(21, 23), "with-bad": prompt(22, 17)}
    expected = solo_ids(model, {s: p for s, p in prompts.items() if s != "bad"}, max_new_tokens=6)
    gate = threading.Event()

    class Hold(LogitsProcessor):  # "running" decodes alone until the two others are queued
        def __call__(self, input_ids, scores):
            assert gate.wait(WAIT)
            return scores

    with ChatPipeline(model, char_tokenizer(), AttnStore("16MiB"), max_new_tokens=6, max_batch_size=4,
                      eos_token_id=None, logits_processor=LogitsProcessorList([Hold()])) as pipe:
        running = pipe.submit_prompt("running", prompts["running"])
        with pipe._cond:
            bad = pipe.submit_prompt("bad", prompts["bad"])
            with_bad = pipe.submit_prompt("with-bad", prompts["with-bad"])
        gate.set()
        with pytest.raises(MemoryError, match="injected"):
            bad.result(WAIT)
        assert running.result(WAIT).generated_ids == expected["running"]
        assert with_bad.result(WAIT).generated_ids == expected["with-bad"]
        assert pipe.submit_prompt("later", prompt(40, 10)).result(WAIT).generated_tokens == 6
        assert pipe._worker.is_alive()


class Broken:
    """A client's streamer that fails: on its first token, and again when it is ended."""

    def __init__(self):
        self.puts = 0

    def put(self, value):
        self.puts += 1
        if self.puts > 1:  # the prompt, then the first token
            raise ConnectionError("the client's stream is broken")

    def end(self):
        raise ConnectionError("the client's stream is broken (end)")


@pytest.mark.parametrize("batch", [1, 4])
def test_a_streamer_that_raises_fails_its_turn_and_the_worker_goes_on(batch):
    model = make_tiny("llama")
    with ChatPipeline(model, char_tokenizer(), AttnStore("16MiB"), max_new_tokens=5, max_batch_size=batch,
                      eos_token_id=None) as pipe:
        with pipe._cond:
            broken = pipe.submit_prompt("broken", prompt(20, 12), Broken())
            other = pipe.submit_prompt("other", prompt(30, 14))
        with pytest.raises(ConnectionError):
            broken.result(WAIT)
        assert other.result(WAIT).generated_tokens == 5
        assert pipe.submit_prompt("later", prompt(40, 10)).result(WAIT).generated_tokens == 5


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("huge", [10**12, 2**63])
def test_a_huge_max_new_tokens_is_cut_where_the_models_positions_end(batch, huge):
    """The pipeline clamps a turn's reply to the model's positions (max_position_embeddings 512 here): a
    500-token prompt gets 12 tokens, whatever it asked, and the batch cache is sized for those."""
    for arch in ("llama", "gpt2"):  # gpt2: absolute positions, where a reply past them would not even run
        model = make_tiny(arch)
        with ChatPipeline(model, char_tokenizer(), AttnStore("16MiB"), max_batch_size=batch,
                          eos_token_id=None) as pipe:
            assert pipe.position_limit == 512 and pipe.max_reply_tokens == 512 - 4 - 1
            reply = pipe.submit_prompt("huge", prompt(20, 500), max_new_tokens=huge).result(WAIT)
            assert reply.generated_tokens == reply.max_new_tokens == 12, arch
            assert pipe.submit_prompt("later", prompt(40, 10), max_new_tokens=3).result(WAIT).generated_tokens == 3


def test_per_turn_max_new_tokens_must_be_a_positive_integer():
    with ChatPipeline(make_tiny("llama"), char_tokenizer(), None, max_batch_size=4) as pipe:
        for bad in (0, -1, 2.5, "5", True, None):
            with pytest.raises(ValueError, match="max_new_tokens"):
                pipe.submit_prompt("s", prompt(20, 5), max_new_tokens=bad)


def test_a_closed_pipeline_refuses_turns_with_pipeline_closed():
    from hf_attnstore.serving.pipeline import PipelineClosed

    pipe = ChatPipeline(make_tiny("llama"), char_tokenizer(), None)
    pipe.close(timeout=60)
    with pytest.raises(PipelineClosed, match="closed"):
        pipe.submit_prompt("s", prompt(20, 5))
    with pytest.raises(ValueError):  # still a ValueError, as before (and as a closed file's)
        pipe.submit("s", "hello")


def test_a_failing_look_ahead_hint_at_submit_does_not_fail_the_submit(monkeypatch, caplog):
    store = AttnStore("16MiB")
    with ChatPipeline(make_tiny("llama"), char_tokenizer(), store, max_new_tokens=3, eos_token_id=None) as pipe:
        def broken(*args, **kwargs):
            raise OSError("the remote tier is down")

        monkeypatch.setattr(store, "prefetch", broken)
        futures = [pipe.submit_prompt(f"s{i}", prompt(20 + i, 8)) for i in range(3)]
        assert [f.result(WAIT).generated_tokens for f in futures] == [3, 3, 3]
    assert "look-ahead hints failed" in caplog.text


def test_a_failure_of_the_batch_loop_itself_fails_the_turns_in_flight_and_the_loop_goes_on(monkeypatch):
    real = batching.BatchRunner._settle
    calls = {"n": 0}

    def settle(self):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected: a bug in settling the batch")
        return real(self)

    monkeypatch.setattr(batching.BatchRunner, "_settle", settle)
    with ChatPipeline(make_tiny("llama"), char_tokenizer(), AttnStore("16MiB"), max_new_tokens=4, max_batch_size=4,
                      eos_token_id=None) as pipe:
        with pipe._cond:
            first = [pipe.submit_prompt(f"s{i}", prompt(20 + i, 10 + i)) for i in range(2)]
        for f in first:
            with pytest.raises(RuntimeError, match="injected"):
                f.result(WAIT)
        assert pipe.submit_prompt("later", prompt(40, 10)).result(WAIT).generated_tokens == 4
        assert pipe.submit_prompt("s0", prompt(20, 10)).result(WAIT).generated_tokens == 4  # its session is free


def test_an_admission_that_fails_half_way_is_undone():
    from hf_attnstore.serving.batch_cache import BatchKV

    def kv(length, value, heads=2):
        return [(torch.full((1, heads, length, 4), float(value)), torch.full((1, heads, length, 4), -float(value)))] * 3

    cache = BatchKV()
    cache.admit([kv(5, 1)], rows=4, room=4)
    with pytest.raises(RuntimeError):  # the second joiner's KV does not fit its row (3 heads): written half-way
        cache.admit([kv(4, 2), kv(6, 3, heads=3)], rows=4, room=4)
    cache.keep_rows(1)
    assert cache.rows == 1 and len(cache.first) == 1
    cache.admit([kv(3, 4)], rows=4, room=4)
    for b, (length, value) in enumerate(((5, 1), (3, 4))):
        for layer in cache.layers:
            assert cache.width - cache.pad(b) == length
            assert torch.all(layer.keys[b, :, cache.pad(b):] == value)
            assert torch.all(layer.keys[b, :, : cache.pad(b)] == 0)
