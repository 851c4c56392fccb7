"""Every script in eval/ runs at a tiny size and checks its own invariants, not its timings.

The scripts check what their runs must have done (every measured resume reused exactly its own session's
history from the tier it measures, every user finished every turn, greedy replies equal recomputation's...) and
exit non-zero otherwise; this module runs each one and checks its exit status, the rows of the Markdown table it
prints, and that it left nothing in the temporary folder. The sizes are tiny (64-token histories, one or two
repetitions: two where a later one could find what an earlier one stored): the numbers mean nothing, the code
paths are the ones a real run takes.

All of them run in one `tests/eval_runner.py` process, which imports torch and transformers once and forks a
child per script (its own process, exit status and log), with one torch thread: about three and a half minutes
on the shared 2-core dev machine. The module runs only the scripts of the tests selected (``-k``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Script:
    """One run of an eval/ script: its arguments (``{tmp}``: a scratch folder) and what its log must show."""

    script: str
    args: tuple[str, ...] = ()
    expect: tuple[str, ...] = ()  # lines or cells its output must contain
    timeout_s: int = 240
    checks: tuple = field(default=())  # functions of the log that raise on a violated invariant


def plain_path(log: str) -> None:
    """trace_turn: a plain resumed turn runs at most 25 package modules, 12 of store/, and its new KV reaches the file
    through at most 8 store modules (docs/design.md, "Following one turn")."""
    limits = {"package modules run": 25, "store modules run": 12, "store modules from a layer's KV to the file": 8}
    for label, limit in limits.items():
        found = re.search(re.escape(label) + r":\s+(\d+)", log)
        assert found and 0 < int(found.group(1)) <= limit, f"{label}: {found and found.group(1)} (at most {limit})"


def same_counts(pattern: str):
    """A check: every match of `pattern` (two numbers) shows equal numbers, and there is at least one."""
    def check(log: str) -> None:
        found = re.findall(pattern, log)
        assert found and all(a == b for a, b in found), f"{pattern}: {found}"
    return check


def forced_calls_reused(log: str) -> None:
    """bench_agents --tools: every forced call came back schema-valid and each request reused >= 90% of the
    agent's previous one (issue 46's bar)."""
    row = re.search(r"\| attnstore \| forced \|(.*)", log)
    assert row, log[-2000:]
    cells = [c.strip() for c in row.group(1).split("|")]
    assert cells[4] == "100%", cells  # valid calls
    assert float(cells[6].rstrip("%")) >= 90, cells  # previous request reused


# Two repetitions where a later one could find an earlier one's stored prompt (a cache hit timed as a resume).
TINY_RESUME = ("--history", "64", "--new", "8", "--reps", "2")
RUNS = {
    "trace_turn": Script("trace_turn.py", ("--list",), checks=(plain_path,)),
    "batch_fidelity": Script("batch_fidelity.py", ("--sessions", "2", "--turns", "2", "--batch", "2",
                                                   "--max-new-tokens", "4", "--max-user-tokens", "16",
                                                   "--dtypes", "float32"),
                             checks=(same_counts(r"\| float32 \| \d+ \| (\d+)/(\d+) \|"),)),
    "bench_agents": Script("bench_agents.py", ("--agents", "2", "--steps", "2", "--systems", "attnstore",
                                               "--max-tokens", "4", "--task-chars", "200", "--budget", "600"),
                           expect=("| attnstore | ",)),
    # With tools: ours forces every call, so each is schema-valid, and a request reuses the one before it.
    "bench_agents-tools": Script("bench_agents.py", ("--tools", "--agents", "2", "--steps", "2", "--systems",
                                                     "attnstore", "--max-tokens", "4", "--task-chars", "200",
                                                     "--budget", "1200"),
                                 checks=(forced_calls_reused,)),
    "bench_router": Script("bench_router.py", ("--users", "2", "--turns", "2", "--think", "0.05", "--max-tokens", "4",
                                               "--message-chars", "40", "--policies", "round_robin", "--kill"),
                           expect=("| round_robin | 4 | 0 |", "| round_robin, replica 0 killed | 4 | 0 |"),
                           timeout_s=600),
    "bench_batch": Script("bench_batch.py", ("--sessions", "2", "--turns", "1", "--batch", "1,2",
                                             "--max-new-tokens", "4", "--message-chars", "200"),
                          expect=("| 1 | ", "| 2 | ")),
    "bench_codec": Script("bench_codec.py", (*TINY_RESUME, "--decode", "2", "--codecs", "none,int8"),
                          expect=("| lossless | ", "| int8 | ", "order of the variants per repetition")),
    "bench_compress": Script("bench_compress.py", ("--history", "64", "--codecs", "none,int4"),
                             expect=("| lossless | ", "| int4 | ")),
    "bench_decode": Script("bench_decode.py", ("--prompt", "16", "--new", "4", "--reps", "2"),
                           expect=("DynamicCache    median", "AttnStoreCache  median", "time in the cache")),
    "bench_decode-resume": Script("bench_decode.py", ("--resume", *TINY_RESUME),
                                  expect=("ideal    median", "AS-host  median")),
    "bench_families": Script("bench_families.py", ("--arch", "lfm2", *TINY_RESUME),
                             expect=("| RE | ", "| AS-host | ", "| AS-disk | ", "states ")),
    "bench_fingerprint": Script("bench_fingerprint.py", ("--no-7b", "--reps", "1"), expect=("memo check",)),
    "bench_partial": Script("bench_partial.py", ("--history", "128", "--new", "8", "--reps", "2", "--heads", "0,64",
                                                 "--chunk", "64"), expect=("| 0 | ", "| 64 | ")),
    "bench_prefill": Script("bench_prefill.py", ("--sessions", "2", "--history", "16", "--new", "8", "--spread",
                                                 "4", "--chunks", "4", "--reps", "1"),
                            expect=("| one at a time | ", "| chunks of 4 | ", "| padded batch | ")),
    "bench_prefix": Script("bench_prefix.py", ("--system", "70", "--question", "8", "--sessions", "2", "--new", "2"),
                           expect=("| 1 | 0 | 0 | ", "| 2 | 77 | 0 | ")),
    "bench_recompute": Script("bench_recompute.py", ("--history", "128", "--new", "8", "--reps", "1",
                                                     "--chunk-tokens", "32", "--tiers", "disk", "--target", "0"),
                              expect=("| disk (cold) | ",)),
    "bench_remote": Script("bench_remote.py", TINY_RESUME, expect=("AS-disk    median", "AS-remote  median")),
    # Two sizes, so the store grows, is timed and reopened twice (the numbers are a real run's only at 1k-100k).
    "bench_scale": Script("bench_scale.py", ("--sizes", "10,20", "--reps", "2", "--system", "128", "--own", "16"),
                          expect=("| sessions held | ", "| 12 | ", "| 22 | ")),
    "bench_serve": Script("bench_serve.py", ("--users", "2", "--turns", "2", "--systems", "attnstore",
                                             "--max-tokens", "4", "--message-chars", "200", "--disk-dir", "{tmp}"),
                          expect=("| 2 | attnstore | ",)),
    "bench_sliding": Script("bench_sliding.py", (*TINY_RESUME, "--decode", "2", "--window", "32"),
                            expect=("| RE | ", "| AS | ")),
    "bench_sparse": Script("bench_sparse.py", ("--histories", "64", "--new", "8", "--decode", "2", "--reps", "1"),
                           expect=("| 64 | dense | ", "| 64 | alisa 80% | ", "| 64 | sparq 80% | ",
                                   "| 64 | quest 80% host | ", "| 64 | sparq 80% host | ")),
    "bench_sparse_batch": Script("bench_sparse_batch.py", ("--sessions", "2", "--history", "32", "--new-tokens", "4",
                                                           "--batch-kv", "64MiB", "--message-chars", "120"),
                                 expect=("| dense, bounded by 64MiB | ", "| alisa 0.2, bounded by 64MiB | ")),
    "bench_sparse_copies": Script("bench_sparse_copies.py", ("--sessions", "1", "--history", "96", "--new", "8",
                                                             "--decode", "4", "--chunk", "16"),
                                  expect=("| whole | ", "| sparse + int8 | ")),
    "bench_tiers": Script("bench_tiers.py", (*TINY_RESUME, "--decode", "2"),
                          expect=("| RE: recompute history + new tokens | ", "| AS-disk, layer-wise, buffer all 30 | ",
                                  "| disk tier, sync saving (flush before returning) | ", "plain sequential read")),
    "bench_turn": Script("bench_turn.py", ("--sections", "sweep", "--histories", "64", "--news", "8", "--reps", "2"),
                         expect=("| 64 | 8 | ",)),
    "codec_fidelity": Script("codec_fidelity.py", ("--codecs", "int8", "--only", "ppl,greedy", "--ppl-texts", "1",
                                                   "--ppl-length", "96", "--window", "64", "--ppl-chunk", "16",
                                                   "--turns", "2"),
                             expect=("| lossless | ", "| int8 | ")),
    "ppl": Script("ppl.py", ("--limit", "1", "--length", "80", "--window", "48", "--chunk", "16", "--corpora",
                             "sharegpt", "--modes", "recompute,decoupled"),
                  expect=("| recompute | ", "| decoupled | ")),
    "quant_ablation": Script("quant_ablation.py", ("--texts", "1", "--corpora", "sharegpt", "--context", "32",
                                                   "--score", "8", "--bits", "4"),
                             expect=("| lossless (fp32) | 32 | ", "| pre RoPE, per channel | 4 | ")),
    "replay": Script("replay.py", ("--conversations", "2", "--max-turns", "2", "--max-user-tokens", "16",
                                   "--max-reply-tokens", "16", "--policies", "lru"),
                     checks=(same_counts(r"greedy tokens identical to RE on (\d+)/(\d+) turns"),)),
    "replay_replicas": Script("replay_replicas.py", ("--conversations", "2", "--max-turns", "2", "--max-user-tokens",
                                                     "16", "--max-reply-tokens", "16"),
                              expect=("sticky", "Redis")),
    "rerotate_scaled_rope": Script("rerotate_scaled_rope.py", expect=("| dynamic | ", "| longrope | ")),
    "simulate": Script("simulate.py", ("--sessions", "20", "--plot", "", "--sections",
                                       "policies,overflow,capacity,codecs,partial,recompute,shared,replicas"),
                       expect=("| RE (no store) | ", "| LLaMA-13B | ", "| on | ", "| LLaMA-70B | 25 GB/s |")),
    "sparse_ppl": Script("sparse_ppl.py", ("--limit", "1", "--length", "80", "--chunk", "16", "--score-from", "48",
                                           "--sparsities", "0.5", "--policies", "streaming,oracle,sparq", "--corpora",
                                           "sharegpt"),
                         expect=("| streaming | 50% |", "| oracle | 50% |", "| sparq | 50% |")),
    "sparse_recall": Script("sparse_recall.py", ("--trials", "1", "--filler-turns", "1", "--filler-tokens", "16",
                                                 "--sparsities", "0.5", "--policies", "streaming,oracle,sparq"),
                            expect=("| dense | ", "| streaming 50% | ", "| oracle 50% | ", "| sparq 50% | ")),
}
# Run elsewhere: the reliability scorecard in its quick form (faults.py runs the rows of the other modules).
ELSEWHERE = {name: "tests/test_faults_scorecard.py"
             for name in ("faults.py", "faults_durable.py", "faults_found.py", "faults_kill.py", "faults_shared.py",
                          "faults_stress.py")}


def test_every_eval_script_is_run():
    assert {p.name for p in (ROOT / "eval").glob("*.py")} == {r.script for r in RUNS.values()} | set(ELSEWHERE)


@pytest.fixture(scope="module")
def results(request, tmp_path_factory):
    """Runs the scripts of the selected tests in one runner; returns each one's status, seconds, leftovers and log."""
    selected = [item.callspec.params["name"] for item in request.session.items
                if item.module is sys.modules[__name__] and hasattr(item, "callspec")]
    out, tmp = tmp_path_factory.mktemp("eval-logs"), tmp_path_factory.mktemp("eval-tmp")
    scratch = tmp_path_factory.mktemp("eval-scratch")
    jobs = [[name, RUNS[name].script, [a.replace("{tmp}", str(scratch)) for a in RUNS[name].args],
             RUNS[name].timeout_s] for name in selected]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "TMPDIR": str(tmp)}  # eval_runner.py: one torch thread, the CPU
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "eval_runner.py"), str(out), json.dumps(jobs)],
                          capture_output=True, text=True, timeout=sum(j[3] for j in jobs) + 120, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    status = json.loads((out / "results.json").read_text())
    return {name: dict(status[name], log=(out / f"{name}.log").read_text(errors="replace"),
                       scratch=sorted(p.name for p in scratch.iterdir())) for name in status}


