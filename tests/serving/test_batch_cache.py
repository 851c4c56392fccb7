"""The batch cache (serving/batch_cache.py): rows right-aligned through joins, steps, leaves and re-selections;
slabs within a byte bound."""

from __future__ import annotations

import torch

from hf_attnstore.serving.batch_cache import BatchKV, token_bytes


def kv(length, value, layers=3):
    return [(torch.full((1, 2, length, 4), float(value)), torch.full((1, 2, length, 4), -float(value)))] * layers


def test_batch_kv_keeps_each_rows_kv_right_aligned_through_joins_and_leaves():
    cache = BatchKV()
    expected = []  # per row: (length, value)

    def check():
        assert cache.layers[0].keys.shape[0] == len(expected)
        for b, (length, value) in enumerate(expected):
            for layer in cache.layers:
                row = layer.keys[b]
                assert cache.width - cache.pad(b) == length
                assert torch.all(row[:, cache.pad(b):] == value) and torch.all(layer.values[b, :, cache.pad(b):] == -value)
                assert torch.isfinite(row).all() and torch.isfinite(layer.values[b]).all()

    for length, value in ((5, 1), (3, 2), (9, 3)):  # the third is longer than the free columns: reallocated
        cache.admit([kv(length, value)], rows=4, room=6)
        expected.append((length, value))
        check()
    slab = cache.layers[0]._k
    for layer in cache.layers:  # one decoding step for every row
        layer.update(torch.full((3, 2, 1, 4), 7.0), torch.full((3, 2, 1, 4), -7.0))
    cache.remove(0)  # the last row (value 3) moves to row 0
    expected = [(10, 3), (4, 2)]
    assert cache.width == 10
    for layer in cache.layers:
        assert torch.all(layer.keys[:, :, -1] == 7)
        layer.keys[:, :, -1] = layer.keys[:, :, -2]  # make the check below uniform
        layer.values[:, :, -1] = layer.values[:, :, -2]
    check()
    for layer in cache.layers:  # whatever is not live may hold anything (the slab is allocated uninitialized)
        for t in (layer._k, layer._v):
            t[layer.n:] = float("nan")
            t[:, :, : layer.start] = float("nan")
    cache.admit([kv(8, 4)], rows=4, room=2)  # fits: written in place, into a row that held garbage
    expected.append((8, 4))
    check()
    cache.admit([kv(12, 8)], rows=4, room=2)  # in place, longer than the batch: older rows get zeroed padding
    assert cache.layers[0]._k is slab
    expected.append((12, 8))
    check()
    cache.admit([kv(2, 5), kv(20, 6)], rows=6, room=2)  # several at once: one reallocation for the longest
    expected += [(2, 5), (20, 6)]
    check()




def test_keep_in_row_keeps_each_heads_columns_right_aligned_and_pads_the_rest():
    """A sparse row's re-selection: per layer and head its own columns, the same count, at the row's end; the
    freed columns are zeroed padding; the other rows and the mask's start follow."""
    cache = BatchKV()
    rows = []
    for length in (6, 4):
        layers = []
        for layer in range(2):
            keys = torch.arange(length, dtype=torch.float32).view(1, 1, length, 1).expand(1, 2, length, 4).clone()
            keys[:, 1] += 100 + 10 * layer  # head 1 and layer 1 differ
            layers.append((keys, -keys))
        rows.append(layers)
    cache.admit(rows, rows=2, room=4)
    other = cache.layers[0].keys[1].clone()
    picks = [torch.tensor([[0, 2, 5], [1, 3, 4]]), torch.tensor([[1, 2, 3], [0, 4, 5]])]
    cache.keep_in_row(0, picks)
    assert cache.width == 4 and cache.pad(0) == 1 and cache.pad(1) == 0  # the longer row is now row 1
    for layer, picked in zip(cache.layers, picks):
        row = layer.keys[0]
        assert torch.all(row[:, 0] == 0) and torch.all(layer.values[0, :, 0] == 0)  # padding
        for head in range(2):
            base = 0 if head == 0 else 100 + 10 * cache.layers.index(layer)
            assert row[head, 1:, 0].tolist() == [base + p for p in picked[head].tolist()]
            assert torch.equal(layer.values[0, head, 1:], -row[head, 1:])
    assert torch.equal(cache.layers[0].keys[1], other[:, -4:])


def test_a_byte_bound_gives_up_headroom_before_it_is_exceeded():
    per_token = token_bytes(kv(1, 0))
    free = BatchKV()
    free.admit([kv(10, 1), kv(10, 2)], rows=8, room=5)
    allocated = sum(layer._k.nbytes + layer._v.nbytes for layer in free.layers)
    assert allocated > 8 * 15 * per_token  # rows for every possible member, columns with headroom
    for bound in (2 * 15 * per_token, 2 * 20 * per_token):
        bounded = BatchKV()
        bounded.admit([kv(10, 1), kv(10, 2)], rows=8, room=5, max_bytes=bound)
        assert sum(layer._k.nbytes + layer._v.nbytes for layer in bounded.layers) <= bound
        bounded.admit([kv(7, 3)], rows=8, room=5, max_bytes=3 * 15 * per_token)  # a joiner: reallocated, still bound
        assert bounded.rows == 3 and sum(layer._k.nbytes + layer._v.nbytes for layer in bounded.layers) <= 3 * 15 * per_token
        assert torch.all(bounded.layers[0].keys[2, :, bounded.pad(2):] == 3)
