"""A query-aware session's history in host memory (cache/host_history.py, `SparseConfig(history_on_host=True)`).

What must hold, fp32: with the history on the host a decoding step attends to exactly what the same policy attends
to with the history on the device (same selection, same keys and values in the same order), so greedy decoding gives
the same tokens, through `generate` and through a resumed session, and a prompt fed in two forwards the same logits;
each step moves from the host exactly its chosen tokens' rows (keys and values for Quest, values for SparQ, whose
keys stay on the device), and the device holds exactly the sinks, the last step's recent window on and Quest's page
summaries (SparQ: every key too); a window that must reach back gets its rows from the host.
"""

from __future__ import annotations

import pytest
import torch

from hf_attnstore import AttnStore, AttnStoreCache, SparseConfig
from hf_attnstore.cache import query_aware
from hf_attnstore.cache.host_history import GatherBuffers, HostHistory, HostRows, Window
from hf_attnstore.cache.query_aware import Selection, _quest_layout, recent_start, selecting
from hf_attnstore.cache.upstream import cache_kwargs

from ..conftest import make_tiny, random_ids
from .test_sparse import GREEDY


def _config(policy: str, host: bool, slope: float = 0.0) -> SparseConfig:
    return SparseConfig(0.25, sink_tokens=3, policy=policy, page_tokens=4, sketch_dims=4, history_on_host=host,
                        layer_slope=slope)


def _session(model, policy: str, host: bool, ids, new: int = 20, slope: float = 0.0):
    """A first turn of `ids` and `new` generated tokens, then a resumed turn of 5 more ids and `new` tokens."""
    store = AttnStore(host_bytes="64MiB")
    config = _config(policy, host, slope)
    first = AttnStoreCache(model, store, "s", ids, kv_budget=config)
    out = model.generate(first.input_ids, **cache_kwargs(first), max_new_tokens=new, **GREEDY)
    first.close()
    store.flush()
    later = torch.cat([out, random_ids(5, 7).to(out.device)], dim=1)
    second = AttnStoreCache(model, store, "s", later, kv_budget=config)
    again = model.generate(second.input_ids, **cache_kwargs(second), max_new_tokens=new, **GREEDY)
    return out, again, second


@pytest.mark.parametrize("policy", ["quest", "sparq"])
def test_greedy_decoding_with_the_history_on_the_host_equals_it_on_the_device(policy):
    model = make_tiny("llama")
    ids = random_ids(60, 3)
    out, again, device_cache = _session(model, policy, False, ids)
    host_out, host_again, cache = _session(model, policy, True, ids)
    assert torch.equal(out, host_out) and torch.equal(again, host_again)
    assert cache.reused_tokens == out.shape[1] - 1 > 60  # the second turn resumed the stored session
    assert cache.get_seq_length() == device_cache.get_seq_length() == again.shape[1] - 1
    assert cache.turn.sparse_from == device_cache.turn.sparse_from is not None  # labels stay true
    selection = cache.turn.selection
    assert set(selection.host) == set(range(model.config.num_hidden_layers))
    assert selection.steps == device_cache.turn.selection.steps > 0
    assert all(h.steps == 19 and h.whole_bytes == 0 for h in selection.host.values())  # the load gave the prompt
    dense = AttnStoreCache(model, AttnStore(host_bytes="64MiB"), "d", ids)
    assert not torch.equal(out, model.generate(dense.input_ids, **cache_kwargs(dense), max_new_tokens=20, **GREEDY))


