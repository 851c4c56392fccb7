"""One test per transformers internal that hf_attnstore relies on (hf_attnstore/cache/upstream.py).

Each failure names the internal that moved, so an upstream release that breaks us says where to look: fix the
seam (upstream.py) and the row of docs/design.md's table, never pin the release away.
"""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
import transformers

from hf_attnstore import AttnStore, AttnStoreCache
from hf_attnstore.cache import upstream

from ..conftest import REGIME_LIMIT, char_tokenizer, make_tiny, random_ids


def require(ok: bool, internal: str, detail: str) -> None:
    if not ok:
        pytest.fail(f"transformers {transformers.__version__} changed the internal `{internal}` that "
                    f"hf_attnstore/cache/upstream.py relies on: {detail}")


def test_cache_argument_name_is_the_one_models_take():
    model = make_tiny("llama")
    for name, fn in [("LlamaForCausalLM.forward", type(model).forward),
                     ("LlamaModel.forward", type(model.model).forward),
                     ("GenerationMixin.prepare_inputs_for_generation",
                      transformers.GenerationMixin.prepare_inputs_for_generation)]:
        params = inspect.signature(inspect.unwrap(fn)).parameters
        require(upstream.CACHE_ARG in params, f"{name}({upstream.CACHE_ARG}=...)",
                f"the cache argument is no longer called {upstream.CACHE_ARG!r} (parameters: {list(params)})")


def test_model_output_returns_the_cache():
    model = make_tiny("llama")
    cache = upstream.DynamicCache(config=model.config)
    out = model(random_ids(5, 0).view(1, -1), **upstream.cache_kwargs(cache), use_cache=True)
    require(upstream.output_cache(out) is cache, "CausalLMOutputWithPast.cache",
            "the output no longer returns the cache it was given under `cache` or `past_key_values`")


def test_generate_passes_the_cache_to_the_base_model_forward():
    """hooks.py wraps `model.base_model.forward` and finds the cache among its keyword arguments."""
    model = make_tiny("llama")
    seen = []
    base = upstream.base_model(model)
    original = base.forward

    def spy(*args, **kwargs):
        seen.append(upstream.cache_from(kwargs))
        return original(*args, **kwargs)

    base.forward = spy
    cache = upstream.DynamicCache(config=model.config)
    ids = random_ids(6, 1).view(1, -1)
    model.generate(ids, attention_mask=torch.ones_like(ids), **upstream.cache_kwargs(cache), max_new_tokens=2,
                   do_sample=False, pad_token_id=0)
    require(len(seen) >= 2 and all(c is cache for c in seen), "model.base_model.forward(cache=...)",
            f"generate's forwards reached the base model with caches {seen!r}, not the one given")


