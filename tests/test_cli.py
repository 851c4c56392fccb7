"""The `attnstore` command line, on the real SmolLM2 (integration)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hf_attnstore.cli import build_parser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_parser_knows_the_commands():
    parser = build_parser()
    assert parser.parse_args(["chat", "--session", "x"]).session == "x"
    assert parser.parse_args(["replay", "--conversations", "3"]).conversations == 3
    serve = parser.parse_args(["serve", "--max-batch-size", "4", "--max-batch-tokens", "256"])
    assert (serve.max_batch_size, serve.max_batch_tokens) == (4, 256)
    assert parser.parse_args(["serve"]).max_batch_tokens is None  # whole prompts by default
    assert parser.parse_args(["serve"]).kv_codec == "none"  # lossless by default
    assert parser.parse_args(["serve"]).recompute_by_cost is False  # stored sessions are loaded by default
    assert parser.parse_args(["serve", "--recompute-by-cost"]).recompute_by_cost is True
    assert parser.parse_args(["chat", "--kv-codec", "int4"]).kv_codec == "int4"
    # A server starts with its remote tier down (a cache), unless told to fail fast.
    assert parser.parse_args(["serve"]).remote_required is False
    assert parser.parse_args(["serve", "--remote-required"]).remote_required is True
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--kv-codec", "int3"])
    # --kv-budget: a fraction (with a point) or a token count, checked as SparseConfig checks it.
    assert parser.parse_args(["serve"]).kv_budget is None
    served = parser.parse_args(["serve", "--kv-budget", "0.2", "--sparse-policy", "h2o"])
    assert (served.kv_budget, served.sparse_policy) == (0.2, "h2o")
    assert parser.parse_args(["serve", "--kv-budget", "512"]).kv_budget == 512
    assert parser.parse_args(["serve", "--sparse-copies"]).sparse_copies is True
    assert parser.parse_args(["serve"]).sparse_copies is False
    assert parser.parse_args(["serve", "--kv-budget", "1.0"]).kv_budget == 1.0
    for bad in ("1.5", "0", "-3", "abc", "0.0", "nan", "inf", "1", "4"):  # "1": a count of one, not "all"
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "--kv-budget", bad])
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--sparse-policy", "tova"])
    sparse = parser.parse_args(["eval", "sparse", "--sparsities", "0.8", "--protocol", "turn"])
    assert (sparse.sparsities, sparse.protocol, sparse.chunk, sparse.layer_slopes) == ("0.8", "turn", 32, "0")
    assert parser.parse_args(["eval", "sparse", "--layer-slopes", "0,0.5"]).layer_slopes == "0,0.5"
    with pytest.raises(SystemExit):
        parser.parse_args(["eval", "sparse", "--protocol", "all"])
    with pytest.raises(SystemExit):
        parser.parse_args(["fly"])


@pytest.mark.integration
def test_chat_repl(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.path.join(ROOT, "src")}
    commands = "Hello there\n/stats\nAnd again?\n/reset\n/stats\n/quit\n"
    run = subprocess.run([sys.executable, "-m", "hf_attnstore", "chat", "--session", "t", "--max-new-tokens", "6",
                          "--disk-dir", str(tmp_path)], input=commands, capture_output=True, text=True,
                         timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip()  # streamed replies
    assert "[miss: reused 0/" in run.stderr and "[host: reused" in run.stderr
    assert "'tokens': 0" in run.stderr  # /stats after /reset
