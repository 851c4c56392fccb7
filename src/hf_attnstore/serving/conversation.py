"""From OpenAI message lists to exact token ids, and from token ids to the stored session they continue.

OpenAI clients send the whole conversation each turn, as text. Two things stand between that and reusing
the stored KV:

* **Stable ids.** Tokenizing the rendered conversation as one string can tokenize the boundary between two
  messages differently from one turn to the next, and re-tokenizing a reply the model generated often gives
  other ids than the ones it generated (a generated "ĊĊ" comes back as two "Ċ"; LMCache #129, #151). So
  :class:`MessageTokens` tokenizes each message's piece of the template separately (a conversation's ids are
  then always a prefix of its continuation's), and an assistant message whose text is a reply this server
  generated gets back the exact ids it was generated as (:class:`ReplyMemo`).
* **Which session.** Without an explicit session id, :class:`SessionIndex` finds the stored session whose
  ids are the longest prefix of the request's: chained digests of block-aligned prefixes, one dictionary
  probe per block of the request. Sessions are found only within their scope (the requests' ``cache_salt``).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict

from .tools import message_call_key

_PROBE = "\x00attnstore-probe\x00"


class ToolsUnrenderable(ValueError):
    """The chat template fails to render the request's tools (a schema nested deeper than it can recurse...): the
    client's error, naming the tool's field at fault in `param`.

    Example:
        >>> ToolsUnrenderable("tools.0.function.parameters", RecursionError()).param
        'tools.0.function.parameters'
    """

    def __init__(self, param: str, error: BaseException, depth: int | None = None):
        shown = param.replace(".function", "].function").replace("tools.", "tools[", 1) if param != "tools" else param
        why = (f"its JSON is nested {depth} levels deep, more than the template can recurse into" if
               isinstance(error, RecursionError) and depth is not None else f"{type(error).__name__}: {error}"[:300])
        super().__init__(f"the chat template cannot render `{shown}`: {why}; send a flatter or smaller schema")
        self.param = param


def _depth(value) -> int:
    """How deeply `value` (JSON: dicts and lists) nests (an iterative walk: it may be deeper than Python recurses)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            stack += [(child, depth + 1) for child in (item.values() if isinstance(item, dict) else item)]
    return deepest


class ReplyMemo:
    """Replies this server generated: their text, as returned to the client, mapped to their exact ids.

    Bounded (least recently used entries go first); with `shared` (a `shared_state.SharedState`), also kept in the
    replicas' Redis and read from it on a local miss. Two generations with the same text and other ids keep
    the later one: an echoed reply then matches the other session's KV only up to that point (a miss
    beyond it, never wrong KV: the store compares ids).

    Example:
        >>> memo = ReplyMemo()
        >>> memo.add("Hello!", [7, 8])
        >>> memo.get("Hello!")
        [7, 8]
    """

    def __init__(self, max_entries: int = 100_000, shared=None):
        self._entries: OrderedDict[tuple[str, str], tuple[int, ...]] = OrderedDict()
        self._calls: OrderedDict[tuple[str, str], str] = OrderedDict()  # tools.call_key -> the reply's text
        self._max = max_entries
        self._lock = threading.Lock()
        # Replicas behind one load balancer (shared_state.SharedState): a reply one of them generated keeps its
        # exact ids on every other, so a conversation it continues re-tokenizes nothing.
        self.shared = shared

    def add_calls(self, key: str, text: str, scope: str = "") -> None:
        """Remembers that the reply with tool calls `key` (`tools.call_key`) was generated as `text` (its ids
        are then remembered under `text` with `add`)."""
        with self._lock:
            self._calls[(scope, key)] = text
            self._calls.move_to_end((scope, key))
            while len(self._calls) > self._max:
                self._calls.popitem(last=False)
        if self.shared is not None:
            self.shared.put_calls(scope, key, text)

    def calls_text(self, key: str, scope: str = "") -> str | None:
        with self._lock:
            text = self._calls.get((scope, key))
        if text is None and self.shared is not None:
            text = self.shared.get_calls(scope, key)
        return text

    def add(self, text: str, ids: list[int], scope: str = "") -> None:
        """Remembers `ids` as the generation of `text` within `scope` (a request's ``cache_salt``: replies
        generated for one salt never shape another's prompts)."""
        if not text:
            return
        self._keep((scope, text), tuple(ids))
        if self.shared is not None:
            self.shared.put_reply(scope, text, list(ids))

    def _keep(self, key: tuple[str, str], ids: tuple[int, ...]) -> None:
        with self._lock:
            self._entries[key] = ids
            self._entries.move_to_end(key)
            while len(self._entries) > self._max:
                self._entries.popitem(last=False)

    def get(self, text: str, scope: str = "") -> list[int] | None:
        key = (scope, text)
        with self._lock:
            ids = self._entries.get(key)
            if ids is not None:
                self._entries.move_to_end(key)
                return list(ids)
        if self.shared is None or not text:
            return None
        found = self.shared.get_reply(scope, text)  # generated by another replica
        if found is not None:
            self._keep(key, tuple(found))
        return found


