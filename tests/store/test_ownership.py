"""One owner changes the store's state (docs/design.md, "The store's state and its owner"; STYLE.md habit 17).

An entry's fields, the owner's own attributes (pins, dirty marks, disk reservations, queues, counters) and the
store's statistics are written only in the owner's module: every other store module calls the owner's methods.
The test parses the store's modules and fails on any assignment, augmented assignment or `del` whose target is
such an attribute (or an item of one), and on any mutating call (`add`, `discard`, `append`, ...) on one, outside
the owner's module. Making the fields public was never ownership: this rule is.
"""

from __future__ import annotations

import ast
from pathlib import Path

STORE = Path(__file__).resolve().parents[2] / "src" / "hf_attnstore" / "store"
OWNER_MODULE = "index.py"
OWNER_CLASS = "StoreState"
MUTATORS = {"add", "discard", "remove", "append", "appendleft", "pop", "popleft", "clear", "update", "setdefault",
            "extend", "insert"}


def _fields(path: Path, cls: str) -> set[str]:
    """A class's fields: its annotated class attributes and every `self.x` it assigns."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for n in ast.walk(node):
                if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
                    names.add(n.target.id)
                elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and \
                        isinstance(n.value, ast.Name) and n.value.id == "self":
                    names.add(n.attr)
    assert names, (path, cls)
    return names


def watched() -> set[str]:
    return _fields(STORE / "index.py", "Entry") | _fields(STORE / OWNER_MODULE, OWNER_CLASS) | \
        _fields(STORE / "stats.py", "StoreStats")


def _annotation(node: ast.expr | None) -> str | None:
    return ast.unparse(node).strip("'\"") if node is not None else None


class _Writes(ast.NodeVisitor):
    """Writes to watched attributes whose receiver is not `self` (a class's own fields are its own) and not a
    name annotated as a class other than `Entry` (a `SaveResult`'s `mirrored` is the result's)."""

    def __init__(self, names: set[str]):
        self.names, self.found, self.scopes = names, [], [{}]

    def visit_FunctionDef(self, node):
        args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
        self.scopes.append({**self.scopes[-1], **{a.arg: _annotation(a.annotation) for a in args if a.annotation}})
        self.generic_visit(node)
        self.scopes.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def _foreign(self, receiver: ast.expr) -> bool:
        if isinstance(receiver, ast.Name):
            if receiver.id == "self":
                return False
            kind = self.scopes[-1].get(receiver.id)
            return kind is None or kind.split(" ")[0] == "Entry"
        return True

    def _target(self, target: ast.expr, node: ast.AST) -> None:
        if isinstance(target, (ast.Tuple, ast.List)):
            for t in target.elts:
                self._target(t, node)
            return
        if isinstance(target, ast.Starred):
            self._target(target.value, node)
            return
        attr = target.value if isinstance(target, ast.Subscript) else target
        if isinstance(attr, ast.Attribute) and attr.attr in self.names and self._foreign(attr.value):
            self.found.append((node.lineno, ast.unparse(target)))

    def visit_Assign(self, node):
        for t in node.targets:
            self._target(t, node)
        self.generic_visit(node)

    def visit_AugAssign(self, node):
        self._target(node.target, node)
        self.generic_visit(node)

    def visit_AnnAssign(self, node):
        if node.value is not None:
            self._target(node.target, node)
        self.generic_visit(node)

    def visit_Delete(self, node):
        for t in node.targets:
            self._target(t, node)
        self.generic_visit(node)

    def visit_For(self, node):
        self._target(node.target, node)
        self.generic_visit(node)

    def visit_Call(self, node):
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr in MUTATORS and isinstance(f.value, ast.Attribute) and \
                f.value.attr in self.names and self._foreign(f.value.value):
            self.found.append((node.lineno, ast.unparse(f) + "(...)"))
        self.generic_visit(node)


def foreign_writes(path: Path, names: set[str]) -> list[str]:
    visitor = _Writes(names)
    visitor.visit(ast.parse(path.read_text()))
    return [f"{path.relative_to(STORE)}:{line}: {what}" for line, what in sorted(set(visitor.found))]


def test_only_the_owner_writes_entries_pins_dirty_marks_reservations_and_stats():
    names = watched()
    found = [hit for path in sorted(STORE.rglob("*.py")) if path.name != OWNER_MODULE
             for hit in foreign_writes(path, names)]
    assert not found, f"{len(found)} writes to the store's state outside {OWNER_MODULE} (call an owner's method):\n" + \
        "\n".join(found)


def test_the_rule_finds_writes():
    """The parser catches each kind of write it is meant to catch, and leaves a class's own fields alone."""
    source = (
        "def f(self, e, job: SaveJob, n: Entry):\n"
        "    e.pins += 1\n"
        "    n.write = 0\n"
        "    self.index.dirty.add(e.key)\n"
        "    del self.index.entries[e.key]\n"
        "    self.index.stats.misses += 1\n"
        "    e.chunks, self.index.disk_used = {}, 0\n"
        "    job.mirrored = set()\n"
        "    self.pins = 0\n"
    )
    visitor = _Writes(watched())
    visitor.visit(ast.parse(source))
    assert [line for line, _ in sorted(visitor.found)] == [2, 3, 4, 5, 6, 7, 7], visitor.found


def test_a_turn_writer_changes_only_its_own_fields():
    """The sink (turn_sink.py) asks the writer (`start`, `refuse`) rather than writing its fields from another
    file: no store module but writer.py assigns to a `writer.<field>`."""
    found = []
    for path in sorted(STORE.rglob("*.py")):
        if path.name == "writer.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)) and \
                    isinstance(node.value, ast.Name) and node.value.id == "writer":
                found.append(f"{path.relative_to(STORE)}:{node.lineno}: writer.{node.attr}")
    assert not found, "\n".join(found)
