"""Recurrent and convolution states of hybrid models, kept with a session's KV.

Linear-attention and state-space layers (qwen3_next, lfm2, falcon_h1, jamba, ...) keep no per-token KV:
after ``t`` tokens they hold fixed-size states that summarize the whole history. Unlike pre-RoPE keys,
those states cannot be re-positioned, cut or shared by another history: a state is reused only by a turn
whose prompt extends exactly the ``t`` tokens it was computed for. So each state records its token count
and the digest of those tokens' ids (seeded with the model fingerprint, as chunks are), and a session
keeps at most one state, the one at the end of its last turn (the ids a next turn extends).

On disk (and in the remote tier) a state is one safetensors file, ``s-<digest>.safetensors``, whose string
metadata carries the format, fingerprint, session id, token count, history digest and an xxh64 checksum
per tensor; its *digest* hashes that metadata and is pinned by the manifest, like a chunk's. Read back, the
whole file is validated and every checksum verified: any doubt is a FormatError (a clean miss). No pickle.

Tensor names: ``L{layer:04d}.c{i}`` (conv state ``i`` of model layer ``layer``) and ``L{layer:04d}.r{i}``
(recurrent state ``i``). A session kept sparse (or truncated by importance) also keeps its tokens' importance
scores this way, which are valid for the same tokens: ``I{slot:04d}.alisa{window}`` or ``I{slot:04d}.h2o``
(``[kv_heads, tokens]`` fp32 of KV slot ``slot``, named by what they sum, cache/importance.py). Files of older
versions name them ``I{slot:04d}`` (fp16, without the label): they are read, and their scores not used. A session
kept sparse also keeps the selection its next turn starts from, ``S{slot:04d}`` (``[kv_heads, kept]`` int64 session
positions, ascending): what sparse cold copies keep (`StoreConfig.sparse_copies`).
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
import torch
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save

from .format import FORMAT, FormatError, KV_DTYPES, STATE_PREFIX, StateRef, checksum, metadata_digest, tensor_bytes


_NAME = re.compile(r"L\d{4}\.[cr]\d{1,3}|I\d{4}(?:\.h2o|\.alisa\d{1,6})?|S\d{4}")
MAX_STATE_TENSORS = 4096


def selection_name(slot: int) -> str:
    """The name of KV slot `slot`'s selection: the positions a sparse session's next turn keeps (module docstring).

    Example:
        >>> selection_name(3)
        'S0003'
    """
    return f"S{slot:04d}"


def by_slot(state: "SessionState", kind: str) -> dict[int, torch.Tensor]:
    """A state's selections (`kind` ``"S"``) or importance scores (``"I"``, of whatever policy), by KV slot.

    Example:
        >>> state = SessionState.capture(4, {"S0000": torch.tensor([[0, 3]]), "S0001": torch.tensor([[1, 2]]),
        ...                                  "L0002.r0": torch.zeros(2)})
        >>> {slot: t.tolist() for slot, t in by_slot(state, "S").items()}
        {0: [[0, 3]], 1: [[1, 2]]}
    """
    return {int(name[1:5]): t for name, t in state.tensors.items() if name.startswith(kind)}


def _allowed(name: str, t: torch.Tensor) -> bool:
    if not _NAME.fullmatch(name):
        return False
    return t.dtype == torch.int64 and t.dim() == 2 if name.startswith("S") else t.dtype in KV_DTYPES


@dataclass(frozen=True)
class SessionState:
    """A hybrid model's non-attention states after the first `tokens` tokens of a session.

    Attributes:
        tokens: How many tokens of the session the states summarize.
        tensors: Name -> CPU tensor (see the module docstring for the names).
        checksums: Name -> xxh64 of the tensor's bytes.
        prefix: Digest of the session's ids ``[:tokens]`` (`format.prefix_digest`); empty until the store
            seals the state against the ids it stored (:meth:`sealed`).
        key: ``(fingerprint, session_id)`` once sealed.
        digest: Pins the state's content once sealed: a hash of its metadata, which holds every tensor's
            checksum (the manifest records it, as it records each chunk's).

    Example:
        >>> state = SessionState.capture(12, {"L0001.r0": torch.ones(2, 4), "L0001.c0": torch.zeros(2, 3)})
        >>> state.tokens, sorted(state.tensors), state.nbytes
        (12, ['L0001.c0', 'L0001.r0'], 56)
        >>> sealed = state.sealed(("model-a", "chat-1"), prefix="p" * 32)  # bound to the ids it summarizes
        >>> sealed.key, len(sealed.digest)
        (('model-a', 'chat-1'), 32)
    """

    tokens: int
    tensors: dict[str, torch.Tensor]
    checksums: dict[str, str]
    prefix: str = ""
    key: tuple[str, str] = ("", "")
    digest: str = ""

    @classmethod
    def capture(cls, tokens: int, tensors: dict[str, torch.Tensor]) -> "SessionState":
        """Copies `tensors` (any device) to host memory and checksums them: the model may change its own."""
        copies = {name: t.detach().to("cpu", copy=True).contiguous() for name, t in tensors.items()}
        for name, t in copies.items():
            if not _allowed(name, t):
                raise TypeError(f"state tensor {name!r} of dtype {t.dtype} cannot be stored")
        return cls(int(tokens), copies, {name: checksum(tensor_bytes(t)) for name, t in copies.items()})

    def sealed(self, key: tuple[str, str], prefix: str) -> "SessionState":
        """This state bound to a session and the digest of the ids it was computed for."""
        state = dataclasses.replace(self, prefix=prefix, key=key)
        return dataclasses.replace(state, digest=metadata_digest(state._meta()))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def _meta(self) -> dict[str, str]:
        return {
            "format": FORMAT,
            "kind": "state",
            "fingerprint": self.key[0],
            "session_id": self.key[1],
            "n_tokens": str(self.tokens),
            "prefix": self.prefix,
            "checksums": json.dumps(self.checksums, sort_keys=True),
        }

    @property
    def ref(self) -> StateRef:
        assert self.digest, "seal the state before naming it"
        return StateRef(STATE_PREFIX + self.digest, self.tokens, self.digest)

    def encode(self) -> bytes:
        """The state's file: safetensors bytes (see the module docstring)."""
        return safetensors_save(self.tensors, metadata=self._meta())

    @classmethod
    def decode(cls, data: bytes, key: tuple[str, str], ref: StateRef) -> "SessionState":
        """Parses and verifies a state file against the manifest's reference.

        Raises:
            FormatError: On any doubt (another format, model, session or history, a checksum mismatch).
        """
        try:
            tensors = safetensors_load(bytes(data))
            header_len = int.from_bytes(bytes(data[:8]), "little")
            meta = json.loads(bytes(data[8 : 8 + header_len]))["__metadata__"]
            if meta.get("format") != FORMAT or meta.get("kind") != "state":
                raise FormatError("not a state file of this format")
            sums = json.loads(meta["checksums"])
            state = cls(int(meta["n_tokens"]), tensors, {str(k): str(v) for k, v in sums.items()},
                        str(meta["prefix"]), (str(meta["fingerprint"]), str(meta["session_id"])), metadata_digest(meta))
        except FormatError:
            raise
        except Exception as exc:  # any malformed header or tensor: the file is damaged
            raise FormatError(f"unreadable state file: {exc}") from exc
        if state.key != key:
            raise FormatError("state of another model or session")
        if state.tokens != ref.tokens or state.digest != ref.digest:
            raise FormatError("state is not the one the manifest pinned")
        if set(tensors) != set(state.checksums) or len(tensors) > MAX_STATE_TENSORS:
            raise FormatError("state tensors disagree with their checksums")
        for name, t in tensors.items():
            if not _allowed(name, t):
                raise FormatError(f"unexpected state tensor {name!r}")
            if checksum(tensor_bytes(t)) != state.checksums[name]:
                raise FormatError(f"checksum mismatch in state tensor {name}")
        return state
