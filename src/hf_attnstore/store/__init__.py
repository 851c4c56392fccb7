"""The hierarchical KV store behind :class:`~hf_attnstore.AttnStoreCache`."""

from .buffer import SessionBuffer, SessionKV
from .config import StoreConfig
from .format import FormatError
from .loader import LoadError
from .store import AttnStore, StoreIOError, StoreStats, TurnWriter

__all__ = ["AttnStore", "FormatError", "LoadError", "SessionBuffer", "SessionKV", "StoreConfig", "StoreIOError",
           "StoreStats", "TurnWriter"]
