"""Model fingerprints: every weight counts, changes are noticed, the memo costs nothing per turn."""

from __future__ import annotations

import copy

import pytest
import torch

from hf_attnstore import AttnStore, AttnStoreCache
from hf_attnstore.cache import fingerprint as fp_module
from hf_attnstore.cache.fingerprint import forget_fingerprint, model_fingerprint

from ..conftest import make_tiny, random_ids
from hf_attnstore.cache.upstream import cache_kwargs


def merge_low_rank(model, rank: int = 4, scale: float = 0.05) -> None:
    """What merging a LoRA into every k_proj/v_proj does: W += B @ A, in place."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("k_proj.weight", "v_proj.weight")):
                out_f, in_f = p.shape
                b, a = torch.randn(out_f, rank, generator=g), torch.randn(rank, in_f, generator=g)
                p.add_(scale * b @ a)


def test_merged_low_rank_update_is_a_miss_not_reuse():
    """The issue's case: a tuned model must not reuse its base model's sessions."""
    model = make_tiny("llama")
    store = AttnStore(host_bytes="64MiB")
    ids = random_ids(40, 0)
    cache = AttnStoreCache(model, store, "s", ids)
    model(cache.input_ids, **cache_kwargs(cache), use_cache=True)
    merge_low_rank(model)
    again = AttnStoreCache(model, store, "s", torch.cat([ids, random_ids(5, 1)], 1))
    assert again.reused_tokens == 0 and again.kv_source == "miss"


def test_every_parameter_counts_not_a_sample():
    base = make_tiny("llama")
    reference = model_fingerprint(base)
    for name, _ in base.named_parameters():
        tuned = copy.deepcopy(base)
        with torch.no_grad():
            flat = dict(tuned.named_parameters())[name].view(-1)
            flat[flat.numel() // 2 + 1] += 1e-3  # one element, past any prefix a sample would read
        assert model_fingerprint(tuned) != reference, name


def test_memo_is_used_until_a_weight_changes(monkeypatch):
    model = make_tiny("qwen2")
    calls = []
    full = fp_module._full_fingerprint
    monkeypatch.setattr(fp_module, "_full_fingerprint", lambda *a: calls.append(1) or full(*a))
    first = model_fingerprint(model)
    assert model_fingerprint(model) == first and len(calls) == 1  # memoized
    with torch.no_grad():
        model.model.layers[1].self_attn.v_proj.weight.mul_(1.01)  # in place: the version counter moves
    changed = model_fingerprint(model)
    assert changed != first and len(calls) == 2
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone() * 2)  # replaced
    assert model_fingerprint(model) not in (first, changed) and len(calls) == 3
    assert model_fingerprint(model.to(torch.float64)) != first  # cast


def test_writes_through_data_need_forget_fingerprint():
    """PyTorch does not version `.data` writes; forget_fingerprint is the documented remedy."""
    model = make_tiny("llama")
    before = model_fingerprint(model)
    model.model.layers[0].self_attn.k_proj.weight.data += 0.01
    forget_fingerprint(model)
    assert model_fingerprint(model) != before


@pytest.mark.parametrize("arch", ["llama-longrope", "llama-dynamic"])
def test_length_dependent_rope_frequencies_do_not_change_the_fingerprint(arch):
    """Their rotary module rewrites its `inv_freq` buffers on every call; the config they follow is hashed."""
    from ..conftest import REGIME_LIMIT

    model = make_tiny(arch)
    before = model_fingerprint(model)
    rotary, freqs = model.model.rotary_emb, model.model.rotary_emb.inv_freq.clone()
    with torch.no_grad():
        model(random_ids(REGIME_LIMIT + 8, 0))  # the long (longrope) or grown (dynamic) frequencies
    assert not torch.equal(rotary.inv_freq, freqs)
    assert model_fingerprint(model) == before
    forget_fingerprint(model)
    assert model_fingerprint(model) == before
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    assert model_fingerprint(model) != before  # the weights still count


def test_namespace_separates_entries():
    model = make_tiny("llama")
    assert model_fingerprint(model, "tenant-a") != model_fingerprint(model, "tenant-b") != model_fingerprint(model)
    shared = AttnStore(host_bytes="64MiB", namespace="a")
    ids = random_ids(30, 3)
    cache = AttnStoreCache(model, shared, "s", ids)
    model(cache.input_ids, **cache_kwargs(cache), use_cache=True)
    assert AttnStoreCache(model, shared, "s", torch.cat([ids, ids], 1)).reused_tokens == 30
    other = AttnStore(host_bytes="64MiB", namespace="b")
    other._index.entries = shared._index.entries  # the same entries, seen from another namespace: never served
    assert AttnStoreCache(model, other, "s", torch.cat([ids, ids], 1)).reused_tokens == 0


def test_meta_model_and_bad_arguments_are_refused():
    with torch.device("meta"):
        model = make_tiny("llama")
    with pytest.raises(ValueError, match="meta device"):
        model_fingerprint(model)
    with pytest.raises(TypeError, match="`model`"):
        model_fingerprint(None)
    with pytest.raises(TypeError, match="`namespace`"):
        model_fingerprint(make_tiny("llama"), namespace=3)


def test_peft_adapters_active_disabled_and_merged_differ():
    peft = pytest.importorskip("peft", reason="needs peft (the dev extra installs it)")
    base = make_tiny("llama")
    plain = model_fingerprint(base)
    model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(r=4, target_modules=["k_proj", "v_proj"],
                                                                      init_lora_weights=False))
    active = model_fingerprint(model)
    with model.disable_adapter():
        disabled = model_fingerprint(model)
    model.merge_adapter()
    merged = model_fingerprint(model)
    assert len({plain, active, disabled, merged}) == 4
    model.unmerge_adapter()  # W + BA - BA is W only up to rounding: another model, another fingerprint
    assert model_fingerprint(model) != merged
