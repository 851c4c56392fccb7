"""A query-aware layer's history kept in host memory: the device holds what every step reads, a step moves the rest
of what it selected (`SparseConfig(history_on_host=True)`, ShadowKV's and InfiniGen's offloading, on Quest and SparQ).

Tensors are ``[1, kv_heads, tokens, head_dim]`` on the device and ``[kv_heads, tokens, head_dim]`` on the host.

A :class:`HostHistory` keeps every token of one layer in host memory (pinned when the layer runs on CUDA, so that a
copy to the device can be asynchronous), and in a device :class:`Window` the sinks, the recent window and the tokens
after it. Quest keeps its page summaries on the device (query_aware.PageSummaries); SparQ's sketch reads any
`sketch_dims` of the keys' components, chosen per query, so all its keys stay on the device and only values live on
the host alone. A decoding step selects on the device, then :meth:`HostHistory.step` gathers the selected tokens'
rows in host memory (``torch.gather`` into a pinned staging buffer) and copies them to a device buffer that every
layer of the turn reuses (:class:`GatherBuffers`), between the sinks and the recent window: the keys and values the
step attends to are those, in the order a device-resident history gives (same selection, same attention). A forward
of several tokens (a prompt) attends to the whole history, copied from the host for that forward alone
(:meth:`HostHistory.whole`); the issue's measure is per decoding step.

On CUDA a decoding step waits for the GPU once per layer: the chosen positions go to the CPU, which gathers (a kernel
that gathers from pinned memory itself, as ShadowKV's do, is not built here); the copy of the gathered rows to the
device is asynchronous, from pinned staging rows that the next layer's gather waits to reuse. A new token's rows go
to the host as the layer appends them (strided per head in host memory, a copy PyTorch makes synchronously).

Example:
    >>> history = HostHistory(sinks=2, keys_on_device=False, buffers=GatherBuffers())
    >>> kv = torch.arange(10.0).view(1, 1, 10, 1)  # 10 tokens, one KV head, head_dim 1
    >>> history.keep_from(7)  # the next step reads its recent window from position 7
    >>> history.append(kv, kv)
    >>> history.values.window.view()[0, 0, :, 0].tolist()  # on the device: the 2 sinks and positions 7..9
    [0.0, 1.0, 7.0, 8.0, 9.0]
    >>> keys, values = history.step(sinks=2, chosen=torch.tensor([[3, 5]]), recent=2, history=9)
    >>> values[0, 0, :, 0].tolist(), history.step_bytes  # 2 sinks, 2 moved from the host, recent 7..8, new 9
    ([0.0, 1.0, 3.0, 5.0, 7.0, 8.0, 9.0], 16)
"""

from __future__ import annotations

import torch


