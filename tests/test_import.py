"""`import hf_attnstore` loads what AttnStore and AttnStoreCache need (store/, cache/), not serving/ or lab/: those
load on first use of their names."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = """
import json, sys
import hf_attnstore
loaded = lambda: sorted(n for n in sys.modules if n.split(".")[0] == "hf_attnstore")
before = loaded()
third = sorted(n for n in ("fastapi", "uvicorn", "prometheus_client", "openai", "lm_eval") if n in sys.modules)
from hf_attnstore import ChatPipeline, PipelineTuning, load_default_model
print(json.dumps({"before": before, "third": third, "after": loaded(), "names": [ChatPipeline.__name__,
      PipelineTuning.__name__, load_default_model.__name__], "dir": "ChatPipeline" in dir(hf_attnstore)}))
"""


def test_import_loads_only_the_store_and_the_cache():
    out = json.loads(subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True,
                                    timeout=300).stdout)
    layers = {name.split(".")[1] for name in out["before"] if "." in name}
    assert layers == {"cache", "store"}, layers
    assert out["third"] == [], out["third"]  # the server's and the lab's dependencies are not imported either
    assert "hf_attnstore.serving.pipeline" in out["after"] and "hf_attnstore.lab.models" in out["after"]
    assert out["names"] == ["ChatPipeline", "PipelineTuning", "load_default_model"] and out["dir"]


def test_an_unknown_name_is_an_attribute_error():
    import hf_attnstore
    import pytest

    with pytest.raises(AttributeError, match="no attribute 'ChatPipelin'"):
        hf_attnstore.ChatPipelin
