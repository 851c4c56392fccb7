"""Exact or miss: a chunk is only ever served in the history it was computed for (issue: wrong-KV holes)."""

from __future__ import annotations

import shutil

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from hf_attnstore import AttnStore, AttnStoreCache
from hf_attnstore.store.tiers.disk import DiskLockedError
from hf_attnstore.cache.upstream import cache_kwargs

FAST = dict(fsync=False, idle_flush_s=0.05, io_timeout_s=10, chunk_tokens=4)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2,
                      max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(cfg).eval()


def ids(seed: int, n: int = 4) -> torch.Tensor:
    return torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def turn(model, store, prompt, session="s"):
    cache = AttnStoreCache(model, store, session, prompt)
    model(cache.input_ids[:, cache.reused_tokens:], **cache_kwargs(cache), use_cache=True)
    store.flush()


@torch.no_grad()
def max_logit_error(model, store, prompt, session="s") -> tuple[int, float]:
    """(reused tokens, max |logit difference| against recomputation) of one forward resuming `prompt`."""
    cache = AttnStoreCache(model, store, session, prompt, save=False)
    got = model(cache.input_ids[:, cache.reused_tokens:], **cache_kwargs(cache)).logits[0, -1]
    want = model(prompt, **cache_kwargs(DynamicCache())).logits[0, -1]
    return cache.reused_tokens, float((got - want).abs().max())


X, X2, T, U, TAIL = (ids(i) for i in range(5))


def test_second_opener_of_a_disk_dir_is_refused_with_the_folder_named(tmp_path):
    a = AttnStore(disk_dir=str(tmp_path), **FAST)
    with pytest.raises(DiskLockedError, match=str(tmp_path)):
        AttnStore(disk_dir=str(tmp_path), **FAST)
    a.close()
    AttnStore(disk_dir=str(tmp_path), **FAST).close()  # the lock goes with the store


def test_foreign_chunk_of_the_same_session_is_never_served(model, tmp_path):
    """A chunk file replaced by one of the same session id computed after another history is a miss."""
    other = tmp_path / "other"
    b = AttnStore(disk_dir=str(other), **FAST)
    turn(model, b, X2)
    turn(model, b, torch.cat([X2, T], 1))
    b.close()
    a = AttnStore(disk_dir=str(tmp_path / "a"), **FAST)
    turn(model, a, torch.cat([X, T], 1))
    turn(model, a, torch.cat([X, T, U], 1))
    a.evict("s")
    a.flush()
    # Same session id, same file name, same token ids: chunk 1 holds T, computed after X2 in B and after X
    # in A. Before chunks were chained and pinned, A served B's copy (max |dlogit| 1.9).
    src, dst = [next((root / "sessions").iterdir()) for root in (other, tmp_path / "a")]
    shutil.copy(src / "00000001.safetensors", dst / "00000001.safetensors")
    prompt = torch.cat([X, T, U, TAIL], 1)
    _, error = max_logit_error(model, a, prompt)  # found while loading: recomputed mid-forward
    assert error < 1e-4
    assert a.stats().load_errors == 1
    a.close()
    a = AttnStore(disk_dir=str(tmp_path / "a2"), **FAST)
    turn(model, a, torch.cat([X, T], 1))
    turn(model, a, torch.cat([X, T, U], 1))
    a.close()
    dst = next((tmp_path / "a2" / "sessions").iterdir())
    shutil.copy(src / "00000001.safetensors", dst / "00000001.safetensors")
    a = AttnStore(disk_dir=str(tmp_path / "a2"), **FAST)  # found on reopen: a clean miss
    assert a.lookup("s", AttnStoreCache.fingerprint_of(model)) is None
    assert max_logit_error(model, a, prompt) == (0, pytest.approx(0, abs=1e-4))
    a.close()


def test_resume_after_foreign_writes_is_exact_or_miss(model, tmp_path):
    """The issue's reproduction, with the second opener refused: every resumed turn matches recomputation."""
    a = AttnStore(disk_dir=str(tmp_path), **FAST)
    with pytest.raises(DiskLockedError):
        AttnStore(disk_dir=str(tmp_path), **FAST)
    turn(model, a, torch.cat([X, T], 1))
    turn(model, a, torch.cat([X, T, U], 1))
    a.evict("s")
    a.flush()
    reused, error = max_logit_error(model, a, torch.cat([X, T, U, TAIL], 1))
    assert reused == 12 and error < 1e-4
    a.close()
    a = AttnStore(disk_dir=str(tmp_path), **FAST)
    reused, error = max_logit_error(model, a, torch.cat([X, T, U, TAIL], 1))
    assert reused == 12 and error < 1e-4
    a.close()
