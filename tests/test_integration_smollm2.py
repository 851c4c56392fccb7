"""Integration tests on the real SmolLM2-135M-Instruct and real ShareGPT conversations (CPU, fp32)."""

from __future__ import annotations


import pytest
import torch
from transformers import DynamicCache

from hf_attnstore import AttnStore, AttnStoreCache
from hf_attnstore.cache.chat import ChatTokens
from hf_attnstore.lab.data import load_sharegpt
from hf_attnstore.lab.evaluation import load_texts, sliding_perplexity
from hf_attnstore.cache.upstream import cache_kwargs

pytestmark = pytest.mark.integration
MAX_USER_TOKENS = 96  # long ShareGPT prompts are clipped so the test stays fast on two cores


def clip(tokenizer, text: str) -> str:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:MAX_USER_TOKENS]
    return tokenizer.decode(ids)


@pytest.fixture(scope="module")
def conversations():
    return load_sharegpt(limit=2, min_user_turns=3)


def test_chat_tokens_splice_matches_the_template(smollm2):
    _, tokenizer = smollm2
    chat = ChatTokens(tokenizer)
    first = chat.first_turn("Hi")
    reply = tokenizer("Hello! How can I help?<|im_end|>", add_special_tokens=False, return_tensors="pt")
    ids = chat.next_turn(torch.cat([first, reply["input_ids"]], dim=1), "Tell me a joke")
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
         {"role": "user", "content": "Tell me a joke"}], add_generation_prompt=True, return_tensors="pt")
    assert ids.tolist() == rendered["input_ids"].tolist()


def test_sharegpt_turns_equal_recompute(smollm2, conversations):
    model, tokenizer = smollm2
    chat = ChatTokens(tokenizer)
    store = AttnStore(host_bytes="1GiB")
    greedy = dict(max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    for conv in conversations:
        ids = None
        for turn, message in enumerate(conv.user_turns[:3]):
            message = clip(tokenizer, message)
            ids = chat.first_turn(message) if ids is None else chat.next_turn(ids, message)
            cache = AttnStoreCache(model, store, conv.id, ids)
            out = model.generate(cache.input_ids, **cache_kwargs(cache), **greedy)
            ref = model.generate(ids, **cache_kwargs(DynamicCache()), **greedy)
            assert torch.equal(out, ref), f"{conv.id} turn {turn}"
            if turn:
                assert cache.reused_tokens > 0.5 * ids.shape[1]
            ids = out


def test_decoupled_truncation_keeps_perplexity(smollm2):
    model, tokenizer = smollm2
    (ids,) = load_texts("sharegpt", tokenizer, 1, 1536)
    ppl = {mode: sliding_perplexity(model, ids, context_window=1024, chunk_tokens=128, mode=mode).ppl
           for mode in ("recompute", "decoupled", "naive-rotated")}
    assert abs(ppl["decoupled"] - ppl["recompute"]) / ppl["recompute"] < 0.02, ppl
    assert ppl["naive-rotated"] > 3 * ppl["recompute"], ppl


def test_converted_checkpoint_loads_with_plain_transformers(smollm2):
    """The de-quantized copy is a regular checkpoint: AutoConfig knows its class, pipeline() loads it."""
    from transformers import AutoConfig, pipeline

    from hf_attnstore.lab.models import DEFAULT_GGUF, _converted_gguf, default_model_dir

    folder = _converted_gguf(default_model_dir(), DEFAULT_GGUF)
    assert AutoConfig.from_pretrained(folder).architectures == ["LlamaForCausalLM"]
    generator = pipeline("text-generation", model=str(folder), device="cpu")
    out = generator("Hello", max_new_tokens=2, do_sample=False)
    assert out[0]["generated_text"].startswith("Hello")