def test_deprecated_cache_argument_still_reaches_our_cache():
    """Users of the old name (`past_key_values=`) keep working while transformers accepts it."""
    model = make_tiny("llama")
    store = AttnStore(host_bytes="64MiB")
    ids = random_ids(12, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        first = AttnStoreCache(model, store, "s", ids[:, :8])
        model(first.input_ids, past_key_values=first)
        first.close()
        second = AttnStoreCache(model, store, "s", ids)
        model(second.input_ids[:, second.reused_tokens:], past_key_values=second)
    require(second.reused_tokens == 8 and second.saved_tokens == 4, "forward(past_key_values=...)",
            f"reused {second.reused_tokens}, saved {second.saved_tokens} through the deprecated name")


def test_generic_prepare_inputs_takes_the_cache():
    model = make_tiny("llama")
    cache = upstream.DynamicCache(config=model.config)
    prepare = upstream.generic_prepare_inputs(model)
    inputs = prepare(random_ids(4, 3).view(1, -1), **upstream.cache_kwargs(cache))
    require(upstream.cache_from(inputs) is cache, "GenerationMixin.prepare_inputs_for_generation",
            f"the generic version no longer hands the cache on (got keys {sorted(inputs)})")


def test_assisted_generation_builds_its_drafter_first_then_feeds_the_whole_sequence():
    """speculative.py: assisted generation builds its drafter with `_get_candidate_generator(model_kwargs=...,
    generation_config=..., assistant_model=...)` on the model before any forward (where a turn refuses a mode it cannot
    roll back), and its first forward hands `prepare_inputs_for_generation` the whole sequence with
    `next_sequence_length=None` (where our cache's reused tokens are sliced off), which feeds the last
    `next_sequence_length` ids when given."""
    model = make_tiny("llama")
    cache = upstream.DynamicCache(config=model.config)
    events = []
    build, prepare = getattr(model, upstream.CANDIDATE_GENERATOR), model.prepare_inputs_for_generation

    def spy_build(*args, **kwargs):
        generator = build(*args, **kwargs)
        events.append(("build", upstream.cache_from(kwargs.get("model_kwargs") or {}) is cache,
                       kwargs.get("generation_config") is not None and "assistant_model" in kwargs,
                       hasattr(generator, "requires_model_outputs")))
        return generator

    def spy_prepare(input_ids, *args, **kwargs):
        events.append(("prepare", input_ids.shape[1], kwargs.get("next_sequence_length", "absent")))
        return prepare(input_ids, *args, **kwargs)

    setattr(model, upstream.CANDIDATE_GENERATOR, spy_build)
    model.prepare_inputs_for_generation = spy_prepare
    ids = random_ids(6, 4)
    model.generate(ids, **upstream.cache_kwargs(cache), max_new_tokens=3, do_sample=False, pad_token_id=0,
                   prompt_lookup_num_tokens=2)
    require(events[0] == ("build", True, True, True),
            f"GenerationMixin.{upstream.CANDIDATE_GENERATOR}(model_kwargs=, generation_config=, assistant_model=)",
            f"assisted generation no longer builds its drafter first, so, on the model (events: {events[:2]})")
    first = events[1]
    require(first[0] == "prepare" and first[1] >= 6 and first[2] is None, "_assisted_decoding's first forward",
            f"it no longer passes the whole sequence with `next_sequence_length=None` (got {first})")
    inputs = prepare(ids, next_sequence_length=2, **upstream.cache_kwargs(upstream.DynamicCache(config=model.config)))
    require(torch.equal(inputs["input_ids"], ids[:, -2:]), "prepare_inputs_for_generation(next_sequence_length=)",
            "it no longer feeds the last `next_sequence_length` ids")


def test_cache_takes_prebuilt_layers_and_dynamic_layer_contract():
    layer = upstream.DynamicLayer()
    cache = upstream.Cache(layers=[layer])
    require(cache.layers == [layer], "Cache(layers=...)", "Cache no longer keeps the layers it is given")
    k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 8, dtype=torch.float64)
    keys, values = layer.update(k, v)
    require(layer.is_initialized and torch.equal(keys, k) and torch.equal(values, v) and values.dtype == v.dtype,
            "DynamicLayer.update / is_initialized / keys / values",
            "a DynamicLayer no longer keeps the keys and values it is given (each in its own dtype)")
    require(layer.get_seq_length() == 3 and layer.get_mask_sizes(2) == (5, 0), "DynamicLayer.get_mask_sizes",
            f"length {layer.get_seq_length()}, mask sizes {layer.get_mask_sizes(2)}")
    layer.crop(-1)
    require(layer.keys.shape[2] == 2 and layer.is_croppable, "DynamicLayer.crop", "crop(-1) no longer drops a token")


def test_sliding_window_layer_state():
    """layers.AttnStoreSlidingLayer sets DynamicSlidingWindowLayer's state itself and reuses its mask sizes."""
    layer = upstream.DynamicSlidingWindowLayer(sliding_window=4)
    for name in ("sliding_window", "cumulative_length", "_sliding_window_tensor"):
        require(hasattr(layer, name), f"DynamicSlidingWindowLayer.{name}", "the attribute is gone")
    layer.update(torch.randn(1, 1, 6, 2), torch.randn(1, 1, 6, 2))
    require(layer.get_seq_length() == 6 and layer.keys.shape[2] == 3, "DynamicSlidingWindowLayer.update",
            f"it kept {layer.keys.shape[2]} of 6 tokens (window 4: expected the last 3)")