@pytest.mark.integration  # the bundled SmolLM2 and ShareGPT
@pytest.mark.parametrize("name", sorted(RUNS))
def test_eval_script(name, results):
    run, result = RUNS[name], results[name]
    log = result["log"]
    assert result["code"] == 0, f"eval/{run.script} exited {result['code']} in {result['seconds']} s:\n{log[-4000:]}"
    for text in run.expect:
        assert text in log, f"eval/{run.script}: no {text!r} in its output:\n{log[-3000:]}"
    for check in run.checks:
        check(log)
    assert not result["left"], f"eval/{run.script} left {result['left']} in the temporary folder"
    assert not result["scratch"], f"eval/{run.script} left {result['scratch']} in the folder it was given"


def test_the_scale_plot_draws_the_rows(tmp_path, monkeypatch):
    """bench_scale --plot: the table's times against sessions held, one PNG."""
    monkeypatch.syspath_prepend(str(ROOT / "eval"))
    import bench_scale

    rows = [{"held": n, "write one session": 1e-3, "plan a resumed turn": 2e-3, "plan a new conversation": 3e-4,
             "evict one session": 2e-5, "sessions/s reopened": 700.0, "all indexed": n / 650} for n in (1020, 10020)]
    bench_scale.plot(rows, str(tmp_path / "scale.png"))
    assert (tmp_path / "scale.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
