# The one way a model's chunks cross between the device and the host. Invariants: a stream holds
# one host buffer (pinned when the device is CUDA), reused for every chunk and never larger than
# the largest chunk it carried; a copy out of the model is queued on a side CUDA stream after
# the work queued so far, and the compute stream waits for it before anything queued later (an
# optimizer step, a mix) can write those values, so the training thread never waits for it;
# the thread that wants the bytes waits for the copy alone. On the CPU the same calls copy
# through the buffer with plain copies (the live model is host memory already: callers there
# copy straight into the message and use this only where a device is involved).
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StagingStatistics:
    """What a ChunkStaging did: its buffer's bytes (the host memory it holds), how often it was
    (re)allocated, the chunks it carried each way, and whether it is pinned."""

    nbytes: int
    allocations: int
    to_host: int
    to_device: int
    pinned: bool


def pinnable(device: torch.device) -> bool:
    """Whether host buffers for `device` are pinned: CUDA devices, where CUDA is usable."""
    return device.type == "cuda" and torch.cuda.is_available()


class ChunkStaging:
    """One stream's host buffer for chunks going between `device` and the wire.

    Args:
        device: where the model lives.
        pin: pin the buffer (page-locked: a device copy runs without the host and overlaps
            compute); None: when the device is CUDA and CUDA is usable.

    A chunk is carried under the buffer's lock, so chunks of one stream take turns for it (the
    copy of a chunk takes a fraction of its trip over any network).
    """

    def __init__(self, device: torch.device | str, *, pin: bool | None = None) -> None:
        self.device = torch.device(device)
        self.pinned = pinnable(self.device) if pin is None else pin
        self._buffer: torch.Tensor | None = None  # (nbytes,) uint8 on the host
        self._lock = threading.Lock()
        self._side = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._allocations = self._to_host = self._to_device = 0

    def statistics(self) -> StagingStatistics:
        nbytes = 0 if self._buffer is None else self._buffer.numel()
        return StagingStatistics(nbytes, self._allocations, self._to_host, self._to_device,
                                 self.pinned)  # fmt: skip

    def _host(self, nbytes: int) -> torch.Tensor:
        """The buffer, grown to `nbytes` when smaller (under the lock)."""
        if self._buffer is None or self._buffer.numel() < nbytes:
            self._buffer = None  # (the old one goes back before the new one is made)
            self._buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned)
            self._allocations += 1
        return self._buffer

    @staticmethod
    def _views(buffer: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Flat views of `buffer` with the dtypes and sizes of `like`, one after another (each
        at an offset aligned to 16 bytes)."""
        out, offset = [], 0
        for t in like:
            n = t.numel() * t.element_size()
            out.append(buffer[offset : offset + n].view(t.dtype))
            offset += -(-n // 16) * 16
        return out

    @staticmethod
    def nbytes_of(like: Sequence[torch.Tensor]) -> int:
        return sum(-(-(t.numel() * t.element_size()) // 16) * 16 for t in like)

    @contextlib.contextmanager
    def to_host(self) -> Iterator[HostCopy]:
        """Hold the buffer for one chunk copied out of the model:

            with staging.to_host() as copy:
                trainer.read(lambda live: copy.start([live["w"].reshape(-1)[a:b], ...]))
                for view, value in zip(payload_views, copy.host()): view.copy_(value)

        `start` (inside the model's lock, so the values are one consistent read) queues the
        copies and returns at once; `host()` (outside it) waits for them and gives host views
        of the values, valid until the block ends (the buffer carries the next chunk then).
        """
        with self._lock:
            copy = HostCopy(self)
            try:
                yield copy
            finally:
                copy.finish()  # (the buffer is not handed on while a copy may still write it)
            self._to_host += 1

    def to_device(self, values: Sequence[torch.Tensor],
                  out: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:  # fmt: skip
        """`values` (host tensors) on the device through the buffer: into `out` (device tensors
        of their sizes) when given, else into new ones. The copies are queued on the side
        stream and the compute stream waits for them: what is queued on it after this call
        (a check, a mix) sees the values; the host memory of `values` is free on return."""
        with self._lock:
            views = self._views(self._host(self.nbytes_of(values)), values)
            for view, value in zip(views, values, strict=True):
                view.copy_(value.reshape(-1))
            if out is None:
                out = [torch.empty(v.numel(), dtype=v.dtype, device=self.device) for v in values]
            if self._side is None:
                for target, view in zip(out, views, strict=True):
                    target.reshape(-1).copy_(view)
            else:
                compute = torch.cuda.current_stream(self.device)
                self._side.wait_stream(compute)  # (`out` may be in use by queued work)
                with torch.cuda.stream(self._side):
                    for target, view in zip(out, views, strict=True):
                        target.reshape(-1).copy_(view, non_blocking=True)
                        target.record_stream(self._side)
                    event = torch.cuda.Event()
                    event.record(self._side)
                compute.wait_event(event)
                event.synchronize()  # the buffer carries the next chunk after this
            self._to_device += 1
            return list(out)


class HostCopy:
    """One chunk on its way out of the model through a ChunkStaging's buffer (see to_host)."""

    def __init__(self, staging: ChunkStaging) -> None:
        self._staging = staging
        self._views: list[torch.Tensor] | None = None
        self._event: torch.cuda.Event | None = None

    def start(self, sources: Sequence[torch.Tensor]) -> None:
        """Queue the copies of `sources` (called where they cannot change: the model's lock)."""
        if self._views is not None:
            raise RuntimeError("one start per chunk")
        staging = self._staging
        views = staging._views(staging._host(staging.nbytes_of(sources)), sources)
        side = staging._side
        if side is None:
            for view, src in zip(views, sources, strict=True):
                view.copy_(src.reshape(-1))
        else:
            compute = torch.cuda.current_stream(staging.device)
            side.wait_stream(compute)  # after the writes queued so far
            with torch.cuda.stream(side):
                for view, src in zip(views, sources, strict=True):
                    view.copy_(src.reshape(-1), non_blocking=True)
                self._event = torch.cuda.Event()
                self._event.record(side)
            compute.wait_event(self._event)  # later writes of these values come after it
        self._views = views

    def host(self) -> list[torch.Tensor]:
        """Host views of the values copied (waits for the copies: this thread only)."""
        if self._views is None:
            raise RuntimeError("host() before start()")
        self.finish()
        return self._views

    def finish(self) -> None:
        if self._event is not None:
            self._event.synchronize()
            self._event = None
