"""The examples in the package's docstrings run as written (doctests): every module with one is collected here.

Examples that need the bundled model or a server say ``# doctest: +SKIP`` on those lines; everything else runs on
tiny random models and temporary folders."""

from __future__ import annotations

import doctest
import importlib
import tempfile
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
MODULES = sorted(
    ".".join(path.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")
    for path in (SRC / "hf_attnstore").rglob("*.py") if ">>>" in path.read_text()
)


def test_examples_exist_where_the_public_api_is():
    """The modules of the public entry points carry examples (docs/design.md, "The map")."""
    for name in ("hf_attnstore.store.store", "hf_attnstore.cache.cache", "hf_attnstore.serving.pipeline",
                 "hf_attnstore.store.index", "hf_attnstore.store.config"):
        assert name in MODULES


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name, tmp_path, monkeypatch):
    # Examples that make folders (`tempfile.mkdtemp()`, as a user would) make them in pytest's temporary folder,
    # which pytest removes, so no run leaves attnstore folders behind in /tmp.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name} (run it with -s)"
