"""The hierarchical store's benchmarks: TTFT per tier, pre-loading ablation, async saving, disk throughput.

    python eval/bench_tiers.py --history 2048 --new 128 --reps 5 [--disk-dir DIR]

All variants of a section are measured in one run, each once per repetition in an order drawn afresh for every
repetition (from `--seed`; the orders are printed), and medians are reported as Markdown tables:

  ttft      RE (recompute history + new tokens) vs ideal (KV resident in a live DynamicCache) vs AS-host
            (session in the host tier) vs AS-disk (session only on disk, its pages dropped from the page cache
            with posix_fadvise(DONTNEED); the store's default pre-loading for the model's device).
            TTFT = building the cache + the prefill forward of the new tokens (which loads the KV).
  preload   AS-disk without layer-wise pre-loading (wait for all layers, the paper's NO-PL) and with it,
            read buffer 0, 4, 15 and all layers (the paper's PL-B0 ... Fig. 19); interleaved with the above.
  saving    one turn (prefill + 32 decoded tokens) with a host-only store (no disk: the reference), with
            the disk tier saving asynchronously (the default), and saving synchronously (flush before
            the turn returns, Fig. 20's baseline).
  disk      GB/s of loading sessions from disk (cold) vs a plain sequential read of the same files.

Every measured resume has new tokens of its own (a repeated prompt would be served by prefix sharing from the
session that stored it first: a cache hit, not a resume), and fails the run unless it reused exactly the
history, of its own session, from the tier it measures. The temporary folder is removed also when a run fails.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from hf_attnstore import AttnStore, AttnStoreCache, load_default_model
from hf_attnstore.store.format import session_dirname
from hf_attnstore.cache.upstream import cache_kwargs


def drop_page_cache(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def sequential_read(folder: Path) -> tuple[int, float]:
    """Reads every file of `folder` once, in name order, 8 MiB at a time (the bound a loader can reach)."""
    total, t = 0, time.perf_counter()
    for path in sorted(folder.iterdir()):
        with open(path, "rb", buffering=0) as f:
            while chunk := f.read(8 << 20):
                total += len(chunk)
    return total, time.perf_counter() - t


def history_snapshot(model, ids: torch.Tensor, H: int):
    """Prefills ``ids[:, :H]`` into a live DynamicCache (the ideal) and through a store.

    Returns:
        The DynamicCache, the model's fingerprint, and the stored session as (ids, pre-RoPE keys, values),
        to be written under other session ids with ``open_turn(...).append(*snapshot)``.
    """
    resident = DynamicCache()
    model(ids[:, :H], **cache_kwargs(resident))
    with AttnStore(host_bytes="16GiB") as store:
        seed = AttnStoreCache(model, store, "seed", ids[:, :H])
        model(seed.input_ids, **cache_kwargs(seed))
        snap = store.lookup("seed", seed.fingerprint)
        snapshot = snap.tensors(0, snap.length)
    return resident, seed.fingerprint, snapshot


def ideal_prefill(model, resident: DynamicCache, new_ids: torch.Tensor) -> float:
    """Seconds of one prefill of `new_ids` over a copy of `resident` (the history's KV already live)."""
    cache = DynamicCache()
    for i, layer in enumerate(resident.layers):
        cache.update(layer.keys.clone(), layer.values.clone(), i)
    t = time.perf_counter()
    model(new_ids, **cache_kwargs(cache))
    return time.perf_counter() - t


class Resumes:
    """Prompts for measured resumes: the stored history, then new tokens drawn afresh for every resume.

    With prefix sharing, a turn starts from another session whose stored ids begin with a longer prefix of its
    prompt than its own. Resumes that repeated one prompt would find the first one's whole prompt (saved by its
    turn) and time that cache hit instead of a resume; fresh new tokens leave every session only its own history.

    Example:
        >>> prompts = Resumes(torch.arange(100, 104).view(1, -1), new=2, vocab_size=1000)
        >>> a, b = prompts.next(), prompts.next()
        >>> a.shape, torch.equal(a[:, :4], b[:, :4]), torch.equal(a[:, 4:], b[:, 4:])
        (torch.Size([1, 6]), True, False)
    """

    def __init__(self, history: torch.Tensor, new: int, vocab_size: int, seed: int = 1):
        self.history, self.new, self.vocab_size = history, new, vocab_size
        self._generator = torch.Generator().manual_seed(seed)

    def next(self) -> torch.Tensor:
        new = torch.randint(100, self.vocab_size, (1, self.new), generator=self._generator)
        return torch.cat([self.history, new.to(self.history.device)], dim=1)


def check_resume(cache, reused: int, sources: tuple[str, ...]) -> None:
    """Fails unless the measured turn resumed what it measures: `reused` tokens of its own session's stored KV,
    loaded from one of `sources` (not another session's prefix, not a miss)."""
    assert cache.shared_from is None, f"the turn started from session {cache.shared_from!r}: a cache hit, not a resume"
    assert cache.reused_tokens == reused, f"the turn reused {cache.reused_tokens} tokens, not {reused}"
    assert cache.kv_source in sources, f"the KV came from {cache.kv_source!r}, not {' or '.join(sources)}"


def med(xs):
    return statistics.median(xs)


def interleaved(variants: dict, reps: int, seed: int = 0) -> tuple[dict[str, list], list[list[str]]]:
    """Each variant's result over `reps` repetitions (`variants[name](rep)`), every variant once per repetition in
    an order drawn anew each time from one generator seeded with `seed`: this machine's speed drifts, so no
    variant may always run first or last.

    Returns:
        The results per variant, and the order of each repetition (print it with :func:`orders_line`).

    Example:
        >>> rows, orders = interleaved({"a": lambda rep: rep, "b": lambda rep: -rep}, reps=2)
        >>> rows, sorted(orders[0])
        ({'a': [0, 1], 'b': [0, -1]}, ['a', 'b'])
    """
    rng = random.Random(seed)
    rows: dict[str, list] = {name: [] for name in variants}
    orders = []
    for rep in range(reps):
        order = list(variants)
        rng.shuffle(order)
        orders.append(order)
        for name in order:
            rows[name].append(variants[name](rep))
    return rows, orders


def orders_line(orders: list[list[str]], seed: int) -> str:
    """The orders :func:`interleaved` ran, one repetition after another."""
    return f"order of the variants per repetition (seed {seed}): " + " | ".join(", ".join(o) for o in orders)


@contextlib.contextmanager
def scratch_folder(given: str | None, prefix: str):
    """`given` (created if needed; it must be empty, and is kept after), or a new temporary folder removed at the
    end, also when the run fails."""
    if given is not None:
        folder = Path(given)
        folder.mkdir(parents=True, exist_ok=True)
        if any(folder.iterdir()):
            raise SystemExit(f"--disk-dir {given} is not empty: the benchmark writes its own sessions there")
        yield folder
        return
    root = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--history", type=int, default=2048)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--decode", type=int, default=32, help="tokens generated in the saving benchmark")
    p.add_argument("--disk-dir", default=None, help="an empty folder for the disk tier (default: a temporary one)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--sections", default="ttft,saving,disk", help="comma-separated: ttft (with preload), saving, disk")
    p.add_argument("--seed", type=int, default=0, help="seed of the variants' order in each repetition")
    args = p.parse_args(argv)
    sections = set(args.sections.split(","))
    torch.set_grad_enabled(False)
    model, _ = load_default_model(dtype=args.dtype)
    gen = torch.Generator().manual_seed(0)
    history = torch.randint(100, model.config.vocab_size, (1, args.history), generator=gen).to(model.device)
    prompts = Resumes(history, args.new, model.config.vocab_size)
    print(f"SmolLM2-135M {args.dtype} on {model.device}, {torch.get_num_threads()} threads; history {args.history}, "
          f"new {args.new} (drawn afresh for every measured turn), {args.reps} reps (medians)")
    with scratch_folder(args.disk_dir, "attnstore-bench-") as root:
        if "ttft" in sections:
            measure_ttft(model, history, prompts, args, root)
        if "saving" in sections:
            measure_saving(model, prompts, args, root / "saving")
        if "disk" in sections:
            measure_disk(model, history, args, root / "throughput")
    return 0


