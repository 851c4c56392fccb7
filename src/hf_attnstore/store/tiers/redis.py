"""A bound on a whole call, for clients whose own timeouts bound each socket read but not the call.

redis-py's cluster client answers one command within its `socket_timeout`, but a pipeline (and an MGET across
nodes, which is one) that fails on a hung node is resent command by command, each on a new connection with a
handshake of its own: on a frozen node one lookup took 5 to 6 times the timeout (tests/store/test_remote_cluster.py and
tests/serving/test_shared_state.py, with the bound removed). :class:`Deadline` runs each
call on a small pool of threads and waits for it at most `seconds`. A call that overruns is abandoned, not
interrupted: its thread ends when the client's own timeouts end it, and the caller sees a ``TimeoutError`` (an
``OSError``, which the tiers already take as a failure of the server: a miss, and the circuit breaker).

Example:
    >>> import time
    >>> deadline = Deadline(0.05, name="example")
    >>> deadline.call(sum, [1, 2, 3])
    6
    >>> deadline.call(time.sleep, 0.5)
    Traceback (most recent call last):
    ...
    TimeoutError: no answer within 0.05 s
    >>> deadline.close()
"""

from __future__ import annotations

import concurrent.futures
from concurrent.futures import ThreadPoolExecutor
import dataclasses
import logging
import secrets
import threading
import time
from concurrent.futures import Future
from urllib.parse import urlsplit, urlunsplit
import torch

from ..format import ChunkMeta, FORMAT, FormatError, Manifest, Span, StateRef, bytes_to_tensor, chunk_digest, layer_names, read_chunk_meta, read_kept, read_range, session_dirname, verified
from .base import CHUNK_SUFFIX, ChunkReader, Key, MANIFEST, SerialWriter, Tier


class Deadline:
    """Runs calls on `workers` threads and waits for each at most `seconds` (see the module's docstring).

    Args:
        seconds: The bound on one call, queueing for a thread included.
        workers: Calls that may run at once; abandoned calls hold theirs until they end.
        name: The threads' name prefix.
    """

    def __init__(self, seconds: float, workers: int = 8, name: str = "attnstore-deadline"):
        if not seconds > 0:
            raise ValueError(f"`seconds` must be positive, got {seconds!r}")
        self.seconds = seconds
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)

    def call(self, fn, *args, **kwargs):
        """``fn(*args, **kwargs)``, or ``TimeoutError`` when it has not returned within the bound."""
        future = self._pool.submit(fn, *args, **kwargs)
        try:
            return future.result(timeout=self.seconds)
        except concurrent.futures.TimeoutError:
            future.cancel()  # still queued: never runs; running: abandoned, it ends on the client's own timeouts
            raise TimeoutError(f"no answer within {self.seconds:g} s") from None

    def close(self) -> None:
        """Stops taking calls; calls still running end on their own."""
        self._pool.shutdown(wait=False, cancel_futures=True)


logger = logging.getLogger(__name__)
PREFIX = "attnstore:" + FORMAT.rsplit("/", 1)[-1] + ":"
MAX_VALUE_BYTES = 512 * 1024 * 1024  # Redis's limit on one string value
BACKOFF_S = 5.0  # after a failure, the tier is skipped this long (and, down since the start, reconnected this often)


class RemoteUnavailableError(RuntimeError):
    """The remote tier cannot be reached or refused us (wrong password, wrong database).

    `transient`: the server could not be reached (down, restarting, a network fault), as opposed to a refusal
    that retrying cannot fix (credentials, database index, a malformed URL).

    Example:
        >>> error = RemoteUnavailableError("redis://cache:6379: connection refused", transient=True)
        >>> error.transient  # down or restarting: worth retrying, unlike a wrong password
        True
    """

    def __init__(self, message: str, transient: bool = False):
        super().__init__(message)
        self.transient = transient


class MissingChunks(RuntimeError):
    """A manifest was to be written that names chunks the remote tier no longer holds (expired, evicted, or lost
    with a restart): it is not written. `digests`: the missing ones (the caller puts them again, or rewrites the
    session).

    Example:
        >>> print(MissingChunks(["0123456789abcdef" * 2, "fedcba9876543210" * 2]))
        the remote tier no longer holds 2 chunk(s) the manifest names (0123456789ab, fedcba987654)
    """

    def __init__(self, digests: list[str]):
        super().__init__(f"the remote tier no longer holds {len(digests)} chunk(s) the manifest names "
                         f"({', '.join(d[:12] for d in digests[:3])}{' ...' if len(digests) > 3 else ''})")
        self.digests = digests


