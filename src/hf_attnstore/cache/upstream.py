"""The one seam to transformers: every use of something outside its documented public API goes through here.

transformers moves fast and its internals move with it (5.24 renamed the forward argument `past_key_values`
to `cache` on every model). Each internal this package relies on is named once below, with why we need it;
`tests/cache/test_upstream.py` checks each one against the installed release and fails with a message naming it,
so the next upstream change costs one file and one clear test failure. docs/design.md ("The transformers
seam") keeps the table of what we rely on and the versions checked.

Public API we also use, and need not route through here: `AutoModelForCausalLM`, `AutoTokenizer`,
`DynamicCache(config=...)`, `model.generate`, `GenerationConfig`, stopping criteria and the streamers.

Example:
    >>> from hf_attnstore.cache import upstream
    >>> upstream.CACHE_ARG in ("cache", "past_key_values")
    True
    >>> upstream.cache_kwargs(None) == {upstream.CACHE_ARG: None}
    True
"""

from __future__ import annotations

import functools
import inspect
import warnings

import torch
import transformers
from packaging.version import Version
from torch import nn
from transformers import GenerationMixin

# cache_utils: the layer classes our cache subclasses or fills, and the reading of a config's layer types.
# Cache and DynamicCache are public; the layer objects are how `DynamicCache` is built since 5.0, and our
# layers subclass them so that transformers' masks, crop and assisted decoding treat them as its own.
from transformers.cache_utils import (  # noqa: F401  (re-exported: the rest of the package imports them here)
    Cache,
    DummyLayer,
    DynamicCache,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionCacheLayerMixin,
    LinearAttentionLayer,
    get_layer_types_and_kwargs,
)

__all__ = ["Cache", "DummyLayer", "DynamicCache", "DynamicLayer", "DynamicSlidingWindowLayer",
           "LinearAttentionCacheLayerMixin", "LinearAttentionLayer", "CACHE_ARG", "CACHE_ARGS", "cache_kwargs",
           "cache_from", "output_cache", "base_model", "generic_prepare_inputs", "CANDIDATE_GENERATOR", "find_rotary",
           "rope_type", "rope_limit", "layer_types", "LOAD_KWARGS", "seq_length", "set_linear_length",
           "tested_range_warning", "warn_if_untested", "decoding_plan",
           "GENERATE_ARGS", "response_template", "register_attention", "sdpa_attention", "attention_implementation",
           "set_attention_implementation", "eager_attention"]

# The releases this package was tested with, oldest and newest (make test runs the lock's, CI also the newest
# on the registry and the oldest here; setup.cfg's lower bound is the oldest).
TESTED_OLDEST = "5.23.0"
TESTED_NEWEST = "5.24.0"
VERSION = transformers.__version__

# What our loaders pass to `from_pretrained` (lab/models.py): the model as its checkpoint has it. From 5.25
# `from_pretrained` turns the Hub's kernels on by default (`use_kernels=None` means on), which needs the `kernels`
# package (loading fails without it), fetches kernels from the Hub, and swaps layers for them; 5.23 and 5.24 take
# the same option with False as their default.
LOAD_KWARGS = {"use_kernels": False}


def _cache_arg() -> str:
    """The name under which models take and return their cache: ``cache`` from 5.24, ``past_key_values`` before.

    Read from the signature of the generic `prepare_inputs_for_generation` (which every decoder-only model
    inherits) rather than from the version number, so a backport or a rename back is followed too.
    """
    params = inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    return "cache" if "cache" in params else "past_key_values"


CACHE_ARG = _cache_arg()
# Every name a model forward, `generate` or `prepare_inputs_for_generation` may receive a cache under: the
# current one first; the old one stays accepted (deprecated from 5.24 until 5.40/6.0).
CACHE_ARGS = (CACHE_ARG, "past_key_values") if CACHE_ARG != "past_key_values" else (CACHE_ARG,)


def cache_kwargs(cache) -> dict:
    """Keyword arguments that pass `cache` to a model's forward or `generate` under this release's name.

    Example:
        >>> import torch
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
        ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
        >>> cache = DynamicCache()
        >>> logits = model(torch.tensor([[1, 2, 3]]), **cache_kwargs(cache)).logits
        >>> cache.get_seq_length()  # the forward filled the cache passed under this release's name
        3
    """
    return {CACHE_ARG: cache}


def cache_from(kwargs: dict):
    """The cache among a forward's or `prepare_inputs_for_generation`'s keyword arguments, under either name.

    Example:
        >>> cache_from({CACHE_ARG: "the cache"}), cache_from({"past_key_values": "the cache"}), cache_from({})
        ('the cache', 'the cache', None)
    """
    for name in CACHE_ARGS:
        if kwargs.get(name) is not None:
            return kwargs[name]
    return None


