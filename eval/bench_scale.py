"""Scale (issue 56): per-turn store work with 1k, 10k, 100k sessions held over one shared system prompt.

    python eval/bench_scale.py                      # N = 1,000, 10,000, 100,000
    python eval/bench_scale.py --sizes 1000,10000   # fewer

One store with a disk tier and a 256 MiB host tier grows to each N in turn: a first session stores the system prompt
(`--system` tokens), and every other session is a new conversation over it, planned as a turn plans it
(`AttnStore.find` offers the shared prefix; `open_turn` starts from its snapshot) and then appends its own
`--own` tokens. KV is written directly through the public API (`open_turn(...).append(...)`) with tiny per-layer
tensors (`--layers` x `--heads` x `--head-dim`, float16): no model runs, so what is timed is the store alone.

At each N it prints the rate the store grew at (writes and their saves, to the last `flush`), then, once the saves
have landed, times (median of `--reps`): writing one more session (find, open_turn, append, close: the turn's own
calls, each with the saves quiet: its save is flushed after it, untimed), planning a resumed turn of an older
session (`find` with its history and a new message; each of them evicted to disk first, at every N, so the
plan includes starting its load, which is waited for untimed), planning a new conversation over the shared prompt
(`find`, shared match), evicting one session from host memory (`evict`), and reopening the store (construct
on the same folder, first `find`; with `--cold`, from a dropped page cache); and the process's RSS. Then, in a
fresh process each (so that nothing of this one's memory is counted): reopening in the background (`reopen_in_background`: the time from
the constructor to the first turn's `find` of an old session, and until every session is indexed), and the
index's memory per session (that process's RSS once all are indexed, less the same process's RSS before it
opened the store, over N; no KV is in host memory after a reopen). The run fails unless every resumed plan
found the session's own KV and every new conversation the shared prompt.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from hf_attnstore import AttnStore, StoreTuning

FP = "bench-scale-model"


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


class Sessions:
    """Writes the sessions of the benchmark into a store (see the module docstring)."""

    def __init__(self, args):
        self.args = args
        self.system = torch.arange(10, 10 + args.system)
        self.count = 0  # sessions written besides the system prompt's
        shape = (1, args.heads, args.own, args.head_dim)
        self.own_kv = [torch.randn(shape, dtype=torch.float16) for _ in range(args.layers)]
        self.system_kv = [torch.randn((1, args.heads, args.system, args.head_dim), dtype=torch.float16)
                          for _ in range(args.layers)]

    def own_ids(self, i: int) -> torch.Tensor:
        return torch.arange(args_base(i), args_base(i) + self.args.own)

    def ids(self, i: int) -> torch.Tensor:
        return torch.cat([self.system, self.own_ids(i)])

    def write_system(self, store: AttnStore) -> None:
        with store.open_turn("system", FP, None, torch.empty(0)) as turn:
            assert turn.append(self.system, self.system_kv, self.system_kv)

    def write(self, store: AttnStore) -> None:
        """One more conversation over the system prompt, planned as a turn plans it."""
        i, self.count = self.count, self.count + 1
        sid = f"chat-{i}"
        found = store.find(sid, FP, self.ids(i))
        shared = found.shared
        if shared is None or shared.length < self.args.system:
            raise SystemExit(f"session {sid}: the shared system prompt was not found ({found})")
        with store.open_turn(sid, FP, shared.snapshot, torch.arange(self.args.system)) as turn:
            assert turn.append(self.own_ids(i), self.own_kv, self.own_kv)


def args_base(i: int) -> int:
    return 1_000_000 + 1000 * i  # each session's own ids, distinct from every other's


def timed(fn, reps: int, after=None) -> float:
    """The median time of ``fn(r)`` over `reps`; ``after(r, result)`` runs after each, untimed."""
    times = []
    for r in range(reps):
        t = time.perf_counter()
        result = fn(r)
        times.append(time.perf_counter() - t)
        if after is not None:
            after(r, result)
    return statistics.median(times)


def open_store(args, folder: str) -> AttnStore:
    return AttnStore(host_bytes=args.host_bytes, disk_dir=folder,
                     tuning=StoreTuning(fsync=False, chunk_tokens=args.chunk_tokens))


FLUSH_S = 3600.0  # the saves behind N writes can take minutes on a loaded machine: flush() waits for them

# A fresh process reopens the folder in the background: the first turn's wait, the whole index's, its memory.
REOPEN = """
import json, sys, time, torch
sys.path.insert(0, {eval_dir!r})
from bench_scale import rss_mib, FP
from hf_attnstore import AttnStore, StoreTuning
before = rss_mib()
t = time.perf_counter()
store = AttnStore(host_bytes={host!r}, disk_dir={folder!r}, tuning=StoreTuning(fsync=False, chunk_tokens={chunk},
                                                                              reopen_in_background=True))