PRELOADS = {  # the AS-disk variants: the store's pre-loading options
    "AS-disk": {},
    "nopl": dict(preload=False),
    "pl0": dict(preload=True, read_buffer_layers=0),
    "pl4": dict(preload=True, read_buffer_layers=4),
    "pl15": dict(preload=True, read_buffer_layers=15),
    "plall": dict(preload=True, read_buffer_layers=None),
}


def measure_ttft(model, history: torch.Tensor, prompts: Resumes, args, root: Path) -> None:
    """TTFT of RE, the ideal, AS-host and every AS-disk variant, all interleaved in one order per repetition."""
    H, R = args.history, args.reps
    resident, fp, snapshot = history_snapshot(model, history, H)
    # One disk session per measured AS-disk turn (a resumed session holds the turn's tokens afterwards).
    sessions = iter(f"s{i}" for i in range(R * len(PRELOADS)))
    with AttnStore(host_bytes="16GiB", disk_dir=str(root)) as writer:
        for i in range(R * len(PRELOADS)):
            writer.open_turn(f"s{i}", fp, None, torch.arange(0)).append(*snapshot)
    kv_bytes = sum(k.nbytes + v.nbytes for k, v in zip(snapshot[1], snapshot[2]))
    model(history[:, :8])  # warm-up

    def resume(store: AttnStore, session: str, source: str) -> float:
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

    def host(rep: int) -> float:
        host_store.open_turn(f"h{rep}", fp, None, torch.arange(0)).append(*snapshot)
        return resume(host_store, f"h{rep}", "host")

    def disk(options: dict):
        def run(rep: int) -> float:
            session = next(sessions)
            with AttnStore(host_bytes="16GiB", disk_dir=str(root), **options) as store:  # reopened: on disk only
                drop_page_cache(root / "sessions" / session_dirname(fp, session))
                seconds = resume(store, session, "disk")
                store.close(flush=False)
            return seconds
        return run

    variants = {"RE": recompute, "ideal": lambda rep: ideal_prefill(model, resident, prompts.next()[:, H:]),
                "AS-host": host, **{name: disk(options) for name, options in PRELOADS.items()}}
    with AttnStore(host_bytes="16GiB") as host_store:
        rows, orders = interleaved(variants, R, args.seed)
    ideal = med(rows["ideal"])
    layers = model.config.num_hidden_layers
    labels = {
        "RE": "RE: recompute history + new tokens",
        "ideal": "ideal: history KV resident in a live `DynamicCache`",
        "AS-host": "AS-host: session in the host tier",
        "AS-disk": f"AS-disk: session on disk only, cold page cache (the default pre-loading on {model.device.type})",
        "nopl": "AS-disk, no pre-load (NO-PL)",
        "pl0": "AS-disk, layer-wise pre-load, read buffer 0 layers",
        "pl4": "AS-disk, layer-wise, buffer 4",
        "pl15": "AS-disk, layer-wise, buffer 15",
        "plall": f"AS-disk, layer-wise, buffer all {layers}",
    }
    print(f"\n[ttft] KV {kv_bytes / 2**20:.1f} MiB per session; {orders_line(orders, args.seed)}\n")
    print(f"| variant (median of {R}) | TTFT | vs ideal |\n| --- | --- | --- |")
    for name, label in labels.items():
        print(f"| {label} | {1000 * med(rows[name]):.0f} ms | {med(rows[name]) / ideal:.3f} |")


