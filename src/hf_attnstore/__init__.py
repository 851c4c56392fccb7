"""hf_attnstore: hierarchical, position-decoupled KV cache reuse for multi-turn chat with transformers."""

from .cache import AttnStoreCache
from .config import TruncationConfig, parse_bytes
from .fingerprint import model_fingerprint
from .models import load_default_model
from .pipeline import ChatPipeline
from .store import AttnStore, StoreStats
from .upstream import cache_kwargs, warn_if_untested

warn_if_untested()  # once, at import: the installed transformers is outside the tested range

__version__ = "0.1.0"
__all__ = [
    "AttnStore",
    "AttnStoreCache",
    "ChatPipeline",
    "StoreStats",
    "TruncationConfig",
    "cache_kwargs",
    "load_default_model",
    "model_fingerprint",
    "parse_bytes",
]