class _Disconnected:
    """The client of a tier that has not connected yet: every use is a RemoteUnavailableError (a miss, a failed
    copy), raised before any call is made."""

    def __init__(self, url: str):
        self.url = url

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)  # (copy, pickle and hasattr probes)
        raise RemoteUnavailableError(f"the remote tier {self.url} is not connected yet (it was down when the store "
                                     "started; reconnecting in the background)", transient=True)


def _cluster_enabled(client) -> bool:
    """Whether the server is a Redis Cluster node (servers that hide ``INFO`` are taken as standalone)."""
    import redis

    try:
        return bool(client.info("cluster").get("cluster_enabled"))
    except redis.ResponseError:
        return False


def connect_redis(url: str, options: dict, what: str) -> tuple:
    """A connected client of the server at `url` (the cluster client when it is a Redis Cluster node), and whether
    it is a cluster. `what` names the server in errors (never with the password: pass a redacted URL in it).

    Raises:
        RemoteUnavailableError: `transient` when the server cannot be reached; not when it refuses us.

    Example:
        >>> connect_redis("redis://127.0.0.1:1", {"socket_connect_timeout": 0.5}, what="the test server")
        Traceback (most recent call last):
        ...
        hf_attnstore.store.tiers.redis.RemoteUnavailableError: the test server cannot be reached (...)
    """
    import redis  # the `redis` client is only needed with a remote tier

    from redis.backoff import NoBackoff
    from redis.cluster import RedisCluster
    from redis.exceptions import AuthorizationError, ClusterError, RedisClusterException, TryAgainError
    from redis.retry import Retry

    client = None
    try:
        client = redis.Redis.from_url(url, **options)
        client.ping()
        if _cluster_enabled(client):
            # A Redis Cluster node: the cluster client learns the slot map from it and sends each key (and each
            # part of a pipeline) to the node that owns it. No retries: each is another `socket_timeout` on a hung
            # node, and a miss now costs less than a turn that waits. A pipeline still resends what failed on new
            # connections, so the callers bound a cluster's whole calls (deadline.py).
            client.close()
            client = RedisCluster.from_url(url, retry=Retry(NoBackoff(), 0), **options)
            client.ping()
            return client, True
        return client, False
    except (redis.AuthenticationError, AuthorizationError) as exc:
        _close_quietly(client)
        raise RemoteUnavailableError(f"{what} refused the credentials ({exc}): check the user and password in the "
                                     "URL") from None
    except (redis.ConnectionError, redis.TimeoutError, OSError, ClusterError, TryAgainError,
            RedisClusterException) as exc:
        _close_quietly(client)
        raise RemoteUnavailableError(f"{what} cannot be reached ({exc})", transient=True) from None
    except (redis.RedisError, ValueError) as exc:
        _close_quietly(client)
        raise RemoteUnavailableError(f"{what} cannot be used ({exc})") from None


def redacted(url: str) -> str:
    """The URL without its password (in the user part or a ``password=`` query): never logged or raised.

    Example:
        >>> redacted("redis://alice:secret@cache.internal:6379/0")
        'redis://alice:***@cache.internal:6379/0'
        >>> redacted("unix:///run/redis.sock?password=secret&db=2")
        'unix:///run/redis.sock?password=***&db=2'
    """
    parts = urlsplit(url)
    netloc = parts.netloc
    if parts.password is not None:
        host = netloc.rsplit("@", 1)[1]
        netloc = f"{parts.username or ''}:***@{host}"
    query = "&".join("password=***" if q.startswith("password=") else q for q in parts.query.split("&")) \
        if parts.query else ""
    if not netloc:  # unix:///path: urlunsplit would drop the empty authority
        return f"{parts.scheme}://{parts.path}" + (f"?{query}" if query else "")
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


