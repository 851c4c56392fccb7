"""hf_attnstore: hierarchical, position-decoupled KV cache reuse for multi-turn chat with transformers."""

from .cache import AttnStoreCache
from .config import TruncationConfig, parse_bytes
from .fingerprint import model_fingerprint
from .models import load_default_model
from .pipeline import ChatPipeline
from .store import AttnStore, StoreStats

__version__ = "0.1.0"
__all__ = [
    "AttnStore",
    "AttnStoreCache",
    "ChatPipeline",
    "StoreStats",
    "TruncationConfig",
    "load_default_model",
    "model_fingerprint",
    "parse_bytes",
]
