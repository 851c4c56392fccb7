"""Shared fixtures: tiny random models (fast, exact) and the real SmolLM2 (integration tests)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

VOCAB = 128
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
               num_attention_heads=4, max_position_embeddings=512, pad_token_id=0, bos_token_id=1,
               eos_token_id=2)


def _gqa(**extra):
    return dict(_COMMON, num_key_value_heads=2, **extra)


# Each entry builds a tiny model of one architecture we support. Partial rotary (phi3, gpt_neox), GQA,
# qk-norm (qwen3) and a sliding-window mask shorter than the test sequences (mistral) are all covered.
TINY_MODELS = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**_gqa())),
    "mistral": lambda: MistralForCausalLM(MistralConfig(**_gqa(sliding_window=24))),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**_gqa())),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**_gqa(head_dim=16))),
    "phi3": lambda: Phi3ForCausalLM(Phi3Config(**_gqa(rope_parameters={"rope_type": "default",
                                                                          "rope_theta": 10000.0,
                                                                          "partial_rotary_factor": 0.5}))),
    "gpt_neox": lambda: GPTNeoXForCausalLM(GPTNeoXConfig(**dict(_COMMON))),
}
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
_SCALED = dict(attention_multiplier=0.2, embedding_multiplier=3.0, residual_multiplier=0.5, logits_scaling=2.0)
_SLIDING = dict(sliding_window=24, layer_types=["sliding_attention", "sliding_attention", "full_attention"])
_MLA = dict(kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)
_DEEPSEEK_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 64,
                  "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}
_MLA_MOE = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_group=1, topk_group=1)
# Families whose attention is llama's (one rotary module, `rotate_half` on the first rotary dims) around other
# parts: mixture-of-experts MLPs, qk-norms, clipped qkv, multipliers, biases, LayerNorm, and sliding-window
# layers mixed with global ones (one rotary module for both, so keys are re-rotated alike).
# transformers is imported lazily here: each class is only needed by the tests that build it.
FAMILY_MODELS = {
    "mixtral": lambda: _build("Mixtral", _gqa(num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": lambda: _build("Qwen2Moe", _gqa(**_MOE, shared_expert_intermediate_size=32)),
    "qwen3_moe": lambda: _build("Qwen3Moe", _gqa(**_MOE, head_dim=16)),
    "olmo": lambda: _build("Olmo", _gqa(clip_qkv=8.0)),
    "olmo2": lambda: _build("Olmo2", _gqa()),
    "olmoe": lambda: _build("Olmoe", _gqa(num_experts=4, num_experts_per_tok=2)),
    "granitemoe": lambda: _build("GraniteMoe", _gqa(num_local_experts=4, num_experts_per_tok=2, **_SCALED)),
    "granite": lambda: _build("Granite", _gqa(**_SCALED)),
    "starcoder2": lambda: _build("Starcoder2", _gqa(sliding_window=None)),
    "stablelm": lambda: _build("StableLm", _gqa(qk_layernorm=True, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})),
    "gemma": lambda: _build("Gemma", _gqa(head_dim=16)),
    "seed_oss": lambda: _build("SeedOss", _gqa(head_dim=16)),
    "apertus": lambda: _build("Apertus", _gqa()),
    "arcee": lambda: _build("Arcee", _gqa()),
    "exaone4": lambda: _build("Exaone4", _gqa(**_SLIDING)),
    "smollm3": lambda: _build("SmolLM3", _gqa(no_rope_layers=[1, 0, 1])),  # layer 1 without RoPE
    "gemma2": lambda: _build("Gemma2", _gqa(**_SLIDING, head_dim=16)),
    "gpt_oss": lambda: _build("GptOss", _gqa(**_SLIDING, head_dim=16, num_local_experts=4, num_experts_per_tok=2)),
    # Rotary over interleaved pairs of dims (glm: on the first half of each head).
    "cohere": lambda: _build("Cohere", _gqa()),
    "glm": lambda: _build("Glm", _gqa(head_dim=16)),
    "helium": lambda: _build("Helium", _gqa(head_dim=16)),
    "ernie4_5": lambda: _build("Ernie4_5", _gqa(head_dim=16)),
    # Complex-number rotary over pairs, NoPE layers (the last), chunked attention, experts every other layer.
    "llama4_text": lambda: _build("Llama4", _gqa(head_dim=16, intermediate_size_mlp=128, num_hidden_layers=4,
                                                 num_local_experts=2, num_experts_per_tok=1, interleave_moe_layer_step=2,
                                                 no_rope_layers=[1, 1, 1, 0], attention_chunk_size=16)),
    # Sliding and global layers with their own rotary frequencies (local and global bases).
    "gemma3_text": lambda: _build("Gemma3", _gqa(**_SLIDING, head_dim=16)),
    "gemma3": lambda: _gemma3_multimodal(),  # the image-text wrapper most checkpoints ship as, used for text
    "olmo3": lambda: _build("Olmo3", _gqa(**_SLIDING, rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 500000.0}})),
    "hunyuan_v1_dense": lambda: _build("HunYuanDenseV1", _gqa(head_dim=16)),
    # Multi-head latent attention: the cache holds a latent (32 wide) and the key's rotary part (8 wide), one
    # head each; rotate_half on de-interleaved dims (deepseek_v3 and kin), complex pairs (deepseek_v2).
    "deepseek_v3": lambda: _build("DeepseekV3", dict(_COMMON, **_MLA, **_MLA_MOE, first_k_dense_replace=1,
                                                     rope_parameters=_DEEPSEEK_YARN)),  # as its checkpoints
    "deepseek_v3-plain": lambda: _build("DeepseekV3", dict(_COMMON, **_MLA, **_MLA_MOE, rope_interleave=False)),
    "deepseek_v2": lambda: _build("DeepseekV2", dict(_COMMON, **_MLA, **_MLA_MOE, first_k_dense_replace=1)),
    "glm4_moe_lite": lambda: _build("Glm4MoeLite", dict(_COMMON, **_MLA, **_MLA_MOE)),
    "youtu": lambda: _build("Youtu", dict(_COMMON, **_MLA)),
    "axk1": lambda: _build("AXK1", dict(_COMMON, **_MLA, **_MLA_MOE)),
}


# Hybrids: attention layers mixed with linear-attention / state-space layers (their recurrent and convolution
# states are stored at the end of each turn). Four layers each; RoPE on the attention layers of qwen3_next,
# qwen3_5, lfm2, falcon_h1, bamba (and granitemoehybrid's "rope" variant), none (NoPE) on the others.
_LINEAR = dict(head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
               linear_value_head_dim=16)
_MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=32, mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=16)
_ALTERNATING = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
HYBRID_MODELS = {
    "qwen3_next": lambda: _build("Qwen3Next", _gqa(**_LINEAR, **_MOE, num_hidden_layers=4,
                                                   shared_expert_intermediate_size=32)),
    "qwen3_5_text": lambda: _build("Qwen3_5", _gqa(**_LINEAR, num_hidden_layers=4)),
    "lfm2": lambda: _build("Lfm2", _gqa(num_hidden_layers=4, layer_types=["conv", "full_attention", "conv",
                                                                          "full_attention"])),
    "falcon_h1": lambda: _build("FalconH1", _gqa(num_hidden_layers=4, mamba_d_ssm=64, mamba_n_heads=4,
                                                 mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1,
                                                 mamba_chunk_size=16)),  # attention and mamba in every layer
    "bamba": lambda: _build("Bamba", _gqa(num_hidden_layers=4, attn_layer_indices=[1, 3], **_MAMBA2)),
    "granitemoehybrid": lambda: _build("GraniteMoeHybrid", _gqa(num_hidden_layers=4, num_local_experts=4,
                                                                num_experts_per_tok=2, layer_types=_ALTERNATING,
                                                                shared_intermediate_size=64, **_MAMBA2)),
    "granitemoehybrid-rope": lambda: _build("GraniteMoeHybrid", _gqa(
        num_hidden_layers=4, num_local_experts=4, num_experts_per_tok=2, layer_types=_ALTERNATING,
        shared_intermediate_size=64, position_embedding_type="rope", **_MAMBA2)),
    "jamba": lambda: _build("Jamba", _gqa(num_hidden_layers=4, num_experts=2, num_experts_per_tok=1,
                                          attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                                          expert_layer_offset=1, mamba_d_state=8, mamba_dt_rank=8)),
    "nemotron_h": lambda: _build("NemotronH", _gqa(
        num_hidden_layers=4, mamba_num_heads=4, mamba_head_dim=32, ssm_state_size=8, n_groups=1, chunk_size=16,
        head_dim=16, layers_block_type=["mamba", "mlp", "attention", "mlp"])),  # MLP layers keep no cache
    # Multi-head latent attention between linear-attention layers (kimi_linear's KDA, without RoPE).
    "kimi_linear": lambda: _build("KimiLinear", dict(_COMMON, **_MLA, num_key_value_heads=4, num_hidden_layers=4,
                                                     layer_types=_ALTERNATING, linear_head_dim=16, linear_num_heads=4,
                                                     first_k_dense_replace=4)),
    "bailing_hybrid": lambda: _build("BailingHybrid", dict(_COMMON, **_MLA, num_key_value_heads=4,
                                                           num_hidden_layers=4, layer_types=_ALTERNATING)),
    "zamba2": lambda: _build("Zamba2", _gqa(num_hidden_layers=4, mamba_d_state=8, mamba_headdim=16,
                                            n_mamba_heads=8, num_mem_blocks=1, chunk_size=16,
                                            layers_block_type=["mamba", "hybrid", "mamba", "hybrid"])),
}


def _gemma3_multimodal():
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

    text = Gemma3TextConfig(**_gqa(**_SLIDING, head_dim=16))
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=32, patch_size=8)
    return Gemma3ForConditionalGeneration(Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                                       mm_tokens_per_image=4, image_token_index=VOCAB - 1,
                                                       boi_token_index=VOCAB - 2, eoi_token_index=VOCAB - 3))


def _build(name: str, config: dict):
    import transformers

    config_class = getattr(transformers, f"{name}TextConfig", None) or getattr(transformers, f"{name}Config")
    return getattr(transformers, f"{name}ForCausalLM")(config_class(**config))


# Llama with each length-independent RoPE scaling type: re-rotation goes through the model's own rotary
# module, so scaled frequencies (and yarn's attention scaling) must round-trip exactly too.
_ROPE_SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
}
SCALED_ROPE_MODELS = {
    f"llama-{name}": (lambda p=params: LlamaForCausalLM(LlamaConfig(**_gqa(rope_parameters={"rope_theta": 10000.0,
                                                                                              **p}))))
    for name, params in _ROPE_SCALINGS.items()
}
# Length-dependent RoPE (rope.RopeAdapter.regime): frequencies that change past REGIME_LIMIT tokens, which the
# tests' conversations cross. longrope with distinct short and long factors (and its attention scaling).
REGIME_LIMIT = 48
_LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": REGIME_LIMIT}


def _longrope(dims: int, **extra) -> dict:
    return {**_LONGROPE, "factor": 512 / REGIME_LIMIT, "short_factor": [1.0 + 0.05 * i for i in range(dims)],
            "long_factor": [1.0 + 0.5 * i for i in range(dims)], **extra}


LENGTH_DEPENDENT_MODELS = {
    "llama-longrope": lambda: LlamaForCausalLM(LlamaConfig(**_gqa(rope_parameters=_longrope(8)))),
    "phi3-longrope": lambda: Phi3ForCausalLM(Phi3Config(**_gqa(
        original_max_position_embeddings=REGIME_LIMIT, rope_parameters=_longrope(4, partial_rotary_factor=0.5)))),
    "llama-dynamic": lambda: LlamaForCausalLM(LlamaConfig(**dict(
        _gqa(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}),
        max_position_embeddings=REGIME_LIMIT))),
}
ABSOLUTE_MODELS = {
    "gpt2": lambda: GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=3, n_head=4, n_positions=512,
                                               bos_token_id=1, eos_token_id=2)),
}


def make_tiny(arch: str, seed: int = 0, dtype: torch.dtype = torch.float32):
    torch.manual_seed(seed)
    builders = {**TINY_MODELS, **ABSOLUTE_MODELS, **SCALED_ROPE_MODELS, **LENGTH_DEPENDENT_MODELS, **FAMILY_MODELS,
                **HYBRID_MODELS}
    return builders[arch]().to(dtype).eval()


@pytest.fixture
def tiny_llama():
    return make_tiny("llama")


def random_ids(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (1, n), generator=g)


CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def char_tokenizer():
    """A character-level tokenizer (printable ASCII and newline) within the tiny models' vocabulary."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {t: i for i, t in enumerate(specials + chars + ["<unk>"])}
    assert len(vocab) <= VOCAB
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<|end|>",
                                   additional_special_tokens=specials[2:])
    fast.chat_template = CHAT_TEMPLATE
    return fast


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """A tiny random llama and the character tokenizer saved in a folder (its path), as `--model` takes one."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    make_tiny("llama").save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def smollm2():
    from hf_attnstore import load_default_model

    model, tokenizer = load_default_model(dtype="float32", device="cpu")
    return model, tokenizer