def measure_saving(model, prompts: Resumes, args, root: Path) -> None:
    """One turn from scratch (prefill + decode) with a host-only store, the disk tier saving asynchronously (the
    default), and saving synchronously (flush before the turn returns), interleaved.

    Wall-clock differences of ~9 s turns drown in this machine's noise (+-5%), so the cost of saving is also
    measured directly: the turn's own time in saving code (un-rotating keys, copying KV into the host tier) and
    the background writer's time overlapping the turn."""
    critical, overlap, flush_s = [], [], []

    def turn(name: str):
        def run(rep: int) -> float:
            disk = None if name == "host only" else str(root / f"{name[5:]}{rep}")
            prompt = prompts.next()
            with AttnStore(host_bytes="16GiB", disk_dir=disk) as store:
                t = time.perf_counter()
                cache = AttnStoreCache(model, store, "t", prompt)
                out = model.generate(cache.input_ids, **cache_kwargs(cache), max_new_tokens=args.decode,
                                     do_sample=False, min_new_tokens=args.decode, pad_token_id=0)
                turn_s = time.perf_counter() - t
                if name == "disk async":
                    critical.append(cache.save_seconds / turn_s)
                    overlap.append(store.stats().write_seconds / turn_s)
                if name == "disk sync":
                    f = time.perf_counter()
                    store.flush()
                    flush_s.append(time.perf_counter() - f)
                    turn_s = time.perf_counter() - t
                cache.close()
                store.flush()
                # The turn measured what it claims: the whole turn stored (and on disk, with a disk tier).
                stored = store.lookup("t", cache.fingerprint)
                assert stored is not None and stored.length >= out.shape[1] - 1, "the turn was not saved"
                assert disk is None or store.stats().disk_bytes_used > 0, "nothing reached the disk tier"
            return turn_s
        return run

    names = ("host only", "disk async", "disk sync")
    rows, orders = interleaved({name: turn(name) for name in names}, args.reps, args.seed)
    base = med(rows["host only"])
    labels = {"host only": "host tier only (no disk)", "disk async": "disk tier, async saving (default)",
              "disk sync": "disk tier, sync saving (flush before returning)"}
    print(f"\n[saving] one turn from scratch: prefill {args.history + args.new} + decode {args.decode} tokens; "
          f"{orders_line(orders, args.seed)}\n")
    print(f"| store | turn (wall clock, median of {args.reps}) | vs host only |\n| --- | --- | --- |")
    for name, label in labels.items():
        change = "" if name == "host only" else f"{100 * (med(rows[name]) / base - 1):+.1f}%"
        print(f"| {label} | {med(rows[name]):.3f} s | {change} |")
    print(f"\nasync: saving work on the turn's thread {100 * med(critical):.2f}% of the turn; disk writes during "
          f"the turn {100 * med(overlap):.2f}% (written behind, after it)")
    print(f"sync: the flush the turn waits for {med(flush_s):.3f} s = {100 * med(flush_s) / base:.1f}% of the turn")


