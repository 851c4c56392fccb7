"""What each of a model's decoder layers caches: KV, recurrent or convolution states, both, or nothing.

:class:`LayerLayout` is read from the model's config once per turn; the cache's layers (layers.py), the RoPE
adapter (rope.py), the fingerprint and the batch runner all ask it which layer keeps what.

Example:
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
    ...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    >>> layout = LayerLayout.of(model)
    >>> layout.kinds, layout.kv_layers, layout.has_state
    (('kv', 'kv'), [0, 1], False)
"""

from __future__ import annotations

from dataclasses import dataclass

from .upstream import layer_types

KV, STATE, BOTH, NONE = "kv", "state", "both", "none"
# Multi-head latent attention whose cache holds the latent as keys and the rotated key part as values.
LATENT_MODEL_TYPES = frozenset({"deepseek_v2", "deepseek_v3", "glm4_moe_lite", "youtu", "axk1",
                                "kimi_linear", "bailing_hybrid"})  # (these two: hybrids, see rope.py)
_KINDS = {"full_attention": KV, "sliding_attention": KV, "chunked_attention": KV, "linear_attention": STATE,
          "conv": STATE, "hybrid": BOTH, "hybrid_sliding": BOTH, "dummy": NONE}


@dataclass(frozen=True)
class LayerLayout:
    """What each of a model's layers caches: ``kinds[i]`` is ``"kv"``, ``"state"``, ``"both"`` or ``"none"``;
    ``states[i]`` how many conv/recurrent state pairs it has (linear-attention layers only); `latent`: the
    model caches a latent and the key's rotary part (multi-head latent attention), which the store keeps with
    their roles swapped (see the module docstring)."""

    kinds: tuple[str, ...]
    states: tuple[int, ...]
    latent: bool = False
    # Per model layer, the sliding window of a sliding-attention KV layer (None elsewhere): such a layer keeps
    # on the device only the `window - 1` tokens its next query can attend to (the store keeps them all).
    windows: tuple[int | None, ...] = ()
    # Per model layer, whether it is a full-attention KV layer (not sliding nor chunked): the layers a cache with
    # `kv_budget` keeps sparse (a chunked layer's mask depends on its keys' positions, which sparse layers hide).
    full: tuple[bool, ...] = ()

    @classmethod
    def of(cls, model) -> "LayerLayout":
        """The layout of `model`'s decoder (every layer keeps KV unless its config's layer types say otherwise).

        Raises:
            ValueError: A layer type whose cache the store cannot keep (e.g. a compressed or indexed one).
        """
        config = model.config.get_text_config(decoder=True)
        if getattr(config, "layer_types", None) is None and not getattr(config, "sliding_window", None):
            return cls((KV,) * config.num_hidden_layers, (0,) * config.num_hidden_layers,
                       config.model_type in LATENT_MODEL_TYPES, (None,) * config.num_hidden_layers,
                       (True,) * config.num_hidden_layers)
        types, kwargs = layer_types(config)
        windows = tuple(kw.get("sliding_window") if t == "sliding_attention" else None for t, kw in zip(types, kwargs))
        unknown = sorted({t for t in types if t not in _KINDS})
        if unknown:
            raise ValueError(f"layer type(s) {', '.join(map(repr, unknown))} of model type {config.model_type!r} keep "
                             "a cache AttnStoreCache cannot store; use DynamicCache for this model")
        kinds = tuple(_KINDS[t] for t in types)
        return cls(kinds, tuple(kw.get("number_of_states", 1) if k in (STATE, BOTH) else 0
                                for k, kw in zip(kinds, kwargs)), config.model_type in LATENT_MODEL_TYPES, windows,
                   tuple(t == "full_attention" for t in types))

    @property
    def kv_layers(self) -> list[int]:
        """The model layers that keep KV, in order: layer ``kv_layers[s]`` has the store's slot ``s``."""
        return [i for i, kind in enumerate(self.kinds) if kind in (KV, BOTH)]

    @property
    def slot_windows(self) -> dict[int, int]:
        """KV slot -> sliding window, for the sliding-attention slots."""
        return {slot: self.windows[i] for slot, i in enumerate(self.kv_layers) if self.windows and self.windows[i]}

    @property
    def chunked(self) -> list[int]:
        """The chunked-attention KV layers (llama4): neither full nor sliding."""
        return [i for i, kind in enumerate(self.kinds) if kind == KV and self.full and not self.full[i]
                and not (self.windows and self.windows[i])]

    @property
    def has_state(self) -> bool:
        """Whether some layer keeps recurrent or convolution states (a hybrid model)."""
        return any(kind in (STATE, BOTH) for kind in self.kinds)