def _grown(buffer: torch.Tensor | None, needed: int, dim: int, make) -> torch.Tensor:
    """`buffer` if it holds `needed` along `dim`, else a larger one (by an eighth, at least 64 more) with its rows."""
    have = 0 if buffer is None else buffer.shape[dim]
    if needed <= have:
        return buffer
    bigger = make(max(needed, have + max(64, have // 8)))
    if have:
        bigger.narrow(dim, 0, have).copy_(buffer)
    return bigger


class Window:
    """One tensor's device rows: positions ``[0, min(sinks, start))`` then ``[start, total)``, in one buffer.

    Example:
        >>> window = Window(sinks=1)
        >>> window.append(torch.arange(6.0).view(1, 1, 6, 1))
        >>> _ = window.keep_from(4, host=None)  # drop positions 1..3: the sink 0, then 4, 5
        >>> window.view()[0, 0, :, 0].tolist(), window.index(5)
        ([0.0, 4.0, 5.0], 2)
    """

    def __init__(self, sinks: int):
        self.sinks, self.start, self.total = sinks, 0, 0
        self.buf: torch.Tensor | None = None  # [1, kv_heads, capacity, d]

    @property
    def head(self) -> int:
        return min(self.sinks, self.start)

    @property
    def length(self) -> int:
        return min(self.head, self.total) + max(0, self.total - self.start)

    def index(self, position: int) -> int:
        """Where a resident `position` is in the buffer."""
        return position if position < self.head else self.head + position - self.start

    def view(self) -> torch.Tensor:
        """The resident rows, ``[1, kv_heads, length, d]`` (a view of the buffer)."""
        return self.buf[:, :, : self.length]

    @property
    def nbytes(self) -> int:
        """Bytes of the resident rows."""
        return 0 if self.buf is None else self.view().nbytes

    def append(self, x: torch.Tensor) -> None:
        """Positions ``[total, total + n)`` (`x`, ``[1, kv_heads, n, d]``): their resident rows are kept."""
        lo, n = self.total, x.shape[2]
        parts = []
        if lo < self.head:
            parts.append(x[:, :, : self.head - lo])
        if max(lo, self.start) < lo + n:
            parts.append(x[:, :, max(lo, self.start) - lo :])
        at = self.length
        rows = sum(part.shape[2] for part in parts)
        self.buf = _grown(self.buf, at + rows, 2, lambda c: x.new_empty(x.shape[0], x.shape[1], c, x.shape[3]))
        for part in parts:
            self.buf[:, :, at : at + part.shape[2]] = part
            at += part.shape[2]
        self.total = lo + n

    def keep_from(self, start: int, host: "HostRows | None") -> int:
        """Keeps the sinks and ``[start, total)``; returns the bytes copied from `host` (a window that must reach
        further back than it holds gets those rows back from there)."""
        assert start >= 0, "a window starts inside the session"
        if self.buf is None or self.total == 0:
            self.start = start
            return 0
        start = min(start, self.total)
        if start >= self.start:
            head, src = min(self.sinks, start), self.index(start) if start < self.total else self.length
            count = self.total - start
            # Overlapping ranges of one buffer: copy the kept rows out first.
            self.buf[:, :, head : head + count] = self.buf[:, :, src : src + count].clone()
            self.start = start
            return 0
        assert host is not None, "a window without a host copy never moves back"
        old, kept_head = self.start, self.head
        lo = max(start, kept_head)
        back = host.rows[:, lo:old].to(self.buf.device, non_blocking=True)[None]
        tail = self.buf[:, :, kept_head : self.length]
        self.buf = torch.cat([self.buf[:, :, :kept_head], back, tail], dim=2)
        self.start = start
        return back.nbytes


class HostRows:
    """One tensor's rows of every position in host memory, ``[kv_heads, capacity, d]`` (pinned for CUDA).

    Example:
        >>> rows = HostRows()
        >>> rows.append(torch.ones(1, 2, 3, 4))
        >>> rows.rows.shape[0], rows.total
        (2, 3)
    """

    def __init__(self):
        self.rows: torch.Tensor | None = None
        self.total = 0

    def append(self, x: torch.Tensor) -> None:
        n, pin = x.shape[2], x.device.type == "cuda"

        def make(capacity: int) -> torch.Tensor:
            return torch.empty(x.shape[1], capacity, x.shape[3], dtype=x.dtype, pin_memory=pin)

        if self.rows is not None and self.total + n > self.rows.shape[1] and pin:
            torch.cuda.current_stream(x.device).synchronize()  # pending copies into the old buffer land first
        self.rows = _grown(self.rows, self.total + n, 1, make)
        # From the GPU into pinned memory, ordered before every later copy back on this stream; reads on the CPU wait
        # for it (HostHistory.host_ready; the strided destination makes PyTorch copy synchronously anyway).
        self.rows[:, self.total : self.total + n].copy_(x[0], non_blocking=pin)
        self.total += n

    @property
    def nbytes(self) -> int:
        return 0 if self.rows is None else self.rows[:, : self.total].nbytes


class GatherBuffers:
    """The device buffer a decoding step's keys and values are gathered into, and the host staging rows, shared by
    a turn's layers: layers run one after the other, and on CUDA each layer's copies and attention are ordered on
    one stream, so one layer's buffers are free when the next one fills them.

    Example:
        >>> buffers = GatherBuffers()
        >>> buffers.out("k", (1, 2, 5, 4), torch.float32, torch.device("cpu")).is_contiguous()
        True
    """

    def __init__(self):
        self._flat: dict[str, torch.Tensor] = {}
        self._copied: "torch.cuda.Event | None" = None

    def _get(self, name: str, shape: tuple, dtype, device, pin: bool = False) -> torch.Tensor:
        count = 1
        for size in shape:
            count *= size
        old = self._flat.get(name)
        if old is None or old.numel() < count or old.dtype != dtype or old.device != device:
            extra = count // 8  # a step selects one token more every few steps: grow ahead
            self._flat[name] = torch.empty(count + extra, dtype=dtype, device=device, pin_memory=pin)
        return self._flat[name][:count].view(shape)

    def out(self, name: str, shape: tuple, dtype, device) -> torch.Tensor:
        """A contiguous device tensor of `shape`, reused by the next call of the same name."""
        return self._get("out." + name, shape, dtype, device)

    def staging(self, name: str, shape: tuple, dtype, pin: bool) -> torch.Tensor:
        """A contiguous host tensor of `shape` (pinned if `pin`), free to write: the last copy from it has landed."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
        return self._get("staging." + name, shape, dtype, torch.device("cpu"), pin)

    def copied(self, device: torch.device) -> None:
        """The staging buffers were just copied from, asynchronously (CUDA): the next writer waits for that."""
        if device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record(torch.cuda.current_stream(device))

    @property
    def device_nbytes(self) -> int:
        """Bytes of the device buffers (one layer's selection, all layers share them)."""
        return sum(t.nbytes for name, t in self._flat.items() if name.startswith("out."))


class _Part:
    """One of keys or values: its device window and, unless it stays whole on the device, its host rows."""

    def __init__(self, sinks: int, on_host: bool):
        self.window = Window(sinks)
        self.host = HostRows() if on_host else None


class HostHistory:
    """One layer's history in host memory and what of it the device holds (module docstring).

    Args:
        sinks: Leading tokens the device always holds (the config's `sink_tokens`).
        keys_on_device: Keep every key on the device (SparQ's sketch reads them); only values then move.
        buffers: The turn's shared :class:`GatherBuffers`.

    Attributes:
        total: Tokens of the session so far (this forward's included).
        step_bytes: Bytes decoding steps copied from the host: the selected rows not on the device.
        steps: Decoding steps that gathered.
        refill_bytes: Bytes a window got back from the host (a recent window that reaches further back than the
            last one did: Quest's, when its pages' split changes).
        whole_bytes: Bytes copied from the host for forwards that attended to the whole history (prompts).

    Example:
        >>> history = HostHistory(sinks=1, keys_on_device=True, buffers=GatherBuffers())
        >>> history.keep_from(3)
        >>> history.append(torch.ones(1, 1, 5, 2), torch.ones(1, 1, 5, 2))
        >>> history.keys.window.length, history.values.window.length  # SparQ: all keys, sink and 3..4 of values
        (5, 3)
    """

    def __init__(self, sinks: int, keys_on_device: bool, buffers: GatherBuffers):
        self.keys, self.values = _Part(sinks, not keys_on_device), _Part(sinks, True)
        self.buffers = buffers
        self.total = 0
        self.step_bytes = self.steps = self.whole_bytes = self.refill_bytes = 0
        self._written: "torch.cuda.Event | None" = None

    @property
    def _parts(self) -> tuple[_Part, ...]:
        return (self.keys, self.values)

    def keep_from(self, start: int) -> None:
        """The next forward reads the device's rows from `start` on (and the sinks): drops those before it, or gets
        back from the host those it needs and no longer holds."""
        for part in self._parts:
            if part.host is not None:
                self.refill_bytes += part.window.keep_from(start, part.host)

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """This forward's tokens (``[1, kv_heads, n, d]`` each, on the device): to the host and the windows."""
        for part, x in zip(self._parts, (keys, values)):
            part.window.append(x)
            if part.host is not None:
                part.host.append(x)
        self.total += keys.shape[2]
        if keys.device.type == "cuda":
            self._written = torch.cuda.Event()
            self._written.record(torch.cuda.current_stream(keys.device))

    def host_ready(self) -> None:
        """Waits until the host rows hold every appended token (their copies from the GPU are asynchronous)."""
        if self._written is not None:
            self._written.synchronize()
            self._written = None

    def host_keys(self) -> torch.Tensor:
        """Every key, ``[1, kv_heads, total, d]``: host rows (Quest summarizes its pages from them), or the device's."""
        if self.keys.host is None:
            return self.keys.window.view()
        self.host_ready()
        return self.keys.host.rows[None, :, : self.total]

    def resident(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values the device holds (views): what the layer hands a decoding step's attention."""
        return self.keys.window.view(), self.values.window.view()

    @property
    def device_nbytes(self) -> int:
        """Bytes of KV this layer holds on the device (page summaries and the shared buffers not included)."""
        return self.keys.window.nbytes + self.values.window.nbytes

    @property
    def host_nbytes(self) -> int:
        """Bytes of KV this layer holds in host memory."""
        return sum(part.host.nbytes for part in self._parts if part.host is not None)

    def whole(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every token's keys and values on the device: `keys`/`values` if they are already whole, else copied
        from the host for this forward alone (counted in `whole_bytes`)."""
        out = []
        for part, x in zip(self._parts, (keys, values)):
            if x.shape[2] == self.total:
                out.append(x)
            elif part.host is None or part.window.length == self.total:
                out.append(part.window.view())
            else:
                rows = part.host.rows[None, :, : self.total].to(x.device, non_blocking=True)
                self.whole_bytes += rows.nbytes
                out.append(rows)
        return out[0], out[1]

    def step(self, sinks: int, chosen: torch.Tensor, recent: int, history: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A decoding step's keys and values, ``[1, kv_heads, sinks + m + recent + 1, d]``: the first `sinks`, the
        `chosen` positions (``[kv_heads, m]`` ascending, between the sinks and the recent window), the `recent` ones
        before position `history`, and the new token, in that order. The chosen rows not on the device come from
        the host: one gather per head in host memory, one copy to the device."""
        kv_heads, m = chosen.shape
        begin = history - recent
        index, outs = None, []
        for name, part in zip(("k", "v"), self._parts):
            window = part.window
            # The sinks are the head's rows, or the window is whole from position 0.
            assert window.start <= begin and (sinks <= window.head or window.start <= window.head), \
                "the device holds the step's sinks and recent rows"
            buf = window.buf
            out = self.buffers.out(name, (1, kv_heads, sinks + m + self.total - begin, buf.shape[3]), buf.dtype,
                                   buf.device)
            out[:, :, :sinks] = buf[:, :, :sinks]
            out[:, :, sinks + m :] = buf[:, :, window.index(begin) : window.length]
            outs.append(out)
            if part.host is None:  # the whole tensor is on the device: gathered there
                at = chosen[None, :, :, None].expand(-1, -1, -1, buf.shape[3])
                out[:, :, sinks : sinks + m] = buf[:, :, : self.total].gather(2, at)
                continue
            if index is None:
                index = chosen.cpu()  # on CUDA this waits for the selection
                self.host_ready()
            rows = part.host.rows
            staged = self.buffers.staging(name, (kv_heads, m, rows.shape[2]), rows.dtype, rows.is_pinned())
            torch.gather(rows[:, :history], 1, index[:, :, None].expand(-1, -1, rows.shape[2]), out=staged)
            out[0, :, sinks : sinks + m].copy_(staged, non_blocking=True)
            self.step_bytes += staged.nbytes
        self.buffers.copied(self.values.window.buf.device)
        self.steps += 1
        return outs[0], outs[1]
