"""Speculative decoding through an AttnStoreCache (cache/speculative.py): assisted generation (`assistant_model`) and
prompt lookup (`prompt_lookup_num_tokens`) on resumed sessions give plain greedy's tokens, reuse the session, and
leave in the store exactly the tokens the model kept (none of the rejected drafts); modes that cannot roll the
session back are refused before any forward."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from hf_attnstore import AttnStore, AttnStoreCache
from hf_attnstore.cache.upstream import cache_kwargs

from ..conftest import make_tiny, random_ids

GREEDY = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
FAST = dict(fsync=False, idle_flush_s=0.05, io_timeout_s=10, chunk_tokens=16)


def _drafting(mode: str, arch: str) -> dict:
    """`generate` options of a speculative mode: a draft model sharing the vocabulary (another random init), the
    model's own first layer (early exit), or prompt lookup (n-grams of the prompt, which repeats itself): drafts are
    proposed, and most are rejected."""
    if mode == "assistant":
        return dict(assistant_model=make_tiny(arch, seed=1))
    if mode == "early_exit":
        return dict(assistant_early_exit=1)
    return dict(prompt_lookup_num_tokens=3)


def _prompt(n: int, seed: int) -> torch.Tensor:
    """A prompt that repeats a short random phrase, so that prompt lookup finds n-grams to draft from."""
    phrase = random_ids(6, seed)
    return phrase.repeat(1, n // 6 + 1)[:, :n]


def _generate(model, cache_or_none, ids, new_tokens, **extra):
    cache = cache_or_none if cache_or_none is not None else DynamicCache(config=model.config)
    return model.generate(ids, attention_mask=torch.ones_like(ids), **cache_kwargs(cache), max_new_tokens=new_tokens,
                          **GREEDY, **extra)


def _count_rejections(cache) -> list[int]:
    """Records how many drafted tokens each `crop` of `cache` rejects (generate calls it on the cache it returns)."""
    rejected, crop = [], cache.crop

    def counting(tokens_to_remove: int) -> None:
        rejected.append(-tokens_to_remove)
        crop(tokens_to_remove)

    cache.crop = counting
    return rejected


# Full attention; a sliding window shorter than the chat; multi-head latent attention (one mode: it is slow).
@pytest.mark.parametrize("mode, arch", [(mode, arch) for arch in ("llama", "mistral")
                                        for mode in ("assistant", "prompt_lookup", "early_exit")]
                         + [("assistant", "deepseek_v3")])
def test_speculative_decoding_resumes_a_session_as_plain_greedy(mode, arch):
    model, store = make_tiny(arch), AttnStore(host_bytes="64MiB")
    first = AttnStoreCache(model, store, "s", _prompt(30, 1))
    history = _generate(model, first, first.input_ids, 6)
    first.close()
    prompt = torch.cat([history, _prompt(12, 2)], dim=1)

    cache = AttnStoreCache(model, store, "s", prompt)
    rejected = _count_rejections(cache)
    out = _generate(model, cache, cache.input_ids, 12, **_drafting(mode, arch))
    assert cache.reused_tokens == history.shape[1] - 1  # all the first turn fed the model
    assert torch.equal(out, _generate(model, None, prompt, 12))  # recomputation
    plain = AttnStoreCache(model, AttnStore(host_bytes="64MiB"), "p", prompt)
    assert torch.equal(out, _generate(model, plain, prompt, 12))  # plain greedy
    assert sum(rejected) > 0  # drafts were rejected, and cropped from the cache
    # The store holds what the model kept: everything fed to it (the last token was never fed).
    assert torch.equal(store.token_ids("s", cache.fingerprint), out[0, :-1])
    assert cache.get_seq_length() == out.shape[1] - 1 and torch.equal(cache.token_ids, out[0, :-1])
    assert cache.saved_tokens == out.shape[1] - 1 - cache.reused_tokens
    cache.close()

    # A third turn resumes every kept token, with recomputation's output.
    third = torch.cat([out, random_ids(4, 3)], dim=1)
    cache = AttnStoreCache(model, store, "s", third)
    assert cache.reused_tokens == out.shape[1] - 1
    assert torch.equal(_generate(model, cache, cache.input_ids, 6), _generate(model, None, third, 6))


@pytest.mark.parametrize("mode", ["assistant", "prompt_lookup"])
def test_speculative_decoding_resumes_a_session_from_disk(tmp_path, mode):
    model = make_tiny("llama")
    with AttnStore(host_bytes="16MiB", disk_dir=str(tmp_path), **FAST) as store:
        first = AttnStoreCache(model, store, "s", _prompt(40, 4))
        history = _generate(model, first, first.input_ids, 5)
        first.close()
        store.flush()
        store.evict("s")
        prompt = torch.cat([history, _prompt(10, 5)], dim=1)
        cache = AttnStoreCache(model, store, "s", prompt)
        assert cache.kv_source == "disk" and cache.reused_tokens == history.shape[1] - 1
        out = _generate(model, cache, cache.input_ids, 10, **_drafting(mode, "llama"))
        assert torch.equal(out, _generate(model, None, prompt, 10))
        cache.close()
        store.flush()
        store.evict("s")
        assert torch.equal(store.token_ids("s", cache.fingerprint), out[0, :-1])
        third = torch.cat([out, random_ids(3, 6)], dim=1)
        cache = AttnStoreCache(model, store, "s", third)
        assert cache.kv_source == "disk" and cache.reused_tokens == out.shape[1] - 1
        assert torch.equal(_generate(model, cache, cache.input_ids, 5), _generate(model, None, third, 5))


def test_speculative_decoding_of_a_truncated_session():
    """A turn whose context overflowed feeds the truncated prompt: drafts continue its positions."""
    model, store = make_tiny("llama"), AttnStore(host_bytes="64MiB")
    first = AttnStoreCache(model, store, "s", _prompt(50, 7), context_window=64)
    history = _generate(model, first, first.input_ids, 6)
    first.close()
    prompt = torch.cat([history, _prompt(12, 8)], dim=1)
    cache = AttnStoreCache(model, store, "s", prompt, context_window=64)
    plain = AttnStoreCache(model, AttnStore(host_bytes="64MiB"), "s", prompt, context_window=64)
    assert cache.dropped_tokens > 0 and cache.reused_tokens > 0
    out = _generate(model, cache, cache.input_ids, 8, prompt_lookup_num_tokens=3)
    assert torch.equal(out, _generate(model, plain, plain.input_ids, 8))
    assert torch.equal(store.token_ids("s", cache.fingerprint), out[0, :-1])


def test_speculative_decoding_of_a_hybrid_keeps_its_states_with_the_kept_tokens():
    """lfm2's convolution states roll back with `crop` (transformers refuses models with recurrent states): the
    states stored at the turn's end belong to the kept tokens, so the next turn reuses them."""
    model, store = make_tiny("lfm2"), AttnStore(host_bytes="64MiB")
    first = AttnStoreCache(model, store, "s", _prompt(24, 9))
    history = _generate(model, first, first.input_ids, 5)
    first.close()
    prompt = torch.cat([history, _prompt(8, 10)], dim=1)
    cache = AttnStoreCache(model, store, "s", prompt)
    rejected = _count_rejections(cache)
    out = _generate(model, cache, cache.input_ids, 10, prompt_lookup_num_tokens=3)
    assert cache.reused_tokens == history.shape[1] - 1 and sum(rejected) > 0
    assert torch.equal(out, _generate(model, None, prompt, 10))
    cache.close()
    third = torch.cat([out, random_ids(3, 11)], dim=1)
    cache = AttnStoreCache(model, store, "s", third)
    assert cache.reused_tokens == out.shape[1] - 1
    assert torch.equal(_generate(model, cache, cache.input_ids, 5), _generate(model, None, third, 5))


