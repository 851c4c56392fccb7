"""Sparse cold copies (`StoreConfig.sparse_copies`): which tokens a chunk keeps, and how the store refuses them
where they were not asked for. End to end with models: tests/cache/test_sparse_copies.py."""

from __future__ import annotations

import pytest
import torch

from hf_attnstore.store import AttnStore
from hf_attnstore.store.sparse_copies import first_missing, gather, kept_positions


def test_a_chunk_keeps_its_selected_tokens_padded_by_importance():
    selection = {0: torch.tensor([[0, 2, 9], [1, 5, 9]]), 1: torch.tensor([[3, 4, 5], [0, 8, 9]])}
    scores = {slot: torch.arange(10, dtype=torch.float32).flip(0).expand(2, -1) for slot in range(2)}  # earlier: higher
    kept = kept_positions(selection, scores, None, 0, 10, heads=2)
    assert kept.shape == (2, 2, 3)  # every head keeps three: the most any head selected
    for slot, rows in selection.items():
        for h in range(2):
            assert set(rows[h].tolist()) <= set(kept[slot, h].tolist())
    # Tokens 4-7: slot 1 head 0 selects two of them (4, 5), the others one or none, padded by score to two.
    kept = kept_positions(selection, scores, None, 4, 8, heads=2)
    assert kept.tolist() == [[[0, 1], [0, 1]], [[0, 1], [0, 1]]]
    scores = {slot: torch.arange(10, dtype=torch.float32).expand(2, -1) for slot in range(2)}  # later: higher
    kept = kept_positions(selection, scores, None, 4, 8, heads=2)
    assert kept.tolist() == [[[2, 3], [1, 3]], [[0, 1], [2, 3]]]  # the selected, then the most important others


def test_a_chunk_whose_selection_covers_it_is_written_whole_and_no_selection_means_whole():
    selection = {0: torch.arange(8).expand(2, -1)}
    assert kept_positions(selection, None, None, 0, 8, heads=2) is None
    assert kept_positions(None, None, None, 0, 8, heads=2) is None


def test_absent_tokens_are_never_kept_and_without_a_selection_the_present_ones_are():
    absent = torch.zeros(1, 2, 8, dtype=torch.bool)
    absent[0, 0, [1, 2, 3]] = True
    absent[0, 1, [5, 6, 7]] = True
    kept = kept_positions(None, None, absent, 8, 16, heads=2)
    assert kept.shape == (1, 2, 5)
    assert not bool(absent[0].gather(1, kept[0]).any())
    selection = {0: torch.tensor([[8, 10, 12], [9, 10, 11]])}  # 10 - 8 = 2 has no KV in head 0: never kept
    kept = kept_positions(selection, None, absent, 8, 16, heads=2)
    assert kept.tolist() == [[[0, 4, 7], [1, 2, 3]]]  # head 0: its two selected, then the latest present


def test_a_head_without_any_kv_in_the_tokens_cannot_be_written():
    absent = torch.zeros(1, 2, 4, dtype=torch.bool)
    absent[0, 1] = True
    with pytest.raises(ValueError, match="no KV"):
        kept_positions(None, None, absent, 0, 4, heads=2)


def test_a_selection_that_does_not_fit_the_kv_keeps_everything():
    assert kept_positions({0: torch.tensor([[1, 2]])}, None, None, 0, 8, heads=2) is None  # one head of two
    assert kept_positions({3: torch.tensor([[1], [2]])}, None, None, 0, 8, heads=2) is None  # another slot


def test_first_missing_and_gather():
    kept = torch.tensor([[[0, 1, 3], [0, 1, 2]]])
    assert first_missing(kept) == 2
    x = torch.arange(8.0).view(1, 2, 4, 1)
    assert gather([x], kept)[0].view(2, 3).tolist() == [[0, 1, 3], [4, 5, 6]]


def test_sparse_copies_need_a_lower_tier_and_a_bool(tmp_path):
    with pytest.raises(ValueError, match="disk_dir"):
        AttnStore("1MiB", sparse_copies=True)
    with pytest.raises(TypeError, match="sparse_copies"):
        AttnStore("1MiB", tmp_path, sparse_copies="yes")
