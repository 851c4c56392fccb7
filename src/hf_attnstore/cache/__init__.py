"""The cache side: what plugs into transformers.

`AttnStoreCache` (cache.py) is the `transformers.Cache` passed to `generate`; its per-layer objects
(layers.py), the RoPE maths (rope.py), the forward wrapper (hooks.py), the model fingerprint
(fingerprint.py), the reuse and truncation plan (truncation.py), chat turns at token level (chat.py) and
the one seam to transformers' internals (upstream.py). It imports the store below it, never the layers above.

Example:
    >>> from hf_attnstore.cache import AttnStoreCache, TruncationConfig  # doctest: +SKIP
"""

from .cache import AttnStoreCache
from .config import SparseConfig, TruncationConfig

__all__ = ["AttnStoreCache", "SparseConfig", "TruncationConfig"]