def output_cache(output):
    """The cache a model's output returns (``output.cache`` from 5.24, ``output.past_key_values`` before).

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> import torch
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
        ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
        >>> type(output_cache(model(torch.tensor([[1, 2, 3]]), use_cache=True))).__name__
        'DynamicCache'
    """
    for name in CACHE_ARGS:
        value = getattr(output, name, None)
        if value is not None:
            return value
    return None


def base_model(model: nn.Module) -> nn.Module:
    """The decoder a causal LM delegates to (`model.base_model`): the forward our cache brackets (hooks.py).

    transformers' causal LMs call ``self.model(...)`` (the `base_model_prefix` attribute) with the cache; we
    wrap that module's `forward` to learn where each forward starts and ends.

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
        ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
        >>> type(base_model(model)).__name__
        'LlamaModel'
    """
    return model.base_model


def generic_prepare_inputs(model: nn.Module):
    """`GenerationMixin.prepare_inputs_for_generation` bound to `model`: the generic version, for models that
    override it (phi3 recomputes everything where longrope switches regime; see hooks.py).

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> import torch
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
        ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
        >>> inputs = generic_prepare_inputs(model)(torch.tensor([[1, 2, 3]]))
        >>> inputs["input_ids"].tolist()
        [[1, 2, 3]]
    """
    return functools.partial(GenerationMixin.prepare_inputs_for_generation, model)


# generation/utils.py: assisted generation (`_assisted_decoding`, speculative.py). It builds its drafter with
# `GenerationMixin._get_candidate_generator(generation_config=..., model_kwargs=..., assistant_model=..., ...)`,
# called on the model with keyword arguments before any forward (private): wrapping it on the model lets a turn
# refuse a drafting mode it cannot roll back before anything is computed; the drafter's `requires_model_outputs`
# says it drafts from the model's hidden states. The first forward then passes the whole sequence with
# `next_sequence_length=None` to `prepare_inputs_for_generation`, which feeds the last `next_sequence_length` ids
# when given one (checked by tests/cache/test_upstream.py).
CANDIDATE_GENERATOR = "_get_candidate_generator"


def find_rotary(model: nn.Module) -> nn.Module | None:
    """The decoder's rotary module (`rotary_emb`): on the base model, on its language model (multimodal wrappers
    such as Gemma3ForConditionalGeneration), or on `model.model` where the base-model prefix does not match
    (llama4). Called as ``rotary(x, position_ids[, layer_type])`` and returning cos/sin ``[1, seq, rot_dim]``
    (complex frequencies for llama4 and deepseek_v2); we never re-implement its frequencies (rope.py).

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
        ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
        >>> find_rotary(model) is model.model.rotary_emb
        True
    """
    for holder in (model.base_model, getattr(model.base_model, "language_model", None), getattr(model, "model", None)):
        rotary = getattr(holder, "rotary_emb", None)
        if isinstance(rotary, nn.Module):
            return rotary
    return None


def rope_type(rotary: nn.Module):
    """The rotary module's `rope_type`: a string, or a dict per layer type (gemma3, olmo3).

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
        ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
        >>> rope_type(find_rotary(model))
        'default'
    """
    return getattr(rotary, "rope_type", "default")


def rope_limit(rotary: nn.Module, config) -> int:
    """The length up to which length-dependent RoPE keeps its short (`longrope`) or base (`dynamic`) frequencies:
    `rope_parameters["original_max_position_embeddings"]` for longrope, the module's `original_max_seq_len`
    (set by `dynamic_rope_update`'s module) or the config's `max_position_embeddings` for dynamic.

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        ...     num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512)
        >>> rope_limit(find_rotary(LlamaForCausalLM(config)), config)  # static RoPE: the model's whole window
        512
    """
    if rope_type(rotary) == "longrope":
        return int(rotary.config.rope_parameters["original_max_position_embeddings"])
    return int(getattr(rotary, "original_max_seq_len", config.max_position_embeddings))


def set_linear_length(layer, tokens: int) -> None:
    """Tells a linear-attention layer whose states were put in by hand (`layers._restore`) that they summarize
    `tokens` tokens, as if it had computed them.

    From 5.25 the layer counts its own tokens (``cumulative_length_linear``, added to by its updates): that count
    is its ``get_seq_length``, and the cache's when layer 0 is linear (bamba, jamba, lfm2, ...), so models place
    the next token by it. Left at 0, a resumed hybrid session would decode as if it had no history. Before 5.25
    the cache read the length from an attention layer and the layer kept no count.

    Example:
        >>> layer = LinearAttentionLayer(number_of_states=1)
        >>> set_linear_length(layer, 7)
        >>> int(getattr(layer, "cumulative_length_linear", 7))
        7
    """
    length = getattr(layer, "cumulative_length_linear", None)
    if isinstance(length, torch.Tensor):
        length.fill_(tokens)


