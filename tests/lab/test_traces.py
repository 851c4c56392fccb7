"""Reading Mooncake-format traces: what a valid line gives, and a clear ValueError naming the line otherwise."""

from __future__ import annotations

import json

import pytest

from hf_attnstore.lab.traces import TraceRequest, block_tokens, chat_trace, load_trace, write_trace


def write_lines(path, objs):
    path.write_text("".join((o if isinstance(o, str) else json.dumps(o)) + "\n" for o in objs))
    return path


def req(ts, n_in, ids, n_out=1):
    return {"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": ids}


def test_reads_requests_in_order_with_partial_last_blocks(tmp_path):
    path = write_lines(tmp_path / "t.jsonl", [req(0, 1300, [1, 2, 3]), "", req(7.5, 512, [1], 9)])
    reqs = load_trace(path)
    assert reqs == [TraceRequest(0.0, 1300, 1, (1, 2, 3)), TraceRequest(7.5, 512, 9, (1,))]
    assert [block_tokens(reqs[0], k) for k in range(3)] == [512, 512, 276]
    assert len(load_trace(path, limit=1)) == 1


@pytest.mark.parametrize("line, message", [
    ("{not json", "t.jsonl:2: not JSON"),
    ("[1, 2]", "t.jsonl:2: expected a JSON object"),
    (json.dumps({"timestamp": 1, "input_length": 5}), "missing field(s) `output_length`, `hash_ids`"),
    (json.dumps(req(1, -5, [])), "`input_length`=-5"),
    (json.dumps(req(1, 5, [4], n_out=-1)), "`output_length`=-1"),
    (json.dumps(req(1, 10**12, [4])), "`input_length`=1000000000000"),
    (json.dumps(req(-1, 5, [4])), "`timestamp`=-1"),
    (json.dumps(req(1, 5, ["x"])), "`hash_ids` must be a list of integers"),
    (json.dumps(req(1, 1025, [4, 5])), "2 `hash_ids` for `input_length`=1025: expected 3 blocks"),
    (json.dumps(req(1, 1024, [1, 9])), "block 9 comes after block 1 here but after None earlier"),
])
def test_malformed_lines_are_named(tmp_path, line, message):
    path = write_lines(tmp_path / "t.jsonl", [req(0, 600, [9, 10]), line])
    with pytest.raises(ValueError) as e:
        load_trace(path)
    assert message in str(e.value)


def test_out_of_order_and_empty_traces_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"t.jsonl:2: `timestamp` 1.0 is before"):
        load_trace(write_lines(tmp_path / "t.jsonl", [req(5, 1, [1]), req(1, 1, [2])]))
    with pytest.raises(ValueError, match="holds no requests"):
        load_trace(write_lines(tmp_path / "e.jsonl", [""]))
    with pytest.raises(ValueError, match="`limit`=0"):
        load_trace(tmp_path / "t.jsonl", limit=0)


def test_chat_trace_is_deterministic_prefix_addressed_and_round_trips(tmp_path):
    a, b = chat_trace(conversations=50, seed=3), chat_trace(conversations=50, seed=3)
    assert a == b and a != chat_trace(conversations=50, seed=4)
    write_trace(a, tmp_path / "chat.jsonl")
    assert load_trace(tmp_path / "chat.jsonl") == a  # valid: block counts, order, one prefix per block
    # Later turns of a conversation reuse the earlier turn's full blocks: some request starts with another's.
    starts = {r.hash_ids[:2] for r in a if len(r.hash_ids) > 2}
    assert any(r.hash_ids[:2] in starts for r in a if len(r.hash_ids) == 2) or len(starts) < len(a)
