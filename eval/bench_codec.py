"""What the lossy codecs cost and save: bytes, AS-disk TTFT, load time, save cost (issue 14).

    python eval/bench_codec.py --history 2048 --new 128 --reps 5 --codecs none,int8,int4

For each codec, sessions of `--history` tokens (SmolLM2's KV of one prefill) are written to a disk tier with
that codec. Then, interleaved per repetition (this machine drifts) and reported as medians:

  bytes     bytes per token of the session's files on disk (chunks with headers, and the manifest).
  ttft      AS-disk: a store reopened on the folder (the session on disk only, its pages dropped from the
            page cache), the turn's cache built and the `--new` tokens prefilled (the load included); next to
            recomputation (RE) and the session in host memory (AS-host).
  load      a prefetch alone (no model running): request to last layer in host memory, verified and
            dequantized.
  host      AS-host with the store's host copy as it is after a save: the whole chunks kept encoded
            (`kv_codec_host`, dequantized by the turn as each layer loads), and the bytes per token that
            copy holds in host memory.
  save      one turn (prefill of history + new, `--decode` greedy tokens) with a disk tier of that codec:
            the saving work on the turn's own thread, and the save thread's time to encode and write the
            session (after the turn: write-behind), both as shares of the turn.

Every variant runs once per repetition, all in one order drawn afresh for every repetition (from `--seed`; the
orders are printed). Every measured resume has new tokens of its own: the sessions share their history, and a
repeated prompt would be served by prefix sharing from the session that stored it first (a cache hit, not a
resume). A resume that did not reuse exactly the history, of its own session, from the tier it measures, a load
that did not finish, or a save that did not reach the disk fails the run. The temporary folder is removed also
when a run fails.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from hf_attnstore import AttnStore, AttnStoreCache, load_default_model
from hf_attnstore.store.format import session_dirname

sys.path.insert(0, str(Path(__file__).parent))
from bench_tiers import (  # noqa: E402
    Resumes, check_resume, drop_page_cache, history_snapshot, interleaved, orders_line, scratch_folder)
from hf_attnstore.cache.upstream import cache_kwargs


def codec_of(name: str):
    return None if name == "none" else name


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--history", type=int, default=2048)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--decode", type=int, default=32)
    p.add_argument("--codecs", default="none,int8,int4")
    p.add_argument("--disk-dir", default=None, help="an empty parent folder of the disk tiers (default: temporary)")
    p.add_argument("--seed", type=int, default=0, help="seed of the variants' order in each repetition")
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)
    model, _ = load_default_model()
    gen = torch.Generator().manual_seed(0)
    history = torch.randint(100, model.config.vocab_size, (1, args.history), generator=gen)
    with scratch_folder(args.disk_dir, "attnstore-codec-") as root:
        run(model, history, Resumes(history, args.new, model.config.vocab_size), args, root)
    return 0


def run(model, history: torch.Tensor, prompts: Resumes, args, root: Path) -> None:
    H, R = args.history, args.reps
    codecs = args.codecs.split(",")
    _, fp, snapshot = history_snapshot(model, history, H)
    per_token = {}
    for name in codecs:  # one session per measured AS-disk turn and per load
        with AttnStore(host_bytes="16GiB", disk_dir=str(root / name), kv_codec=codec_of(name)) as store:
            for i in range(2 * R):
                with store.open_turn(f"s{i}", fp, None, torch.arange(0)) as w:
                    w.append(*snapshot)
        folder = root / name / "sessions" / session_dirname(fp, "s0")
        per_token[name] = sum(f.stat().st_size for f in folder.iterdir()) / H
    model(history[:, :8])  # warm-up

    def turn(store, session, source) -> float:
        prompt = prompts.next()
        t = time.perf_counter()
        cache = AttnStoreCache(model, store, session, prompt)
        model(cache.input_ids[:, H:], **cache_kwargs(cache))
        seconds = time.perf_counter() - t
        check_resume(cache, H, (source,))
        cache.close()
        return seconds

    def recompute(rep: int) -> float:
        t = time.perf_counter()
        model(prompts.next(), **cache_kwargs(DynamicCache()))
        return time.perf_counter() - t

    def as_host(rep: int) -> float:
        with host.open_turn(f"h{rep}", fp, None, torch.arange(0)) as w:
            w.append(*snapshot)
        return turn(host, f"h{rep}", "host")

    def disk_ttft(name: str):
        def measure(rep: int) -> float:
            with AttnStore(host_bytes="16GiB", disk_dir=str(root / name), kv_codec=codec_of(name)) as store:
                drop_page_cache(root / name / "sessions" / session_dirname(fp, f"s{2 * rep}"))
                seconds = turn(store, f"s{2 * rep}", "disk")
                store.close(flush=False)
            return seconds
        return measure

    def load_alone(name: str):
        def measure(rep: int) -> float:
            session = f"s{2 * rep + 1}"
            with AttnStore(host_bytes="16GiB", disk_dir=str(root / name), kv_codec=codec_of(name)) as store:
                drop_page_cache(root / name / "sessions" / session_dirname(fp, session))
                t = time.perf_counter()
                assert store.prefetch([session], fp) == 1, f"session {session} was not found on disk"
                with store._index.cond:  # wait for the load (the benchmark peeks at the store's counter)
                    done = store._index.cond.wait_for(lambda: store._index.loads_active == 0, 60)
                seconds = time.perf_counter() - t
                assert done and store.stats().bytes_read > 0, "the load did not finish"
                store.close(flush=False)
            return seconds
        return measure

    host_per_token = {}

    # The host copy a save leaves behind (encoded with a lossy codec): written, flushed, resumed.
    def host_copy(name: str):
        def measure(rep: int) -> float:
            with AttnStore(host_bytes="16GiB", disk_dir=str(root / f"host-{name}-{rep}"), kv_codec=codec_of(name),
                           fsync=False) as store:
                with store.open_turn(f"k{rep}", fp, None, torch.arange(0)) as w:
                    w.append(*snapshot)
                store.flush()
                host_per_token[name] = store.stats().host_bytes_used / H
                return turn(store, f"k{rep}", "host")
        return measure

    variants = {"RE": recompute, "AS-host": as_host}
    for name in codecs:
        variants.update({f"ttft {name}": disk_ttft(name), f"load {name}": load_alone(name),
                         f"host {name}": host_copy(name)})
    with AttnStore(host_bytes="16GiB") as host:
        rows, orders = interleaved(variants, R, args.seed)

    def save(name: str):  # a turn from scratch on a disk tier of this codec: (turn s, turn-thread share, save share)
        def measure(rep: int) -> tuple[float, float, float]:
            with AttnStore(host_bytes="16GiB", disk_dir=str(root / f"save-{name}-{rep}"), kv_codec=codec_of(name)) \
                    as store:
                t = time.perf_counter()
                cache = AttnStoreCache(model, store, "t", prompts.next())
                model.generate(cache.input_ids, **cache_kwargs(cache), max_new_tokens=args.decode, do_sample=False,
                               min_new_tokens=args.decode, pad_token_id=0)
                turn_s = time.perf_counter() - t
                cache.close()
                store.flush()
                assert store.stats().disk_bytes_used > 0, "the turn's session did not reach the disk tier"
                return turn_s, cache.save_seconds / turn_s, store.stats().write_seconds / turn_s
        return measure

    saves, save_orders = interleaved({name: save(name) for name in codecs}, R, args.seed + 1)

    print(f"SmolLM2-135M fp32 on {model.device}, {torch.get_num_threads()} threads; history {H} + new {args.new} "
          f"(drawn afresh for every measured turn), {R} reps (medians); disk tiers in {root}")
    print(orders_line(orders, args.seed))
    print(f"save turns: {orders_line(save_orders, args.seed + 1)}")
    print("\n| codec | bytes/token on disk (files) | vs lossless | AS-disk TTFT | load alone | bytes/token in host "
          "memory | AS-host TTFT | saving on the turn's thread | save thread (encode + write, after the turn) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    base = per_token.get("none")
    for name in codecs:
        ratio = f"{base / per_token[name]:.2f}x smaller" if base and name != "none" else "–"
        own, background = [s[1] for s in saves[name]], [s[2] for s in saves[name]]
        print(f"| {name if name != 'none' else 'lossless'} | {per_token[name]:,.0f} | {ratio} | "
              f"{1000 * med(rows[f'ttft {name}']):,.0f} ms | {1000 * med(rows[f'load {name}']):,.0f} ms | "
              f"{host_per_token[name]:,.0f} | {1000 * med(rows[f'host {name}']):,.0f} ms | "
              f"{100 * med(own):.2f}% | {100 * med(background):.1f}% |")
    print(f"\nRE (recompute {H + args.new} tokens) {1000 * med(rows['RE']):,.0f} ms; AS-host in a host-only store "
          f"{1000 * med(rows['AS-host']):,.0f} ms; turn (prefill {H + args.new} + decode {args.decode}) "
          f"{med([s[0] for runs in saves.values() for s in runs]):.2f} s")


def med(xs):
    return statistics.median(xs)


if __name__ == "__main__":
    sys.exit(main())
