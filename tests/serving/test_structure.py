"""The serving package's shape: no import circle between its modules, type-only imports included."""

from __future__ import annotations

import grimp


def test_no_serving_module_imports_itself_back_even_for_type_hints():
    """setup.cfg's acyclic contract leaves type-only imports out (circles in cache/ and store/ still close through
    them); serving has none, and keeps none: the batch runner names the pipeline by `jobs.TurnSource`."""
    graph = grimp.build_graph("hf_attnstore", exclude_type_checking_imports=False, cache_dir=None)
    modules = sorted(m for m in graph.find_children("hf_attnstore.serving"))
    circles = [(a, b) for a in modules for b in modules
               if a < b and graph.chain_exists(a, b, as_packages=True) and graph.chain_exists(b, a, as_packages=True)]
    assert not circles, circles

