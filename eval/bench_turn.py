"""TTFT of one turn vs history length: recomputation (RE), the store (AS-host, AS-disk) and the ideal.

    python eval/bench_turn.py --sections sweep,grid --reps 3 --plot docs/img/bench_turn.png

Sections:
  sweep   histories 256 ... 4096 tokens x 64 / 128 / 256 new tokens (--histories, --news)
  grid    1K tokens split as history/new = 500/500, 600/400, 700/300, 800/200, 900/100 (the paper's Fig. 18)

Variants, run back to back for each point and repetition, in an order drawn afresh each time (from `--seed`;
printed), so this machine's drift hits them alike; medians reported. Every measured turn has new tokens of its
own (a repeated prompt would be served by prefix sharing from the session that stored it first: a cache hit,
not a resume), and a resume that did not reuse exactly its own session's history from its tier fails the run:
  * RE:      a fresh DynamicCache, prefill history + new tokens.
  * ideal:   a DynamicCache already holding the history's KV (as if it never left the device), prefill new.
  * AS-host: AttnStoreCache over a store whose host tier holds the session, prefill new (and save the turn).
  * AS-disk: the same from a store that has the session on disk only: a store reopened on the folder, the
             session's pages dropped from the page cache (cold read), the store's default pre-loading.
TTFT = building the cache (lookup, reuse plan) + the prefill forward of what is not reused, which loads the
KV layer by layer and re-applies RoPE. The pre-loading ablation (Fig. 19) and sync vs async saving (Fig. 20)
are in eval/bench_tiers.py.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import time
from pathlib import Path

import torch
from bench_tiers import Resumes, check_resume, drop_page_cache, history_snapshot, ideal_prefill, scratch_folder
from transformers import DynamicCache

from hf_attnstore import AttnStore, AttnStoreCache, load_default_model
from hf_attnstore.store.format import session_dirname
from hf_attnstore.cache.upstream import cache_kwargs

VARIANTS = ("RE", "ideal", "AS-host", "AS-disk")
GRID = ((500, 500), (600, 400), (700, 300), (800, 200), (900, 100))


def measure_history(model, ids: torch.Tensor, H: int, news: list[int], reps: int, root: Path,
                    rng: random.Random) -> dict:
    """Medians of every variant for one history length and each number of new tokens."""
    history = ids[:, :H]
    resident, fp, snapshot = history_snapshot(model, history, H)
    sessions = [f"d{n}-{r}" for n in news for r in range(reps)]
    with AttnStore(host_bytes="16GiB", disk_dir=str(root)) as writer:
        for s in sessions:
            writer.open_turn(s, fp, None, torch.arange(0)).append(*snapshot)
    out = {}
    with AttnStore(host_bytes="16GiB") as host:
        for n in news:
            prompts = Resumes(history, n, model.config.vocab_size, seed=H * 1000 + n)
            rows = {v: [] for v in VARIANTS}
            orders = []
            for rep in range(reps):

                def resume(store, session):
                    cache = AttnStoreCache(model, store, session, prompts.next())
                    model(cache.input_ids[:, H:], **cache_kwargs(cache))
                    return cache

                def run(variant):
                    if variant == "RE":
                        prompt = prompts.next()
                        t = time.perf_counter()
                        model(prompt, **cache_kwargs(DynamicCache()))
                        return time.perf_counter() - t
                    if variant == "ideal":
                        return ideal_prefill(model, resident, prompts.next()[:, H:])
                    if variant == "AS-host":
                        session, store, source = f"h{n}-{rep}", host, "host"
                        host.open_turn(session, fp, None, torch.arange(0)).append(*snapshot)
                    else:
                        session, source = f"d{n}-{rep}", "disk"
                        store = AttnStore(host_bytes="16GiB", disk_dir=str(root))  # reopened: on disk only
                        drop_page_cache(root / "sessions" / session_dirname(fp, session))
                    try:
                        t = time.perf_counter()
                        cache = resume(store, session)
                        seconds = time.perf_counter() - t
                        check_resume(cache, H, (source,))
                        cache.close()
                    finally:
                        if store is not host:
                            store.close(flush=False)
                    return seconds

                order = list(VARIANTS)
                rng.shuffle(order)
                orders.append(order)
                for v in order:
                    rows[v].append(run(v))
            out[n] = {v: statistics.median(x) for v, x in rows.items()}
            out[n]["all"] = rows
            out[n]["orders"] = orders
            ideal = out[n]["ideal"]
            print(f"  history {H:5d} new {n:4d}: " + "  ".join(f"{v} {1000 * out[n][v]:7.1f} ms" for v in VARIANTS)
                  + f"   AS-host/ideal {out[n]['AS-host'] / ideal:.3f}  AS-disk/ideal {out[n]['AS-disk'] / ideal:.3f}"
                  f"  RE/AS-host {out[n]['RE'] / out[n]['AS-host']:.2f}x; orders: "
                  + " | ".join(", ".join(o) for o in orders), flush=True)
    shutil.rmtree(root / "sessions", ignore_errors=True)
    return out


def table(points: dict) -> str:
    lines = ["| history | new | RE | ideal | AS-host | AS-disk | AS-host / ideal | AS-disk / ideal | RE / AS-host |",
             "| --- " * 9 + "|"]
    for (H, n), m in points.items():
        lines.append(f"| {H} | {n} | {1000 * m['RE']:.0f} ms | {1000 * m['ideal']:.0f} ms | {1000 * m['AS-host']:.0f} ms | "
                     f"{1000 * m['AS-disk']:.0f} ms | {m['AS-host'] / m['ideal']:.3f} | {m['AS-disk'] / m['ideal']:.3f} | "
                     f"{m['RE'] / m['AS-host']:.1f}x |")
    return "\n".join(lines)


def plot(sweep: dict, grid: dict, news: list[int], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    if sweep:
        n = 128 if 128 in news else news[0]
        hs = sorted(H for H, m in sweep if m == n)
        for v, style in zip(VARIANTS, ("o-", "s--", "^-", "v-")):
            axes[0].plot(hs, [1000 * sweep[(H, n)][v] for H in hs], style, label=v, ms=4)
        axes[0].set(xscale="log", yscale="log", xlabel="history tokens", ylabel="TTFT (ms)",
                    title=f"TTFT vs history, {n} new tokens")
        axes[0].set_xticks(hs, [str(h) for h in hs])
        axes[0].xaxis.set_minor_formatter(NullFormatter())
        axes[0].legend(fontsize=8)
    if grid:
        labels = [f"{H}/{n}" for H, n in grid]
        width = 0.2
        for j, v in enumerate(VARIANTS):
            axes[1].bar([i + (j - 1.5) * width for i in range(len(labels))], [1000 * m[v] for m in grid.values()],
                        width, label=v)
        axes[1].set_xticks(range(len(labels)), labels)
        axes[1].set(xlabel="history / new tokens (1K in all)", ylabel="TTFT (ms)", title="Fig. 18 grid")
        axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", default="sweep,grid")
    p.add_argument("--histories", default="256,512,1024,2048,4096")
    p.add_argument("--news", default="64,128,256")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--disk-dir", default=None, help="an empty folder for the disk tier (default: a temporary one)")
    p.add_argument("--plot", default=None, help="write the plots to this PNG")
    p.add_argument("--json", default=None, help="also write the results to this file")
    p.add_argument("--replot", default=None, help="only redraw --plot from a --json file of an earlier run")
    p.add_argument("--seed", type=int, default=0, help="seed of the variants' order in each repetition")
    args = p.parse_args(argv)
    if args.replot:
        with open(args.replot) as f:
            points = {(x["history"], x["new"]): x for x in json.load(f)["points"]}
        grid = {k: v for k, v in points.items() if k in GRID}
        plot({k: v for k, v in points.items() if k not in GRID}, grid, [int(x) for x in args.news.split(",")],
             args.plot)
        return 0
    sections = set(args.sections.split(","))
    torch.set_grad_enabled(False)
    model, _ = load_default_model(dtype=args.dtype)
    histories = [int(x) for x in args.histories.split(",")]
    news = [int(x) for x in args.news.split(",")]
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(100, model.config.vocab_size, (1, max(histories) + max(news) + 1000), generator=gen)
    ids = ids.to(model.device)
    rng = random.Random(args.seed)
    model(ids[:, :8])  # warm-up
    print(f"SmolLM2-135M {args.dtype} on {model.device}, {torch.get_num_threads()} threads, {args.reps} reps "
          f"(medians); variants in an order drawn afresh per point and repetition (seed {args.seed})")
    started = time.perf_counter()
    sweep, grid = {}, {}
    with scratch_folder(args.disk_dir, "attnstore-bench-") as root:
        if "sweep" in sections:
            for H in histories:
                for n, m in measure_history(model, ids, H, news, args.reps, root, rng).items():
                    sweep[(H, n)] = m
            print("\n[sweep]\n" + table(sweep))
        if "grid" in sections:
            for H, n in GRID:
                grid[(H, n)] = measure_history(model, ids, H, [n], args.reps, root, rng)[n]
            print("\n[grid] 1K tokens, history/new (Fig. 18)\n" + table(grid))
    print(f"\nmeasured in {time.perf_counter() - started:.0f} s")
    if args.plot:
        plot(sweep, grid, news, args.plot)
        print(f"plot: {args.plot}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "points": [{"history": H, "new": n, **m} for (H, n), m in
                                                      {**sweep, **grid}.items()]}, f, indent=1)
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
