"""The hierarchical KV store behind :class:`~hf_attnstore.AttnStoreCache`: its facade.

Everything outside the store (the cache, serving, the lab) imports these names from here, not from the modules
that hold them (docs/design.md, "The map": one line per module).

Module paths of the release before (`hf_attnstore.store.found`, `.store_state`, `.disk`, `.policy.lru`, ...) still
import, for one release, with a `FutureWarning` naming the new one (CHANGELOG.md, "What moved").
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings

from .buffer import LoadError, LoadHandle, Segment, SessionBuffer, SessionKV, copy_into, dense
from .config import StoreConfig, StoreTuning, parse_bytes
from .format import FormatError, bytes_per_token, make_geometry
from .index import MAX_SESSION_ID_BYTES, validate_session_id
from .loader import MIN_PREFILL_TOKENS, ResumeCosts
from .policy import lookahead_windows
from .states import SessionState, selection_name
from .stats import OnceLogger, StoreStats
from .store import AttnStore, Found, Match, StoreIOError
from .tiers.disk import DiskLockedError
from .tiers.redis import Deadline, RemoteUnavailableError, connect_redis, redacted
from .writer import TurnWriter

__all__ = ["AttnStore", "Deadline", "DiskLockedError", "FormatError", "Found", "LoadError", "LoadHandle", "Match",
           "MAX_SESSION_ID_BYTES", "MIN_PREFILL_TOKENS", "OnceLogger", "RemoteUnavailableError", "ResumeCosts", "Segment", "SessionBuffer", "SessionKV", "SessionState",
           "StoreConfig", "StoreIOError", "StoreStats", "StoreTuning", "TurnWriter", "bytes_per_token", "copy_into", "dense",
           "connect_redis", "lookahead_windows", "make_geometry", "parse_bytes", "redacted", "selection_name", "validate_session_id"]

# The modules of the release before, by their path under `hf_attnstore.store`, and where their code is now.
MOVED = {
    "block_pool": "lab.block_pool",
    "costs": "store.loader",
    "deadline": "store.tiers.redis",
    "disk": "store.tiers.disk",
    "encoded": "store.buffer",
    "entry": "store.index",
    "eviction": "store.index",
    "found": "store.store",
    "geometry": "store.format",
    "host": "store.index",
    "load_handle": "store.buffer",
    "load_planner": "store.loader",
    "load_thread": "store.loader",
    "logs": "store.stats",
    "placement": "store.policy",
    "policy.base": "store.policy",
    "policy.blocks": "lab.block_policy",
    "policy.density": "lab.block_policy",
    "policy.fifo": "store.policy",
    "policy.lookahead": "store.policy",
    "policy.lru": "store.policy",
    "prefixes": "store.index",
    "redis_server": "lab.redis_server",
    "refill": "store.saver",
    "remote": "store.tiers.redis",
    "save_thread": "store.saver",
    "sizes": "store.config",
    "state": "store.states",
    "store_state": "store.index",
    "tier": "store.tiers.base",
    "turn_sink": "store.writer",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old module path as the module that now holds its code (one release; a `FutureWarning` says
    where). The module object is the new one, so `mock.patch("hf_attnstore.store.disk.os.replace")` patches what
    runs."""

    PREFIX = __name__ + "."

    def __init__(self):
        self.specs: dict[str, importlib.machinery.ModuleSpec] = {}  # each new module's own spec, seen before any alias

    def find_spec(self, fullname, path=None, target=None):
        old = fullname[len(self.PREFIX):] if fullname.startswith(self.PREFIX) else None
        if old not in MOVED:
            return None
        new = "hf_attnstore." + MOVED[old]
        warnings.warn(f"`{fullname}` moved to `{new}`; the old path is removed in the next release",
                      FutureWarning, stacklevel=2)
        return importlib.machinery.ModuleSpec(fullname, self, origin=new)

    def create_module(self, spec):
        module = importlib.import_module(spec.origin)
        # The import system sets the alias's spec on the module it is handed: its own is put back (exec_module),
        # the one it had before any alias touched it (two threads importing two aliases of one module at once).
        if module.__spec__.name == spec.origin:
            self.specs.setdefault(spec.origin, module.__spec__)
        return module

    def exec_module(self, module):
        module.__spec__ = self.specs[module.__name__]  # the module is the new one, already executed


if not any(type(f).__qualname__ == _MovedModules.__qualname__ for f in sys.meta_path):  # once, reloads too
    sys.meta_path.append(_MovedModules())
# `hf_attnstore.store.policy` was a package: its old submodules (`policy.lru`, ...) are found through this finder.
sys.modules[__name__ + ".policy"].__path__ = []