def seq_length(value) -> int:
    """A cache's or layer's ``get_seq_length()`` as a plain int.

    From 5.25 a linear-attention layer returns its token counter itself (``cumulative_length_linear``, a 0-d
    tensor it adds to in place), and so does the cache when its layer 0 is linear. Kept as it is, anything that
    stores the value and later adds to it (`store.buffer`'s length after a crop) would move the layer's counter
    too: the next forward would be placed past its tokens. Before 5.25 it was an int.

    Example:
        >>> counter = torch.tensor(5)
        >>> n = seq_length(counter)
        >>> n += 1
        >>> n, int(counter)
        (6, 5)
    """
    return int(value)


def layer_types(config) -> tuple[list[str], list[dict]]:
    """Per decoder layer, its cache type (``full_attention``, ``sliding_attention``, ``linear_attention``, ...)
    and the keyword arguments `DynamicCache(config=...)` would build its layer with (`sliding_window`,
    `number_of_states`): transformers' `get_layer_types_and_kwargs`.

    Example:
        >>> from transformers import LlamaConfig
        >>> types, kwargs = layer_types(LlamaConfig(num_hidden_layers=2))
        >>> types
        ['full_attention', 'full_attention']
    """
    return get_layer_types_and_kwargs(config)


def tested_range_warning(version: str = VERSION) -> str | None:
    """The warning for a transformers release outside the tested range, or None inside it.

    Example:
        >>> tested_range_warning(TESTED_NEWEST) is None
        True
        >>> "tested" in tested_range_warning("4.57.0")
        True
    """
    installed = Version(version)
    if Version(TESTED_OLDEST) <= installed and installed.release[:2] <= Version(TESTED_NEWEST).release[:2]:
        return None
    return (f"hf_attnstore was tested with transformers {TESTED_OLDEST} to {TESTED_NEWEST}, and transformers "
            f"{version} is installed: it may work, but the internals it relies on (hf_attnstore/cache/upstream.py) are "
            "not checked for it; run `pytest tests/cache/test_upstream.py` to check them, or install a tested release")


def warn_if_untested() -> None:
    """Warns once, at import, when the installed transformers lies outside the tested range (not an error:
    users may know better).

    Example:
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     warn_if_untested()
        >>> len(caught) == (tested_range_warning() is not None)  # a warning only outside the tested range
        True
    """
    message = tested_range_warning()
    if message is not None:
        warnings.warn(message, UserWarning, stacklevel=3)


# generation/utils.py: how `generate` turns its keyword arguments into the processors it decodes with. The batch
# runner decodes many turns in one forward but must pick each turn's tokens exactly as `generate` would for it
# alone, for every option `generate` takes; building the processors with transformers' own code (rather than a
# subset of our own) is what keeps that true as options are added upstream.
GENERATE_ARGS = ("logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn", "tokenizer", "streamer",
                 "negative_prompt_ids", "negative_prompt_attention_mask", "synced_gpus", "assistant_model",
                 "custom_generate", "trust_remote_code", "assistant_tokenizer", "attention_mask")


def decoding_plan(model: nn.Module, prompt, options: dict):
    """What ``model.generate(prompt, **options)`` decodes with, built by transformers itself: the prepared
    `GenerationConfig` (the model's defaults, the options, special tokens and lengths, as `generate` prepares
    them), its logits processors and warpers, and the options `generate` would pass on to the model (none is
    expected: the caller refuses to batch a turn that has some).

    Uses `GenerationMixin._prepare_generation_config`, `_prepare_special_tokens`, `_prepare_generated_length` and
    `_get_logits_processor` (private; checked by tests/cache/test_upstream.py).

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> import torch
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
        ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
        >>> config, processors, rest = decoding_plan(model, torch.tensor([[1, 2, 3]]),
        ...     {"max_new_tokens": 4, "repetition_penalty": 1.5, "do_sample": False})
        >>> config.max_length, [type(p).__name__ for p in processors], rest
        (7, ['RepetitionPenaltyLogitsProcessor'], {})
    """
    from transformers import LogitsProcessorList

    options = dict(options)
    given = {name: options.pop(name) for name in GENERATE_ARGS if name in options}
    defaults = model.generation_config
    has_default_max = options.get("max_length") is None and defaults.max_length is None
    has_default_min = options.get("min_length") is None and defaults.min_length is None
    config, rest = model._prepare_generation_config(None, **options)
    model._prepare_special_tokens(config, True, device=prompt.device)
    length = int(prompt.shape[1])
    config = model._prepare_generated_length(
        generation_config=config, has_default_max_length=has_default_max, has_default_min_length=has_default_min,
        model_input_name="input_ids", input_ids_length=length, inputs_tensor=prompt)
    processors = model._get_logits_processor(
        generation_config=config, input_ids_seq_length=length, encoder_input_ids=prompt,
        prefix_allowed_tokens_fn=given.get("prefix_allowed_tokens_fn"),
        logits_processor=given.get("logits_processor") or LogitsProcessorList(), device=prompt.device,
        model_kwargs={})
    rest.pop("use_cache", None)
    return config, processors, rest


