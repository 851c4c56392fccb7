"""A multi-turn ChatPipeline over a store with a disk tier: the session survives a restart.

    python examples/chat_pipeline.py [--disk-dir /tmp/attnstore-example] [--kv-budget 0.2]

The first pipeline chats two turns and closes (its store writes the session to disk); a second pipeline
over a new store on the same folder continues the conversation, loading the session's KV from disk.
With `--kv-budget` every turn attends to that share of the history (sparse window attention, ALISA); the
store keeps every token, and the tokens' importance scores, which the second pipeline reads back with them.
"""

import argparse
import tempfile

from hf_attnstore import AttnStore, ChatPipeline, load_default_model

parser = argparse.ArgumentParser()
parser.add_argument("--disk-dir", default=None)
parser.add_argument("--max-new-tokens", type=int, default=24)
parser.add_argument("--kv-budget", type=float, default=None, help="e.g. 0.2: attend to 20%% of the history")
args = parser.parse_args()
# Without --disk-dir, a temporary folder, removed when the process exits (also when it fails).
scratch = None if args.disk_dir else tempfile.TemporaryDirectory(prefix="attnstore-example-")
folder = args.disk_dir or scratch.name
model, tokenizer = load_default_model()

with AttnStore(host_bytes="1GiB", disk_dir=folder) as store, \
        ChatPipeline(model, tokenizer, store, max_new_tokens=args.max_new_tokens, kv_budget=args.kv_budget) as pipe:
    for message in ["Hi! What is a KV cache?", "Why does reusing it save time?"]:
        reply = pipe.chat("bob", message, timeout=600)
        print(f"[{reply.kv_source}: reused {reply.reused_tokens}/{reply.history_tokens}, "
              f"TTFT {1000 * reply.ttft_s:.0f} ms] {reply.text!r}")

# A new process would do the same: a new store on the folder finds the session on disk.
with AttnStore(host_bytes="1GiB", disk_dir=folder) as store, \
        ChatPipeline(model, tokenizer, store, max_new_tokens=args.max_new_tokens, kv_budget=args.kv_budget) as pipe:
    reply = pipe.chat("bob", "Summarize in one sentence.", timeout=600)
    # The pipeline prefetched the session from disk as soon as the message was queued, so the turn found it
    # in host memory: the bytes read from disk tell where it came from.
    read = store.stats().bytes_read
    print(f"after a restart [{reply.kv_source}: reused {reply.reused_tokens}/{reply.history_tokens}, "
          f"{read / 2**20:.1f} MiB read from disk] {reply.text!r}")
    assert reply.reused_tokens > 0 and read > 0
