"""Replaying real ShareGPT conversations through a ChatPipeline (the `attnstore replay` command)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from .data import load_sharegpt
from .pipeline import ChatPipeline, Reply
from .store import AttnStore



@dataclass
class ReplayResult:
    policy: str
    prefetch: bool
    replies: list[Reply]
    host_bytes: int

    def summary(self) -> dict:
        """Hit rate over resumed turns (every turn but a session's first), where hits were served from,
        and mean TTFT."""
        seen, resumed = set(), []
        for r in self.replies:
            if r.session_id in seen:
                resumed.append(r)
            seen.add(r.session_id)
        hits = [r for r in resumed if r.kv_source in ("host", "disk")]
        return {
            "policy": self.policy + (" + prefetch" if self.prefetch else ""),
            "turns": len(self.replies),
            "resumed": len(resumed),
            "hit_rate": len(hits) / max(1, len(resumed)),
            "host_share": sum(r.kv_source == "host" for r in hits) / max(1, len(hits)),
            "ttft_ms": 1000 * statistics.mean(r.ttft_s for r in self.replies),
            "ttft_resumed_ms": 1000 * statistics.mean(r.ttft_s for r in resumed) if resumed else float("nan"),
        }


def conversation_jobs(conversations: int, turns: int, max_user_tokens: int, tokenizer) -> list[tuple[str, str]]:
    """(session id, message) jobs, round-robin over conversations: turn 1 of each, then turn 2 of each...

    Round-robin puts `conversations - 1` other jobs between a session's turns, so a host tier holding a
    fraction of the sessions cannot keep them all: the ones resumed come from disk unless fetched ahead.
    """
    convs = load_sharegpt(limit=conversations, min_user_turns=2)
    clipped = [[tokenizer.decode(tokenizer(m, add_special_tokens=False)["input_ids"][:max_user_tokens])
                for m in c.user_turns[:turns]] for c in convs]
    jobs = []
    for t in range(turns):
        jobs.extend((c.id, msgs[t]) for c, msgs in zip(convs, clipped) if t < len(msgs))
    return jobs


def replay(model, tokenizer, jobs: list[tuple[str, str]], *, host_bytes: int, disk_dir: str, policy: str,
           prefetch: bool, max_new_tokens: int = 16, progress: bool = True) -> ReplayResult:
    """Submits all jobs at once (a trace), so the pipeline's queue sees what comes next."""
    from tqdm.auto import tqdm

    store = AttnStore(host_bytes=host_bytes, disk_dir=disk_dir, policy=policy, idle_flush_s=0.05)
    pipe = ChatPipeline(model, tokenizer, store, max_new_tokens=max_new_tokens,
                        prefetch_window=None if prefetch else 0)
    futures = [pipe.submit(sid, msg) for sid, msg in jobs]
    replies = [f.result(600) for f in tqdm(futures, desc=f"{policy}{'+prefetch' if prefetch else ''}",
                                           disable=not progress)]
    pipe.close()
    store.close()
    return ReplayResult(policy, prefetch, replies, host_bytes)
