"""`attnstore simulate --trace`: the JSON object it promises, the tables, and clean refusals of bad input."""

from __future__ import annotations

import json

import pytest

from hf_attnstore.cli import main
from hf_attnstore.lab.trace_sim import TraceSimConfig, belady_hit_rate, simulate_trace
from hf_attnstore.lab.traces import chat_trace, load_trace, write_trace


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("trace") / "chat.jsonl"
    write_trace(chat_trace(conversations=60, seed=2), path)
    return path


def test_json_holds_every_policy_at_every_capacity_with_the_bounds(trace_file, capsys):
    assert main(["simulate", "--trace", str(trace_file), "--host-tokens", "20K", "50000",
                 "--policies", "lru,retention", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    reqs = load_trace(trace_file)
    assert out["requests"] == len(reqs) and out["input_tokens"] == sum(r.input_length for r in reqs)
    assert [(r["host_tokens"], r["policy"]) for r in out["results"]] == [
        (20_000, "lru"), (20_000, "retention"), (50_000, "lru"), (50_000, "retention")]
    lru = simulate_trace(reqs, TraceSimConfig(20_000, "lru")).token_hit_rate
    assert out["results"][0]["token_hit_rate"] == pytest.approx(lru) and 0 < lru < 1
    assert [b["host_tokens"] for b in out["bounds"]] == [20_000, 50_000]
    assert out["bounds"][1]["belady"] == pytest.approx(belady_hit_rate(reqs, 50_000))
    for b in out["bounds"]:
        assert b["belady"] <= b["infinite"]
    assert set(out["results"][0]["costs"]) == {"llama-13b", "llama-70b"}


def test_tables_are_printed_by_default(trace_file, capsys):
    assert main(["simulate", "--trace", str(trace_file), "--host-tokens", "20K", "--policies", "lru-leaf",
                 "--disk-tokens", "100K", "--window", "4", "--models", "llama-70b"]) == 0
    out = capsys.readouterr().out
    assert "| host tokens | lru-leaf | Belady | Belady (leaf ties) | infinite | Belady (host + disk) |" in out
    assert "look-ahead window 4 requests; disk tier 0.1M tokens" in out
    assert "| LLaMA-70B | 20K | lru-leaf |" in out


def test_bad_input_is_refused_with_a_message(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n{"timestamp": 1}\n')
    assert main(["simulate", "--trace", str(bad)]) == 2
    assert f"{bad}:2: missing field(s)" in capsys.readouterr().err
    assert main(["simulate", "--trace", str(tmp_path / "absent.jsonl")]) == 2
    assert "absent.jsonl" in capsys.readouterr().err
    assert main(["simulate", "--trace", str(bad), "--policies", "mru"]) == 2
    with pytest.raises(SystemExit):
        main(["simulate", "--trace", str(bad), "--host-tokens", "-5"])
    assert "'-5' must be a whole number of tokens" in capsys.readouterr().err


def test_with_a_disk_tier_policies_are_compared_with_belady_at_both_tiers_capacity(trace_file, capsys):
    assert main(["simulate", "--trace", str(trace_file), "--host-tokens", "20K", "--disk-tokens", "30K",
                 "--policies", "lru", "--models", "", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    reqs = load_trace(trace_file)
    both = belady_hit_rate(reqs, 50_000)
    assert out["bounds"][0]["belady_host_and_disk"] == pytest.approx(both)
    lru = simulate_trace(reqs, TraceSimConfig(20_000, "lru", disk_tokens=30_000)).token_hit_rate
    assert out["results"][0]["of_belady"] == pytest.approx(lru / both)


def test_gaps_prints_where_each_policy_hits_by_reuse_distance(trace_file, capsys):
    assert main(["simulate", "--trace", str(trace_file), "--host-tokens", "20K", "--policies", "lru,slru",
                 "--models", "", "--gaps"]) == 0
    out = capsys.readouterr().out
    assert "| gap (requests) | reused tokens | lru | slru | Belady |" in out
    gap_rows = [line for line in out.splitlines() if line.startswith("| 1-1 |") or line.startswith("| 2-3 |")]
    assert gap_rows, out


def test_instances_serve_the_trace_on_a_prefill_cluster(trace_file, capsys):
    assert main(["simulate", "--trace", str(trace_file), "--host-tokens", "20K", "--policies", "lru-leaf",
                 "--models", "llama-70b", "--instances", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    costs = out["results"][0]["costs"]["llama-70b"]
    assert out["instances"] == 2 and out["utilization"] > 0
    assert costs["ttft_mean_s"] >= costs["wait_mean_s"] >= 0 and costs["queued_mean"] >= 0
    assert main(["simulate", "--trace", str(trace_file), "--instances", "2"]) == 2  # two default models
    assert "name exactly one model" in capsys.readouterr().err
    assert main(["simulate", "--trace", str(trace_file), "--instances", "-1", "--models", "llama-70b"]) == 2
    assert "`instances`=-1" in capsys.readouterr().err


def test_replay_prints_the_store_beside_the_simulator(trace_file, capsys):
    assert main(["simulate", "--trace", str(trace_file), "--replay", "40", "--replay-block", "8",
                 "--host-tokens", "10K", "--policies", "lru,slru"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| 40 |")]
    assert len(rows) == 2 and all("| yes |" in row for row in rows)
    assert rows[0].startswith("| 40 | 8 | 19 | lru |") and "The first 40 requests" in out


def test_replay_through_the_pipeline(trace_file, capsys):
    assert main(["simulate", "--trace", str(trace_file), "--replay", "40", "--replay-block", "8",
                 "--host-tokens", "10K", "--policies", "slru", "--replay-through", "pipeline"]) == 0
    out = capsys.readouterr().out
    (row,) = [line for line in out.splitlines() if line.startswith("| 40 |")]
    assert "| yes |" in row and "same argmax" in row and "ChatPipeline" in out


def test_replay_refuses_what_it_does_not_replay(trace_file, capsys):
    assert main(["simulate", "--trace", str(trace_file), "--replay", "5", "--window", "4"]) == 2
    assert "--window" in capsys.readouterr().err
    assert main(["simulate", "--trace", str(trace_file), "--replay", "5", "--instances", "2"]) == 2
    assert "--instances" in capsys.readouterr().err
    assert main(["simulate", "--trace", str(trace_file), "--replay", "5", "--host-tokens", "100"]) == 2
    assert "capacity in blocks" in capsys.readouterr().err
