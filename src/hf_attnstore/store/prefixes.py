"""Which stored sessions begin with a given token prefix: a table of chained block hashes, as vLLM's automatic
prefix caching keys its blocks.

A session's token ids are cut into blocks of `BLOCK` tokens; block k is keyed by a hash chained over blocks
0..k (so a key names a whole prefix, not one block). The table maps each key, within one model fingerprint, to the
sessions whose ids begin with that prefix, most recently stored last. It only proposes: the store compares the
candidates' real ids with the prompt (under its lock) before anything is reused, so a stale or colliding entry
costs a comparison, never wrong KV. Prefixes shorter than one block are not looked up (recomputing fewer than
`BLOCK` tokens costs little).

Example:
    >>> import torch
    >>> table = PrefixTable()
    >>> system = torch.arange(3 * BLOCK)
    >>> table.add(("fp", "alice"), torch.cat([system, torch.tensor([7, 8])]))
    >>> table.candidates("fp", torch.cat([system, torch.tensor([9])]), exclude=("fp", "bob"))
    [(('fp', 'alice'), 192)]
"""

from __future__ import annotations

import hashlib

import torch

from .tier import Key

BLOCK = 64  # tokens per hashed block


def block_hashes(token_ids: torch.Tensor, block: int = BLOCK, partial: bool = False) -> list[bytes]:
    """The chained hash of every whole block of `token_ids` (1-D, int64): entry k names ids[: (k + 1) * block].

    Args:
        token_ids: The ids.
        block: Tokens per block.
        partial: Also hash the trailing partial block, if any (its hash names the whole of `token_ids`; it differs
            from the hash of any whole block, whose bytes are longer).

    Example:
        >>> hashes = block_hashes(torch.arange(150))  # two whole blocks of 64; the 22 tokens after them are not hashed
        >>> len(hashes), hashes[0] == block_hashes(torch.arange(64))[0]
        (2, True)
        >>> len(block_hashes(torch.arange(150), block=64, partial=True))  # the 22 tokens too
        3
    """
    ids = token_ids.detach().to("cpu", torch.long).contiguous().view(-1)
    out, h = [], b""
    data = ids.numpy().tobytes()
    width = block * 8
    for k in range(-(-ids.numel() // block) if partial else ids.numel() // block):
        h = hashlib.blake2b(h + data[k * width : (k + 1) * width], digest_size=16).digest()
        out.append(h)
    return out


class PrefixTable:
    """Sessions by the prefixes they begin with (see the module docstring). Guarded by the store's lock
    (`StoreState.lock`).

    Example:
        >>> table = PrefixTable()
        >>> table.add(("model-a", "alice"), torch.arange(130))
        >>> table.candidates("model-a", torch.cat([torch.arange(100), torch.tensor([7])]))  # one whole block shared
        [(('model-a', 'alice'), 64)]
    """

    def __init__(self):
        self._sessions: dict[tuple[str, bytes], dict[Key, None]] = {}  # (fingerprint, hash) -> keys, oldest first
        self._hashes: dict[Key, list[bytes]] = {}  # what each session was added under

    def add(self, key: Key, token_ids: torch.Tensor) -> None:
        """Records (or re-records, after it grew or changed) that session `key` begins with these ids."""
        self.remove(key)
        hashes = block_hashes(token_ids)
        for h in hashes:
            users = self._sessions.setdefault((key[0], h), {})
            users[key] = None  # newest last
        if hashes:
            self._hashes[key] = hashes

    def remove(self, key: Key) -> None:
        for h in self._hashes.pop(key, ()):
            users = self._sessions.get((key[0], h))
            if users is not None:
                users.pop(key, None)
                if not users:
                    del self._sessions[(key[0], h)]

    def candidates(self, fingerprint: str, token_ids: torch.Tensor, exclude: Key | None = None,
                   limit: int = 4, every_depth: bool = False) -> list[tuple[Key, int]]:
        """Up to `limit` sessions sharing the longest whole-block prefix with `token_ids`, newest first, each with
        the tokens that prefix covers (a lower bound: the store extends it by comparing ids). `every_depth`: also
        up to `limit` of those sharing each shorter prefix, deepest first (for a caller that may use less of a
        session than it shares: a dense turn reuses a session's exact tokens only)."""
        levels: list[list[tuple[Key, int]]] = []
        for k, h in enumerate(block_hashes(token_ids)):
            users = self._sessions.get((fingerprint, h))
            found = [key for key in reversed(users or {}) if key != exclude]
            if not found:
                break
            levels.append([(key, (k + 1) * BLOCK) for key in found[:limit]])
        if not every_depth:
            return levels[-1] if levels else []
        out, seen = [], set()
        for level in reversed(levels):
            for key, tokens in level:
                if key not in seen:
                    seen.add(key)
                    out.append((key, tokens))
        return out

    def __len__(self) -> int:
        return len(self._hashes)
