"""Stored responses in the replicas' shared Redis (`shared_state.SharedState`): ``previous_response_id`` resolves
on any replica behind the load balancer, also after the replica that wrote it died. The interface and the stored
form are `response_store.ResponseStore`'s (the same JSON, read back through the same validation, never
unpickled); only where the responses live differs.

Nothing is cached in this process: a response deleted on one replica is gone on all of them at once. A response
lives as long as the shared state's TTL, else until Redis evicts it (``allkeys-lru``): a chain whose older response
was evicted cannot be continued (a 400 that says to send the whole conversation), as with the file backend's
`max_responses`.
"""

from __future__ import annotations

import json
import logging

from .response_store import RESPONSE_ID, Chains, StoredResponse
from .shared_state import SharedState

logger = logging.getLogger(__name__)


class RedisResponseStore(Chains):
    """`ResponseStore`'s interface over the shared Redis.

    Args:
        shared: The replicas' shared state (its Redis connection, namespace and TTL).

    Example:
        >>> responses = RedisResponseStore(SharedState("unix:///tmp/redis.sock"))  # doctest: +SKIP
        >>> responses.get("resp_" + "0" * 32) is None  # doctest: +SKIP
        True
    """

    def __init__(self, shared: SharedState):
        self.shared = shared

    def put(self, record: StoredResponse) -> None:
        """Keeps `record` (replacing one with its id). A failed write is logged: the response then cannot be
        chained from (the client is told so when it tries)."""
        if not self.shared.put_response(record.id, json.dumps(record.to_json())):
            logger.warning("stored response %s could not be written to the shared state", record.id)

    def get(self, response_id: str) -> StoredResponse | None:
        """The stored response, or None (unknown, deleted, evicted, malformed id, or a damaged value: logged)."""
        if not isinstance(response_id, str) or not RESPONSE_ID.fullmatch(response_id):
            return None
        text = self.shared.get_response(response_id)
        if text is None:
            return None
        try:
            record = StoredResponse.from_json(json.loads(text))
        except (ValueError, RecursionError, AttributeError) as exc:
            logger.warning("stored response %s cannot be read (%s): treated as unknown", response_id, exc)
            return None
        return record if record.id == response_id else None

    def delete(self, response_id: str) -> bool:
        """Forgets a response on every replica; False if it was unknown."""
        if not isinstance(response_id, str) or not RESPONSE_ID.fullmatch(response_id):
            return False
        return self.shared.delete_response(response_id)
