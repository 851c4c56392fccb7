"""Which of the package's modules one plain resumed turn runs (docs/design.md, "Following one turn").

The turn: a session written by an earlier process, reopened from its disk folder by a new store, resumed with
three new tokens and three generated ones, dense, local only (no remote tier, no sparse attention, no importance
scores, no speculative decoding), then flushed to disk. Every Python call into `hf_attnstore` is recorded, in the
turn's own thread and in the store's I/O threads, from `AttnStoreCache(...)` to the flush; the store's set-up (its
reopen scan) is not part of the turn and is not counted.

Printed: the modules that ran, those of `store/`, the number of calls from one package module into another, and
the store modules on the path of the turn's new KV from the layer that computed it to the file on disk (every store
module that runs under the cache's recorder, which hands a forward's KV to the store, or in the threads that
write: the save thread and the disk tier's writer).

    python eval/trace_turn.py            # the table
    python eval/trace_turn.py --list     # and every module by name
    python eval/trace_turn.py --shape    # also files and lines of store/ and cache/, and their biggest classes
"""

from __future__ import annotations

import argparse
import ast
import sys
import tempfile
import threading
from collections import Counter
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

PACKAGE = "hf_attnstore"
RECORDER = "hf_attnstore.cache.record"
# The store's threads that write what a turn computed (the save thread, and the disk tier's serial writer); the
# load thread reads the session in and is not on the write path.
WRITERS = ("attnstore-save", "attnstore-disk-write")


def tiny_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return LlamaForCausalLM(config).eval()


class Trace:
    """A profile function for every thread: records each call into the package while `on` is set."""

    def __init__(self):
        self.on = False
        self.modules: Counter = Counter()
        self.cross: Counter = Counter()  # (caller module, callee module) -> calls
        self.write_path: set[str] = set()

    def __call__(self, frame, event, arg):
        if not self.on or event != "call":
            return
        module = frame.f_globals.get("__name__", "")
        if not module.startswith(PACKAGE):
            return
        self.modules[module] += 1
        caller = frame.f_back
        while caller is not None and not caller.f_globals.get("__name__", "").startswith(PACKAGE):
            caller = caller.f_back  # through torch or transformers: the package module that called it
        if caller is not None and caller.f_globals["__name__"] != module:
            self.cross[(caller.f_globals["__name__"], module)] += 1
        if module.startswith(PACKAGE + ".store"):
            if threading.current_thread().name in WRITERS:
                self.write_path.add(module)
            else:
                f = frame.f_back
                while f is not None:
                    if f.f_globals.get("__name__") == RECORDER:
                        self.write_path.add(module)
                        break
                    f = f.f_back


def short(module: str) -> str:
    return module[len(PACKAGE) + 1:].replace(".", "/") + ".py"


def run(show: bool) -> dict:
    from hf_attnstore import AttnStore, AttnStoreCache, cache_kwargs

    model = tiny_model()
    prompt = torch.randint(3, 128, (1, 40))
    with tempfile.TemporaryDirectory() as folder:
        with AttnStore(host_bytes="64MiB", disk_dir=folder) as store:  # an earlier process: the first turn
            with AttnStoreCache(model, store, session_id="alice", input_ids=prompt) as cache:
                out = model.generate(cache.input_ids, max_new_tokens=3, do_sample=False, **cache_kwargs(cache))
        ids = torch.cat([out, torch.randint(3, 128, (1, 3))], dim=1)

        trace = Trace()
        threading.setprofile(trace)  # the store's I/O threads start in its constructor: traced from their start
        sys.setprofile(trace)
        try:
            store = AttnStore(host_bytes="64MiB", disk_dir=folder)  # a new process reopens the folder
            trace.on = True
            with AttnStoreCache(model, store, session_id="alice", input_ids=ids) as cache:
                model.generate(cache.input_ids, max_new_tokens=3, do_sample=False, **cache_kwargs(cache))
                reused = cache.reused_tokens
            store.flush()
            trace.on = False
            store.close()
        finally:
            sys.setprofile(None)
            threading.setprofile(None)
    assert reused == ids.shape[1] - 1 or reused > 0, "the resumed turn reused nothing: not the turn traced"
    store_modules = sorted(m for m in trace.modules if m.startswith(PACKAGE + ".store"))
    result = {
        "modules": len(trace.modules),
        "store_modules": len(store_modules),
        "cross_module_calls": sum(trace.cross.values()),
        "write_path_store_modules": len(trace.write_path),
        "reused_tokens": reused,
    }
    print(f"one plain resumed turn from disk ({reused} of {ids.shape[1]} prompt tokens reused):")
    print(f"  package modules run:                 {result['modules']}")
    print(f"  store modules run:                   {result['store_modules']}")
    print(f"  calls from one module into another:  {result['cross_module_calls']}")
    print(f"  store modules from a layer's KV to the file: {result['write_path_store_modules']}")
    if show:
        print("modules:", ", ".join(short(m) for m in sorted(trace.modules)))
        print("store modules:", ", ".join(short(m) for m in store_modules))
        print("KV to file:", ", ".join(short(m) for m in sorted(trace.write_path)))
    return {**result, "module_names": sorted(trace.modules), "write_path": sorted(trace.write_path)}


def shape(top: int = 6) -> dict:
    """Files and lines of store/ and cache/ (every .py but `__init__.py`), and their biggest classes."""
    import hf_attnstore

    root = Path(hf_attnstore.__file__).parent
    result = {}
    for package in ("store", "cache"):
        files = [f for f in sorted((root / package).rglob("*.py")) if f.name != "__init__.py"]
        classes = []
        for f in files:
            for node in ast.walk(ast.parse(f.read_text())):
                if isinstance(node, ast.ClassDef):
                    methods = sum(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in node.body)
                    classes.append((node.end_lineno - node.lineno + 1, methods, node.name, f.relative_to(root)))
        lines = sum(len(f.read_text().splitlines()) for f in files)
        result[package] = {"files": len(files), "lines": lines}
        print(f"{package}/: {len(files)} files, {lines} lines; biggest classes:")
        for n, methods, name, where in sorted(classes, reverse=True)[:top]:
            print(f"  {name} ({where.as_posix()}): {n} lines, {methods} methods")
    return result


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="also list every module by name")
    parser.add_argument("--shape", action="store_true", help="also files, lines and biggest classes of store/, cache/")
    args = parser.parse_args(argv)
    result = run(args.list)
    if args.shape:
        result["shape"] = shape()
    return result


if __name__ == "__main__":
    main()
