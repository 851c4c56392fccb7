"""The replay: the trace, the virtual-time driver (exact on a fake pipeline), and RE vs AS on a tiny model."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

import pytest

from hf_attnstore.lab.costs import CostModel
from hf_attnstore.serving.pipeline import Reply
from hf_attnstore.lab.replay import ReplayConfig, Trace, build_trace, drive, report, run_recompute, run_store, same_outputs

from ..conftest import char_tokenizer, make_tiny


@dataclass
class Conv:
    id: str
    turns: list


CONVS = [Conv(f"c{i}", [(f"question {i}.{k} " + "x" * (5 * k), f"answer {i}.{k} " + "y" * 20) for k in range(4)])
         for i in range(5)]


def test_trace_is_clipped_seeded_and_has_unique_ids():
    tok = char_tokenizer()
    cfg = ReplayConfig(conversations=4, max_turns=3, max_user_tokens=12, max_reply_tokens=8, context_window=64)
    a, b = build_trace(tok, cfg, CONVS), build_trace(tok, cfg, CONVS)
    assert a == b  # the seed fixes arrivals and think times
    assert a.session_ids == ["s00000", "s00001", "s00002", "s00003"] and a.num_turns == 12
    assert a.turns[0][0] == ("question 0.0", "answer 0")  # 12 and 8 characters: one token each
    assert all(x < y for x, y in zip(a.arrivals, a.arrivals[1:]))
    assert all(len(t) == 3 and min(t) >= 0 for t in a.think_s)
    generated = build_trace(tok, ReplayConfig(**{**cfg.__dict__, "replies": "generate"}), CONVS)
    assert all(reply is None for turns in generated.turns for _, reply in turns)


class FakePipeline:
    """Serves each turn in `service` seconds and records what was queued when."""

    def __init__(self, service: float):
        self.service, self.submitted = service, []

    def submit(self, session_id, message, reply=None):
        self.submitted.append((session_id, message))
        f = Future()
        f.set_result(Reply(session_id, reply or "", 10, 0, 10, 1, 0, ttft_s=0.1, total_s=self.service,
                           kv_source="recompute"))
        return f


def test_driver_runs_one_server_in_virtual_time():
    trace = Trace(["a", "b"], [[("a1", "r"), ("a2", "r")], [("b1", "r")]], arrivals=[1.0, 1.5],
                  think_s=[[0.25, 0.0], [0.0]])
    records, end = drive(FakePipeline(service=1.0), trace, progress=False)
    got = [(r.session, r.turn, r.arrival_s, r.start_s) for r in records]
    # a1 runs 1-2; b1 arrived at 1.5 and waits until 2; a2 arrives at 2 + 0.25 while b1 runs, starts at 3.
    assert got == [(0, 0, 1.0, 1.0), (1, 0, 1.5, 2.0), (0, 1, 2.25, 3.0)]
    assert end == 4.0
    assert records[1].ttft_queued_s == pytest.approx(0.5 + 0.1)


def test_bad_configs():
    for bad in (dict(conversations=0), dict(arrival_rate=0), dict(think_time_s=-1), dict(replies="x"),
                dict(max_user_tokens=1024, context_window=2048), dict(host_fraction=0), dict(max_turns=0)):
        with pytest.raises(ValueError):
            ReplayConfig(**bad)


def test_cost_model():
    c = CostModel().cost(3600, dram_bytes=100e9, ssd_bytes=1000e9, duration_s=7200)
    assert c["gpu"] == 5.0 and c["dram"] == pytest.approx(100 * 2 * 0.0088)
    assert c["ssd"] == pytest.approx(1000 * 2 * 0.000082) and c["total"] == pytest.approx(sum(
        v for k, v in c.items() if k != "total"))
    with pytest.raises(ValueError):
        CostModel().cost(-1)


def test_recompute_and_store_replay_the_same_trace(tmp_path, capsys):
    model, tok = make_tiny("llama"), char_tokenizer()
    # A window small enough that later turns overflow; a host tier for about one session, disk for all.
    cfg = ReplayConfig(conversations=5, max_user_tokens=40, max_reply_tokens=24, context_window=160,
                       arrival_rate=2.0, think_time_s=0.5, host_fraction=0.2, timeout_s=60)
    trace = build_trace(tok, cfg, CONVS)
    re = run_recompute(model, tok, trace, cfg, progress=False)
    store = run_store(model, tok, trace, cfg, progress=False)
    for run in (re, store):
        assert sorted((r.session, r.turn) for r in run.records) == [(i, k) for i in range(5) for k in range(4)]
    assert all(r.reply.reused_tokens == 0 for r in re.records)
    resumed = [r.reply for r in store.records if r.turn > 0]
    assert all(r.tier in ("host", "disk") and r.reused_tokens > 0 for r in resumed)
    same, compared = same_outputs(re, store)
    assert compared >= 10 and same == compared  # every untruncated turn: the same greedy tokens
    assert any(r.reply.dropped_tokens for r in store.records)  # the window overflowed on the way
    s_re, s_as = re.summary(), store.summary()
    assert s_re["miss"] == 1.0 and s_re["cost"]["dram"] == 0
    assert s_as["hit_host"] + s_as["hit_disk"] == 1.0 and s_as["cost"]["dram"] > 0
    assert s_as["reused_share"] > 0.3 and store.peak_disk_bytes > 0 and store.stats.bytes_written > 0
    assert 0 < store.peak_host_bytes <= store.host_bytes

    # The report: both runs on one trace, a table, the identity line, a plot and a JSON file.
    report(model, tok, cfg, [("lookahead", True)], plot_path=str(tmp_path / "r.png"),
           json_path=str(tmp_path / "r.json"), progress=False, conversations=CONVS)
    out = capsys.readouterr().out
    assert "| RE |" in out and "| AS lookahead + prefetch |" in out and "identical to RE on" in out
    assert (tmp_path / "r.png").stat().st_size > 1000 and (tmp_path / "r.json").stat().st_size > 100


def test_generated_replies_are_the_same_with_and_without_the_store():
    model, tok = make_tiny("llama"), char_tokenizer()
    cfg = ReplayConfig(conversations=2, max_turns=3, max_user_tokens=20, replies="generate", max_new_tokens=4,
                       context_window=400, timeout_s=60)
    trace = build_trace(tok, cfg, CONVS)
    re, store = run_recompute(model, tok, trace, cfg, progress=False), run_store(model, tok, trace, cfg, progress=False)
    assert same_outputs(re, store) == (6, 6)
    assert all(len(r.reply.greedy_ids) == 4 for r in store.records)
    assert sum(r.reply.reused_tokens for r in store.records) > 0
