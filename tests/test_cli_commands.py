"""Every `attnstore` command run at its smallest size, in-process (`main(argv)`): its exit status and the
rows of the table it prints. A tiny random Llama saved to a folder stands in for the model where the command
takes `--model`; `demo` (SmolLM2 only) and `eval mmlu` (lm-eval, about a minute) are integration tests."""

from __future__ import annotations

import io
import json
import re

import pytest

from hf_attnstore.cli import main



def rows(text: str) -> list[list[str]]:
    """The body rows of the Markdown tables in `text`, as lists of cells."""
    out = []
    for line in text.splitlines():
        if line.startswith("|") and not line.startswith("| ---"):
            out.append([cell.strip() for cell in line.strip("|").split("|")])
    return out


def test_replay_runs_the_systems_asked_for(model_dir, tmp_path, capsys):
    records = tmp_path / "replay.json"
    argv = ["replay", "--model", model_dir, "--conversations", "2", "--max-turns", "2", "--max-user-tokens", "16",
            "--max-reply-tokens", "16", "--window", "256", "--rate", "10", "--think", "0.1",
            "--policies", "lookahead,lru", "--json", str(records)]
    assert main(argv) == 0
    table = rows(capsys.readouterr().out)
    systems = [r[0] for r in table[1:]]
    assert systems == ["RE", "AS lookahead + prefetch", "AS lru"], table
    saved = json.loads(records.read_text())
    assert saved["config"]["conversations"] == 2 and sorted(saved["turns"]) == sorted(systems)
    assert main([*argv[:-2], "--policies", "fifo", "--no-recompute"]) == 0
    assert [r[0] for r in rows(capsys.readouterr().out)[1:]] == ["AS fifo"]


def test_eval_ppl_prints_a_row_per_mode(model_dir, capsys):
    assert main(["eval", "ppl", "--model", model_dir, "--corpora", "pydoc", "--limit", "1", "--length", "192",
                 "--window", "96", "--chunk", "32", "--modes", "recompute,naive"]) == 0
    out = capsys.readouterr().out
    assert "pydoc:" in out and "window 96, turns of 32 tokens" in out
    table = rows(out)
    assert [r[:2] for r in table[1:]] == [["recompute", "4"], ["naive", "4"]], table
    assert all(float(r[2]) > 1 for r in table[1:])  # perplexities


def test_eval_sparse_prints_a_row_per_policy_and_sparsity(model_dir, capsys):
    assert main(["eval", "sparse", "--model", model_dir, "--corpora", "pydoc", "--limit", "1", "--length", "128",
                 "--chunk", "32", "--score-from", "64", "--sparsities", "0.5", "--policies", "dense,alisa"]) == 0
    table = rows(capsys.readouterr().out)
    assert [r[:2] for r in table[1:]] == [["dense", "0%"], ["alisa", "50%"]], table


def test_eval_fidelity_finds_float32_resumption_identical(model_dir, capsys):
    assert main(["eval", "fidelity", "--model", model_dir, "--dtypes", "float32", "--turns", "3",
                 "--max-new-tokens", "3", "--max-user-tokens", "16"]) == 0
    (row,) = rows(capsys.readouterr().out)[1:]
    assert row[0] == "float32" and row[1] == "3" and row[2].startswith("3/3"), row


def test_chat_reads_stdin_and_resumes_its_session(model_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello there\nAnd again?\n/stats\n/reset\n/stats\n/quit\n"))
    assert main(["chat", "--model", model_dir, "--session", "t", "--max-new-tokens", "3",
                 "--disk-dir", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "[miss: reused 0/" in err and re.search(r"\[host: reused [1-9]", err), err
    assert "'tokens': 0" in err  # /stats after /reset


@pytest.mark.integration
def test_eval_mmlu_prints_a_row_per_mode(model_dir, capsys):
    assert main(["eval", "mmlu", "--model", model_dir, "--limit", "2", "--window", "256",
                 "--modes", "none,recompute"]) == 0
    table = rows(capsys.readouterr().out)
    assert [r[0] for r in table[1:]] == ["none", "recompute"], table


@pytest.mark.integration
def test_demo_on_smollm2(capsys, tmp_path):
    plot = tmp_path / "demo.png"
    assert main(["demo", "--conversations", "1", "--turns", "2", "--max-new-tokens", "4",
                 "--max-user-tokens", "16", "--plot", str(plot)]) == 0  # 0: greedy outputs identical to recomputation
    out = capsys.readouterr().out
    assert "greedy outputs identical to recomputation: 2/2 turns" in out, out
    assert out.count("Loading") == 1 and "TTFT AS: time to first token" in out  # one loading line, the legend
    first, second = [line for line in out.splitlines() if re.match(r"\S+\s+[12]\s+\d+", line)]
    assert first.endswith("(first turn: nothing to reuse)") and "first turn" not in second, out
    assert re.search(r"resumed turns \(2nd and later, 1 of 2\): mean TTFT \d+ ms with the store \(AS\) vs \d+ ms "
                     r"recomputing \(RE\): -?\d+% lower", out), out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
