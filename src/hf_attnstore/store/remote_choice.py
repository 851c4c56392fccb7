"""The choice between a local copy of a session and a longer copy in the shared remote tier (another server
extended the session): which copy a lookup uses, the checks a remote copy passes before it may replace a local
one, and putting the local copy back when the remote one fails to load. Last writer wins, as for the remote tier
itself; a local durable copy is never deleted for a remote copy that has not loaded.
"""

from __future__ import annotations



from .codec import serves
from .config import StoreConfig
from .format import FormatError, Manifest, check_chain
from .index import Entry, Key, StoreState, remote_signature
from .loader import LoadJob
from .tiers.redis import RemoteTier, RemoteUnavailableError


class RemoteChoice:
    """Decides, for `AttnStore`, between the local and the remote copy of a session (see the module docstring).

    Args:
        state: The store's state, changed only through its methods.
        remote: The remote tier, or None (then every lookup uses the local copy).
        config: The store's configuration (its codec, `sparse_copies`).
        local_disk: Whether the store has a disk tier: a local durable copy the remote one may replace.
        durable: Whether the remote tier is the tier below host memory (no disk tier): a remote copy is then the
            session's durable copy, as a disk copy would be.

    Example:
        >>> state = StoreState(StoreConfig(host_bytes="1MiB"), has_disk=False, has_lower=False)
        >>> choice = RemoteChoice(state, None, state.config, local_disk=False, durable=False)
        >>> choice.find(("model-a", "chat-1")) is None  # no remote tier: nothing found there
        True
    """

    def __init__(self, state: StoreState, remote: RemoteTier | None, config: StoreConfig, local_disk: bool,
                 durable: bool):
        self.state, self.remote, self.config = state, remote, config
        self.local_disk, self.durable = local_disk, durable

    def find(self, key: Key) -> tuple[Manifest, tuple, bool] | None:
        """The remote tier's manifest of the session, its layout and whether it may replace a local copy, or
        None: absent, not longer than the local copy, or not servable here (a remote miss; a failure of the
        tier or of its data is counted). Called without the lock.

        With no local copy, only the first chunk's header is read (for the layout and codec): the load checks
        the rest, and a failure is only a miss. With a local copy, which the remote one would replace, every
        chunk's header is checked first (this session's, this model's, the local layout, a codec this store
        serves, chained as the manifest pins): a copy refused here, or whose load fails later, is remembered
        (`Entry.refused`) and not tried again until the remote copy changes."""
        remote = self.remote
        if remote is None or self.state.closed or not remote.available():
            return None
        local = None
        try:
            manifest = remote.manifest(key)
            if manifest is None:
                return None
            with self.state.lock:  # the common case, a local copy at least as long, needs no more round trips
                self.state.apply_ended_turns()
                local = self.state.entries.get(key)
                if local is not None and (local.length >= manifest.length or local.refused == remote_signature(manifest)
                                          or local.pins or local.writers or local.loading is not None):
                    return None  # (a local copy in use is not replaced: see `adopt`)
            if not manifest.spans:
                return None  # nothing stored but a dropped head: nothing to reuse
            if local is None:
                with remote.get(key, manifest.spans[0].chunk, manifest.spans[0].owner) as chunk:
                    if not serves(self.config.codec, chunk.meta.accuracy) or \
                            (chunk.meta.kept is not None and not self.config.sparse_copies):
                        return None  # written by a store with a less accurate codec: a miss (the load checks all)
                    return manifest, (chunk.meta.geometry, chunk.meta.dtype), False
            if not self.verify(remote, key, manifest, local.layout):
                self.refuse(local, manifest)
                return None
            return manifest, local.layout, True
        except (RemoteUnavailableError, FormatError) as exc:
            if isinstance(exc, FormatError) and local is not None:
                self.refuse(local, manifest)  # damaged or foreign data: a miss until it changes
            with self.state.lock:
                self.state.count(remote_errors=1)
            self.state.once.warning("remote_lookup", "remote tier: a lookup failed (%s); served as a miss", exc)
            return None

    def verify(self, remote: RemoteTier, key: Key, manifest: Manifest, layout: tuple) -> bool:
        """Whether a remote copy may replace the local one: False when it holds chunks of a codec this store does
        not serve. Reads every chunk's header (no KV); the load verifies the ids and checksums again.

        Raises:
            FormatError: A chunk is missing, damaged, of another model or session, of another layout, or not the
                one the manifest pinned (the chain).
            RemoteUnavailableError: The tier failed.
        """
        metas, seen = [], {}
        for span in manifest.spans:
            meta = seen.get(span.chunk)
            if meta is None:
                with remote.get(key, span.chunk, span.owner) as chunk:  # checks the header against `key`
                    meta = seen[span.chunk] = chunk.meta
            if not serves(self.config.codec, meta.accuracy) or (meta.kept is not None and not self.config.sparse_copies):
                return False  # (a derived chunk counts as lossy; a sparse one is served where asked for)
            if (meta.geometry, meta.dtype) != layout:
                raise FormatError("the remote copy's shapes or dtype differ from the local copy's")
            if span.end > meta.n_tokens:
                raise FormatError("span beyond the chunk's tokens")
            metas.append(meta)
        check_chain(manifest, metas)
        return True

    def refuse(self, local: Entry, manifest: Manifest) -> None:
        """The remote copy `manifest` is not to replace `local` until it changes (lock taken here)."""
        with self.state.lock:
            if self.state.entries.get(local.key) is local:
                self.state.refuse_remote(local, remote_signature(manifest))

    def adopt(self, key: Key, found: tuple[Manifest, tuple, bool] | None) -> Entry | None:
        """The entry a lookup uses (lock held): the local one, unless the remote copy is longer, was verified
        to replace it (`find`), and the local one is idle (nothing reads or writes it). Last writer
        wins, as for the remote tier itself.

        A local durable copy is never deleted here: the remote entry takes over its files (the session's
        folder, whose manifest stays valid until the remote copy, once loaded, is written over it) and keeps
        it as its `fallback`, put back in the index if the remote copy fails to load (`restore_local`)."""
        e = self.state.entries.get(key)
        if found is None:
            return e
        manifest, layout, verified = found
        self.state.apply_ended_turns()
        if e is not None and (e.length >= manifest.length or e.pins or e.writers or e.loading is not None
                              or not verified or e.refused == remote_signature(manifest)):
            return e
        return self.state.adopt_remote(e, Entry(key=key, layout=layout), manifest, local_disk=self.local_disk,
                                       durable=self.durable)

    def restore_local(self, e: Entry, refuse: Manifest | None = None) -> bool:
        """Puts back the local copy that the remote entry `e` was to replace (lock held), if it has one and is
        still indexed: its load failed or cannot start. Returns whether it did. With `refuse`, that remote copy
        is not tried again until it changes."""
        return self.state.restore_local(e, remote_signature(refuse) if refuse is not None else None)

    def loaded(self, job: LoadJob, error: BaseException | None) -> bool:
        """A load ended (lock held): a remote copy that was to replace a local one replaces it once loaded; if it
        failed, the local copy is put back. Returns whether it was."""
        e = job.entry
        if error is None:
            self.state.forget_fallback(e)  # it replaces the local copy (written over it behind the turn)
            return False
        if self.restore_local(e, refuse=None if isinstance(error, RemoteUnavailableError) else job.manifest):
            self.state.once.warning("remote_restore", "remote tier: session %r could not be loaded from it (%s); "
                                    "the local copy is kept and served", e.key[1], error)
            return True
        return False
