"""Replicas behind a real router on this machine: a private ``redis-server`` (the shared tier), N ``attnstore serve``
processes over it, and ``sglang-router`` (the Rust router of the `sglang-router` wheel, a dev dependency) in front.

    python -m hf_attnstore.lab.cluster --model DIR --replicas 2 --policy round_robin    # or: make replicas

Each replica has its own host tier and disk folder and shares the Redis: sessions' KV (store/remote.py), stored
responses, the session index and the memo of generated replies (serving/shared_state.py), so a conversation or a
Responses chain continues on whichever replica the router picks, also after one was killed. Everything waits with a
timeout, and a process that dies while starting is reported with the end of its log.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from ..lab.redis_server import RedisServer, free_port

POLICIES = ("round_robin", "cache_aware", "manual", "power_of_two", "random")


@dataclass(frozen=True)
class ClusterConfig:
    """What `Cluster` starts.

    Args:
        folder: Where the Redis socket, the replicas' disk folders and every process's log go.
        model: ``attnstore serve --model`` (None: the bundled SmolLM2).
        replicas: How many replicas.
        policy: The router's ``--policy``.
        serve_args: More ``attnstore serve`` options, the same for every replica.
        disk: Whether each replica has a disk tier (``--disk-dir``) under the host tier.
        redis_maxmemory: The Redis's ``maxmemory`` (with ``allkeys-lru``), e.g. ``"256mb"``; None: no limit.
        startup_timeout_s: Longest wait for a process to answer.

    Example:
        >>> ClusterConfig(Path("/tmp/c"), replicas=2, policy="round_robin").replicas
        2
    """

    folder: Path
    model: str | None = None
    replicas: int = 2
    policy: str = "round_robin"
    serve_args: tuple[str, ...] = ()
    disk: bool = True
    redis_maxmemory: str | None = None
    startup_timeout_s: float = 300.0

    def __post_init__(self):
        if not isinstance(self.replicas, int) or isinstance(self.replicas, bool) or self.replicas < 1:
            raise ValueError(f"`replicas` must be a positive integer, got {self.replicas!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"`policy` must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if not self.startup_timeout_s > 0:
            raise ValueError(f"`startup_timeout_s` must be positive, got {self.startup_timeout_s!r}")


def get_json(url: str, timeout: float = 5.0):
    """GET `url` as JSON (raises OSError or ValueError).

    Example:
        >>> get_json("http://127.0.0.1:8000/health")["status"]  # doctest: +SKIP
        'ok'
    """
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def _log_tail(path: Path, chars: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


class Cluster:
    """Redis, `config.replicas` replicas and the router, started by `start` (or ``with``), stopped by `close`.

    Example:
        >>> with Cluster(ClusterConfig(Path(tmp), model="tiny-dir")) as cluster:  # doctest: +SKIP
        ...     client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="none")
    """

    def __init__(self, config: ClusterConfig):
        self.config = config
        self.redis = RedisServer(config.folder / "redis", maxmemory=config.redis_maxmemory)
        self.ports = [free_port() for _ in range(config.replicas)]
        self.router_port = free_port()
        self.replicas: list[subprocess.Popen | None] = [None] * config.replicas
        self.router: subprocess.Popen | None = None
        self.served_name: str | None = None
        self._logs: list = []  # the processes' log files, closed with them

    @property
    def url(self) -> str:
        """The router's base URL (``/v1/...`` under it)."""
        return f"http://127.0.0.1:{self.router_port}"

    @property
    def replica_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{port}" for port in self.ports]

    def __enter__(self) -> "Cluster":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        """Starts everything and waits until the router lists the replicas' model. Raises RuntimeError (with the
        end of the failed process's log) when a process exits or does not answer within the timeout."""
        try:
            import sglang_router  # noqa: F401
        except ImportError:
            raise RuntimeError("the router is not installed: pip install sglang-router (setup.cfg's dev extra)") \
                from None
        self.config.folder.mkdir(parents=True, exist_ok=True)
        try:
            self.redis.start()
            for i in range(self.config.replicas):
                self.start_replica(i)
            for i in range(self.config.replicas):
                self.served_name = self._wait(self.replicas[i], self.replica_urls[i] + "/server_info",
                                              self._log(f"replica{i}"))["served_model_name"]
            self.router = subprocess.Popen(
                [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port",
                 str(self.router_port), "--prometheus-port", str(free_port()), "--policy", self.config.policy,
                 "--log-level", "warn",
                 "--worker-urls", *self.replica_urls],
                stdout=self._open_log("router"), stderr=subprocess.STDOUT, start_new_session=True)
            deadline = time.monotonic() + self.config.startup_timeout_s
            while True:  # the router discovers each worker's model (GET /server_info) before it lists it
                listed = self._wait(self.router, self.url + "/v1/models", self._log("router"))
                if [m.get("id") for m in listed.get("data", [])] == [self.served_name]:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the router lists {listed} rather than {self.served_name!r}")
                time.sleep(0.2)
        except BaseException:
            self.close()
            raise

    def start_replica(self, i: int) -> None:
        """(Re)starts replica `i` on its port, over the shared Redis (returns at once: see `wait_replica`)."""
        config = self.config
        args = [sys.executable, "-m", "hf_attnstore", "serve", "--port", str(self.ports[i]), "--remote",
                self.redis.url, *config.serve_args]
        if config.model is not None:
            args += ["--model", config.model]
        if config.disk:
            args += ["--disk-dir", str(config.folder / f"disk{i}")]
        self.replicas[i] = subprocess.Popen(args, stdout=self._open_log(f"replica{i}"), stderr=subprocess.STDOUT,
                                            start_new_session=True)

    def wait_replica(self, i: int) -> None:
        self._wait(self.replicas[i], self.replica_urls[i] + "/health", self._log(f"replica{i}"))

    def kill(self, i: int) -> None:
        """SIGKILLs replica `i` (nothing flushed, nothing said to the router) and reaps it."""
        process = self.replicas[i]
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGKILL)
            process.wait(timeout=30)

    def _log(self, name: str) -> Path:
        return self.config.folder / f"{name}.log"

    def _open_log(self, name: str):
        f = open(self._log(name), "ab")
        self._logs.append(f)
        return f

    def _wait(self, process: subprocess.Popen, url: str, log: Path):
        deadline = time.monotonic() + self.config.startup_timeout_s
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"{process.args[:5]} exited with status {process.returncode}:\n{_log_tail(log)}")
            try:
                return get_json(url, timeout=5.0)
            except (OSError, ValueError):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{url} did not answer within {self.config.startup_timeout_s:.0f} s:\n"
                                       f"{_log_tail(log)}") from None
                time.sleep(0.2)

    def close(self) -> None:
        """Stops the router and the replicas (SIGTERM: they flush; SIGKILL after 60 s) and the Redis."""
        for process in [self.router, *self.replicas]:
            if process is not None and process.poll() is None:
                process.terminate()
        for process in [self.router, *self.replicas]:
            if process is None:
                continue
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=30)
        for f in self._logs:
            f.close()
        self._logs.clear()
        self.redis.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hf_attnstore.lab.cluster", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="attnstore serve --model (default: the bundled SmolLM2)")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--policy", default="round_robin", choices=POLICIES)
    parser.add_argument("--folder", default=None, help="logs, disk tiers, the Redis socket (default: a temporary one)")
    parser.add_argument("--no-disk", action="store_true", help="replicas without a disk tier (Redis below host memory)")
    parser.add_argument("--redis-maxmemory", default=None, help="e.g. 1gb (with allkeys-lru); default: no limit")
    parser.add_argument("serve_args", nargs=argparse.REMAINDER, help="after --: more attnstore serve options")
    args = parser.parse_args(argv)
    folder = Path(args.folder) if args.folder else Path(tempfile.mkdtemp(prefix="attnstore-cluster-"))
    extra = tuple(a for a in args.serve_args if a != "--")
    try:
        config = ClusterConfig(folder, args.model, args.replicas, args.policy, extra, not args.no_disk,
                               args.redis_maxmemory)
    except ValueError as exc:
        parser.error(str(exc))
    # SIGTERM (and SIGINT, which a shell's background job ignores) stop everything through `close`.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with Cluster(config) as cluster:
        print(f"router on {cluster.url}/v1 ({config.policy}) over {', '.join(cluster.replica_urls)}; Redis "
              f"{cluster.redis.url}; logs in {folder}. Ctrl-C stops everything.", flush=True)
        try:
            while all(p is not None and p.poll() is None for p in [cluster.router, *cluster.replicas]):
                time.sleep(1)
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
