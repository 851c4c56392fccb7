"""Position decoupling: un-rotating keys to pre-RoPE form and re-rotating them for new positions.

Keys are cached *before* rotary position embedding so that their positions can change (after a context
overflow drops the oldest tokens) without invalidating them. We never re-implement a model's rotary
frequencies: cos/sin always come from the model's own rotary module, so scaling variants (linear, yarn,
llama3) are exact. Layout of every key tensor here: ``[batch, kv_heads, seq, head_dim]``.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from . import upstream
from .layout import LATENT_MODEL_TYPES, LayerLayout

logger = logging.getLogger(__name__)

# Model types whose attention rotates interleaved pairs of dims; those of `_HALF_FREQS` take the first half of
# the module's cos/sin and repeat each frequency twice (`repeat_interleave(2)`) before applying them.
_INTERLEAVED = frozenset({"cohere", "glm", "helium", "ernie4_5", "llama4_text", "deepseek_v2"})
# Rotary modules that return complex frequencies (their attention multiplies pairs of dims by them).
_COMPLEX = frozenset({"llama4_text", "deepseek_v2"})
_HALF_FREQS = frozenset({"glm", "helium", "ernie4_5"})
# Model types whose attention applies `rotate_half`-style RoPE to the first `cos.shape[-1]` dims of each head
# (full rotary for most, partial for phi3/gpt_neox/stablelm) with one rotary module shared by all layers, the
# sliding-window layers of mixed models included. Each one is covered by equivalence tests against full
# recomputation (tests/cache/test_cache.py, tests/cache/test_families.py).
SUPPORTED_ROPE_MODEL_TYPES = frozenset({
    "llama", "mistral", "qwen2", "qwen3", "phi3", "gpt_neox",
    # Mixture-of-experts MLPs around llama's attention.
    "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe",
    # qk-norms, clipped qkv, multipliers, biases, LayerNorm; the same rotary.
    "olmo", "olmo2", "granite", "starcoder2", "stablelm", "gemma", "seed_oss", "apertus", "arcee",
    "hunyuan_v1_dense",
    # Sliding-window layers mixed with global ones, one rotary module for both (gpt_oss: with attention sinks,
    # which change no key, and cos/sin of half the head dim, applied to both halves).
    "exaone4", "gemma2", "gpt_oss",
    # NoPE layers (no rotary at all) between RoPE ones: their keys are stored and loaded as they are.
    "smollm3",
    # Per-layer-type rotary: sliding and global layers with their own frequencies (one module, called per type).
    "gemma3_text", "olmo3",
    # Rotary over interleaved pairs of dims (glm: partial; llama4 as complex numbers, with NoPE layers).
    *_INTERLEAVED,
    # Multi-head latent attention: the cache holds a latent (no positions) and the key's rotary part, rotated
    # by `rotate_half` (deepseek_v3 and its kin, interleaved weights or not: the interleaved form is
    # `rotate_half` over de-interleaved dims, a fixed permutation that stays in the cache) or by complex
    # pairs (deepseek_v2). The layers hand the store the rotary part as its keys (layers.LayerLayout.latent).
    *LATENT_MODEL_TYPES,
})
# Hybrids: attention layers (llama's `rotate_half` RoPE, or none at all: NoPE) mixed with linear-attention or
# state-space layers whose recurrent and convolution states the store keeps at the end of each turn (layers.py,
# store/states.py). Their states are not position-decoupled, so a turn reuses a session only when its prompt
# extends exactly the ids the states were computed for: any divergence or truncation recomputes.
HYBRID_MODEL_TYPES = frozenset({"qwen3_next", "qwen3_5_text", "lfm2", "falcon_h1", "bamba", "granitemoehybrid",
                                "jamba", "nemotron_h", "zamba2",
                                # With multi-head latent attention layers (kimi_linear's without RoPE).
                                "kimi_linear", "bailing_hybrid"})
# Families refused, with the reason their error gives (any other unlisted type is refused as unverified).
_REFUSED = {
    "gemma4_text": "its layers differ in head dim, and some reuse another layer's KV (KV sharing), which the "
                   "store's one geometry per model does not describe yet",
    "gemma4": "its layers differ in head dim, and some reuse another layer's KV (KV sharing), which the store's "
              "one geometry per model does not describe yet",
    "deepseek_v32": "its sparse-attention indexer keeps a second cache of its own (`update_indexer`), which the "
                    "store does not keep",
}
# Models with absolute (or no) position embeddings: KV is reused as-is and never re-rotated.
SUPPORTED_ABSOLUTE_MODEL_TYPES = frozenset({"gpt2"})
# RoPE variants whose frequencies depend on the length of each call (`torch.max(position_ids) + 1`):
# `longrope` uses its short factors up to `original_max_position_embeddings` and its long ones past it (two
# fixed sets); `dynamic` NTK keeps the base frequencies below `max_position_embeddings` and grows them with the
# length past it (and keeps the largest it has seen as module state). Re-rotating stored pre-RoPE keys with
# the frequencies of the current call fixes layer 0's keys only: every deeper layer's KV was computed from
# hidden states that the old frequencies shaped (`eval/rerotate_scaled_rope.py`: layer 1 off by up to 5e-3).
# So KV is tagged with the *regime* of the frequencies it was computed with (see RopeAdapter.regime), and only
# reused under the same one: exact within a regime, a miss across.
_LENGTH_DEPENDENT_ROPE = frozenset({"dynamic", "longrope"})


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Rotates half the hidden dims, as transformers' Llama-family attention does.

    Example:
        >>> rotate_half(torch.tensor([1.0, 2.0, 3.0, 4.0])).tolist()
        [-3.0, -4.0, 1.0, 2.0]
    """
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """Rotates interleaved pairs of dims ``(0, 1), (2, 3), ...``, as cohere, glm, helium, ernie4_5 and llama4
    (with complex numbers) do.

    Example:
        >>> rotate_pairs(torch.tensor([1.0, 2.0, 3.0, 4.0])).tolist()
        [-2.0, 1.0, -4.0, 3.0]
    """
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


