"""The package imports with `install_requires` alone: every third-party module it loads is declared."""

from __future__ import annotations

import ast
import configparser
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Distribution name -> the module it provides, where they differ.
IMPORT_NAMES = {"pyyaml": "yaml", "prometheus-client": "prometheus_client"}


def declared_modules() -> set[str]:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    names = set()
    for line in cfg["options"]["install_requires"].strip().splitlines():
        dist = re.split(r"[<>=!~;\[ ]", line.strip(), maxsplit=1)[0].lower()
        names.add(IMPORT_NAMES.get(dist, dist.replace("-", "_")))
    return names


def module_level_imports(path: Path) -> set[str]:
    """Top-level names imported when the module is loaded (imports inside functions are lazy: extras)."""
    tree = ast.parse(path.read_text())
    roots = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def test_every_import_of_the_runtime_modules_is_declared():
    script = ("import json, sys, hf_attnstore, hf_attnstore.serving.pipeline, hf_attnstore.cli, hf_attnstore.cache.chat, "
              "hf_attnstore.serving, hf_attnstore.serving.metrics, hf_attnstore.lab.replicas; "
              "print(json.dumps(sorted(m.__file__ for n, m in sys.modules.items() "
              "if n.split('.')[0] == 'hf_attnstore' and getattr(m, '__file__', None))))")
    files = json.loads(subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True,
                                      cwd=ROOT).stdout)
    assert len(files) > 10
    allowed = declared_modules() | set(sys.stdlib_module_names) | {"hf_attnstore"}
    missing = {(Path(f).name, name) for f in files for name in module_level_imports(Path(f)) - allowed}
    assert not missing, f"imported at load time but not in install_requires: {sorted(missing)}"