def measure_disk(model, history: torch.Tensor, args, root: Path) -> None:
    """Loader GB/s vs a plain sequential read of the same files, both from a cold page cache, interleaved.

    The loader is timed alone (a prefetch: no model computing, no read buffer waiting for a consumer),
    from the request to the last layer verified in host memory.
    """
    reps = max(3, args.reps)
    _, fp, snapshot = history_snapshot(model, history, args.history)
    with AttnStore(host_bytes="16GiB", disk_dir=str(root)) as writer:
        for rep in range(reps):
            writer.open_turn(f"d{rep}", fp, None, torch.arange(0)).append(*snapshot)

    def loader(rep: int) -> float:
        folder = root / "sessions" / session_dirname(fp, f"d{rep}")
        with AttnStore(host_bytes="16GiB", disk_dir=str(root)) as store:
            drop_page_cache(folder)
            t = time.perf_counter()
            assert store.prefetch([f"d{rep}"], fp) == 1, "the session was not found on disk"
            with store._index.cond:  # wait for the load to finish (the benchmark peeks at the store's counter)
                done = store._index.cond.wait_for(lambda: store._index.loads_active == 0, 60)
            seconds = time.perf_counter() - t
            read = store.stats().bytes_read
            assert done and read >= sum(f.stat().st_size for f in folder.iterdir()) // 2, "the load did not finish"
            store.close(flush=False)
        return read / seconds / 1e9

    def plain(rep: int) -> float:
        folder = root / "sessions" / session_dirname(fp, f"d{rep}")
        drop_page_cache(folder)
        n, s = sequential_read(folder)
        return n / s / 1e9

    rows, orders = interleaved({"loader": loader, "plain read": plain}, reps, args.seed)
    print(f"\n[disk] cold reads, alone, {reps} reps; {orders_line(orders, args.seed)}")
    print(f"  loader (layer by layer, verified) {med(rows['loader']):6.2f} GB/s")
    print(f"  plain sequential read             {med(rows['plain read']):6.2f} GB/s   "
          f"loader = {100 * med(rows['loader']) / med(rows['plain read']):.0f}%")


if __name__ == "__main__":
    raise SystemExit(main())
