"""Scorecard rows for the faults that adversarial runs found (issue 29), run by eval/faults.py.

Each row reproduces one finding end to end, many times, and counts what eval/faults.py counts: wrong KV,
crashes, data lost.
"""

from __future__ import annotations

import random
import shutil
import tempfile

import torch

from faults import FAST, Row, resume_is_wrong, sequence, tiny_model, turn
from hf_attnstore import AttnStore

HUGE = 5  # a token whose layer-0 values no fp16 scale can hold (|v| > 65504)


def _huge_value_model():
    """The scorecard's tiny Llama, with token HUGE driving layer 0's values to ~72,000 (and no other token)."""
    model = tiny_model()
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb[:, 0] = 0.0
        emb[HUGE] = 0.0
        emb[HUGE, 0] = 1.0
        model.model.layers[0].self_attn.v_proj.weight[:, 0] = 72_000 / model.config.hidden_size ** 0.5
    return model


def scenario_codec_labels(runs: int, rng: random.Random) -> Row:
    """A lossy store rewrites a loaded lossy partial chunk with tokens its codec cannot encode; a lossless
    store reopened on the folder must not reuse the dequantized tokens (it did: labelled lossless)."""
    row = Row("lossy chunk rewritten over dequantized tokens, reopened lossless")
    model = _huge_value_model()
    for run in range(runs):
        codec = ("int4", "int8")[run % 2]
        root = tempfile.mkdtemp(prefix="faults-codec-")
        try:
            ids = sequence(run, 40)
            ids[ids == HUGE] = HUGE + 1
            first = rng.randrange(9, 24)  # ends inside a chunk: a lossy trailing partial chunk
            for chunk in range(first // 8):  # every whole chunk before it holds one: they stay lossless
                ids[0, chunk * 8 + rng.randrange(8)] = HUGE
            ids[0, rng.randrange(first, first - first % 8 + 8)] = HUGE  # the rewritten chunk cannot be encoded
            with AttnStore(host_bytes="64MiB", disk_dir=root, kv_codec=codec, **FAST) as store:
                turn(model, store, "s", ids[:, :first])
                store.flush()
                store.evict("s")
                turn(model, store, "s", ids[:, : first - first % 8 + 8])
                store.flush()
            with AttnStore(host_bytes="64MiB", disk_dir=root, **FAST) as store:
                row.runs += 1
                reused, wrong = resume_is_wrong(model, store, "s", ids[:, : first - first % 8 + 9])
                row.wrong += wrong or reused > 0  # a lossless store serves no dequantized token at all
        except Exception as exc:
            row.crash(exc)
        shutil.rmtree(root, ignore_errors=True)
    return row
