"""`generate` with an AttnStoreCache: the second turn reuses the first turn's KV from the store.

    python examples/generate_with_cache.py [--model HUB_ID_OR_FOLDER]

Uses your model (`AutoModelForCausalLM.from_pretrained`) with `--model`, else the bundled SmolLM2 (offline). Prints each turn's reused tokens and checks the reply against a plain
`generate` that recomputes the whole history. The conversation is re-rendered from text each turn, so the
reply's re-tokenization may differ from the ids generated: the cache then reuses the common prefix
(`ChatPipeline` and `attnstore serve` keep the exact ids and reuse everything).
"""

import argparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from hf_attnstore import AttnStore, AttnStoreCache, cache_kwargs, load_default_model

parser = argparse.ArgumentParser()
parser.add_argument("--model", default=None, help="a Hub id or a folder (default: the bundled SmolLM2)")
args = parser.parse_args()
if args.model:
    model, tokenizer = AutoModelForCausalLM.from_pretrained(args.model), AutoTokenizer.from_pretrained(args.model)
else:
    model, tokenizer = load_default_model()
store = AttnStore(host_bytes="1GiB")
messages = [{"role": "user", "content": "Name three colours."}]
for turn, follow_up in enumerate(["And three animals?", None]):
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ids = ids["input_ids"]
    cache = AttnStoreCache(model, store, "alice", ids)  # looks the session up, plans the reuse
    with torch.no_grad():
        # `cache=cache` on transformers >= 5.24, `past_key_values=cache` before: cache_kwargs picks the installed name.
        out = model.generate(cache.input_ids, **cache_kwargs(cache), max_new_tokens=20, do_sample=False)
        plain = model.generate(ids, **cache_kwargs(DynamicCache()), max_new_tokens=20, do_sample=False)
    cache.close()  # the turn is over: the store may move the session to a lower tier
    reply = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    print(f"turn {turn}: reused {cache.reused_tokens}/{ids.shape[1]} prompt tokens ({cache.kv_source}); "
          f"same as recomputation: {torch.equal(out, plain)}")
    print(f"  {reply!r}")
    assert torch.equal(out, plain)
    if follow_up is None:
        break
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": follow_up}]
print(store.stats())
store.close()
