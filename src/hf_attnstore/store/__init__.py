"""The KV store behind :class:`~hf_attnstore.AttnStoreCache`."""

from .buffer import SessionBuffer, SessionKV
from .store import AttnStore, StoreConfig, StoreStats, TurnWriter

__all__ = ["AttnStore", "SessionBuffer", "SessionKV", "StoreConfig", "StoreStats", "TurnWriter"]
