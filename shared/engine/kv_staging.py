"""A staging buffer that the ranks of one pipeline stage share, for KV sent to a worker whose ranks
each hold more KV heads than one of ours (a prefill at TP=3 writing into a decode at TP=1).

Such a target rank's block holds every head side by side, so the stage's heads must meet before
they are written (``shared.transfer.relayout``). Where the stage's ranks are processes of one host
on the CPU, they meet here: each rank copies its own heads of the transfer's blocks into one
buffer laid out as the target's blocks, ``[n, layers, 2, bs, every KV head, D]``; once every rank
has (one barrier), each writes its share of the layers over NIXL straight from the buffer, which
every rank registered with its agent. Each byte is copied once, by the rank that holds it; the
other way, an all-gather per writing rank, copies it into the collectives' segment, out again,
into a whole-block tensor and into a staging slab.

The buffer is a ``memfd`` that the stage's first rank makes and the others open through
``/proc/<pid>/fd/<fd>`` (as ``shared.model.shm_collectives``'s segment: nameless, freed with its
last mapping, so a SIGKILLed rank leaks nothing). It is kept between transfers and made anew,
larger, when a transfer needs more; every rank decides that from the same numbers, so the stage's
collectives stay in step. Stages on CUDA, or ranks that do not share memory, gather over their
collectives instead (``gather_heads``).
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import weakref

import torch

log = logging.getLogger(__name__)

_PATH_BYTES = 128


class SharedStaging:
    """One rank's mapping of its stage's staging buffer, and its registrations with the agents that
    write from it. Made by every rank of ``group`` at once (``make``)."""

    def __init__(self, mapping: mmap.mmap, num_bytes: int) -> None:
        self._mmap, self.num_bytes = mapping, num_bytes
        with torch.inference_mode(False):  # an inference tensor could not be written outside that mode
            self.buffer = torch.frombuffer(mapping, dtype=torch.uint8, count=num_bytes)
        self._registrations: dict[int, tuple[weakref.ref, object]] = {}

    @classmethod
    def make(cls, group, num_bytes: int) -> "SharedStaging | None":
        """Every rank of ``group`` (``Collectives``) calls this together; returns this rank's
        mapping, or None on every rank when any rank could not make or open it."""
        fd, path = -1, torch.zeros(_PATH_BYTES, dtype=torch.uint8)
        error = None
        if group.rank == 0:
            try:
                fd = os.memfd_create("tandem-kv-staging", os.MFD_CLOEXEC)
                os.ftruncate(fd, num_bytes)
                where = f"/proc/{os.getpid()}/fd/{fd}".encode()
                path[:len(where)] = torch.frombuffer(bytearray(where), dtype=torch.uint8)
            except OSError as exc:
                error = exc
        group.broadcast(path, 0)
        mapping = None
        if error is None:
            try:
                if group.rank != 0:
                    where = bytes(path[path != 0].tolist()).decode()
                    if not where:
                        raise OSError("the stage's first rank made no staging buffer")
                    fd = os.open(where, os.O_RDWR | os.O_CLOEXEC)
                mapping = mmap.mmap(fd, num_bytes)
            except OSError as exc:
                error = exc
        failed = group.all_reduce(torch.tensor([0.0 if error is None else 1.0]))  # every rank has mapped it
        if fd >= 0:
            os.close(fd)
        if failed.item():
            if error is not None:
                log.warning("rank %d: no shared KV staging (%s): the stage gathers over its collectives",
                            group.rank, error)
            if mapping is not None:
                mapping.close()
            return None
        return cls(mapping, num_bytes)

    def blocks(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The buffer's first bytes as a tensor of ``shape``."""
        return self.buffer[:math.prod(shape) * dtype.itemsize].view(dtype).view(shape)

    def registered_with(self, transfer) -> bool:
        """Whether ``transfer`` (this rank's ``NixlTransfer``) can write from the buffer:
        registered with it on first use. False where registering failed."""
        if transfer is None:
            return False
        known = self._registrations.get(id(transfer))
        if known is not None and known[0]() is transfer:
            return True
        try:
            registration = transfer.register(self.buffer)
        except Exception as exc:  # noqa: BLE001 - the writer copies into a slab of its own instead
            log.warning("cannot register the shared KV staging with this rank's agent: %s", exc)
            return False
        self._registrations[id(transfer)] = (weakref.ref(transfer), registration)
        return True

    def close(self) -> None:
        """Deregister from the agents still open, and unmap (once no tensor views the buffer)."""
        for ref, registration in self._registrations.values():
            transfer = ref()
            if transfer is not None:
                try:
                    transfer.deregister(registration)
                except Exception as exc:  # noqa: BLE001 - a closed agent let go of it already
                    log.debug("deregistering the shared KV staging: %s", exc)
        self._registrations.clear()
        self.buffer = None
        try:
            self._mmap.close()
        except BufferError:  # a tensor still views the buffer: unmapped when it is freed
            pass


_stagings: "weakref.WeakKeyDictionary[object, SharedStaging]" = weakref.WeakKeyDictionary()


def stage_staging(group, num_bytes: int) -> SharedStaging | None:
    """This rank's stage's staging of at least ``num_bytes`` (every rank of ``group`` calls it with
    the same ``num_bytes``): the one it has, or a larger one made now (rounded up to 16 MiB).
    None where the group does not share memory (``group.shm``: CPU ranks of one host) or a rank
    could not make it."""
    if getattr(group, "shm", None) is None:
        return None
    current = _stagings.get(group)
    if current is not None and current.num_bytes >= num_bytes:
        return current
    if current is not None:
        current.close()
        del _stagings[group]
    staging = SharedStaging.make(group, -(-num_bytes // (16 << 20)) * (16 << 20))
    if staging is not None:
        _stagings[group] = staging
    return staging