class RopeAdapter:
    """Wraps a model's rotary module to rotate and un-rotate cached keys.

    Args:
        model: A causal LM from transformers.

    Raises:
        ValueError: If stored KV could not be reused exactly for the model (a family listed in `_REFUSED`,
            length-dependent RoPE per layer type), or its family is not verified here; the message says which.

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
        ...     num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1))
        >>> rope = RopeAdapter(model)
        >>> keys = torch.randn(1, 1, 5, 8)  # [batch, kv_heads, seq, head_dim], pre-RoPE
        >>> cos, sin = rope.cos_sin(torch.arange(5), torch.float32)
        >>> rotated = rope.rotate(keys, cos, sin)  # as the model's attention caches them
        >>> torch.allclose(rope.unrotate(rotated, *rope.inverse(cos, sin)), keys, atol=1e-6)
        True
    """

    def __init__(self, model: nn.Module):
        config = model.config.get_text_config(decoder=True)
        self.model_type = config.model_type
        rotary = upstream.find_rotary(model)
        hybrid = self.model_type in HYBRID_MODEL_TYPES
        if self.model_type in SUPPORTED_ABSOLUTE_MODEL_TYPES or (hybrid and rotary is None):
            self.rotary = None  # absolute positions, or none (NoPE hybrids: jamba, nemotron_h, ...)
        elif (self.model_type in SUPPORTED_ROPE_MODEL_TYPES or hybrid) and isinstance(rotary, nn.Module):
            rope_type = upstream.rope_type(rotary)
            # Per-layer-type rotary (gemma3, olmo3): one module called with each layer's type, which picks
            # that type's frequencies (a local base for sliding layers, a global one for the others).
            per_type = isinstance(rope_type, dict)
            if per_type and _LENGTH_DEPENDENT_ROPE & set(rope_type.values()):
                raise ValueError(
                    f"RoPE types {sorted(set(rope_type.values()))} per layer type, one of them rescaling its "
                    "frequencies with each call's length, are not verified here; use a static RoPE type"
                )
            if not per_type and rope_type in _LENGTH_DEPENDENT_ROPE:
                self.scaling = rope_type
                # Up to this length the frequencies are the short (longrope) or base (dynamic) ones.
                self.limit = upstream.rope_limit(rotary, config)
            self.rotary = rotary
            if self.model_type in _INTERLEAVED:
                self._turn = rotate_pairs
            layers = config.num_hidden_layers
            types = list(config.layer_types) if per_type else [None] * layers
            # smollm3, llama4: `no_rope_layers[i]` is 1 where layer i uses RoPE (the name says the opposite).
            flags = getattr(config, "no_rope_layers", None) if self.model_type in ("smollm3", "llama4_text") else None
            nope = {i for i, uses in enumerate(flags or ()) if not uses}
            # Everything below counts the store's KV slots: the layers that keep KV (all of them but in hybrids).
            kv_layers = LayerLayout.of(model).kv_layers
            self.nope_layers = [slot for slot, i in enumerate(kv_layers) if i in nope]
            self.groups = {}  # rotary group (a layer type, or None) -> its slots; NoPE layers are in none
            for slot, i in enumerate(kv_layers):
                if i not in nope:
                    self.groups.setdefault(types[i], []).append(slot)
            self._group_of = {i: kind for kind, members in self.groups.items() for i in members}
        else:
            supported = sorted(SUPPORTED_ROPE_MODEL_TYPES | SUPPORTED_ABSOLUTE_MODEL_TYPES | HYBRID_MODEL_TYPES)
            why = _REFUSED.get(self.model_type, "its position encoding is not verified to be invertible here")
            raise ValueError(
                f"model type {self.model_type!r} is not supported by AttnStoreCache: {why}; "
                f"supported model types: {', '.join(supported)}"
            )

    nope_layers: list[int] = []  # layers without RoPE in a RoPE model: their keys are never rotated
    scaling: str | None = None  # "longrope" or "dynamic" where the frequencies depend on the call's length
    limit: int = 0  # the length up to which length-dependent frequencies stay the short/base ones
    _turn = staticmethod(rotate_half)  # the 90-degree turn of RoPE's pairs: halves, or interleaved pairs
    groups: dict = {}
    _group_of: dict = {}

    def layer_has_rope(self, slot: int) -> bool:
        """Whether the keys of KV slot `slot` (see layers.LayerLayout) are rotated.

        Example:
            >>> from transformers import LlamaConfig, LlamaForCausalLM
            >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
            ...     num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1))
            >>> RopeAdapter(model).layer_has_rope(0), RopeAdapter(model).layer_has_rope(1)
            (True, True)
        """
        return self.rotary is not None and slot in self._group_of

    def group(self, slot: int):
        """The rotary group of a KV slot (its layer type for per-type rotary, else None).

        Example:
            >>> from transformers import LlamaConfig, LlamaForCausalLM
            >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
            ...     num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1))
            >>> RopeAdapter(model).group(1) is None  # one rotary for every layer
            True
        """
        return self._group_of[slot]

    @property
    def uniform(self) -> bool:
        """Whether every layer is rotated alike (one group, no NoPE layer)."""
        return len(self.groups) == 1 and not self.nope_layers

    @property
    def has_rope(self) -> bool:
        """Whether keys carry rotary positions (and therefore can be decoupled)."""
        return self.rotary is not None

    @property
    def length_dependent(self) -> bool:
        """Whether the frequencies depend on each call's length (`longrope`, `dynamic`): see :meth:`regime`."""
        return self.scaling is not None

    def regime(self, length: int) -> str | None:
        """The frequency regime of a forward whose sequence (past and new tokens) is `length` long.

        KV computed in one regime is reused exactly by forwards of the same regime only. ``""`` for static
        RoPE (and no RoPE) at any length, and for length-dependent RoPE up to :attr:`limit`; ``"long"`` for
        `longrope` past it (its long factors are one fixed set); ``None`` for `dynamic` from `limit` on, where
        the frequencies differ for every length (and depend on the largest length the module has seen), so
        nothing there can be reused.

        Example:
            >>> from transformers import LlamaConfig, LlamaForCausalLM
            >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
            ...     num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1))
            >>> RopeAdapter(model).regime(10), RopeAdapter(model).regime(100_000)  # static RoPE: one regime
            ('', '')
        """
        if self.scaling == "longrope":
            return "" if length <= self.limit else "long"
        if self.scaling == "dynamic":
            # Below the limit the module resets to its base frequencies whatever it saw before (transformers'
            # `dynamic_frequency_update`); at exactly the limit it keeps grown ones if it grew earlier.
            return "" if length < self.limit else None
        return ""

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype, group=None,
                length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of shape ``[1, 1, seq, rot_dim]`` for 1-D ``positions``, computed by the model's module for
        the layers of `group` (see :meth:`group`).

        `length` is the sequence length of the forward they serve, where it exceeds the positions (reused
        keys re-rotated for a longer forward): length-dependent RoPE picks its frequencies from it.

        Example:
            >>> from transformers import LlamaConfig, LlamaForCausalLM
            >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
            ...     num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1))
            >>> cos, sin = RopeAdapter(model).cos_sin(torch.arange(5), torch.float32)
            >>> tuple(cos.shape), cos[0, 0, 0].tolist() == [1.0] * 8  # position 0: no rotation
            ((1, 1, 5, 8), True)
        """
        assert self.rotary is not None, "cos_sin needs a RoPE model"
        if self.length_dependent and length is not None and positions.numel() \
                and length > int(positions.max()) + 1:
            # The module picks its frequencies from the largest position it is given: add the forward's last.
            last = torch.tensor([length - 1], dtype=positions.dtype, device=positions.device)
            cos, sin = self.cos_sin(torch.cat((positions, last)), dtype, group)
            return cos[:, :, :-1], sin[:, :, :-1]
        dummy = torch.empty(0, dtype=dtype, device=positions.device)
        args = () if group is None else (group,)
        if self.model_type in _COMPLEX:
            # The module returns complex frequencies; the attention multiplies pairs of dims by them.
            cis = self.rotary(dummy, positions.view(1, -1), *args)
            return (cis.real.to(dtype).repeat_interleave(2, dim=-1).unsqueeze(1),
                    cis.imag.to(dtype).repeat_interleave(2, dim=-1).unsqueeze(1))
        cos, sin = self.rotary(dummy, positions.view(1, -1), *args)
        if self.model_type == "gpt_oss":  # its attention rotates the two halves with the same half-width cos/sin
            cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
        elif self.model_type in _HALF_FREQS:  # as their attention prepares them
            cos = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1)
            sin = sin[..., : sin.shape[-1] // 2].repeat_interleave(2, dim=-1)
        return cos.unsqueeze(1), sin.unsqueeze(1)

    def rotate(self, keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Applies RoPE exactly as the model's attention does (partial rotary passes the tail dims).

        Example:
            >>> from transformers import LlamaConfig, LlamaForCausalLM
            >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
            ...     num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1))
            >>> rope, keys = RopeAdapter(model), torch.randn(1, 1, 3, 8)
            >>> at_5 = rope.rotate(keys, *rope.cos_sin(torch.full((3,), 5), torch.float32))
            >>> at_7 = rope.rotate(keys, *rope.cos_sin(torch.full((3,), 7), torch.float32))
            >>> torch.allclose(at_5 @ at_5.mT, at_7 @ at_7.mT, atol=1e-5)  # equal shifts keep dot products
            True
        """
        rot = cos.shape[-1]
        if rot == keys.shape[-1]:
            return keys * cos + self._turn(keys) * sin
        head, tail = keys[..., :rot], keys[..., rot:]
        return torch.cat((head * cos + self._turn(head) * sin, tail), dim=-1)

    @staticmethod
    def halves_equal(cos: torch.Tensor, sin: torch.Tensor) -> bool:
        """Whether cos/sin are two equal halves (``cat(freqs, freqs)``), as transformers' rotary modules build
        them: then :meth:`rotate_into` takes its fused path. Check once per set of positions.

        Example:
            >>> from transformers import LlamaConfig, LlamaForCausalLM
            >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
            ...     num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1))
            >>> RopeAdapter.halves_equal(*RopeAdapter(model).cos_sin(torch.arange(4), torch.float32))
            True
        """
        rot = cos.shape[-1]
        half = rot // 2
        return rot % 2 == 0 and torch.equal(cos[..., :half], cos[..., half:]) and torch.equal(sin[..., :half],
                                                                                             sin[..., half:])

    def rotate_into(self, out: torch.Tensor, keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    halves_equal: bool) -> None:
        """:meth:`rotate`, written into `out` without temporaries.

        With `halves_equal` (see :meth:`halves_equal`) and ``c, s`` one half of cos/sin:
        ``out_a = k_a c - k_b s`` and ``out_b = k_b c + k_a s``. Otherwise the general path.

        Example:
            >>> from transformers import LlamaConfig, LlamaForCausalLM
            >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
            ...     num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1))
            >>> rope, keys = RopeAdapter(model), torch.randn(1, 1, 4, 8)
            >>> cos, sin = rope.cos_sin(torch.arange(4), torch.float32)
            >>> out = torch.empty_like(keys)
            >>> rope.rotate_into(out, keys, cos, sin, RopeAdapter.halves_equal(cos, sin))
            >>> torch.allclose(out, rope.rotate(keys, cos, sin), atol=1e-6)
            True
        """
        if not halves_equal or self._turn is not rotate_half:
            out.copy_(self.rotate(keys, cos, sin))
            return
        rot = cos.shape[-1]
        half = rot // 2
        c, s = cos[..., :half], sin[..., :half]
        ka, kb = keys[..., :half], keys[..., half:rot]
        oa, ob = out[..., :half], out[..., half:rot]
        torch.mul(ka, c, out=oa)
        oa.addcmul_(kb, s, value=-1)
        torch.mul(kb, c, out=ob)
        ob.addcmul_(ka, s)
        if rot != keys.shape[-1]:
            out[..., rot:].copy_(keys[..., rot:])

    @staticmethod
    def inverse(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 factors that undo a rotation by ``(cos, sin)``: computed once per forward, used per layer.

        RoPE is a rotation by angle theta scaled by `attention_scaling` (s): k' = s·R(θ)k, so
        k = R(-θ)k' / s² with s² = cos² + sin². Dividing keeps yarn-style scaled RoPE exact too.

        Example:
            >>> cos, sin = torch.tensor([0.6]), torch.tensor([0.8])
            >>> RopeAdapter.inverse(2 * cos, 2 * sin)  # a rotation scaled by 2 is undone by the rotation back, over 2
            (tensor([0.3000]), tensor([0.4000]))
        """
        cos32, sin32 = cos.float(), sin.float()
        norm = cos32 * cos32 + sin32 * sin32
        return cos32 / norm, sin32 / norm

    def unrotate(self, keys: torch.Tensor, inv_cos: torch.Tensor, inv_sin: torch.Tensor) -> torch.Tensor:
        """Inverts :meth:`rotate` in fp32 with factors from :meth:`inverse`; returns the keys' dtype.

        Example:
            >>> from transformers import LlamaConfig, LlamaForCausalLM
            >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
            ...     num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1))
            >>> rope, keys = RopeAdapter(model), torch.randn(1, 1, 4, 8, dtype=torch.bfloat16)
            >>> cos, sin = rope.cos_sin(torch.arange(4), torch.float32)
            >>> back = rope.unrotate(rope.rotate(keys.float(), cos, sin), *rope.inverse(cos, sin)).to(torch.bfloat16)
            >>> torch.equal(back, keys)
            True
        """
        rot = inv_cos.shape[-1]
        k32 = keys.float()
        head = k32[..., :rot]
        head = head * inv_cos - self._turn(head) * inv_sin
        if rot != keys.shape[-1]:
            head = torch.cat((head, k32[..., rot:]), dim=-1)
        return head.to(keys.dtype)
