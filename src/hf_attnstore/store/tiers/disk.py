"""The disk tier: one folder per session with immutable chunk files and a manifest.

It implements the lower-tier interface of tiers/base.py. Every method here only moves bytes; which session lives
where is decided by the store's state (index.py).
"""

from __future__ import annotations

import fcntl
import logging
import os
import secrets
import shutil
import stat
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from pathlib import Path

import torch
import xxhash

from ..format import (ChunkMeta, FormatError, Manifest, StateRef, bytes_to_tensor, check_chain, file_reader,
    layer_names, read_chunk_meta, read_kept, read_range, session_dirname)
from .base import CHUNK_SUFFIX, ChunkReader, Key, MANIFEST, ScannedSession, SerialWriter, Tier

logger = logging.getLogger(__name__)
TMP_PREFIX = ".tmp-"
LOCK = "LOCK"


class DiskLockedError(RuntimeError):
    """Another store (in this process or another) has the disk tier's folder open.

    Example:
        >>> import tempfile
        >>> from hf_attnstore.store import AttnStore
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     first = AttnStore(host_bytes="1MiB", disk_dir=folder)
        ...     try:
        ...         AttnStore(host_bytes="1MiB", disk_dir=folder)  # a second store on the same folder
        ...     except DiskLockedError:
        ...         print("locked")
        ...     first.close()
        locked
    """


def _numpy(t: torch.Tensor):
    """A writable numpy view of a contiguous CPU tensor (bf16 through int16: numpy has no bf16)."""
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


def _read_all(fd: int, size: int) -> bytes:
    """The file's `size` bytes (a file shorter than its `fstat` said reads short, and fails to parse)."""
    parts, offset = [], 0
    while offset < size:
        part = os.pread(fd, size - offset, offset)
        if not part:
            break
        parts.append(part)
        offset += len(part)
    return b"".join(parts)


def _write_bytes(fd: int, data: bytes) -> None:
    """Writes all of `data` (a seam for fault-injection tests: ENOSPC, EIO)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _fsync_dir(folder: Path) -> None:
    """Makes the folder's entries (a rename, a new link) durable."""
    dfd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


class DiskChunk(ChunkReader):
    """A chunk file opened for reading (see :meth:`DiskTier.get`).

    Example:
        >>> import tempfile
        >>> from hf_attnstore.store.format import encode_chunk
        >>> ids, k, v = torch.tensor([5, 6, 7]), [torch.zeros(1, 2, 3, 4)], [torch.ones(1, 2, 3, 4)]
        >>> data, _ = encode_chunk("model-a", "chat-1", ids, k, v, prefix="", previous="")
        >>> keys, values = torch.empty(1, 2, 2, 4), torch.empty(1, 2, 2, 4)
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     tier = DiskTier(folder, fsync=False)
        ...     _ = tier.write(("model-a", "chat-1"), "c0" + CHUNK_SUFFIX, data)
        ...     chunk = tier.get(("model-a", "chat-1"), "c0")
        ...     _ = chunk.read_layer_into(0, 1, 3, keys, values)  # layer 0, tokens 1 and 2 (checksums verified)
        ...     chunk.close(); tier.close()
        >>> chunk.meta.n_tokens, values.unique().tolist()
        (3, [1.0])
    """

    def __init__(self, tier: "DiskTier", fd: int, meta: ChunkMeta):
        self.tier, self.fd, self.meta = tier, fd, meta

    def ids(self) -> torch.Tensor:
        return self.tier.read_ids(self.fd, self.meta)

    def read_layer_into(self, layer, start, end, keys_out, values_out, keep=None) -> int:
        return self.tier.read_layer_into(self.fd, self.meta, layer, start, end, keys_out, values_out, keep)

    def kept(self) -> torch.Tensor:
        return read_kept(file_reader(self.fd), self.meta)

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


