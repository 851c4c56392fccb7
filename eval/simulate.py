"""Paper-scale hit rates by simulation: all ShareGPT conversations, Poisson arrivals, the store's own policies.

    python eval/simulate.py                      # everything below, LLaMA-13B, all conversations
    python eval/simulate.py --sessions 3000 --sections policies

Sections:
  policies   hit rate and where hits come from, per policy, at 128G/2T and 128G/10T (+ RE, no store)
  overflow   decoupled truncation vs KV invalidated on overflow (Fig. 22), per model
  capacity   hit rate vs disk capacity with 128 GB of DRAM (Fig. 23); writes docs/img/sim_capacity.png
  codecs     hit rate and DRAM share vs disk capacity per lossy codec of the cold copies (issue 14), with
             look-ahead + prefetch and LRU
  partial    partial eviction (leading chunks of cold sessions first, Pensieve) vs whole-session eviction,
             lossless and int4, vs disk capacity
  recompute  load or recompute by cost (the store's `recompute_by_cost`) vs always loading, per SSD bandwidth,
             LRU without prefetch and look-ahead + prefetch, 128G/2T (issue 33)
  shared     shared system prompts (`--system-prompts 500,1000,2000`, every conversation opens with one):
             prefix sharing on vs off, vs disk capacity (issue 31)
  replicas   R replicas sharing a remote tier of bandwidth B, round robin vs session affinity, LLaMA-13B and -70B:
             where the shared tier becomes the bottleneck (issue 47; `hf_attnstore.lab.replica_sim`)

See `hf_attnstore.lab.simulation` for the serving model and the cost model's assumptions.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

from hf_attnstore.lab.models import load_default_model
from hf_attnstore.lab.replica_sim import ReplicaSimConfig, simulate_replicas
from hf_attnstore.lab.simulation import PROFILES, SimConfig, codec_ratio, sharegpt_trace, simulate, with_system_prompts

POLICIES = (("lookahead", True), ("lru", False), ("fifo", False))


def row(label, r, re=None, profile=None, cfg=None, re_cfg=None):
    ttft = statistics.mean(r.ttft_s)
    service = statistics.mean(r.service_ttft_s)
    saved = 1 - r.prefill_tokens / r.prefill_tokens_recompute
    gpu = f"{re.gpu_busy_s / r.gpu_busy_s:.2f}x" if re else ""
    cost = f"{100 * (r.cost(profile, cfg)['total'] / re.cost(profile, re_cfg)['total'] - 1):+.0f}%" if re else ""
    hit = f"{100 * r.hit_rate:.1f}%" if r.resumed else "–"
    dram = f"{100 * r.host_share:.1f}%" if r.hits_host + r.hits_disk else "–"
    dram_rate = f"{100 * r.hits_host / r.resumed:.1f}%" if r.resumed else "–"
    return (f"| {label} | {hit} | {dram} | {dram_rate} | {r.disk_drops} | {100 * saved:.0f}% | {gpu} | "
            f"{cost} | {1000 * service:.0f} ms | {ttft:.1f} s | {r.max_queue} |")


HEADER = ("| configuration | hit rate | hits from DRAM | DRAM hit rate | disk drops | prefill saved | GPU time RE/AS "
          "| cost vs RE | mean TTFT (stall + prefill) | mean TTFT (incl. queue) | max queue |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-13b", choices=sorted(PROFILES))
    p.add_argument("--sessions", type=int, default=None, help="conversations replayed (default: all)")
    p.add_argument("--rate", type=float, default=1.0, help="session arrivals per second (Poisson)")
    p.add_argument("--think", type=float, default=30.0, help="mean think time between turns, seconds")
    p.add_argument("--batch", type=int, default=32, help="jobs the engine runs at once")
    p.add_argument("--sections", default="policies,overflow,capacity")
    p.add_argument("--plot", default="docs/img/sim_capacity.png")
    p.add_argument("--rejoin", action="store_true",
                   help="join the parts the packaged (split) ShareGPT cut conversations into (see iter_sharegpt)")
    p.add_argument("--system-prompts", default="500,1000,2000",
                   help="the `shared` section's system prompts, in tokens (each conversation opens with one)")
    p.add_argument("--system-share", type=float, default=1.0, help="the share of conversations that open with one")
    args = p.parse_args(argv)
    _, tokenizer = load_default_model()
    trace = sharegpt_trace(tokenizer, args.sessions, rejoin=args.rejoin)
    turns = sum(len(c) for c in trace)
    base = SimConfig(arrival_rate=args.rate, think_time_s=args.think, batch=args.batch)
    profile = PROFILES[args.model]
    print(f"{len(trace)} ShareGPT conversations{' (split parts rejoined)' if args.rejoin else ''}, {turns} turns ({turns / len(trace):.2f} per conversation), "
          f"Poisson {args.rate}/s, think time {args.think} s (exponential), batch {args.batch}")
    print(f"{profile}")
    started = time.perf_counter()
    sections = args.sections.split(",")

    if "policies" in sections:
        re_cfg = dataclasses.replace(base, host_bytes=0, disk_bytes=0, prefetch=False)
        re = simulate(trace, profile, re_cfg)
        from hf_attnstore.lab.costs import CostModel

        c = CostModel()
        print(f"\n## {profile.name}: policies (cost: ${c.gpu_per_hour}/h per GPU x {profile.gpus} busy time, DRAM "
              f"${c.dram_per_gb_hour}/GB·h and SSD ${c.ssd_per_gb_hour}/GB·h provisioned over the run)\n\n{HEADER}")
        print(row("RE (no store)", re))
        for host, disk in ((128e9, 2e12), (128e9, 10e12)):
            for policy, prefetch in POLICIES:
                cfg = dataclasses.replace(base, host_bytes=host, disk_bytes=disk, policy=policy, prefetch=prefetch)
                r = simulate(trace, profile, cfg)
                label = f"{host / 1e9:.0f}G/{disk / 1e12:.0f}T {policy}{' + prefetch' if prefetch else ''}"
                print(row(label, r, re, profile, cfg, re_cfg), flush=True)

    if "overflow" in sections:
        print("\n## Overflow: decoupled truncation vs KV invalidated (lookahead + prefetch, 128G/10T)\n")
        print("| model | window | hit rate decoupled | hit rate invalidated | overflowed turns |\n| --- | --- | --- | --- | --- |")
        for name in ("llama-13b", "llama-65b", "llama-70b", "falcon-40b"):
            prof = PROFILES[name]
            dec = simulate(trace, prof, base)
            inv = simulate(trace, prof, dataclasses.replace(base, truncation="invalidate"))
            print(f"| {prof.name} | {prof.context_window} | {100 * dec.hit_rate:.1f}% | {100 * inv.hit_rate:.1f}% | "
                  f"{inv.misses_overflow} |", flush=True)

    if "capacity" in sections:
        disks = (0, 0.5e12, 1e12, 2e12, 10e12)
        curves = {}
        print(f"\n## {profile.name}: hit rate vs disk capacity (128 GB DRAM)\n")
        print("| disk | " + " | ".join(f"{p}" for p, _ in POLICIES) + " |\n| --- |" + " --- |" * len(POLICIES))
        for disk in disks:
            cells = []
            for policy, prefetch in POLICIES:
                r = simulate(trace, profile, dataclasses.replace(base, disk_bytes=disk, policy=policy, prefetch=prefetch))
                curves.setdefault(policy, []).append(100 * r.hit_rate)
                cells.append(f"{100 * r.hit_rate:.1f}% ({100 * r.host_share:.0f}% DRAM)")
            print(f"| {disk / 1e12:g} TB | " + " | ".join(cells) + " |", flush=True)
        if args.plot:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            fig, ax = plt.subplots(figsize=(5, 3.2))
            for policy, values in curves.items():
                ax.plot([d / 1e12 for d in disks], values, marker="o", label=policy)
            ax.set_xlabel("disk capacity (TB), 128 GB DRAM")
            ax.set_ylabel("hit rate (%)")
            ax.set_title(f"{profile.name}, {len(trace)} ShareGPT sessions")
            ax.legend()
            fig.tight_layout()
            fig.savefig(args.plot, dpi=120)
            print(f"\nplot: {args.plot}")
    if "codecs" in sections:
        codecs = ((None, "disk"), ("int8", "disk"), ("int4", "disk"), ("int4", "all"))
        disks = (0.5e12, 1e12, 2e12)
        print(f"\n## {profile.name}: lossy cold copies, hit rate vs disk capacity (128 GB DRAM; cells: hit rate "
              "(share of hits from DRAM))\n")
        print("| codec (bytes vs fp16) | policy | " + " | ".join(f"{d / 1e12:g} TB" for d in disks) + " |\n"
              "| --- | --- |" + " --- |" * len(disks))
        for codec, where in codecs:
            ratio = codec_ratio(codec)
            label = "lossless" if codec is None else f"{codec} {'disk' if where == 'disk' else 'host + disk'} ({ratio:.3f})"
            for policy, prefetch in POLICIES[:2]:
                cells = []
                for disk in disks:
                    r = simulate(trace, profile, dataclasses.replace(base, disk_bytes=disk, policy=policy,
                                                                     prefetch=prefetch, kv_codec=codec,
                                                                     codec_tiers=where))
                    cells.append(f"{100 * r.hit_rate:.1f}% ({100 * r.host_share:.0f}%)")
                print(f"| {label} | {policy}{' + prefetch' if prefetch else ''} | " + " | ".join(cells) + " |",
                      flush=True)
    if "partial" in sections:
        disks = (0.25e12, 0.5e12, 1e12, 2e12)
        print(f"\n## {profile.name}: partial vs whole-session eviction from disk (128 GB DRAM; cells: hit rate / "
              "token hit rate / mean TTFT without queueing (load stall + prefill))\n")
        print("| codec | eviction | policy | " + " | ".join(f"{d / 1e12:g} TB" for d in disks) + " |\n"
              "| --- | --- | --- |" + " --- |" * len(disks))
        for codec in (None, "int4"):
            for partial in (False, True):
                for policy, prefetch in POLICIES[:2]:
                    cells = []
                    for disk in disks:
                        r = simulate(trace, profile, dataclasses.replace(base, disk_bytes=disk, policy=policy,
                                                                         prefetch=prefetch, kv_codec=codec,
                                                                         codec_tiers="disk",
                                                                         partial_eviction=partial))
                        cells.append(f"{100 * r.hit_rate:.1f}% / {100 * r.token_hit_rate:.1f}% / "
                                     f"{1000 * statistics.mean(r.service_ttft_s):.0f} ms")
                    print(f"| {codec or 'lossless'} | {'partial' if partial else 'whole'} | "
                          f"{policy}{' + prefetch' if prefetch else ''} | " + " | ".join(cells) + " |", flush=True)
    if "shared" in sections:
        sizes = [int(x) for x in args.system_prompts.split(",")]
        strace, system = with_system_prompts(trace, sizes, args.system_share, seed=0)
        disks = (0.25e12, 0.5e12, 2e12, 100e12)
        print(f"\n## {profile.name}: shared system prompts of {sizes} tokens in {100 * args.system_share:.0f}% of the "
              "conversations, look-ahead + prefetch, 128 GB DRAM, by disk capacity (100 TB: everything fits, so its "
              "peak is the footprint; cells: hit rate of resumed turns / turns that reused another session's "
              "prompt, per conversation / prefill saved vs RE / peak disk bytes / mean TTFT without queueing)\n")
        re_cfg = dataclasses.replace(base, host_bytes=0, disk_bytes=0, prefetch=False)
        re = simulate(strace, profile, re_cfg, system)
        print("| sharing | " + " | ".join(f"{d / 1e12:g} TB" for d in disks) + " |\n| --- |" + " --- |" * len(disks))
        for share in (False, True):
            cells = []
            for disk in disks:
                r = simulate(strace, profile, dataclasses.replace(base, disk_bytes=disk, share_prefixes=share), system)
                firsts = len(strace)
                cells.append(f"{100 * r.hit_rate:.1f}% / {100 * r.prefix_hits / firsts:.0f}% / "
                             f"{100 * (1 - r.prefill_tokens / re.prefill_tokens):.0f}% / {r.peak_disk_bytes / 1e12:.2f} TB / "
                             f"{1000 * statistics.mean(r.service_ttft_s):.0f} ms")
            print(f"| {'on' if share else 'off'} | " + " | ".join(cells) + " |", flush=True)
    if "recompute" in sections:
        print(f"\n## {profile.name}: load or recompute by cost vs always loading, 128 GB DRAM / 2 TB disk, by SSD read "
              "bandwidth (cells: mean / p99 TTFT without queueing (load stall + prefill), mean TTFT with queueing, GPU "
              "busy time, turns whose demand load left leading chunks to recompute)\n")
        print("| SSD | policy | load | recompute by cost | tokens recomputed |\n| --- | --- | --- | --- | --- |")
        for ssd in (1e9, 2e9, 5e9, 10e9):
            for policy, prefetch in POLICIES[:2]:
                cells, chosen = [], ""
                for by_cost in (False, True):
                    r = simulate(trace, profile, dataclasses.replace(base, disk_bytes=2e12, policy=policy,
                                                                     prefetch=prefetch, ssd_read_bytes_per_s=ssd,
                                                                     recompute_by_cost=by_cost))
                    service = sorted(r.service_ttft_s)
                    cells.append(f"{1000 * statistics.mean(service):.0f} / {1000 * service[int(0.99 * len(service))]:.0f}"
                                 f" ms, {statistics.mean(r.ttft_s):.2f} s, GPU {r.gpu_busy_s / 3600:.1f} h, "
                                 f"{r.recompute_choices:,} turns")
                    chosen = f"{r.recompute_chosen_tokens / 1e6:.2f} M" if by_cost else chosen
                print(f"| {ssd / 1e9:g} GB/s | {policy}{' + prefetch' if prefetch else ''} | " + " | ".join(cells)
                      + f" | {chosen} |", flush=True)
    if "replicas" in sections:
        counts = (2, 8, 16, 32, 64)
        print("\n## Replicas sharing one remote tier: round robin vs session affinity, 0.3 new conversations/s per "
              "replica, 30 s think time, 25 GB/s host -> GPU (cells: resumed turns' mean TTFT without GPU queueing, "
              "round robin / affinity, and the link's busy share round robin / affinity; recomputing the history "
              "instead costs the RE column)\n")
        print("| model | remote tier | RE | " + " | ".join(f"{r} replicas" for r in counts) + " |\n| --- | --- | --- |"
              + " --- |" * len(counts))
        for name in ("llama-13b", "llama-70b"):
            for gbps in (5.0, 12.5, 25.0):
                cells, re = [], ""
                for replicas in counts:
                    got = {routing: simulate_replicas(trace, PROFILES[name], ReplicaSimConfig(
                        replicas=replicas, remote_gbps=gbps, routing=routing, rate_per_replica=0.3))
                        for routing in ("round_robin", "affinity")}
                    rr, aff = got["round_robin"], got["affinity"]
                    re = f"{1000 * statistics.mean(rr.recompute_ttft_s):.0f} ms"
                    cells.append(f"{_ms(rr.mean_ttft())} / {_ms(aff.mean_ttft())}, {100 * rr.link_utilization:.0f}% / "
                                 f"{100 * aff.link_utilization:.0f}%")
                print(f"| {PROFILES[name].name} | {gbps:g} GB/s | {re} | " + " | ".join(cells) + " |", flush=True)
    print(f"\nsimulated in {time.perf_counter() - started:.0f} s")


def _ms(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds >= 10 else f"{1000 * seconds:.0f} ms"


if __name__ == "__main__":
    main()
