"""Every example in examples/ runs (smoke tests on the bundled SmolLM2; each checks its own outcome)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_attnstore.lab.redis_server import free_port

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = {
    "generate_with_cache.py": [],
    "chat_pipeline.py": ["--kv-budget", "0.5"],  # sparse sessions, persisted and resumed (dense: tested elsewhere)
    "remote_tier.py": [],
    "lm_eval_mmlu.py": ["--limit", "3", "--window", "256"],
    "openai_server.py": ["--port", None],  # a free port, chosen at run time
}


def test_every_example_is_covered():
    assert {p.name for p in (ROOT / "examples").glob("*.py")} == set(EXAMPLES)


@pytest.mark.integration
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_runs(name):
    args = [str(free_port()) if a is None else a for a in EXAMPLES[name]]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    done = subprocess.run([sys.executable, str(ROOT / "examples" / name), *args], capture_output=True, text=True,
                          timeout=600, cwd=ROOT, env=env)
    assert done.returncode == 0, f"{name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
