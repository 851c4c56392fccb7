"""What replicas behind one load balancer share through the Redis of the store's remote tier, so that any replica
continues any conversation: the stored responses (`response_store_redis.py` keeps them here), the memo of generated
replies' exact ids (`conversation.ReplyMemo`), and where each session stands (`conversation.SessionIndex`: its ids
as the client sends them and as the model saw them, and the chained digest of its last whole block, by which a
request that names no session finds the one it continues). The sessions' KV is the store's (store/remote.py).

Keys, under ``attnstore:serving:1:<t>:`` where ``t`` is the namespace the replica is given: `attnstore serve` makes
it of the tokenizer and chat template's digest (the ids a text has are a tokenizer's), the model's fingerprint and
the context window (a session's model ids are a truncation's), so replicas of another model, or of the same model
with another window, sharing the Redis never read these:

- ``r:<response id>``: a stored response, as the JSON the file backend writes;
- ``m:<h>``: a generated reply's ids (JSON list), ``h`` a digest of its scope and text; ``k:<h>``: the text of a
  reply with tool calls, by its scope and calls key;
- ``s:<h>``: a session's ids and model ids (JSON), ``h`` a digest of its scope and id; ``d:<digest>``: the session
  last indexed at a block digest (scoped already).

Values are JSON, checked on every read (never unpickled): a malformed value is a miss. Redis is a cache here as it is
for the KV: a failed call is a miss (a lookup) or a skipped copy (a write), logged once, and after a failure Redis
is skipped for `BACKOFF_S` so that requests do not wait on a dead server; each call is bounded by `timeout_s`.
The connection is made at the first call, and again after a failure, as the remote tier makes it
(`store.remote.connect_redis`): a Redis Cluster node's URL gives the cluster client, which sends each key to the
node that owns it (the keys carry no hash tag, so they spread over the nodes).
Entries expire with `ttl_s`, else when Redis evicts them (``maxmemory-policy allkeys-lru``, docs/remote.md).
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time

from ..store.tiers.redis import Deadline
from ..store.tiers.redis import RemoteUnavailableError, connect_redis, redacted

logger = logging.getLogger(__name__)
PREFIX = "attnstore:serving:1:"
BACKOFF_S = 5.0


def _digest(*parts: str) -> str:
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        data = part.encode("utf-8", "surrogatepass")
        h.update(len(data).to_bytes(8, "little") + data)
    return h.hexdigest()


def _token_ids(value, limit: int | None = None) -> list[int] | None:
    """`value` as token ids if it is a list of non-negative ints (below `limit`), else None."""
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < (2**31)
                                              for t in value):
        return None
    if limit is not None and any(t >= limit for t in value):
        return None
    return value


def tokenizer_digest(tokenizer) -> str:
    """A digest of what maps text to ids: the tokenizer's vocabulary, its class and its chat template.

    Example:
        >>> len(tokenizer_digest(tokenizer))  # doctest: +SKIP
        16
    """
    vocab = json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=True)
    return _digest(type(tokenizer).__name__, vocab, str(getattr(tokenizer, "chat_template", "")))[:16]


class SharedState:
    """The serving state of replicas that share one Redis (see the module's docstring).

    Args:
        url: The Redis URL (``redis://``, ``rediss://``, ``unix://``): the store's `remote`.
        namespace: Keeps replicas of other tokenizers apart (`tokenizer_digest`).
        ttl_s: Expiry of what is written (None: until Redis evicts it).
        timeout_s: Bound on each call.
        vocab_size: Ids read back must be below it (ids another model made are never fed to this one).

    Example:
        >>> shared = SharedState("unix:///tmp/redis.sock", namespace="abc")  # doctest: +SKIP
        >>> shared.put_reply("", "Hello!", [7, 8]); shared.get_reply("", "Hello!")  # doctest: +SKIP
        [7, 8]
    """

    def __init__(self, url: str, *, namespace: str = "", ttl_s: float | None = None, timeout_s: float = 2.0,
                 vocab_size: int | None = None):
        import redis

        if ttl_s is not None and not ttl_s >= 1:
            raise ValueError(f"`ttl_s` must be at least 1 second or None, got {ttl_s!r}")
        if not timeout_s > 0:
            raise ValueError(f"`timeout_s` must be positive, got {timeout_s!r}")
        self.url = redacted(url)
        self.prefix = f"{PREFIX}{namespace}:"
        self.ttl = None if ttl_s is None else max(1, int(ttl_s))
        self.vocab_size = vocab_size
        self._secret_url = url  # to connect: never logged (`self.url` is)
        self._options = dict(socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self.client = None  # connected at the first call, and again after a failure
        self.cluster = False
        self._deadline = Deadline(timeout_s, name="attnstore-shared-call")
        from redis.exceptions import RedisClusterException

        self._errors = (redis.RedisError, RedisClusterException, OSError, RemoteUnavailableError)
        self._down_until = 0.0
        self._warned = False
        self._lock = threading.Lock()

    # -- calls: a failure is a miss -------------------------------------------------------------------------
    def _call(self, name: str, *args, default=None, **kwargs):
        """``client.<name>(*args, **kwargs)``, or `default` when Redis is down or the call fails."""
        with self._lock:
            if time.monotonic() < self._down_until:
                return default
            client, cluster = self.client, self.cluster
        try:
            if client is None:
                client, cluster = connect_redis(self._secret_url, self._options, what=f"shared state at {self.url}")
                with self._lock:
                    if self.client is None:
                        self.client, self.cluster = client, cluster
                    else:  # another thread connected first
                        _close_quietly(client)
                        client, cluster = self.client, self.cluster
            if name == "mget" and cluster:
                # MGET of keys in several slots is refused by a cluster: the cluster client's non-atomic MGET
                # groups them by node (one round trip each), which is all a lookup needs.
                name = "mget_nonatomic"
            if cluster:  # a cluster's call can outlast its socket timeouts many times over (store/deadline.py)
                answer = self._deadline.call(getattr(client, name), *args, **kwargs)
            else:
                answer = getattr(client, name)(*args, **kwargs)
            if self._warned:  # back after a failure: the next outage is logged again
                with self._lock:
                    back, self._warned = self._warned, False
                if back:
                    logger.warning("shared serving state at %s answers again", self.url)
            return answer
        except self._errors as exc:
            with self._lock:
                self._down_until = time.monotonic() + BACKOFF_S
                warn, self._warned = not self._warned, True
                stale, self.client = self.client, None  # connect afresh (the slot map or the server may have moved)
            if stale is not None:
                _close_quietly(stale)
            if warn:
                logger.warning("shared serving state at %s failed (%s): lookups are misses, writes skipped, for "
                               "%.0f s at a time while it fails", self.url, exc if isinstance(
                                   exc, RemoteUnavailableError) else type(exc).__name__, BACKOFF_S)
            return default

    def _get_json(self, key: str):
        data = self._call("get", self.prefix + key)
        if data is None:
            return None
        try:
            return json.loads(data)
        except (ValueError, RecursionError):
            return None

    def _set(self, key: str, value) -> bool:
        text = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
        return bool(self._call("set", self.prefix + key, text, ex=self.ttl, default=False))

    # -- stored responses (response_store_redis.py) --------------------------------------------------------
    def put_response(self, response_id: str, text: str) -> bool:
        """Stores a response's JSON; False when Redis failed."""
        return self._set("r:" + response_id, text)

    def get_response(self, response_id: str) -> str | None:
        data = self._call("get", self.prefix + "r:" + response_id)
        if data is None:
            return None
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            return None

    def delete_response(self, response_id: str) -> bool:
        return bool(self._call("delete", self.prefix + "r:" + response_id, default=0))

    # -- the memo of generated replies ---------------------------------------------------------------------
    def put_reply(self, scope: str, text: str, ids: list[int]) -> None:
        self._set("m:" + _digest(scope, text), [int(t) for t in ids])

    def get_reply(self, scope: str, text: str) -> list[int] | None:
        return _token_ids(self._get_json("m:" + _digest(scope, text)), self.vocab_size)

    def put_calls(self, scope: str, key: str, text: str) -> None:
        self._set("k:" + _digest(scope, key), {"text": text})

    def get_calls(self, scope: str, key: str) -> str | None:
        value = self._get_json("k:" + _digest(scope, key))
        text = value.get("text") if isinstance(value, dict) else None
        return text if isinstance(text, str) else None

    # -- where sessions stand ------------------------------------------------------------------------------
    def put_session(self, scope: str, session: str, ids, model_ids, digest: bytes) -> None:
        """Records that `session` holds `ids` (`model_ids` as the model saw them); `digest` is the chained digest
        of its last whole block (`SessionIndex.digests`), under which a request continuing it finds it."""
        record = {"session": session, "ids": [int(t) for t in ids], "model_ids": [int(t) for t in model_ids]}
        if self._set("s:" + _digest(scope, session), record):
            self._set("d:" + digest.hex(), {"session": session})

    def get_session(self, scope: str, session: str) -> tuple[tuple[int, ...], list[int]] | None:
        """The ids `session` holds, as the client sends them and as the model saw them, or None."""
        value = self._get_json("s:" + _digest(scope, session))
        if not isinstance(value, dict) or value.get("session") != session:
            return None
        ids, model = (_token_ids(value.get(name), self.vocab_size) for name in ("ids", "model_ids"))
        return None if ids is None or model is None else (tuple(ids), model)

    def find_session(self, scope: str, ids, digests: list[bytes], block: int) -> tuple[str, tuple[int, ...],
                                                                                       list[int]] | None:
        """The session last indexed at the longest of `digests` whose ids are a prefix of `ids`: (its id, ids,
        model ids), or None. One round trip for the digests, one per candidate (longest first)."""
        names = [self.prefix + "d:" + d.hex() for d in digests]
        values = self._call("mget", names, default=None) if names else None
        if not values:
            return None
        ids = tuple(int(t) for t in ids)
        for k in range(len(digests) - 1, -1, -1):
            if values[k] is None:
                continue
            try:
                session = json.loads(values[k]).get("session")
            except (ValueError, AttributeError, RecursionError):
                continue
            if not isinstance(session, str):
                continue
            known = self.get_session(scope, session)
            if known is None:
                continue
            stored, model = known
            # The whole prefix is compared: a `d:` key outlives a rewrite of its session's record (an edited
            # history, a racing replica), so it proves nothing about the ids the record holds now.
            if k * block <= len(stored) <= len(ids) and ids[:len(stored)] == stored:
                return session, stored, model
        return None

    def close(self) -> None:
        with self._lock:
            client, self.client = self.client, None
        if client is not None:
            _close_quietly(client)
        self._deadline.close()


def _close_quietly(client) -> None:
    try:
        client.close()
    except Exception:  # noqa: BLE001 - closing a client of a dead server must not raise
        pass
