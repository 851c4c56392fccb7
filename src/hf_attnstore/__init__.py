"""hf_attnstore: hierarchical, position-decoupled KV cache reuse for multi-turn chat with transformers.

The package is four layers, each importing only the ones below it (docs/design.md, "The map"):
`store` (the tiers, the index, codecs, policies), `cache` (the transformers side: `AttnStoreCache`, its
layers, RoPE, the seam to transformers' internals), `serving` (the chat pipeline, batching, the HTTP
server) and `lab` (simulation, replay, evaluation, the bundled model and data). The public names are here.

Example:
    >>> from hf_attnstore import AttnStore, AttnStoreCache, ChatPipeline  # doctest: +SKIP
"""

from .cache.cache import AttnStoreCache
from .cache.config import SparseConfig, TruncationConfig
from .cache.fingerprint import model_fingerprint
from .cache.upstream import cache_kwargs, warn_if_untested
from .lab.models import load_default_model
from .serving.pipeline import ChatPipeline
from .store import AttnStore, StoreStats
from .store import parse_bytes

warn_if_untested()  # once, at import: the installed transformers is outside the tested range

__version__ = "0.1.0"
__all__ = [
    "AttnStore",
    "AttnStoreCache",
    "ChatPipeline",
    "StoreStats",
    "SparseConfig",
    "TruncationConfig",
    "cache_kwargs",
    "load_default_model",
    "model_fingerprint",
    "parse_bytes",
]