found = store.find("chat-0", FP, torch.tensor({prompt}))
first = time.perf_counter() - t
assert found.own is not None, "chat-0 was not found while the store reopened"
assert store.wait_reopened(timeout=3600)
whole = time.perf_counter() - t
held = len(store.sessions())
print(json.dumps(dict(first=first, whole=whole, held=held, mib=rss_mib() - before)))
store.close(flush=False)
"""


def cold(args) -> None:
    """With `--cold`: the kernel's page cache is dropped, so a reopen reads the disk (as after a reboot)."""
    if args.cold:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")


def reopen_in_background(args, folder: str, sessions: "Sessions") -> dict:
    """Reopens the folder in the background in a fresh process (see `REOPEN`); its measurements."""
    prompt = torch.cat([sessions.ids(0), torch.tensor([5])]).tolist()
    code = REOPEN.format(eval_dir=os.path.dirname(os.path.abspath(__file__)), host=args.host_bytes, folder=folder,
                         chunk=args.chunk_tokens, prompt=prompt)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=FLUSH_S)
    if out.returncode != 0:
        raise SystemExit(f"the background reopen failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def plot(rows: list[dict], path: str) -> None:
    """Per-operation time against sessions held (log-log: a flat line is a cost independent of N), and the reopen
    rate (sessions/s: flat is a cost linear in N)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    held = [r["held"] for r in rows]
    fig, (ops, rate) = plt.subplots(1, 2, figsize=(11, 3.8))
    for name, style in (("write one session", "o-"), ("plan a resumed turn", "s-"),
                        ("plan a new conversation", "^-"), ("evict one session", "v-")):
        ops.plot(held, [r[name] * 1e3 for r in rows], style, label=name, ms=4)
    ops.set(xscale="log", yscale="log", xlabel="sessions held", ylabel="median (ms)",
            title="per-turn store operations")
    ops.legend(fontsize=8)
    rate.plot(held, [r["sessions/s reopened"] for r in rows], "o-", label="reopen (open, first find)", ms=4)
    rate.plot(held, [r["held"] / r["all indexed"] for r in rows], "s--", label="background reopen, all indexed", ms=4)
    rate.set(xscale="log", xlabel="sessions held", ylabel="sessions/s", title="reopening", ylim=(0, None))
    rate.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1000,10000,100000", help="sessions held, comma-separated (default %(default)s)")
    parser.add_argument("--system", type=int, default=1024, help="tokens of the shared system prompt (default %(default)s)")
    parser.add_argument("--own", type=int, default=128, help="each session's own tokens after it (default %(default)s)")
    parser.add_argument("--layers", type=int, default=2, help="layers of the tiny KV (default %(default)s)")
    parser.add_argument("--heads", type=int, default=1, help="KV heads per layer (default %(default)s)")
    parser.add_argument("--head-dim", type=int, default=8, help="head dimension (default %(default)s)")
    parser.add_argument("--host-bytes", default="256MiB", help="the host tier's size (default %(default)s)")
    parser.add_argument("--chunk-tokens", type=int, default=256, help="the store's chunk_tokens (default %(default)s)")
    parser.add_argument("--reps", type=int, default=20, help="repetitions of each timed operation (default %(default)s)")
    parser.add_argument("--disk-dir", help="the disk tier's folder (default: a temporary one, deleted after)")
    parser.add_argument("--cold", action="store_true",
                        help="drop the page cache before each reopen (as after a reboot; needs root)")
    parser.add_argument("--plot", help="also draw the table's times against sessions held into this PNG")
    args = parser.parse_args()
    if args.cold and not os.access("/proc/sys/vm/drop_caches", os.W_OK):
        parser.error("`--cold` drops the page cache through /proc/sys/vm/drop_caches: run it as root, or without it")
    sizes = sorted(int(n) for n in args.sizes.split(","))
    if not sizes or sizes[0] < 1:
        parser.error("`--sizes` must list positive session counts, e.g. 1000,10000")
    temp = tempfile.TemporaryDirectory(prefix="bench-scale-") if args.disk_dir is None else None
    folder = args.disk_dir or temp.name
    sessions = Sessions(args)
    store = open_store(args, folder)
    sessions.write_system(store)
    print(f"system prompt {args.system} tokens, {args.own} own tokens per session, KV {args.layers}x{args.heads}x"
          f"{args.head_dim} float16, host tier {args.host_bytes}, disk tier, chunk_tokens {args.chunk_tokens}; "
          f"medians of {args.reps}")
    print()
    print("| sessions held | grown at (write + save) | write one session | plan a resumed turn "
          "| plan a new conversation (shared prompt) "
          "| evict one session | reopen (open, first find) | sessions/s reopened | RSS "
          "| background reopen: first turn's find | all indexed | index memory per session |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    problems, rows = [], []
    try:
        for n in sizes:
            grown, t = n - sessions.count, time.perf_counter()
            while sessions.count < n:
                sessions.write(store)
            store.flush(timeout=FLUSH_S)
            grow_rate = grown / (time.perf_counter() - t)
            # Each write timed with the saves quiet (flushed after it, untimed): the turn's own calls, not the GIL
            # shared with the save of the one before (the growth rate above counts the saves).
            write_s = timed(lambda r: sessions.write(store), args.reps, after=lambda r, _: store.flush(timeout=FLUSH_S))
            held = sessions.count

            resumed = [(r * 7919) % held for r in range(args.reps)]  # spread over old and new sessions
            for i in resumed:  # each on disk only, at every N: the plan includes starting its load
                store.evict(f"chat-{i}")

            def resume(r):
                i = resumed[r]
                prompt = torch.cat([sessions.ids(i), torch.tensor([5, 6, 7])])
                found = store.find(f"chat-{i}", FP, prompt)
                if found.own is None or found.own.length != args.system + args.own:
                    problems.append(f"N={n}: the resumed session chat-{i} was not found whole")
                return found

            def loaded(r, found):  # a session on disk starts loading: its load is waited for untimed
                if found.own is not None and found.own.snapshot.loader is not None:
                    found.own.snapshot.loader.wait_all()
                # ... to its end: the load thread's bookkeeping after the last layer would otherwise run beside the
                # next plan and be timed with it (on 2 cores, the GIL's switch interval is 5 ms). A server's next
                # plan comes after a model's turn, not a load's last layer.
                deadline = time.monotonic() + 60
                while store.stats().loads_in_flight and time.monotonic() < deadline:
                    time.sleep(0.001)
                if store.stats().loads_in_flight:
                    problems.append(f"N={n}: a resumed session's load did not end within 60 s")

            resume_s = timed(resume, args.reps, after=loaded)

            def new_chat(r):
                found = store.find(f"new-{n}-{r}", FP, torch.cat([sessions.system, torch.tensor([5, 6, 7])]))
                if found.shared is None or found.shared.length < args.system:
                    problems.append(f"N={n}: a new conversation did not find the shared system prompt")

            new_s = timed(new_chat, args.reps)
            recent = [f"chat-{held - 1 - r}" for r in range(args.reps)]  # in host memory, saved (flushed)
            evict_s = timed(lambda r: store.evict(recent[r]), args.reps)
            rss = rss_mib()
            store.flush(timeout=FLUSH_S)
            store.close()
            cold(args)
            bg = reopen_in_background(args, folder, sessions)  # (a fresh process: it takes the folder's lock)
            if bg["held"] < held + 1:
                problems.append(f"N={n}: the background reopen indexed {bg['held']} of {held + 1} sessions")
            cold(args)
            t = time.perf_counter()  # (the close above is untimed: the saves had landed, it stops threads)
            store = open_store(args, folder)
            found = store.find("chat-0", FP, torch.cat([sessions.ids(0), torch.tensor([5])]))
            reopen_s = time.perf_counter() - t
            if found.own is None:
                problems.append(f"N={n}: chat-0 was not found after the reopen")
            elif found.own.snapshot.loader is not None:
                found.own.snapshot.loader.wait_all()
            rows.append({"held": held, "write one session": write_s, "plan a resumed turn": resume_s,
                         "plan a new conversation": new_s, "evict one session": evict_s,
                         "sessions/s reopened": held / reopen_s, "all indexed": bg["whole"]})
            print(f"| {held:,} | {grow_rate:,.0f} sessions/s | {write_s * 1e3:.2f} ms | {resume_s * 1e3:.2f} ms | {new_s * 1e3:.2f} ms | "
                  f"{evict_s * 1e3:.2f} ms | {reopen_s:.2f} s | {held / reopen_s:,.0f} | {rss:,.0f} MiB | "
                  f"{bg['first'] * 1e3:.0f} ms | {bg['whole']:.2f} s | {bg['mib'] * 2**20 / bg['held'] / 1024:.1f} KiB |",
                  flush=True)
    finally:
        store.close(flush=False)
        if temp is not None:
            temp.cleanup()
    if args.plot and rows:
        plot(rows, args.plot)
        print(f"plot: {args.plot}")
    for problem in problems[:10]:
        print("FAILED:", problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