class RemoteChunk(ChunkReader):
    """A chunk value read with ``GETRANGE``: one round trip per layer (its keys and values, pipelined)."""

    def __init__(self, tier: "RemoteTier", name: str, size: int, fp: str, sid: str):
        self.tier, self.name = tier, name
        self.meta: ChunkMeta = read_chunk_meta(self._pread, size, fp, sid)

    def _pread(self, size: int, offset: int) -> bytes:
        if size <= 0:
            return b""
        return self.tier._call(self.tier.client.getrange, self.name, offset, offset + size - 1)

    def ids(self) -> torch.Tensor:
        begin, end = self.meta.offsets["ids"]
        return bytes_to_tensor(read_range(self._pread, begin, end, "ids", self.meta), torch.int64,
                               [self.meta.n_tokens])

    def read_layer_into(self, layer, start, end, keys_out, values_out, keep=None) -> int:
        names = layer_names(layer)
        pipe = self.tier.client.pipeline(transaction=False)
        for name in names:
            begin, stop = self.meta.offsets[name]
            pipe.getrange(self.name, begin, stop - 1)
        datas = self.tier._call(pipe.execute)
        nbytes = 0
        for name, data, out in zip(names, datas, (keys_out, values_out)):
            self.meta.decode_into(name, verified(data, name, self.meta), out, start, keep)
            nbytes += len(data)
        return nbytes

    def kept(self) -> torch.Tensor:
        return read_kept(self._pread, self.meta)

    def close(self) -> None:
        pass  # nothing held: the connection goes back to the pool after each call