class DiskTier(Tier):
    """Files of the disk tier under `root` (created with mode 0700), locked for one store at a time.

    The store that opens a folder owns it: it numbers chunk files, deletes what no manifest references and
    removes temporary files left by a crash. A second owner would break all three, so opening takes an
    exclusive `flock` on ``root/LOCK`` (as RocksDB and LMDB do); the kernel releases it when the process
    dies, so a crash never leaves a stale lock.

    Args:
        root: The folder (``~`` is expanded).
        fsync: Whether writes are made durable (file and folder fsync). Only tests turn it off.
        timeout_s: How long :meth:`close` waits for writes in flight.

    Raises:
        DiskLockedError: Another store has the folder open.
        ValueError: The folder (or its ``sessions`` entry) exists but is not a folder.
        OSError: The folder cannot be created or written (its message names `disk_dir`).

    Example:
        >>> import tempfile
        >>> from hf_attnstore.store.format import encode_chunk
        >>> ids, k, v = torch.tensor([5, 6, 7]), [torch.zeros(1, 2, 3, 4)], [torch.ones(1, 2, 3, 4)]
        >>> data, _ = encode_chunk("model-a", "chat-1", ids, k, v, prefix="", previous="")
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     tier = DiskTier(folder, fsync=False)
        ...     size = tier.put(("model-a", "chat-1"), "c0" + CHUNK_SUFFIX, data).result()  # on the writer thread
        ...     with tier.get(("model-a", "chat-1"), "c0") as chunk:
        ...         print(size == len(data), chunk.ids().tolist())
        ...     tier.close()
        True [5, 6, 7]
    """

    name = "disk"

    def __init__(self, root: str | os.PathLike, fsync: bool = True, timeout_s: float = 60.0):
        self.timeout_s = timeout_s
        self._writer: SerialWriter | None = None
        self.root = Path(os.path.expanduser(os.fspath(root))).resolve()
        self.sessions_root = self.root / "sessions"
        self.fsync = fsync
        self._lock_fd: int | None = None
        for path in (self.root, self.sessions_root):
            if path.exists() and not path.is_dir():
                raise ValueError(f"`disk_dir`: {path} exists and is not a folder; pass a folder (or a new path)")
        try:
            self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(self.root / LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:  # the same type (a PermissionError stays one), with a message that names the option
            raise type(exc)(exc.errno, f"`disk_dir` {os.fspath(root)!r} cannot be created or written ({exc.strerror}): "
                            "pass a folder this process can write, e.g. ~/.cache/hf_attnstore/kv") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise DiskLockedError(
                f"the disk tier folder {self.root} is in use by another AttnStore (this process or another): "
                "close that store first, or give each store its own `disk_dir`"
            ) from None
        self._lock_fd = fd
        self.sessions_root.mkdir(exist_ok=True, mode=0o700)
        self._writer = SerialWriter("attnstore-disk-write")

    def close(self) -> None:
        """Lets the writes in flight finish (up to `timeout_s`), then releases the folder's lock. Idempotent."""
        if self._writer is not None and not self._writer.close(self.timeout_s):
            logger.warning("disk tier: a write to %s did not finish within %s s at close", self.root, self.timeout_s)
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            os.close(fd)  # closing the only descriptor of the lock file releases the flock

    def __del__(self):
        if getattr(self, "_writer", None) is not None:
            self._writer.close(0)  # lets the thread end after its queue; never blocks a finalizer
        fd, self._lock_fd = getattr(self, "_lock_fd", None), None
        if fd is not None:
            os.close(fd)

    # -- the tier interface (tiers/base.py) -----------------------------------------------------------------
    def put(self, key: Key, name: str, data: bytes) -> Future[int]:
        return self._writer.submit(self.write_file, key[0], key[1], name, data)  # fails once closed

    def get(self, key: Key, chunk: str, owner: str = "") -> DiskChunk:
        fd, meta = self.open_chunk(key[0], key[1], chunk, owner)
        return DiskChunk(self, fd, meta)

    def link(self, source: Key, name: str, key: Key, new_name: str) -> tuple[int, tuple]:
        """A hard link: the file's bytes are on disk once, and stay while any session's folder names them, so
        deleting one session (or a crash at any point) never takes a chunk another manifest names. Made before
        the manifest that names it; a crash in between leaves a name no manifest references (collected when
        the folder is next scanned)."""
        src = self.session_dir(*source) / (name + CHUNK_SUFFIX)
        if not src.is_file() or src.is_symlink():
            raise FileNotFoundError(f"chunk {name} of the shared prefix is gone")
        folder = self.session_dir(*key)
        folder.mkdir(mode=0o700, exist_ok=True)
        dst = folder / (new_name + CHUNK_SUFFIX)
        os.link(src, dst, follow_symlinks=False)
        if self.fsync:
            _fsync_dir(folder)
        st = dst.stat()
        return st.st_size, (st.st_dev, st.st_ino)

    def read_state(self, key: Key, ref: StateRef) -> bytes:
        path = self.session_dir(*key) / (ref.name + CHUNK_SUFFIX)
        if not path.is_file() or path.is_symlink():
            raise FormatError("the session's state file is missing or not a regular file")
        try:
            return path.read_bytes()
        except OSError as exc:
            raise FormatError(f"the session's state file cannot be read ({exc})") from exc

    def manifest(self, key: Key) -> Manifest | None:
        path = self.session_dir(*key) / MANIFEST
        try:
            manifest = Manifest.decode(path.read_bytes(), key[0])
        except (OSError, FormatError):
            return None
        return manifest if manifest.session_id == key[1] else None

    def remove(self, key: Key, keep: set[str] | None = None) -> None:
        if keep is None:
            self.delete_session(*key)
        else:
            self.collect_garbage(key[0], key[1], keep)

    def session_dir(self, fingerprint: str, session_id: str) -> Path:
        path = self.sessions_root / session_dirname(fingerprint, session_id)
        assert path.parent == self.sessions_root, "session folders are hashes directly under sessions/"
        return path

    # -- writing ----------------------------------------------------------------------------------
    def _write_atomic(self, folder: Path, name: str, data: bytes) -> int:
        """temp file -> write -> fsync -> rename -> fsync folder. Nothing is visible unless complete."""
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = folder / f"{TMP_PREFIX}{secrets.token_hex(6)}-{name}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            _write_bytes(fd, data)
            if self.fsync:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
        try:
            os.replace(tmp, folder / name)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        if self.fsync:
            _fsync_dir(folder)
        return len(data)

    def write_file(self, fingerprint: str, session_id: str, name: str, data: bytes) -> int:
        """Writes one file of a session (a chunk or the manifest) atomically; returns its size in bytes."""
        return self._write_atomic(self.session_dir(fingerprint, session_id), name, data)

    def collect_garbage(self, fingerprint: str, session_id: str, keep: set[str]) -> None:
        """Deletes chunk files of a session that no manifest references any more."""
        folder = self.session_dir(fingerprint, session_id)
        for path in folder.glob("*" + CHUNK_SUFFIX):
            if path.name[: -len(CHUNK_SUFFIX)] not in keep and not path.name.startswith(TMP_PREFIX):
                self._remove(path)

    def write(self, key: Key, name: str, data: bytes) -> int:
        return self.write_file(key[0], key[1], name, data)

    def delete(self, key: Key, names) -> None:
        folder = self.session_dir(*key)
        for name in names:
            (folder / name).unlink(missing_ok=True)

    def delete_session(self, fingerprint: str, session_id: str) -> None:
        shutil.rmtree(self.session_dir(fingerprint, session_id), ignore_errors=True)

    # -- reading --------------------------------------------------------------------------------------
    def open_chunk(self, fingerprint: str, session_id: str, name: str, owner: str = "") -> tuple[int, ChunkMeta]:
        """Opens a chunk file of the session's folder and validates its header (written by `owner`, if given:
        a shared prefix's chunk). The caller closes the fd."""
        path = self.session_dir(fingerprint, session_id) / (name + CHUNK_SUFFIX)
        if not path.is_file() or path.is_symlink():
            raise FormatError(f"chunk {name} is missing or not a regular file")
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            return fd, read_chunk_meta(file_reader(fd), os.fstat(fd).st_size, fingerprint, owner or session_id)
        except BaseException:
            os.close(fd)
            raise

    @staticmethod
    def read_ids(fd: int, meta: ChunkMeta) -> torch.Tensor:
        begin, end = meta.offsets["ids"]
        return bytes_to_tensor(read_range(file_reader(fd), begin, end, "ids", meta), torch.int64, [meta.n_tokens])

    def read_layer_into(self, fd: int, meta: ChunkMeta, layer: int, start: int, end: int,
                        keys_out: torch.Tensor, values_out: torch.Tensor, keep: dict | None = None) -> int:
        """Reads tokens ``[start, end)`` of a layer into `keys_out`/`values_out` ``[1, heads, end-start, dim]``,
        verifying the checksums. Returns the bytes read (`keep`: see :meth:`ChunkReader.read_layer_into`).

        A whole lossless chunk is read with one `preadv` straight into the destination (one buffer per head:
        each head's tokens are contiguous both in the file and in a host segment) and hashed in place: no
        intermediate copy. A partial span (after truncation) goes through a temporary buffer, and a lossy
        chunk is dequantized from one.
        """
        nbytes = 0
        for name, out in zip(layer_names(layer), (keys_out, values_out)):
            begin, stop = meta.offsets[name]
            if meta.codec is None and start == 0 and end == meta.kv_tokens:
                views = [memoryview(_numpy(out[0, h])).cast("B") for h in range(out.shape[1])]
                got = os.preadv(fd, views, begin)
                if got != stop - begin:
                    raise FormatError(f"short read of {name}: the file is truncated")
                digest = xxhash.xxh64()
                for view in views:
                    digest.update(view)
                if digest.hexdigest() != meta.checksums[name]:
                    raise FormatError(f"checksum mismatch in {name}")
            else:
                meta.decode_into(name, read_range(file_reader(fd), begin, stop, name, meta), out, start, keep)
            nbytes += stop - begin
        return nbytes

    def read_file(self, key: Key, name: str) -> bytes:
        path = self.session_dir(*key) / name
        if not path.is_file() or path.is_symlink():
            raise FormatError(f"{name} is missing or not a regular file")
        return path.read_bytes()

    # -- reopening --------------------------------------------------------------------------------------
    def scan(self) -> Iterator[ScannedSession]:
        """The valid sessions, oldest first.

        Temporary files, orphan chunks and sessions whose manifest or chunk headers fail validation
        (damaged, truncated, another format, copied from another session's folder) are deleted.

        Each folder is listed once, and a shared prefix's file (one inode under many sessions' names) has its
        header and ids read once per scan, not once per name: with one system prompt shared by every session,
        that is most of the reading.
        """
        found = []
        for folder, item, doomed, error in self.read_folders(self.folders()):
            if error is not None:  # not a damaged folder: kept as it is, and not served
                logger.error("disk tier: reading %s failed (%s); the session is not served", folder.name, error)
            self.remove_paths(doomed)
            if item is not None:
                found.append(item)
        found.sort(key=lambda item: item.mtime)
        yield from found

    def read_folders(self, folders: Iterable[Path], shared: dict | None = None) -> Iterator[tuple]:
        """``(folder, session or None, what to remove, error or None)`` for each folder, in order
        (:meth:`scan_folder`, which changes nothing: the caller removes). `error`: an unexpected failure reading
        that folder (a damaged one is not an error: it is to be removed). `shared`: see :meth:`scan_folder` (one
        is made if not given)."""
        shared = {} if shared is None else shared
        for folder in folders:
            try:
                found, doomed = self.scan_folder(folder, shared)
            except Exception as exc:  # one folder's failure is that folder's: the others are read
                yield folder, None, [], exc
            else:
                yield folder, found, doomed, None

    def folders(self) -> list[Path]:
        """The session folders (anything else under ``sessions/`` is removed), in the order of their inodes.

        A reopen of a large store is bound by the disk, not the CPU: on this project's VM a cold folder costs
        ~1-2 ms (its listing, its manifest's inode and data), half that in inode order, which follows where the
        file system put them (as `du` and git order their reads); threads reading at once were slower there.
        """
        with os.scandir(self.sessions_root) as listing:
            items = [(item.inode(), item.name, item.is_dir(follow_symlinks=False)) for item in listing]
        folders = []
        for _, name, is_dir in sorted(items):
            if is_dir:
                folders.append(self.sessions_root / name)
            else:
                self._remove(self.sessions_root / name)
        return folders

    def scan_folder(self, folder: Path, shared: dict | None = None) -> tuple[ScannedSession | None, list[Path]]:
        """Validates one session's folder (see :meth:`scan`) without changing it: its session (None: the folder is
        damaged) and what to remove (a crash's temporary files, orphan chunks, or the whole damaged folder).
        `shared`: a cache of shared files' headers across the folders of one scan."""
        try:
            names = os.listdir(folder)
        except FileNotFoundError:
            return None, []
        except OSError as exc:
            logger.warning("disk tier: removing unreadable session folder %s (%s)", folder.name, exc)
            return None, [folder]
        # A crash's leftovers (the lock says no other store is writing).
        doomed = [folder / name for name in names if name.startswith(TMP_PREFIX)]
        try:
            manifest, sizes, layout, codecs, inodes, sparse, mstat = self._validate(folder, {} if shared is None
                                                                                    else shared)
        except (OSError, FormatError) as exc:
            logger.warning("disk tier: removing damaged session folder %s (%s)", folder.name, exc)
            return None, [folder]
        for name in names:  # orphan chunks (a crash between a link or a chunk and the manifest naming it)
            if (name.endswith(CHUNK_SUFFIX) and not name.startswith(TMP_PREFIX)
                    and name[: -len(CHUNK_SUFFIX)] not in sizes):
                doomed.append(folder / name)
        return ScannedSession(manifest, sizes, layout, mstat.st_mtime, mstat.st_size, codecs, inodes, sparse), doomed

    def remove_paths(self, paths: list[Path]) -> None:
        """Removes what :meth:`scan_folder` said to (a folder with all it holds)."""
        for path in paths:
            self._remove(path)

    def _validate(self, folder: Path, shared: dict) -> tuple:
        path = folder / MANIFEST
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)  # (a symlink fails: ELOOP, an OSError)
        try:
            mstat = os.fstat(fd)
            if not stat.S_ISREG(mstat.st_mode):
                raise FormatError("no manifest")
            manifest = Manifest.decode(_read_all(fd, mstat.st_size))
        finally:
            os.close(fd)
        if session_dirname(manifest.fingerprint, manifest.session_id) != folder.name:
            raise FormatError("manifest does not belong to this folder")
        sizes, pos, layouts, metas, codecs, inodes, sparse = {}, manifest.head, set(), [], set(), {}, False
        for span in manifest.spans:
            owner = span.owner or manifest.session_id
            try:
                fd = os.open(folder / (span.chunk + CHUNK_SUFFIX), os.O_RDONLY | os.O_NOFOLLOW)
            except OSError as exc:
                raise FormatError(f"chunk {span.chunk} is missing or not a regular file") from exc
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise FormatError(f"chunk {span.chunk} is missing or not a regular file")
                # One inode's header is the same under every name: read once per scan (the key holds what the
                # header is checked against, and what would change were the file rewritten).
                cache_key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, manifest.fingerprint, owner)
                cached = shared.get(cache_key) if st.st_nlink > 1 else None
                if cached is None:
                    meta = read_chunk_meta(file_reader(fd), st.st_size, manifest.fingerprint, owner)
                    cached = (meta, self.read_ids(fd, meta))
                    if st.st_nlink > 1:
                        shared[cache_key] = cached
                meta, chunk_ids = cached
            finally:
                os.close(fd)
            metas.append(meta)
            layouts.add((meta.geometry, meta.dtype))
            codecs.add(meta.accuracy)  # a derived chunk counts as lossy
            sparse |= meta.kept is not None
            if span.end > meta.n_tokens:
                raise FormatError("span beyond the chunk's tokens")
            if not torch.equal(chunk_ids[span.start : span.end], manifest.token_ids[pos : pos + span.length]):
                raise FormatError("chunk ids disagree with the manifest")
            sizes[span.chunk] = (st.st_size, meta.n_tokens)
            if st.st_nlink > 1:  # a shared prefix's chunk (hard links): counted once by the store
                inodes[span.chunk] = (st.st_dev, st.st_ino)
            pos += span.length
        if len(layouts) != 1:
            raise FormatError("chunks of one session disagree on shapes or dtype (or there are none)")
        check_chain(manifest, metas)
        if manifest.state is not None:  # verified when loaded (it is read whole then); here: it is there
            path = folder / (manifest.state.name + CHUNK_SUFFIX)
            if not path.is_file() or path.is_symlink():
                raise FormatError("the manifest's state file is missing")
            sizes[manifest.state.name] = (path.stat().st_size, 0)
        return manifest, sizes, layouts.pop(), frozenset(codecs), inodes, sparse, mstat

    @staticmethod
    def _remove(path: Path) -> None:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