def test_linear_attention_layer_state_interface():
    """layers._restore and layers.state_tensors read and write a hybrid layer's states through these."""
    layer = upstream.LinearAttentionLayer(number_of_states=1)
    for name in ("number_of_states", "has_previous_state", "conv_states", "recurrent_states",
                 "is_conv_states_initialized", "is_recurrent_states_initialized"):
        require(hasattr(layer, name), f"LinearAttentionLayer.{name}", "the attribute is gone")
    conv, rec = torch.randn(1, 4, 3), torch.randn(1, 2, 4, 4)
    layer.lazy_initialization(conv_states=conv, state_idx=0, conv_kernel_size=3)
    layer.lazy_initialization(recurrent_states=rec, state_idx=0)
    require(layer.conv_states[0].shape == conv.shape and layer.recurrent_states[0].shape == rec.shape,
            "LinearAttentionLayer.lazy_initialization(conv_states=, recurrent_states=, state_idx=)",
            "the states are no longer allocated at the shapes given")
    dummy = upstream.DummyLayer()
    require(isinstance(layer, upstream.LinearAttentionCacheLayerMixin) and dummy.is_initialized
            and getattr(dummy, "keys", None) is None,
            "LinearAttentionCacheLayerMixin / DummyLayer", "the layer class hierarchy changed")


def test_restored_linear_states_count_their_tokens_and_the_length_is_an_int():
    """lfm2's layer 0 is a convolution: from 5.25 its own counter (`cumulative_length_linear`) is the cache's length,
    so restored states must set it, and the cache must hand out an int, not the counter (that the store's buffer
    once kept and added to, moving the layer's count: layers._restore, AttnStoreCache.get_seq_length)."""
    model, store = make_tiny("lfm2"), AttnStore(host_bytes="64MiB")
    ids = random_ids(20, 3)
    with AttnStoreCache(model, store, "s", ids) as first:
        model(first.input_ids, **upstream.cache_kwargs(first))
    cache = AttnStoreCache(model, store, "s", torch.cat([ids, random_ids(4, 4)], dim=1))
    assert cache.reused_tokens == 20 and isinstance(cache.layers[0], upstream.LinearAttentionCacheLayerMixin)
    length = cache.get_seq_length()
    require(type(length) is int and length == 20, "Cache.get_seq_length() over a linear-attention layer 0",
            f"it is {length!r} after restoring 20 tokens")
    for layer in cache.layers:
        counter = getattr(layer, "cumulative_length_linear", None)
        require(counter is None or int(counter) == 20, "LinearAttentionLayer.cumulative_length_linear",
                f"a restored layer counts {counter!r} tokens, not 20 (upstream.set_linear_length)")
    cache.close()


def test_our_loaders_load_a_checkpoint_without_the_hubs_kernels(tmp_path):
    """5.25 turns `use_kernels` on by default in `from_pretrained`; our loaders pass `upstream.LOAD_KWARGS`."""
    make_tiny("llama").save_pretrained(tmp_path)
    params = inspect.signature(transformers.PreTrainedModel.from_pretrained).parameters
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, **upstream.LOAD_KWARGS)
    require(not getattr(model, "use_kernels", False), "PreTrainedModel.from_pretrained(use_kernels=False)",
            f"the model was loaded with the Hub's kernels on (from_pretrained's parameters: {list(params)})")


def test_layer_types_and_kwargs_of_a_config():
    model = make_tiny("mistral")
    types, kwargs = upstream.layer_types(model.config)
    require(types == ["sliding_attention"] * 3 and kwargs[0].get("sliding_window") == 24,
            "cache_utils.get_layer_types_and_kwargs", f"mistral's layers read as {types}, {kwargs}")


