"""The store's options: a few everyday keywords, the tuning knobs in one typed StoreTuning, old keywords routed to it
with a FutureWarning for one release; `disk_dir` errors name `disk_dir`."""

from __future__ import annotations

import inspect
import warnings
from dataclasses import FrozenInstanceError, fields

import pytest

from hf_attnstore import AttnStore, StoreTuning
from hf_attnstore.store import StoreConfig
from hf_attnstore.store.config import EVERYDAY, TUNING


def test_the_everyday_options_are_few_and_the_rest_are_tuning():
    params = [p for p in inspect.signature(AttnStore.__init__).parameters if p not in ("self", "tuning", "config",
                                                                                          "legacy")]
    assert params == list(EVERYDAY) and len(params) <= 12
    assert set(TUNING) == {f.name for f in fields(StoreTuning)}
    assert set(EVERYDAY) | set(TUNING) == {f.name for f in fields(StoreConfig)}


def test_tuning_reaches_the_config():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new way warns about nothing
        store = AttnStore(host_bytes="1MiB", policy="fifo", tuning=StoreTuning(chunk_tokens=8, fsync=False))
    try:
        assert (store.config.chunk_tokens, store.config.fsync, store.config.policy) == (8, False, "fifo")
        assert store.config.tuning == StoreTuning(chunk_tokens=8, fsync=False, pin_memory=store.config.pin_memory)
    finally:
        store.close()
    with pytest.raises(FrozenInstanceError):
        StoreTuning().chunk_tokens = 3


def test_old_keywords_work_with_a_future_warning_naming_the_new_place():
    with pytest.warns(FutureWarning, match=r"`chunk_tokens`, `idle_flush_s`.*StoreTuning\(chunk_tokens=\.\.\., "
                      r"idle_flush_s=\.\.\.\)") as caught:
        store = AttnStore(host_bytes="1MiB", chunk_tokens=8, idle_flush_s=0.1, tuning=StoreTuning(fsync=False))
    assert caught[0].filename == __file__  # points at the caller's line, not the library's
    try:
        assert (store.config.chunk_tokens, store.config.idle_flush_s, store.config.fsync) == (8, 0.1, False)
    finally:
        store.close()


def test_an_old_keyword_is_still_validated():
    with pytest.warns(FutureWarning), pytest.raises(ValueError, match="chunk_tokens"):
        AttnStore(host_bytes="1MiB", chunk_tokens=0)
    with pytest.raises(ValueError, match="chunk_tokens"):
        AttnStore(host_bytes="1MiB", tuning=StoreTuning(chunk_tokens=0))


def test_unknown_and_contradicting_options_are_refused():
    with pytest.raises(TypeError, match=r"unknown AttnStore option\(s\) `chunk_token`.*StoreTuning"):
        AttnStore(host_bytes="1MiB", chunk_token=8)
    with pytest.raises(TypeError, match="`tuning` must be a StoreTuning"):
        AttnStore(host_bytes="1MiB", tuning={"chunk_tokens": 8})
    config = StoreConfig(host_bytes="1MiB")
    for options in ({"disk_dir": "/tmp/t57/x"}, {"policy": "fifo"}, {"tuning": StoreTuning()}):
        with pytest.raises(TypeError, match="either `config` or separate options"):
            AttnStore(config=config, **options)
    store = AttnStore(config=config)
    assert store.config is config
    store.close()


@pytest.mark.parametrize("folder", ["/sys/attnstore-x", "/proc/nonexistent/kv"])
def test_an_unwritable_disk_dir_names_disk_dir(folder):
    with pytest.raises(OSError, match=r"`disk_dir` '" + folder + "' cannot be created or written"):
        AttnStore(host_bytes="1MiB", disk_dir=folder)


def test_every_stats_field_is_in_one_group_and_the_summary_reads_first():
    from hf_attnstore import StoreStats

    names = [n for group in StoreStats.GROUPS.values() for n in group]
    assert sorted(names) == sorted(f.name for f in fields(StoreStats)), "a StoreStats field without its group"
    assert list(StoreStats.GROUPS)[0] == "usage"
    stats = StoreStats(sessions=2, host_sessions=1, disk_sessions=1, lookups=3, hits_host=1, hits_disk=1, misses=1,
                       host_bytes_used=2**20, host_bytes_limit=2**21, disk_bytes_used=2**20, disk_bytes_limit=2**30,
                       load_errors=1)
    assert stats.summary() == ("2 sessions (1 in host memory, 1 on disk); 3 lookups: 2 hits (host 1, disk 1, remote 0), "
                               "1 misses; host 1.0 of 2.0 MiB, disk 1.0 of 1.0 GiB; errors 1")
    assert stats.grouped()["errors"]["load_errors"] == 1 and stats.hits_host == 1  # the old names still read
