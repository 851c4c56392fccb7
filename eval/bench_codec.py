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
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from hf_attnstore import AttnStore, AttnStoreCache, load_default_model
from hf_attnstore.store.format import session_dirname

sys.path.insert(0, str(Path(__file__).parent))
from bench_tiers import drop_page_cache, history_snapshot  # noqa: E402
from hf_attnstore.cache.upstream import cache_kwargs


def med(xs):
    return statistics.median(xs)


def codec_of(name: str):
    return None if name == "none" else name


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--history", type=int, default=2048)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--decode", type=int, default=32)
    p.add_argument("--codecs", default="none,int8,int4")
    p.add_argument("--disk-dir", default=None, help="parent folder of the disk tiers (default: a temporary one)")
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)
    model, _ = load_default_model()
    H, N, R = args.history, args.new, args.reps
    codecs = args.codecs.split(",")
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(100, model.config.vocab_size, (1, H + N), generator=gen)
    root = Path(args.disk_dir or tempfile.mkdtemp(prefix="attnstore-codec-"))
    shutil.rmtree(root, ignore_errors=True)
    _, fp, snapshot = history_snapshot(model, ids, H)
    n_sessions = 2 * R + 3
    per_token = {}
    for name in codecs:
        with AttnStore(host_bytes="16GiB", disk_dir=str(root / name), kv_codec=codec_of(name)) as store:
            for i in range(n_sessions):
                with store.open_turn(f"s{i}", fp, None, torch.arange(0)) as w:
                    w.append(*snapshot)
        folder = root / name / "sessions" / session_dirname(fp, "s0")
        per_token[name] = sum(f.stat().st_size for f in folder.iterdir()) / H
    model(ids[:, :8])  # warm-up

    def turn(store, session) -> float:
        t = time.perf_counter()
        cache = AttnStoreCache(model, store, session, ids)
        assert cache.reused_tokens == H, cache.reused_tokens
        model(cache.input_ids[:, H:], **cache_kwargs(cache))
        seconds = time.perf_counter() - t
        assert cache.kv_source in ("disk", "host"), cache.kv_source
        cache.close()
        return seconds

    rows = {k: [] for k in ["RE", "AS-host"] + [f"{kind} {c}" for kind in ("ttft", "load", "host") for c in codecs]}
    host_per_token = {}
    host = AttnStore(host_bytes="16GiB")
    for rep in range(R):
        t = time.perf_counter()
        model(ids, **cache_kwargs(DynamicCache()))
        rows["RE"].append(time.perf_counter() - t)
        with host.open_turn(f"h{rep}", fp, None, torch.arange(0)) as w:
            w.append(*snapshot)
        rows["AS-host"].append(turn(host, f"h{rep}"))
        order = list(codecs)
        random.Random(rep).shuffle(order)
        for name in order:
            for kind, session in (("ttft", f"s{2 * rep}"), ("load", f"s{2 * rep + 1}")):
                store = AttnStore(host_bytes="16GiB", disk_dir=str(root / name), kv_codec=codec_of(name))
                drop_page_cache(root / name / "sessions" / session_dirname(fp, session))
                if kind == "ttft":
                    rows[f"ttft {name}"].append(turn(store, session))
                else:
                    t = time.perf_counter()
                    assert store.prefetch([session], fp) == 1
                    with store._index.cond:  # wait for the load (the benchmark peeks at the store's counter)
                        store._index.cond.wait_for(lambda: store._index.loads_active == 0, 60)
                    rows[f"load {name}"].append(time.perf_counter() - t)
                store.close(flush=False)
            # The host copy a save leaves behind (encoded with a lossy codec): written, flushed, resumed.
            with AttnStore(host_bytes="16GiB", disk_dir=str(root / f"host-{name}-{rep}"), kv_codec=codec_of(name),
                           fsync=False) as store:
                with store.open_turn(f"k{rep}", fp, None, torch.arange(0)) as w:
                    w.append(*snapshot)
                store.flush()
                host_per_token[name] = store.stats().host_bytes_used / H
                rows[f"host {name}"].append(turn(store, f"k{rep}"))
    host.close()

    saves = {name: ([], [], []) for name in codecs}  # turn s, turn-thread share, save-thread share
    for rep in range(R):
        for name in random.Random(100 + rep).sample(codecs, len(codecs)):
            store = AttnStore(host_bytes="16GiB", disk_dir=str(root / f"save-{name}-{rep}"), kv_codec=codec_of(name))
            t = time.perf_counter()
            cache = AttnStoreCache(model, store, "t", ids)
            model.generate(cache.input_ids, **cache_kwargs(cache), max_new_tokens=args.decode, do_sample=False,
                           min_new_tokens=args.decode, pad_token_id=0)
            turn_s = time.perf_counter() - t
            cache.close()
            store.flush()
            turn_list, own, background = saves[name]
            turn_list.append(turn_s)
            own.append(cache.save_seconds / turn_s)
            background.append(store.stats().write_seconds / turn_s)
            store.close()

    print(f"SmolLM2-135M fp32 on {model.device}, {torch.get_num_threads()} threads; history {H} + new {N}, "
          f"{R} reps (medians); disk tiers in {root}")
    print("\n| codec | bytes/token on disk | vs lossless | AS-disk TTFT | load alone | bytes/token in host | AS-host TTFT "
          "| turn: saving on its thread | save thread (encode + write) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    base = per_token.get("none")
    for name in codecs:
        ratio = f"{base / per_token[name]:.2f}x smaller" if base and name != "none" else "–"
        _, own, background = saves[name]
        print(f"| {name if name != 'none' else 'lossless'} | {per_token[name]:,.0f} | {ratio} | "
              f"{1000 * med(rows[f'ttft {name}']):.0f} ms | {1000 * med(rows[f'load {name}']):.0f} ms | "
              f"{host_per_token[name]:,.0f} | {1000 * med(rows[f'host {name}']):.0f} ms | "
              f"{100 * med(own):.2f}% | {100 * med(background):.1f}% |")
    print(f"\nRE (recompute {H + N} tokens) {1000 * med(rows['RE']):.0f} ms; AS-host {1000 * med(rows['AS-host']):.0f} ms; "
          f"turn (prefill {H + N} + decode {args.decode}) {med(sum((s[0] for s in saves.values()), [])):.2f} s")
    if args.disk_dir is None:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
