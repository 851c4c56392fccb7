"""The serving package's shape: no import circle between its modules, type-only imports included."""

from __future__ import annotations

from pathlib import Path

import grimp


def test_no_serving_module_imports_itself_back_even_for_type_hints():
    """setup.cfg's acyclic contract leaves type-only imports out (circles in cache/ and store/ still close through
    them); serving has none, and keeps none: the batch runner names the pipeline by `jobs.TurnSource`."""
    graph = grimp.build_graph("hf_attnstore", exclude_type_checking_imports=False, cache_dir=None)
    modules = sorted(m for m in graph.find_children("hf_attnstore.serving"))
    circles = [(a, b) for a in modules for b in modules
               if a < b and graph.chain_exists(a, b, as_packages=True) and graph.chain_exists(b, a, as_packages=True)]
    assert not circles, circles


def test_the_design_map_lists_every_serving_module():
    """docs/design.md's map has a line for every module of serving/ (a package, such as protocol/, by its folder)."""
    root = Path(__file__).resolve().parents[2]
    serving = root / "src" / "hf_attnstore" / "serving"
    map_text = (root / "docs" / "design.md").read_text().split("## The map", 1)[1].split("\n## ", 1)[0]
    wanted = [f"`serving/{p.name}`" for p in serving.glob("*.py") if p.name != "__init__.py"]
    wanted += [f"`serving/{p.name}/`" for p in serving.iterdir() if (p / "__init__.py").exists()]
    missing = [name for name in wanted if name not in map_text]
    assert not missing, missing
