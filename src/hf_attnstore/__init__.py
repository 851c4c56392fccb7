"""hf_attnstore: hierarchical, position-decoupled KV cache reuse for multi-turn chat with transformers.

The package is four layers, each importing only the ones below it (docs/design.md, "The map"):
`store` (the tiers, the index, codecs, policies), `cache` (the transformers side: `AttnStoreCache`, its
layers, RoPE, the seam to transformers' internals), `serving` (the chat pipeline, batching, the HTTP
server) and `lab` (simulation, replay, evaluation, the bundled model and data). The public names are here.

`import hf_attnstore` loads only what `AttnStore` and `AttnStoreCache` need; `ChatPipeline` (serving/) and
`load_default_model` (lab/) are imported on first use, as PEP 562 allows.

Example:
    >>> import hf_attnstore
    >>> hf_attnstore.ChatPipeline.__name__  # serving/ is imported here, on first use
    'ChatPipeline'
"""

from importlib import import_module

from .cache.cache import AttnStoreCache
from .cache.config import SparseConfig, TruncationConfig
from .cache.fingerprint import model_fingerprint
from .cache.upstream import cache_kwargs, warn_if_untested
from .store import AttnStore, StoreStats, StoreTuning, parse_bytes

warn_if_untested()  # once, at import: the installed transformers is outside the tested range

__version__ = "0.1.0"

# Names whose modules load on first use (serving/ and lab/ are layers above the cache: a user of the cache
# alone does not pay for them).
_LAZY = {"ChatPipeline": ".serving.pipeline", "PipelineTuning": ".serving.pipeline",
         "load_default_model": ".lab.models"}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name], __name__), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "AttnStore",
    "AttnStoreCache",
    "ChatPipeline",
    "PipelineTuning",
    "StoreStats",
    "StoreTuning",
    "SparseConfig",
    "TruncationConfig",
    "cache_kwargs",
    "load_default_model",
    "model_fingerprint",
    "parse_bytes",
]
