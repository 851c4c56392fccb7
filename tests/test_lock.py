"""The locked set (requirements/lock.txt) is consistent with setup.cfg's ranges and the seam's tested range."""

from __future__ import annotations

import configparser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

from hf_attnstore.cache import upstream

ROOT = Path(__file__).resolve().parents[1]


def _lock() -> dict[str, Version]:
    pins = {}
    for line in (ROOT / "requirements" / "lock.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"requirements/lock.txt: {line!r} is not an exact pin"
            pins[name.lower().replace("_", "-")] = Version(version)
    return pins


def _install_requires() -> list[Requirement]:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    lines = cfg["options"]["install_requires"].strip().splitlines()
    return [Requirement(line.strip()) for line in lines if line.strip()]


def test_lock_pins_every_runtime_dependency_within_its_range():
    pins = _lock()
    for req in _install_requires():
        name = req.name.lower().replace("_", "-")
        if name == "torch":
            continue  # pinned by the Makefile (the CPU build on this machine's disk)
        assert name in pins, f"{req.name} is in install_requires but not pinned in requirements/lock.txt"
        assert pins[name] in req.specifier, f"lock pins {req.name}=={pins[name]}, outside setup.cfg's {req}"


def test_transformers_bounds_are_the_tested_releases():
    req = next(r for r in _install_requires() if r.name == "transformers")
    lower = min(Version(s.version) for s in req.specifier if s.operator == ">=")
    assert lower.release[:2] == Version(upstream.TESTED_OLDEST).release[:2], (
        f"setup.cfg allows transformers from {lower}, the seam's oldest tested release is {upstream.TESTED_OLDEST}: "
        "CI's test-oldest runs the lower bound, keep them equal")
    assert _lock()["transformers"] == Version(upstream.TESTED_NEWEST), (
        "the lock's transformers is the newest tested release (upstream.TESTED_NEWEST): update both together")
