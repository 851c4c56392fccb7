"""The hierarchical KV store behind :class:`~hf_attnstore.AttnStoreCache`."""

from .buffer import SessionBuffer, SessionKV
from .config import StoreConfig, StoreTuning
from .found import Found, Match
from .disk import DiskLockedError
from .format import FormatError
from .load_handle import LoadError
from .stats import StoreStats
from .store import AttnStore, StoreIOError
from .writer import TurnWriter

__all__ = ["AttnStore", "DiskLockedError", "FormatError", "Found", "LoadError", "Match", "SessionBuffer", "SessionKV",
           "StoreConfig", "StoreIOError", "StoreStats", "StoreTuning", "TurnWriter"]