@pytest.mark.parametrize("policy", ["quest", "sparq"])
def test_with_a_budget_per_layer_the_host_history_still_equals_the_device_history(policy):
    """A pyramid (`layer_slope`): each layer keeps its own recent window on the device (`recent_start` of its own
    budget) and selects its own budget; the tokens are still those of the history on the device, and not the
    uniform budget's."""
    model = make_tiny("llama")
    ids = random_ids(60, 3)
    out, again, device_cache = _session(model, policy, False, ids, slope=0.6)
    host_out, host_again, cache = _session(model, policy, True, ids, slope=0.6)
    assert torch.equal(out, host_out) and torch.equal(again, host_again)
    assert cache.turn.selection.steps == device_cache.turn.selection.steps > 0
    uniform, _, _ = _session(model, policy, False, ids)
    assert not torch.equal(out, uniform)
    total = again.shape[1] - 1
    starts = [recent_start(layer.config, total - 1) for layer in cache.layers]
    # The first layer's larger budget has the longer recent window (Quest's reaches back to a page's end: at most).
    assert starts[0] < starts[-1] if policy == "sparq" else starts[0] <= starts[-1]
    for idx, start in enumerate(starts):  # each device holds its sinks and its own last window on (SparQ: all keys)
        assert cache.turn.selection.host[idx].values.window.length == 3 + total - start


@pytest.mark.parametrize("policy", ["quest", "sparq"])
def test_each_step_moves_its_chosen_rows_and_the_device_holds_what_was_claimed(policy):
    model = make_tiny("llama")
    _, again, cache = _session(model, policy, True, random_ids(60, 4))
    config = cache.sparse
    layer = cache.layers[0]
    kv_heads, dim = layer.keys.shape[1], layer.keys.shape[3]
    row = kv_heads * dim * 4  # one token's keys (or values), one layer, fp32
    total = again.shape[1] - 1
    start = total - 19  # the turn's 19 decoding steps saw histories start .. total - 1
    chosen = 0
    for history in range(start, total):
        keep, sinks, recent, _, pages = _quest_layout(config, history)
        if policy == "sparq":
            sinks, recent = config.split(keep, history)
        chosen += pages * config.page_tokens if policy == "quest" else keep - sinks - recent
    moved = chosen * row * (2 if policy == "quest" else 1)  # SparQ's keys are on the device: values alone move
    last = total - 1
    window = config.sink_tokens + total - recent_start(config, last)  # sinks, then the last step's recent window on
    for idx, layer in enumerate(cache.layers):
        host = cache.turn.selection.host[idx]
        assert host.step_bytes == moved and host.refill_bytes == 0
        assert host.values.window.length == window
        assert host.keys.window.length == (total if policy == "sparq" else window)
        assert host.device_nbytes == layer.keys.nbytes + layer.values.nbytes == (
            host.keys.window.length + window) * row
        assert host.host_nbytes == total * row * (1 if policy == "sparq" else 2)
    summaries = cache.turn.selection.summaries
    assert (len(summaries) == model.config.num_hidden_layers) == (policy == "quest")  # on the device: min and max
    if policy == "quest":
        pages = summaries[0].pages
        assert summaries[0].nbytes == 2 * kv_heads * pages * dim * 4 and pages > 0


@pytest.mark.parametrize("policy", ["quest", "sparq"])
def test_a_prompt_in_two_forwards_attends_to_the_whole_history_from_the_host(policy):
    model = make_tiny("llama")
    ids = random_ids(70, 5)
    logits = []
    for host in (False, True):
        cache = AttnStoreCache(model, AttnStore(host_bytes="64MiB"), "p", ids, kv_budget=_config(policy, host))
        with torch.no_grad():
            model(ids[:, :40], **cache_kwargs(cache))
            logits.append(model(ids[:, 40:], **cache_kwargs(cache)).logits)
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=0)
    assert cache.get_seq_length() == 70 and cache.layers[0].values.shape[2] < 70  # the device holds a window
    assert all(h.whole_bytes > 0 and h.steps == 0 for h in cache.turn.selection.host.values())