class MessageTokens:
    """Token ids of a message list, built piece by piece so they are stable across turns.

    Piece ``i`` is what rendering ``messages[:i+1]`` adds to the rendering of ``messages[:i]``; the last
    piece is the generation prompt. An assistant piece is split around its content, so that its opening
    is tokenized exactly as the generation prompt was when the reply was generated, and its content is the
    generated ids when `memo` knows them. A template that rewrites earlier turns (rendering a prefix of the
    conversation gives text that is not a prefix) falls back to tokenizing the whole text: correct, but
    reuse then ends where the ids differ.

    Args:
        tokenizer: A tokenizer with a chat template.
        memo: Replies this server generated.

    Example:
        >>> tokens = MessageTokens(tokenizer, ReplyMemo())  # doctest: +SKIP
        >>> ids = tokens.prompt_ids([{"role": "user", "content": "hi"}])  # doctest: +SKIP
    """

    def __init__(self, tokenizer, memo: ReplyMemo | None = None):
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("the tokenizer has no chat template: a chat server needs one to render messages")
        self.tokenizer = tokenizer
        self.memo = memo if memo is not None else ReplyMemo()

    def _render(self, messages: list[dict], generation_prompt: bool, tools: list[dict] | None = None) -> str:
        if not messages and not generation_prompt:
            return ""
        return self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def render(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """The chat template's text of `messages` (with `tools`), without a generation prompt."""
        return self._render(messages, False, tools)

    def takes_tools(self, tools: list[dict]) -> bool:
        """Whether the chat template renders `tools` at all (a template that ignores them would let the model
        answer without knowing them).

        Raises:
            ToolsUnrenderable: The template renders tools, but fails on these (it names the tool at fault).
        """
        probe = [{"role": "user", "content": _PROBE}]
        plain = self._render(probe, True)
        try:
            return self._render(probe, True, tools) != plain
        except Exception as exc:  # noqa: BLE001 - jinja's errors, a recursion: which tool is at fault is told below
            error = exc
        if not self._renders(probe, [{"type": "function", "function": {"name": "probe"}}]):
            return False  # it fails on any tool: it does not take tools
        for i, tool in enumerate(tools):
            if self._renders(probe, [tool]):
                continue
            function = tool.get("function") or {}
            bare = {**tool, "function": {k: v for k, v in function.items() if k != "parameters"}}
            if "parameters" in function and self._renders(probe, [bare]):
                param, depth = f"tools.{i}.function.parameters", _depth(function["parameters"])
            else:
                param, depth = f"tools.{i}.function", _depth(function)
            raise ToolsUnrenderable(param, error, depth)
        raise ToolsUnrenderable("tools", error)

    def _renders(self, probe: list[dict], tools: list[dict]) -> bool:
        try:
            self._render(probe, True, tools)
        except Exception:  # noqa: BLE001 - any failure: it does not
            return False
        return True

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

    def generation_prompt(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """What the template adds to open the assistant's reply after `messages` (after none: what it adds after a
        user message, since a template cannot render an empty conversation)."""
        if not messages:
            probe = [{"role": "user", "content": _PROBE}]
            return self._render(probe, True, tools)[len(self._render(probe, False, tools)):]
        return self._render(messages, True, tools)[len(self._render(messages, False, tools)):]

    def prompt_ids(self, messages: list[dict], scope: str = "", tools: list[dict] | None = None) -> list[int]:
        """The ids of the prompt for the next assistant reply after `messages` (replies remembered within
        `scope`, see :class:`ReplyMemo`), rendered with `tools` (the template form) when given.

        Raises:
            ValueError: The template rejects the messages (its message says why).
        """
        try:
            return self._pieces(messages, scope, tools)
        except _NotAppendable:
            return self._encode(self._render(messages, True, tools))
        except Exception as exc:  # jinja errors (roles out of order, unknown fields): the client's fault
            raise ValueError(f"the chat template cannot render these messages: {exc}") from None

    def _pieces(self, messages: list[dict], scope: str, tools: list[dict] | None) -> list[int]:
        ids: list[int] = []
        before = self._render([], False, tools)
        for i, message in enumerate(messages):
            text = self._render(messages[: i + 1], False, tools)
            if not text.startswith(before):
                raise _NotAppendable
            piece = text[len(before):]
            if message.get("role") == "assistant":
                ids += self._assistant_piece(messages[:i], piece, message, scope, tools)
            else:
                ids += self._encode(piece)
            before = text
        full = self._render(messages, True, tools)
        if not full.startswith(before):
            raise _NotAppendable
        return ids + self._encode(full[len(before):])

    def _assistant_piece(self, history: list[dict], piece: str, message: dict, scope: str,
                         tools: list[dict] | None) -> list[int]:
        key = message_call_key(message)
        if key is not None:  # a reply with tool calls: the text it was generated as, if this server made it
            content = self.memo.calls_text(key, scope) or ""
        else:
            content = message.get("content") or ""
        opening = self.generation_prompt(history, tools)
        head = ""
        if not history and piece.find(opening) > 0:  # the conversation's first message: the template may open it
            # with text of its own (a default system prompt) before the assistant's opening
            head, piece = piece[:piece.find(opening)], piece[piece.find(opening):]
        at = piece.find(content, len(opening)) if content else -1
        if not piece.startswith(opening) or at < 0 or piece[len(opening):at].strip():
            # The template renders the reply otherwise than it was generated (it strips reasoning, or formats
            # tool calls its own way): as rendered; reuse ends there.
            return self._encode(head + piece)
        known = self.memo.get(content, scope)
        content_ids = known if known is not None else self._encode(content)
        return self._encode(head) + self._encode(opening) + content_ids + self._encode(piece[at + len(content):])


class _NotAppendable(Exception):
    pass


class SessionIndex:
    """Which stored session a request continues: the session whose ids are the longest prefix of its ids.

    Each session is indexed under the chained digest of its ids' whole blocks of `block` tokens (digest
    ``k`` covers the first ``k * block`` ids and is computed from digest ``k - 1``). A lookup computes the
    request's chained digests once, probes them from the longest down, and checks the candidates' remaining
    ids directly. Bounded: the least recently used sessions are forgotten (their KV stays in the store; a
    forgotten conversation becomes a new session).

    Every method takes a `scope` (the requests' ``cache_salt``; "" without one): a session is found, and
    named, only within its scope, so a request never continues, nor times, a conversation of another salt.

    Example:
        >>> index = SessionIndex(block=4)
        >>> index.add("a", [1, 2, 3, 4, 5, 6])
        >>> index.find([1, 2, 3, 4, 5, 6, 7, 8])
        ('a', 6)
        >>> index.find([1, 2, 3, 4, 5, 6, 7, 8], scope="tenant-b") is None
        True
    """

    def __init__(self, block: int = 16, max_sessions: int = 100_000):
        if block < 1 or max_sessions < 1:
            raise ValueError("`block` and `max_sessions` must be positive")
        self.block, self.max_sessions = block, max_sessions
        # Keyed by (scope, session id).
        self._ids: OrderedDict[tuple[str, str], tuple[int, ...]] = OrderedDict()
        self._extra: dict[tuple[str, str], object] = {}
        self._by_digest: dict[bytes, set[tuple[str, str]]] = {}
        self._digest_of: dict[tuple[str, str], bytes] = {}
        self._used: dict[tuple[str, str], int] = {}  # when each session was last indexed or found
        self._clock = 0
        self._lock = threading.Lock()

    def digests(self, ids, scope: str) -> list[bytes]:
        """Digest ``k`` of the first ``k * block`` ids within `scope`, for every whole block (digest 0: no
        ids)."""
        h = hashlib.blake2b(scope.encode("utf-8", "surrogatepass"), digest_size=16).digest()
        out = [h]
        for k in range(len(ids) // self.block):
            block = ids[k * self.block: (k + 1) * self.block]
            h = hashlib.blake2b(h + b"".join(int(t).to_bytes(8, "little", signed=True) for t in block),
                                digest_size=16).digest()
            out.append(h)
        return out

    def add(self, session: str, ids, extra: object = None, scope: str = "") -> None:
        """Indexes (or re-indexes) `session` as holding exactly `ids`; `extra` is kept with it (see `get`)."""
        ids = tuple(int(t) for t in ids)
        digest = self.digests(ids, scope)[-1]
        key = (scope, session)
        with self._lock:
            self._forget(key)
            self._ids[key] = ids
            self._extra[key] = extra
            self._digest_of[key] = digest
            self._by_digest.setdefault(digest, set()).add(key)
            self._clock += 1
            self._used[key] = self._clock
            while len(self._ids) > self.max_sessions:
                self._forget(next(iter(self._ids)))

    def get(self, session: str, scope: str = "") -> tuple[tuple[int, ...], object] | None:
        """The ids `session` is indexed under and its `extra`, or None."""
        key = (scope, session)
        with self._lock:
            if key not in self._ids:
                return None
            return self._ids[key], self._extra[key]

    def remove(self, session: str, scope: str = "") -> None:
        with self._lock:
            self._forget((scope, session))

    def _forget(self, session: tuple[str, str]) -> None:
        if self._ids.pop(session, None) is None:
            return
        self._extra.pop(session, None)
        self._used.pop(session, None)
        digest = self._digest_of.pop(session)
        sessions = self._by_digest[digest]
        sessions.discard(session)
        if not sessions:
            del self._by_digest[digest]

    def find(self, ids, scope: str = "") -> tuple[str, int] | None:
        """The session of `scope` whose ids are the longest prefix of `ids` (all of them included: a retried
        request), and their length; or None. Of several as long (a regenerated turn that gave the same reply),
        the most recently used: the conversation the client went on with."""
        ids = tuple(int(t) for t in ids)
        digests = self.digests(ids, scope)
        with self._lock:
            for k in range(len(digests) - 1, -1, -1):
                best = None
                for session in self._by_digest.get(digests[k], ()):
                    stored = self._ids[session]
                    if len(stored) <= len(ids) and ids[k * self.block: len(stored)] == stored[k * self.block:]:
                        if best is None or (len(stored), self._used[session]) > (len(self._ids[best]),
                                                                                   self._used[best]):
                            best = session
                if best is not None:
                    self._ids.move_to_end(best)
                    self._clock += 1
                    self._used[best] = self._clock
                    return best[1], len(self._ids[best])
        return None

    def __len__(self) -> int:
        with self._lock:
            return len(self._ids)