def response_template(tokenizer, model_type: str | None = None) -> dict | None:
    """The response template that parses this model's replies into content and tool calls
    (`tokenizer.parse_response` / `tokenizer.get_response_parser`, public), or None when there is none.

    The tokenizer's own `response_template` first; else the one `transformers serve` falls back to for the
    model's family (`transformers.cli.serving.utils._RESPONSE_TEMPLATE_FALLBACKS`, private: checked by
    tests/cache/test_upstream.py), so our server parses tool calls of the same models theirs does.

    Example:
        >>> response_template(object()) is None
        True
    """
    own = getattr(tokenizer, "response_template", None)
    if own is not None or not model_type:
        return own
    try:
        from transformers.cli.serving.utils import _RESPONSE_TEMPLATE_FALLBACKS
    except ImportError:  # moved or gone upstream: the tokenizer's own template (or a flag) is then needed
        return None
    return next((template for types, template in _RESPONSE_TEMPLATE_FALLBACKS.items() if model_type in types), None)


# Attention: the importance scores of sparse window attention (importance.py) are computed beside SDPA, by an
# attention function registered under our own name. `AttentionInterface` and `AttentionMaskInterface` are public
# (transformers' "Attention interface" guide); `sdpa_attention_forward` and `sdpa_mask` are the functions they map
# "sdpa" to, which ours calls and reuses as they are (checked by tests/cache/test_upstream.py).
SDPA, EAGER = "sdpa", "eager"


def register_attention(name: str, function, wraps: str = SDPA) -> None:
    """Registers `function` as attention implementation `name` (it wraps `wraps`, ``"sdpa"`` or ``"eager"``) with
    the masks `wraps` gets, so that ``model.set_attn_implementation(name)`` makes the model call it with them.

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> import torch
        >>> calls = []
        >>> def counted(module, *args, **kwargs):
        ...     calls.append(module.layer_idx)
        ...     return sdpa_attention(module, *args, **kwargs)
        >>> register_attention("counted_sdpa", counted)
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
        ...     num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1))
        >>> set_attention_implementation(model, "counted_sdpa")
        >>> _ = model(torch.tensor([[1, 2, 3]]))
        >>> calls
        [0, 1]
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

    AttentionInterface.register(name, function)
    AttentionMaskInterface.register(name, sdpa_mask if wraps == SDPA else eager_mask)


def sdpa_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA attention (`integrations.sdpa_attention.sdpa_attention_forward`): ``(output, None)``.

    Example:
        >>> import torch
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
        ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
        >>> module, q, kv = model.model.layers[0].self_attn, torch.randn(1, 2, 3, 8), torch.randn(1, 1, 3, 8)
        >>> out, weights = sdpa_attention(module, q, kv, kv, None, scaling=8 ** -0.5)
        >>> tuple(out.shape), weights  # [batch, tokens, heads, head_dim]; no weights
        ((1, 3, 2, 8), None)
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def eager_attention(module: nn.Module):
    """The eager attention of the module's model family: the `eager_attention_forward` of its modeling module
    (each family has its own: gemma2's softcaps, gpt_oss's adds sinks), returning ``(output, weights)``.

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
        ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
        >>> eager_attention(model.model.layers[0].self_attn).__module__
        'transformers.models.llama.modeling_llama'
    """
    import sys

    return sys.modules[type(module).__module__].eager_attention_forward


def attention_implementation(model: nn.Module) -> str | None:
    """The attention implementation the model's decoder runs (``config._attn_implementation``).

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
        ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
        >>> set_attention_implementation(model, "eager")
        >>> attention_implementation(model)
        'eager'
    """
    return getattr(model.config.get_text_config(decoder=True), "_attn_implementation", None)


def set_attention_implementation(model: nn.Module, name: str) -> None:
    """Switches the model's decoder to attention implementation `name` (`PreTrainedModel.set_attn_implementation`);
    a multimodal model's other towers (vision, audio) keep theirs (a dict names the text sub-config alone).

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
        ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
        >>> set_attention_implementation(model, "sdpa")
        >>> attention_implementation(model)
        'sdpa'
    """
    text = model.config.get_text_config(decoder=True)
    if text is model.config:
        model.set_attn_implementation(name)
        return
    keys = [key for key in getattr(model.config, "sub_configs", {}) if getattr(model.config, key, None) is text]
    model.set_attn_implementation({keys[0]: name} if keys else name)