def test_rotary_module_is_found_and_called_as_the_model_does():
    model = make_tiny("llama")
    rotary = upstream.find_rotary(model)
    require(rotary is not None, "model.base_model.rotary_emb", "no rotary module where the decoder kept it")
    require(upstream.rope_type(rotary) == "default", "rotary_emb.rope_type",
            f"rope_type reads {upstream.rope_type(rotary)!r}")
    positions = torch.arange(5).view(1, -1)
    cos, sin = rotary(torch.empty(0), positions)
    require(cos.shape == (1, 5, 16) and sin.shape == cos.shape, "rotary_emb(x, position_ids) -> (cos, sin)",
            f"cos/sin came back as {tuple(cos.shape)}")


def test_length_dependent_rope_limit():
    model = make_tiny("phi3-longrope")
    rotary = upstream.find_rotary(model)
    require(upstream.rope_type(rotary) == "longrope", "rotary_emb.rope_type", "longrope is no longer named so")
    limit = upstream.rope_limit(rotary, model.config)
    require(limit == REGIME_LIMIT, "rotary_emb.config.rope_parameters['original_max_position_embeddings']",
            f"read {limit}, expected {REGIME_LIMIT}")
    dynamic = make_tiny("llama-dynamic")
    limit = upstream.rope_limit(upstream.find_rotary(dynamic), dynamic.config)
    require(limit == REGIME_LIMIT, "rotary_emb.original_max_seq_len (dynamic)", f"read {limit}")


def test_dynamic_rope_rewrites_inv_freq_buffers():
    """fingerprint.py leaves `inv_freq` of length-dependent rotary modules out: they rewrite it per call."""
    model = make_tiny("llama-dynamic")
    rotary = upstream.find_rotary(model)
    before = rotary.inv_freq.clone()
    rotary(torch.empty(0), torch.arange(4 * REGIME_LIMIT).view(1, -1))
    require(not torch.equal(before, rotary.inv_freq), "rotary_emb.inv_freq (dynamic_rope_update)",
            "a long call no longer rewrites the module's frequencies: fingerprint.py's exclusion may be stale")


def test_tested_range_warning():
    require(upstream.tested_range_warning(upstream.TESTED_NEWEST) is None, "(ours)", "newest tested release warns")
    assert upstream.tested_range_warning(upstream.TESTED_OLDEST) is None
    assert "5.0.0" in upstream.tested_range_warning("5.0.0")
    assert upstream.tested_range_warning("99.0.0") is not None



@pytest.mark.parametrize("options", [
    dict(repetition_penalty=1.5, no_repeat_ngram_size=2, min_new_tokens=6),
    dict(do_sample=True, temperature=0.7, top_k=4, top_p=0.9, seed=3),
])
def test_decoding_plan_decodes_as_generate(options):
    """`GenerationMixin._prepare_generation_config`, `_prepare_special_tokens`, `_prepare_generated_length` and
    `_get_logits_processor`: decoding step by step with `decoding_plan`'s processors (and one multinomial draw per
    step when sampling, from a generator seeded as torch's) gives `generate`'s tokens."""
    from transformers import DynamicCache

    model = make_tiny("llama")
    prompt = random_ids(12, seed=5)
    options = {**options, "max_new_tokens": 8}
    seed = options.pop("seed", None)
    try:
        config, processors, rest = upstream.decoding_plan(model, prompt, options)
    except (AttributeError, TypeError) as exc:
        require(False, "GenerationMixin._prepare_generation_config/_prepare_special_tokens/_prepare_generated_length/"
                "_get_logits_processor", f"{type(exc).__name__}: {exc}")
    require(rest == {} and config.max_length == 20, "GenerationMixin._prepare_generated_length",
            f"max_length {config.max_length}, left over {rest}")
    if seed is not None:
        torch.manual_seed(seed)
    want = model.generate(prompt, attention_mask=torch.ones_like(prompt), pad_token_id=0, **options)[0, 12:].tolist()
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    cache, seq, got = DynamicCache(config=model.config), prompt, []
    with torch.no_grad():
        logits = model(prompt, **upstream.cache_kwargs(cache), use_cache=True).logits[:, -1].float()
        for _ in range(8):
            scores = processors(seq, logits)
            token = int(torch.multinomial(torch.softmax(scores, -1), 1, generator=generator)) if config.do_sample \
                else int(scores.argmax(-1))
            got.append(token)
            seq = torch.cat([seq, torch.tensor([[token]])], 1)
            if token in ([config.eos_token_id] if isinstance(config.eos_token_id, int) else config.eos_token_id or []):
                break
            logits = model(seq[:, -1:], **upstream.cache_kwargs(cache), use_cache=True).logits[:, -1].float()
    require(got == want, "GenerationMixin._get_logits_processor", f"decoded {got}, generate gave {want}")


