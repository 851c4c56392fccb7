"""The package's structure, enforced: layers import downward only, no import cycles, and no module reaches into
another module's private members (docs/design.md, "The map")."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "hf_attnstore"
# Private members of other libraries with no public equivalent, each with its reason.
ALLOWED = {
    "_version": "torch.Tensor's version counter: the fingerprint memo notices in-place writes by it",
}
# transformers' internals, in the one seam only (cache/upstream.py), each checked there by tests/cache/test_upstream.py.
SEAM = SRC / "cache" / "upstream.py"
SEAM_ALLOWED = {
    "_prepare_generation_config": "generate's options -> GenerationConfig (the batch runner decodes as generate)",
    "_prepare_special_tokens": "generate's eos/pad tensors, which its logits processors read",
    "_prepare_generated_length": "generate's max/min length from max_new_tokens/min_new_tokens",
    "_get_logits_processor": "the processors and warpers generate builds for a GenerationConfig",
}


def test_import_contracts_are_kept():
    """lint-imports (import-linter) with the contracts in setup.cfg: cli -> lab -> serving -> cache -> store, and
    no cycles between the modules of any package."""
    lint = Path(sys.executable).with_name("lint-imports")
    proc = subprocess.run([str(lint), str(ROOT / "setup.cfg")], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout


STORE_ACYCLIC = """[importlinter]
root_package = hf_attnstore
exclude_type_checking_imports = False

[importlinter:contract:store-acyclic]
name = No import cycles between the store's modules, type-only imports included
type = acyclic_siblings
ancestors =
    hf_attnstore.store
"""


def test_the_store_has_no_import_cycles_even_through_type_only_imports(tmp_path):
    """setup.cfg leaves type-only imports out for the packages that still close a circle through them (it says
    which); the store closes none (docs/design.md, "The map")."""
    config = tmp_path / "store.ini"
    config.write_text(STORE_ACYCLIC)
    lint = Path(sys.executable).with_name("lint-imports")
    proc = subprocess.run([str(lint), "--no-cache", "--config", str(config)], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout


def _own_names(tree: ast.Module) -> set[str]:
    """Every name a module defines: functions, classes, methods, attributes it assigns (`x._y = ...`)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def private_accesses(path: Path) -> list[str]:
    """`obj._name` where `_name` is private (one leading underscore) and defined in no part of this module: a
    reach into another module's private members."""
    tree = ast.parse(path.read_text())
    own, out = _own_names(tree), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if node.attr not in own and node.attr not in ALLOWED and not (path == SEAM and node.attr in SEAM_ALLOWED):
                out.append(f"{path.relative_to(SRC)}:{node.lineno}: .{node.attr}")
    return out


def test_no_module_reaches_into_another_modules_private_members():
    found = [hit for path in sorted(SRC.rglob("*.py")) for hit in private_accesses(path)]
    assert not found, "private members of other modules used (make them public, or pass what is needed):\n" + \
        "\n".join(found)


def test_io_threads_never_see_the_index():
    """The save thread is handed its planner, the load thread a callback, a turn's writer its sink (`TurnSink`): none of
    those classes names the store or its state (docs/design.md, "The store's state and its owner"). They share a
    module with the part of the store that decides for them (saver.py, loader.py, writer.py), not its lock."""
    seen = set()
    for name in ("saver.py", "loader.py", "writer.py"):
        tree = ast.parse((SRC / "store" / name).read_text())
        for cls in [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name in ("SaveThread", "LoadThread",
                                                                                          "TurnWriter")]:
            seen.add(cls.name)
            names = {n.id for n in ast.walk(cls) if isinstance(n, ast.Name)} | \
                {n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute)}
            assert not names & {"AttnStore", "StoreState", "index", "entries", "store", "lock"}, (name, cls.name)
    assert seen == {"SaveThread", "LoadThread", "TurnWriter"}, seen