@pytest.mark.parametrize("options, named", [
    (dict(kv_budget=0.5), "`kv_budget`"),
    (dict(truncation="importance", context_window=64), "`truncation=\"importance\"`"),
])
@pytest.mark.parametrize("mode", ["assistant", "prompt_lookup"])
def test_speculative_decoding_is_refused_before_any_forward_where_the_session_cannot_roll_back(mode, options, named):
    model, store = make_tiny("llama"), AttnStore(host_bytes="64MiB")
    cache = AttnStoreCache(model, store, "s", _prompt(30, 12), **options)
    with pytest.raises(ValueError, match=named) as raised:
        _generate(model, cache, cache.input_ids, 4, **_drafting(mode, "llama"))
    assert "assisted generation" in str(raised.value)
    assert cache.saved_tokens == 0 and store.token_ids("s", cache.fingerprint) is None


def test_a_drafter_that_reads_the_models_hidden_states_is_refused_on_a_resumed_session(monkeypatch):
    """Multi-token prediction (`use_mtp`), DFlash and Gemma 4 assistants draft from the model's hidden states over the
    whole prompt, which a resumed turn never computes: refused before any forward, naming the option. (A stand-in
    drafter: the tiny models have no MTP head.)"""
    model, store = make_tiny("llama"), AttnStore(host_bytes="64MiB")

    class ReadsHiddenStates:
        requires_model_outputs = True

    monkeypatch.setattr(type(model), "_get_candidate_generator", lambda self, **kwargs: ReadsHiddenStates())
    first = AttnStoreCache(model, store, "s", random_ids(20, 14))
    history = _generate(model, first, first.input_ids, 3)
    first.close()
    cache = AttnStoreCache(model, store, "s", torch.cat([history, random_ids(4, 15)], dim=1))
    with pytest.raises(ValueError, match="`use_mtp=True` drafts from the model's hidden states"):
        _generate(model, cache, cache.input_ids, 4, use_mtp=True)
    assert cache.saved_tokens == 0 and torch.equal(store.token_ids("s", cache.fingerprint), history[0, :-1])


def test_beam_search_is_refused_naming_it():
    model, store = make_tiny("llama"), AttnStore(host_bytes="64MiB")
    cache = AttnStoreCache(model, store, "s", random_ids(20, 13))
    with pytest.raises(ValueError, match="beam search"):
        _generate(model, cache, cache.input_ids, 4, num_beams=2)
    assert cache.saved_tokens == 0
