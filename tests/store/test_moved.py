"""The store's module paths of the release before keep working for one release (CHANGELOG.md, "What moved").

Each old path imports, with a `FutureWarning` naming the new one, as the module that now holds its code, and every
public name the old module defined is there. The names are the old release's (its modules' public top-level names,
read from commit 012be50), less the two Protocols that existed only to break an import cycle (`save_thread.Planner`,
`save_thread.Refilling`: removed, as the CHANGELOG says).
"""

from __future__ import annotations

import importlib
import sys
import warnings

import pytest

from hf_attnstore.store import MOVED

OLD_NAMES = {
    "block_pool": ("BlockPool", "BlockPoolConfig", "MAX_BLOCKS",),
    "costs": ("HALF_LIFE", "MIN_PREFILL_TOKENS", "ResumeCosts",),
    "deadline": ("Deadline",),
    "disk": ("DiskChunk", "DiskLockedError", "DiskTier", "LOCK", "TMP_PREFIX",),
    "encoded": ("EncodedSegment", "EncodedSlice", "NOT_INEXACT", "copy_into", "dense",),
    "entry": ("BLOCK", "Entry", "MAX_SESSION_ID_BYTES", "Write", "blocks", "remote_signature", "validate_session_id",),
    "eviction": ("DiskBusy", "Eviction", "NoDiskRoom",),
    "found": ("Found", "Match", "match_of", "verified_state",),
    "geometry": ("Geometry", "bytes_per_token", "make_geometry", "parse_geometry", "shape_of", "shapes",),
    "host": ("HostTier",),
    "load_handle": ("LoadError", "LoadHandle",),
    "load_planner": ("LoadPlanner", "ResumeDecision",),
    "load_thread": ("LoadJob", "LoadThread",),
    "logs": ("OnceLogger",),
    "placement": ("ATTENTION_TOKENS", "HEAD_SEARCH", "RECOMPUTE_MARGIN", "choose_head_drops", "choose_recompute", "choose_victims", "head_drop_candidates", "lookahead_windows", "recompute_cost",),
    "policy": ("BlockKey", "EvictionPolicy", "FIFOPolicy", "HitDensityPolicy", "LRUPolicy", "LeafFirstPolicy", "LeafLRUPolicy", "LookaheadPolicy", "RetentionPolicy", "SegmentedPolicy", "annotations", "make_block_policy", "make_policy",),
    "policy.base": ("EvictionPolicy",),
    "policy.blocks": ("BlockKey", "LeafFirstPolicy", "LeafLRUPolicy", "RetentionPolicy", "SegmentedPolicy",),
    "policy.density": ("AGE_BUCKETS", "HitDensityPolicy",),
    "policy.fifo": ("FIFOPolicy",),
    "policy.lookahead": ("LookaheadPolicy",),
    "policy.lru": ("LRUPolicy",),
    "prefixes": ("BLOCK", "PrefixTable", "block_hashes",),
    "redis_server": ("RedisClusterServers", "RedisServer", "free_cluster_port", "free_port", "redis_server_binary",),
    "refill": ("Refill",),
    "remote": ("BACKOFF_S", "MAX_VALUE_BYTES", "MissingChunks", "PREFIX", "RemoteChunk", "RemoteTier", "RemoteUnavailableError", "connect_redis", "redacted",),
    "save_thread": ("MirrorJob", "MirrorResult", "SaveJob", "SaveResult", "SaveThread",),
    "sizes": ("parse_bytes",),
    "state": ("MAX_STATE_TENSORS", "SessionState", "by_slot", "selection_name",),
    "store_state": ("MAX_RETAINED", "StoreState",),
    "tier": ("CHUNK_SUFFIX", "ChunkReader", "Found", "Key", "MANIFEST", "SerialWriter", "T", "Tier",),
    "turn_sink": ("TurnSink",),
}


def test_every_moved_module_is_listed():
    assert set(OLD_NAMES) == set(MOVED) | {"policy"}  # `policy` was a package, now a module of the same path


def test_the_old_policy_package_s_names_are_on_the_policy_module():
    from hf_attnstore.store import policy

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the block policies moved to the lab: they warn
        missing = [n for n in OLD_NAMES["policy"] if not hasattr(policy, n)]
    assert not missing


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_module_path_imports_with_a_warning_and_keeps_its_names(old):
    name = "hf_attnstore.store." + old
    sys.modules.pop(name, None)  # imported afresh: the warning is given at import
    with pytest.warns(FutureWarning, match="moved to `hf_attnstore." + MOVED[old].replace(".", r"\.") + "`"):
        module = importlib.import_module(name)
    assert module is importlib.import_module("hf_attnstore." + MOVED[old])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # names that moved on again warn once more
        missing = [n for n in OLD_NAMES[old] if not hasattr(module, n)]
    assert not missing, f"{name} lost {missing}"


def test_a_patch_through_an_old_path_patches_what_runs(monkeypatch):
    """`mock.patch("hf_attnstore.store.disk.os.replace")` keeps patching the disk tier's own `os`."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        old = importlib.import_module("hf_attnstore.store.disk")
    from hf_attnstore.store.tiers import disk

    monkeypatch.setattr(old, "DiskLockedError", KeyError)
    assert disk.DiskLockedError is KeyError


def test_an_old_path_leaves_the_module_its_own_spec():
    """The import system sets the old path's spec on the module it returns; the finder puts the module's own back
    (`importlib.reload`, tools reading `__spec__`)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        sys.modules.pop("hf_attnstore.store.placement", None)
        module = importlib.import_module("hf_attnstore.store.placement")
    assert module.__spec__.name == "hf_attnstore.store.policy"


def test_reloading_the_facade_keeps_one_finder():
    import hf_attnstore.store as facade

    importlib.reload(facade)
    assert sum(type(f).__qualname__ == "_MovedModules" for f in sys.meta_path) == 1
