"""The stored responses that the Responses API's ``previous_response_id`` chains from (the request's schema and
its translation into a chat turn are in protocol/responses.py).

A response id names a point in a conversation: the messages up to its reply. A request with
``previous_response_id`` sends only what is new; the server rebuilds the conversation from the chain (each
stored response keeps only its own messages, its input and reply, beside the ids of its session at that point,
4 bytes a token: a chain's text costs n, its ids n squared over n steps, bounded by `ResponseStore`'s limits) and
runs it as a chat turn. The conversation's ids are rendered piece by piece and its replies get back the ids they were
generated as (`ReplyMemo`, re-seeded from the stored response, so this holds after a restart too): the turn
continues the session whose KV holds that point, or, after a restart or from an older response (a branch),
starts a session that reuses the longest stored prefix (the store's prefix sharing). ``instructions`` are not
carried over from the previous response, as OpenAI defines them.

Stored responses live in memory (the most recent `max_responses`) and, with a folder, one JSON file each
(written atomically; read back through the same validation as a request, never unpickled), so a chain survives a
restart. Ids are ``resp_`` and 32 hex digits; any other id is unknown.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import os
import re
import sys
import threading
import time
import uuid
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ValidationError

from ..store.index import validate_session_id
from .protocol import ChatMessage

logger = logging.getLogger(__name__)
RESPONSE_ID = re.compile(r"resp_[0-9a-f]{32}")
FORMAT = 1


def new_response_id() -> str:
    """A new response's id: ``resp_`` and 32 hex digits.

    Example:
        >>> RESPONSE_ID.fullmatch(new_response_id()) is not None
        True
    """
    return f"resp_{uuid.uuid4().hex}"


@dataclass
class StoredResponse:
    """A response kept for ``previous_response_id`` and ``GET``: its own input and reply (the chain gives the
    rest), what the memo needs to give the reply its exact ids again, and the response object as returned.

    Example:
        >>> responses.put(StoredResponse(...))  # doctest: +SKIP
    """

    id: str
    scope: str  # the request's cache_salt scope: a chain continues within its salt only
    session_id: str  # the session the reply was stored in
    point: str  # where that session stood after it (`ChatEngine.session_point`)
    client_ids: array  # the session's ids after the reply, as the client sends them ('i': int32)
    model_ids: array  # and as the model saw them (they differ after truncation)
    previous_id: str | None
    input: list[dict]  # this request's new messages (chat form, as `ChatMessage.model_dump`)
    output: dict  # the reply as an assistant message (chat form)
    raw: str  # the reply's text as generated (special tokens kept when it has calls)
    content_ids: list[int]  # the reply's ids as generated, without the closing end of turn
    calls: bool  # the reply has tool calls (memo'd under `tools.call_key`)
    body: dict  # the response object
    created: float = field(default_factory=time.time)

    def to_json(self) -> dict:
        return {"format": FORMAT, "id": self.id, "scope": self.scope, "session_id": self.session_id,
                "point": self.point, "client_ids": _ids_text(self.client_ids), "model_ids": _ids_text(self.model_ids),
                "previous_id": self.previous_id,
                "input": self.input, "output": self.output, "raw": self.raw, "content_ids": self.content_ids,
                "calls": self.calls, "body": self.body, "created": self.created}

    @classmethod
    def from_json(cls, data: dict) -> "StoredResponse":
        """Validated as a request would be (messages through `ChatMessage`); raises ValueError otherwise."""
        try:
            if data.get("format") != FORMAT or not RESPONSE_ID.fullmatch(str(data.get("id"))):
                raise ValueError("not a stored response of this format")
            previous = data["previous_id"]
            if previous is not None and not RESPONSE_ID.fullmatch(str(previous)):
                raise ValueError("bad previous id")
            messages = [ChatMessage.model_validate(m).model_dump(exclude_none=True) for m in data["input"]]
            output = ChatMessage.model_validate(data["output"]).model_dump(exclude_none=True)
            ids = data["content_ids"]
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                    for t in ids):
                raise ValueError("bad content ids")
            for name, kind in (("scope", str), ("session_id", str), ("point", str), ("raw", str), ("calls", bool),
                               ("body", dict), ("created", float)):
                if not isinstance(data[name], kind):
                    raise ValueError(f"bad {name}")
            validate_session_id(data["session_id"])
            return cls(data["id"], data["scope"], data["session_id"], data["point"], _ids_array(data["client_ids"]),
                       _ids_array(data["model_ids"]), previous, messages, output, data["raw"], ids, data["calls"],
                       data["body"], data["created"])
        except (KeyError, TypeError, AttributeError, ValidationError, binascii.Error) as exc:
            raise ValueError(f"damaged stored response: {exc}") from None


def ids_array(ids) -> array:
    """Token ids, compactly (4 bytes each: a stored response keeps its session's ids).

    Example:
        >>> ids_array([1, 2]).itemsize
        4
    """
    return array("i", ids)


def _ids_text(ids: array) -> str:
    ids = array("i", ids)
    if sys.byteorder != "little":
        ids.byteswap()  # stored little-endian, whatever the machine
    return base64.b64encode(ids.tobytes()).decode("ascii")


def _ids_array(text: str) -> array:
    data = base64.b64decode(text.encode("ascii"), validate=True)
    if len(data) % 4:
        raise ValueError("bad ids")
    ids = array("i")
    ids.frombytes(data)
    if sys.byteorder != "little":
        ids.byteswap()
    if any(t < 0 for t in ids):
        raise ValueError("bad ids")
    return ids


class Chains:
    """What every backend of stored responses shares (this file's, and response_store_redis.py's): a chain followed
    back through the backend's `get`.

    Example:
        >>> ResponseStore().chain(record, max_steps=100)  # doctest: +SKIP
    """

    def chain(self, record: StoredResponse, max_steps: int) -> list[StoredResponse] | None:
        """`record` and the responses it continues, oldest first; None when one of them is gone or the chain is
        longer than `max_steps` (or loops)."""
        out = [record]
        while out[-1].previous_id is not None:
            if len(out) >= max_steps:
                return None
            previous = self.get(out[-1].previous_id)
            if previous is None:
                return None
            out.append(previous)
        return out[::-1]


class ResponseStore(Chains):
    """Stored responses: the most recent `max_responses`, in memory (at most `max_memory_bytes` of them, counted
    as their JSON) and, with `folder`, on disk (one JSON file each, so they survive a restart; the oldest files go
    beyond `max_responses`). Without a folder, a response pushed out of memory is gone.

    Example:
        >>> responses = ResponseStore(max_responses=2)
        >>> responses.get("resp_" + "0" * 32) is None
        True
    """

    def __init__(self, folder: str | os.PathLike | None = None, max_responses: int = 10_000,
                 max_memory_bytes: int = 256 << 20):
        for name, value in (("max_responses", max_responses), ("max_memory_bytes", max_memory_bytes)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"`{name}` must be a positive integer, got {value!r}")
        self.folder = Path(folder) if folder is not None else None
        self.max_responses, self.max_memory_bytes = max_responses, max_memory_bytes
        self._memory: OrderedDict[str, StoredResponse] = OrderedDict()
        self._sizes: dict[str, int] = {}  # bytes of each response in memory (its JSON)
        self._bytes = 0
        self._on_disk: OrderedDict[str, None] = OrderedDict()  # ids with a file, oldest first
        self._lock = threading.Lock()
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)
            files = sorted(self.folder.glob("resp_*.json"), key=lambda p: p.stat().st_mtime)
            for path in files:
                if RESPONSE_ID.fullmatch(path.stem):
                    self._on_disk[path.stem] = None
            for leftover in self.folder.glob(".tmp-*"):  # a crash's half-written file
                leftover.unlink(missing_ok=True)

    def put(self, record: StoredResponse) -> None:
        """Keeps `record` (replacing one with its id). A failed write to disk is logged: the response is then
        kept in memory only."""
        text = json.dumps(record.to_json())
        with self._lock:
            self._keep(record, len(text))
            if self.folder is None:
                return
            try:
                self._write(record.id, text)
            except OSError as exc:
                logger.warning("stored response %s kept in memory only: %s", record.id, exc)
                return
            self._on_disk[record.id] = None
            self._on_disk.move_to_end(record.id)
            while len(self._on_disk) > self.max_responses:
                old, _ = self._on_disk.popitem(last=False)
                (self.folder / f"{old}.json").unlink(missing_ok=True)

    def _keep(self, record: StoredResponse, size: int) -> None:
        """Holds `record` in memory; the least recently used go beyond the count or the bytes (not the newest)."""
        self._bytes -= self._sizes.pop(record.id, 0)
        self._memory[record.id] = record
        self._memory.move_to_end(record.id)
        self._sizes[record.id] = size
        self._bytes += size
        while len(self._memory) > 1 and (len(self._memory) > self.max_responses or
                                         self._bytes > self.max_memory_bytes):
            old, _ = self._memory.popitem(last=False)
            self._bytes -= self._sizes.pop(old, 0)

    def _write(self, response_id: str, text: str) -> None:
        tmp = self.folder / f".tmp-{response_id}"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.folder / f"{response_id}.json")

    def get(self, response_id: str) -> StoredResponse | None:
        """The stored response, or None (unknown, deleted, malformed id, or a damaged file: logged)."""
        if not isinstance(response_id, str) or not RESPONSE_ID.fullmatch(response_id):
            return None
        with self._lock:
            record = self._memory.get(response_id)
            if record is not None or self.folder is None or response_id not in self._on_disk:
                return record
            try:
                with open(self.folder / f"{response_id}.json", encoding="utf-8") as f:
                    text = f.read()
                record = StoredResponse.from_json(json.loads(text))
            except (OSError, ValueError, RecursionError) as exc:
                logger.warning("stored response %s cannot be read (%s): treated as unknown", response_id, exc)
                return None
            if record.id != response_id:
                return None
            self._keep(record, len(text))
            return record

    def delete(self, response_id: str) -> bool:
        """Forgets a response; False if it was unknown. Responses chained from it can no longer be continued."""
        if self.get(response_id) is None:
            return False
        with self._lock:
            self._memory.pop(response_id, None)
            self._bytes -= self._sizes.pop(response_id, 0)
            if self.folder is not None and response_id in self._on_disk:
                del self._on_disk[response_id]
                (self.folder / f"{response_id}.json").unlink(missing_ok=True)
            return True
