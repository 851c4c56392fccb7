"""The reliability scorecard (eval/faults.py) in its quick form: zero wrong KV, crashes and lost data."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_quick_scorecard_has_zero_wrong_kv_crashes_and_losses(tmp_path):
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, str(ROOT / "eval" / "faults.py"), "--quick", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    rows = json.loads(out.read_text())
    assert len(rows) >= 16 and all(r["runs"] > 0 for r in rows), rows
    bad = [r for r in rows if r["wrong_kv"] or r["crashes"] or r["data_lost"]]
    assert not bad and proc.returncode == 0, (bad, proc.stderr[-2000:])