def test_response_template_falls_back_to_transformers_serve_families():
    """`transformers.cli.serving.utils._RESPONSE_TEMPLATE_FALLBACKS`: the family response templates `transformers
    serve` parses tool calls with, for tokenizers that ship none; they parse a Hermes-style tool call with the
    tokenizer's public `get_response_parser`."""
    tok = char_tokenizer()
    template = upstream.response_template(tok, "qwen2")
    require(template is not None and "tool_calls" in template.get("fields", {}),
            "transformers.cli.serving.utils._RESPONSE_TEMPLATE_FALLBACKS", f"no qwen2 template: {template!r}")
    parser = tok.get_response_parser(template, prefix="<|im_start|>assistant\n")
    parser.feed('Sure.<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call><|im_end|>')
    message, _ = parser.finalize()
    assert message["tool_calls"] == [{"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]
    assert message["content"] == "Sure."
    assert upstream.response_template(tok, "llama") is None  # no family template: tools need one given
    tok.response_template = {"fields": {}}
    assert upstream.response_template(tok, "qwen2") == {"fields": {}}  # the tokenizer's own comes first


def test_a_registered_attention_function_is_called_with_sdpa_masks():
    """importance.py registers an attention of its own through `AttentionInterface` (with `sdpa_mask` /
    `eager_mask` from `AttentionMaskInterface`), switches the model with `set_attn_implementation`, and wraps
    `integrations.sdpa_attention.sdpa_attention_forward` or the family's `eager_attention_forward`."""
    model = make_tiny("llama")
    ids = random_ids(9, 3).view(1, -1)
    with torch.no_grad():
        expected = model(ids).logits
    calls = []

    def spy(module, query, key, value, attention_mask, **kwargs):
        calls.append(getattr(module, "layer_idx", None))
        return upstream.sdpa_attention(module, query, key, value, attention_mask, **kwargs)

    upstream.register_attention("hf_attnstore_test_spy", spy)
    try:
        upstream.set_attention_implementation(model, "hf_attnstore_test_spy")
    except Exception as exc:
        require(False, "PreTrainedModel.set_attn_implementation", f"a registered name is refused: {exc}")
    require(upstream.attention_implementation(model) == "hf_attnstore_test_spy", "config._attn_implementation",
            "the model does not report the implementation it was switched to")
    with torch.no_grad():
        got = model(ids).logits
    require(sorted(calls) == list(range(model.config.num_hidden_layers)), "AttentionInterface.register",
            f"the registered attention was not called once per layer ({calls})")
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    # A multimodal model: only the decoder switches (a dict naming the text sub-config); the vision tower keeps
    # the implementation its user chose.
    multimodal = make_tiny("gemma3")
    multimodal.set_attn_implementation({"vision_config": "eager"})
    upstream.set_attention_implementation(multimodal, "hf_attnstore_test_spy")
    require(upstream.attention_implementation(multimodal) == "hf_attnstore_test_spy"
            and multimodal.config.vision_config._attn_implementation == "eager",
            "PreTrainedModel.set_attn_implementation", "a dict of sub-config names is not honoured")
    gemma2 = make_tiny("gemma2")
    attention = gemma2.model.layers[0].self_attn
    require(callable(upstream.eager_attention(attention)), "modeling_gemma2.eager_attention_forward",
            "the family's eager attention function is gone")