def test_a_step_gathers_the_chosen_rows_between_the_sinks_and_the_recent_window():
    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(1, 2, 30, 4, generator=g), torch.randn(1, 2, 30, 4, generator=g)
    history = HostHistory(sinks=2, keys_on_device=False, buffers=GatherBuffers())
    history.keep_from(25)
    history.append(keys, values)  # 29 history tokens and the step's own
    chosen = torch.tensor([[3, 4, 10], [7, 8, 20]])
    k, v = history.step(2, chosen, 4, 29)
    for x, out in ((keys, k), (values, v)):
        expected = torch.cat([x[:, :, :2], x[0, :, None].gather(2, chosen[:, None, :, None].expand(-1, -1, -1, 4))
                              .transpose(0, 1), x[:, :, 25:]], dim=2)
        assert torch.equal(out, expected)
    assert history.step_bytes == 2 * (2 * 3 * 4 * 4) and history.steps == 1  # 3 rows per head, keys and values
    with pytest.raises(AssertionError, match="recent rows"):
        history.step(2, chosen, 6, 29)  # a window from 23: the device no longer holds 23 and 24


@pytest.mark.parametrize("policy", ["quest", "sparq"])
@pytest.mark.parametrize("masked", [False, True])
def test_the_attention_over_a_host_history_equals_it_over_the_device_history(policy, masked):
    """A step with no mask gathers from the host; one given a mask (padding) attends to the whole history copied
    from the host, narrowed by the selection and the mask."""
    g = torch.Generator().manual_seed(1)
    query = torch.randn(1, 4, 1, 8, generator=g)
    keys, values = torch.randn(1, 2, 90, 8, generator=g), torch.randn(1, 2, 90, 8, generator=g)
    given = torch.ones(1, 1, 1, 90, dtype=torch.bool)
    given[..., 10:14] = False
    mask = given if masked else None
    config = _config(policy, True)
    module = type("Attention", (), {"layer_idx": 0, "is_causal": True, "num_key_value_groups": 2, "training": False})()
    with selecting(Selection(_config(policy, False))):
        expected, _ = query_aware.attention(module, query, keys, values, mask, scaling=0.3)
    history = HostHistory(config.sink_tokens, policy == "sparq", GatherBuffers())
    history.keep_from(recent_start(config, 89))
    history.append(keys, values)
    selection = Selection(config)
    selection.host[0] = history
    with selecting(selection):
        out, _ = query_aware.attention(module, query, *history.resident(), mask, scaling=0.3)
    assert torch.equal(out, expected)
    assert (history.steps, history.whole_bytes > 0) == ((0, True) if masked else (1, False))


def test_a_window_drops_rows_before_its_start_and_gets_them_back_from_the_host():
    x = torch.arange(12.0).view(1, 1, 12, 1)
    host, window = HostRows(), Window(sinks=2)
    host.append(x)
    window.append(x)
    assert window.keep_from(8, host) == 0 and window.view().flatten().tolist() == [0, 1, 8, 9, 10, 11]
    assert window.keep_from(5, host) == 3 * 4  # 5, 6, 7 come back
    assert window.view().flatten().tolist() == [0, 1, 5, 6, 7, 8, 9, 10, 11]
    assert window.keep_from(1, host) == 3 * 4 and window.view().flatten().tolist() == list(range(12))


def test_history_on_host_is_validated():
    with pytest.raises(ValueError, match="policy='quest' or 'sparq'"):
        SparseConfig(0.2, policy="oracle", history_on_host=True)
    with pytest.raises(ValueError, match="policy='quest' or 'sparq'"):
        SparseConfig(0.2, history_on_host=True)  # alisa
    with pytest.raises(ValueError, match="True or False"):
        SparseConfig(0.2, policy="quest", history_on_host="yes")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.cuda
@pytest.mark.parametrize("policy", ["quest", "sparq"])
def test_on_cuda_the_history_is_pinned_on_the_host_and_decoding_equals_the_device_history(policy):
    model = make_tiny("llama").cuda()
    ids = random_ids(60, 3).cuda()
    out, again, _ = _session(model, policy, False, ids)
    host_out, host_again, cache = _session(model, policy, True, ids)
    assert torch.equal(out, host_out) and torch.equal(again, host_again)
    host = cache.turn.selection.host[0]
    assert host.values.host.rows.is_pinned() and not host.values.host.rows.is_cuda
    assert host.values.window.buf.is_cuda and host.step_bytes > 0