class RemoteTier(Tier):
    """Sessions in a Redis server shared by several stores (see the module docstring).

    Args:
        url: ``redis://[[user]:password@]host:port/db``, ``rediss://`` (TLS) or ``unix:///path?db=0``.
        ttl_s: Expiry of every value written (``None``: kept until Redis evicts it).
        timeout_s: Socket timeout of each call, and how long :meth:`close` waits for writes.
        required: Whether a server that cannot be reached now is an error. ``False``: the tier starts down
            (:attr:`connected` False, :meth:`available` False: every use a miss or a failed copy) and a
            background thread connects every `BACKOFF_S` seconds until it is up.

    Raises:
        RemoteUnavailableError: The server cannot be reached (unless not `required`), or refuses the
            credentials (the message names the URL without its password).
    """

    name = "remote"
    content_addressed = True

    def __init__(self, url: str, ttl_s: float | None = None, timeout_s: float = 5.0, required: bool = True):
        import redis  # the `redis` client is only needed with a remote tier

        from redis.exceptions import RedisClusterException

        self.url, self.ttl_s, self.timeout_s = redacted(url), ttl_s, timeout_s
        self._errors = (redis.RedisError, RedisClusterException, OSError)
        self._secret_url = url  # to reconnect: never logged or raised (`self.url` is)
        self._options = dict(socket_timeout=timeout_s, socket_connect_timeout=timeout_s, health_check_interval=30)
        self.cluster, self.connected = False, False
        self.client = _Disconnected(self.url)
        self._deadline = Deadline(timeout_s, name="attnstore-remote-call")  # used with a cluster only
        self._down_until = 0.0
        self._closed = False
        self._state = threading.Lock()  # connecting (the background thread) vs closing
        self._stop = threading.Event()
        self._reconnector: threading.Thread | None = None
        self._epoch: bytes | None = None  # the marker this store saw in the server (see `lost`)
        try:
            self.client, self.cluster = self._connect()
            self.connected = True
            self.lost()  # sets the marker (nothing was lost yet: this store wrote nothing)
        except RemoteUnavailableError as exc:
            if required or not exc.transient:
                raise
            logger.warning("%s: the store starts with the remote tier down (every remote lookup a miss) and "
                           "reconnects every %s s in the background (`remote_required=True` fails instead)", exc,
                           BACKOFF_S)
            self._reconnector = threading.Thread(target=self._reconnect, name="attnstore-remote-connect", daemon=True)
            self._reconnector.start()
        self._writer = SerialWriter("attnstore-remote-write")

    def _connect(self):
        """A client of the server (the cluster client for a Redis Cluster node), and whether it is a cluster."""
        return connect_redis(self._secret_url, self._options, what=f"the remote tier {self.url}")

    def _reconnect(self) -> None:
        """The background thread of a tier that was down when the store started: tries every `BACKOFF_S`
        until it connects (or the tier is closed)."""
        refused = False
        while not self._stop.wait(BACKOFF_S):
            try:
                client, cluster = self._connect()
            except RemoteUnavailableError as exc:
                if not exc.transient and not refused:
                    refused = True  # the server is up but refuses us: said once, retried (it may be fixed there)
                    logger.warning("%s", exc)
                continue
            with self._state:
                if self._stop.is_set():
                    _close_quietly(client)
                    return
                self.client, self.cluster = client, cluster
                self.connected = True
            logger.warning("remote tier: %s is up: connected", self.url)
            return

    def available(self) -> bool:
        """False while the tier has not connected yet (down when the store started), and for `BACKOFF_S` after
        a failed call: callers skip the tier (a miss) rather than wait on a dead server at every turn (a
        circuit breaker)."""
        return self.connected and time.monotonic() >= self._down_until

    def lost(self) -> bool:
        """Whether the server lost its data since this store last asked: a restart of a Redis without persistence
        (the usual cache Redis), a FLUSHALL, or an eviction of the marker itself (then sessions are written again:
        a cost, never a loss). A marker key holds a random value that the first store to find it missing sets
        (SET NX): every store sharing the server sees the same value until the next loss. False while the server
        cannot be reached (nothing is known; asked again later).
        """
        if not self.available():
            return False
        name = PREFIX + "epoch"
        try:
            self._call(self.client.set, name, secrets.token_hex(8), None, None, True)  # NX
            epoch = self._call(self.client.get, name)
        except RemoteUnavailableError:
            return False
        changed = self._epoch is not None and epoch != self._epoch
        self._epoch = epoch
        return changed

    def _call(self, fn, *args):
        """One Redis call, within `timeout_s` (a cluster's, through the deadline); any failure of the server or the
        connection is a RemoteUnavailableError."""
        try:
            return self._deadline.call(fn, *args) if self.cluster else fn(*args)
        except self._errors as exc:
            self._down_until = time.monotonic() + BACKOFF_S
            raise RemoteUnavailableError(f"the remote tier {self.url} failed: {exc}", transient=True) from exc

    @staticmethod
    def key_of(key: Key, suffix: str) -> str:
        return f"{PREFIX}{session_dirname(*key)}:{suffix}"

    def _chunk_key(self, key: Key, span: Span) -> str:
        """Where a span's chunk lies: under the session that wrote it (`Span.owner`, a shared prefix's)."""
        return self.key_of((key[0], span.owner) if span.owner else key, "c:" + span.chunk)

    # -- the tier interface ---------------------------------------------------------------------------
    def put(self, key: Key, name: str, data: bytes) -> Future[int]:
        return self._writer.submit(self._put, key, name, data)  # fails once closed

    def _put(self, key: Key, name: str, data: bytes) -> int:
        if name == MANIFEST:
            # Chunks are stored by digest: the manifest names them so (the digests it pins).
            manifest = Manifest.decode(data, key[0])
            spans, dropped = (tuple(Span(s.digest, s.start, s.end, s.digest, s.rebased, s.owner) for s in part)
                              for part in (manifest.spans, manifest.dropped))
            # A state file is named by its digest already ("s-<digest>"), stored like a chunk under it.
            data = Manifest(manifest.fingerprint, manifest.session_id, manifest.token_ids, spans, 0, dropped,
                            manifest.state, manifest.exact).encode()
            target = self.key_of(key, "m")
            # What the server holds now, not what it held: a manifest naming chunks it lost is never written.
            names = [self._chunk_key(key, s) for s in spans] + \
                ([self.key_of(key, "c:" + manifest.state.digest)] if manifest.state is not None else [])
            renew = names
            pipe = self.client.pipeline(transaction=False)
            for name in names:
                pipe.execute_command("TOUCH", name)  # present, and as recent as this session (see `manifest`)
            missing = [n.rsplit(":", 1)[-1] for n, here in zip(names, self._call(pipe.execute)) if not here]
            if missing:
                raise MissingChunks(missing)
        else:
            target, renew = self.key_of(key, "c:" + chunk_digest(data)), []
        if len(data) > MAX_VALUE_BYTES:
            raise ValueError(f"a value of {len(data)} bytes is over Redis's 512 MB limit: lower `chunk_tokens`")
        ttl = None if self.ttl_s is None else max(1, int(self.ttl_s))
        if ttl is not None and renew:
            # Every chunk a manifest names lives as long as it does: the session's own earlier chunks (written
            # turns ago, they would expire while the session is in use) and another session's it shares (a shared
            # prefix's TTL is renewed by each session that writes a manifest naming it).
            pipe = self.client.pipeline(transaction=False)
            for name in renew:
                pipe.expire(name, ttl)
            self._call(pipe.execute)
        self._call(self.client.set, target, data, ttl)
        return len(data)

    def get(self, key: Key, chunk: str, owner: str = "") -> RemoteChunk:
        if owner:  # a shared prefix's chunk lies once, under the session that wrote it
            key = (key[0], owner)
        name = self.key_of(key, "c:" + chunk)
        size = self._call(self.client.strlen, name)
        if not size:
            raise FormatError(f"chunk {chunk[:12]} is not in the remote tier (expired or evicted)")
        return RemoteChunk(self, name, size, *key)

    def read_state(self, key: Key, ref: StateRef) -> bytes:
        data = self._call(self.client.get, self.key_of(key, "c:" + ref.digest))
        if data is None:
            raise FormatError("the session's state is not in the remote tier (expired or evicted)")
        return data

    def manifest(self, key: Key) -> Manifest | None:
        """The session's manifest, cut to its chunks still present (Redis may have evicted later ones), without
        its state if Redis evicted that.

        Raises:
            RemoteUnavailableError: The server failed (the caller treats it as a miss and counts it).
        """
        data = self._call(self.client.get, self.key_of(key, "m"))
        if data is None:
            return None
        try:
            manifest = Manifest.decode(data, key[0])
        except FormatError as exc:
            logger.warning("remote tier: a damaged manifest for a session is ignored (%s)", exc)
            return None
        if manifest.session_id != key[1]:
            return None
        # TOUCH, not EXISTS: both answer whether a chunk is there, but EXISTS leaves its LRU clock alone (Redis looks
        # it up with LOOKUP_NOTOUCH). A shared prefix's chunks are stored once, under the session that wrote them,
        # so with EXISTS they stayed as old as that session however many sessions resumed from them, and a Redis
        # with `maxmemory` + `allkeys-lru` evicted them first: every sharer missed. Each lookup and each save of a
        # sharer now makes them as recent as the sharer. `execute_command("TOUCH", ...)`, not `pipe.touch`: redis-py's
        # cluster pipeline treats `touch` as a multi-key command and answers nothing for it (redis 8.1).
        pipe = self.client.pipeline(transaction=False)
        for span in manifest.spans:
            pipe.execute_command("TOUCH", self._chunk_key(key, span))
        if manifest.state is not None:
            pipe.execute_command("TOUCH", self.key_of(key, "c:" + manifest.state.digest))
        present, end = self._call(pipe.execute), manifest.head
        if manifest.state is not None and not present.pop():
            manifest = dataclasses.replace(manifest, state=None)
        for span, here in zip(manifest.spans, present):
            if not here:
                break
            end += span.length
        if end < manifest.length:
            manifest = manifest.select([(0, end)]) if end > manifest.head else None
        return manifest

    def write(self, key: Key, name: str, data: bytes) -> int:
        """As :meth:`put`, now (a failure of the tier is a `RemoteUnavailableError`, an `OSError`)."""
        return self._put(key, name, data)

    def read_file(self, key: Key, name: str) -> bytes:
        """A session's manifest (as stored here: its chunks named by digest) or a chunk, by its digest."""
        stem = name[: -len(CHUNK_SUFFIX)] if name.endswith(CHUNK_SUFFIX) else name
        data = self._call(self.client.get, self.key_of(key, "m" if name == MANIFEST else "c:" + stem))
        if data is None:
            raise FormatError(f"{name} is not in the remote tier (expired or evicted)")
        return data

    def delete(self, key: Key, names) -> None:
        """Deletes the session's manifest if named (now, unlike :meth:`remove`); chunks stay, as for `remove`:
        content-addressed, they may be pinned by another replica's manifest."""
        if MANIFEST in names:
            self._call(self.client.delete, self.key_of(key, "m"))

    def remove(self, key: Key, keep: set[str] | None = None) -> None:
        """Deletes the session's manifest, in order after the writes queued before (never blocks).

        Only the manifest: chunks are content-addressed and may be pinned by another replica's manifest;
        they expire (`remote_ttl_s`) or are evicted by Redis. Garbage collection (`keep`) is a no-op."""
        if keep is None:
            self._writer.submit(self._call, self.client.delete, self.key_of(key, "m"))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            with self._state:
                self._stop.set()  # a reconnection in flight closes the client it makes
                connected = self.connected
            if not self._writer.close(self.timeout_s):
                logger.warning("remote tier: a write to %s did not finish within %s s at close", self.url,
                               self.timeout_s)
            if connected:
                self.client.close()
            self._deadline.close()


def _close_quietly(client) -> None:
    if client is not None:
        try:
            client.close()
        except Exception:  # noqa: BLE001 - a client that failed to connect: nothing to release that matters
            pass
