"""Collectives through one shared-memory segment, for the ranks of a tensor-parallel group that are
processes (or threads) of one host. A decode step makes two all-reduces of a few KB per layer; gloo
takes 0.4-1.7 ms for one between two processes on loopback (1.2-2.7 ms between three), this
12-15 us (50-70 us between three ranks on two cores), because a rank copies its tensor into the
segment and reads the others' where they lie.

The segment (``Layout``): per rank a 128-byte line of int64 words (step counter, pid, closed flag),
then per parity (0, 1) and per rank one slot of ``slot_bytes``. Every collective is one or more
*steps*; in step ``seq`` a rank

1. copies its values into its slot of parity ``seq % 2``,
2. stores ``seq`` into its counter,
3. waits until every rank's counter is at least ``seq``,
4. reads the slots of parity ``seq % 2`` it needs (all, or ``src``'s).

Double buffering: a rank writes the slot of parity ``seq % 2`` again at step ``seq + 2``, which it
starts only after step ``seq + 1``'s wait, i.e. after every rank stored ``seq + 1``, which each does
only after it finished reading step ``seq``. So no slot is overwritten while a rank still reads it,
and no rank gets more than one step ahead of the slowest.

Memory ordering: the argument above needs (a) a rank's data stores to be visible before its counter
store, and (b) its reads of step ``seq``'s slots to be done before its counter store of ``seq + 1``
(and a reader's data loads not to run ahead of its counter load). x86-64 (TSO) keeps stores in
program order, keeps loads in order, and never moves a store ahead of an earlier load; its stores
are seen in one order by every core. The counter is stored by a memoryview item assignment, one
aligned 8-byte ``mov``, hence atomic; torch's copy kernels use ordinary (not non-temporal) stores,
and an intra-op thread pool joins its threads before the copy returns. Python issues no fence, so
on another architecture (ARM, POWER reorder stores) this module refuses to start and the caller
keeps gloo (``join_shared_memory``).

A segment is a ``memfd`` (``os.memfd_create``), opened by the other ranks as
``/proc/<rank 0's pid>/fd/<fd>``, rather than a file under /dev/shm: it has no name, so it cannot
leak when a rank is SIGKILLed (the kernel frees it with its last mapping), and it does not count
against /dev/shm's size limit (64 MiB in a default Docker container: four ranks' slots, and a
write past that limit is a SIGBUS, not an error).

A rank that waits on a peer checks every ``check_interval_s`` that each late peer's process is
alive (``/proc/<pid>/stat``, a zombie counts as dead: rank 0 is its followers' parent and may not
have reaped one yet) and has not closed, and raises ``RuntimeError`` naming it. all_reduce and
all_gather also give up after ``timeout_s``; broadcast waits without a limit, because followers
wait in it between requests for as long as the server is idle.
"""

from __future__ import annotations

import dataclasses
import logging
import mmap
import os
import platform
import socket
import time
import weakref

import torch

log = logging.getLogger(__name__)

SLOT_BYTES = 8 << 20  # one step of one rank: 512 tokens x 2048 hidden x 4 bytes
LINE_WORDS = 16  # int64 words per rank's header line: 128 bytes, so ranks' counters share no cache line
SEQ, PID, CLOSED = 0, 1, 2  # word of a rank's header line
X86 = ("x86_64", "amd64", "i386", "i686")

# Waiting. A waiter yields its core at once (sched_yield): where ranks outnumber cores (3 on 2
# here) a spinner holds the core the rank it waits for needs. Measured with rank processes on 2
# cores, one all-reduce of [1, 576] float32: 16 us yielding at once, 28 us spinning 20 us first,
# 86 us sleeping at once; 3 ranks: 60-86 us yielding, ~4 ms spinning. Past YIELD_S the peer is
# busy with something long (a prefill; rank 0's idle server) and the waiter sleeps, a nap of
# NAP_SHARE of the time waited so far (oversleeping adds at most that share), at most MAX_NAP_S.
# An idle follower wakes 1 / MAX_NAP_S times a second: with 1 ms naps that cost 3.2% of a core
# here (Python's wake-up, not the wait), with 5 ms under 1%, for at most 5 ms more before the
# first step after an idle spell.
YIELD_S = 2e-3
NAP_SHARE = 0.1
MAX_NAP_S = 5e-3


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where a group's words and slots lie in its segment."""

    size: int
    slot_bytes: int

    @property
    def header_bytes(self) -> int:
        return self.size * LINE_WORDS * 8

    @property
    def total_bytes(self) -> int:
        return self.header_bytes + 2 * self.size * self.slot_bytes

    def word(self, rank: int, field: int) -> int:
        return rank * LINE_WORDS + field


class SharedMemoryCollectives:
    """The ``Collectives`` of one rank, through a segment that rank 0 makes and the others map,
    meeting through ``store`` (a ``torch.distributed.Store`` every rank reaches). Bit for bit the
    same result on every rank: each sums the slots in rank order. A tensor larger than a slot goes
    in slot-sized steps. Not for concurrent use by two threads of one rank (as a process group)."""

    def __init__(self, store, rank: int, size: int, timeout_s: float = 600.0, slot_bytes: int = SLOT_BYTES,
                 check_interval_s: float = 0.1) -> None:
        if platform.machine().lower() not in X86:
            raise RuntimeError(f"shared-memory collectives rely on x86 store ordering; this CPU is "
                               f"{platform.machine()}: use gloo")
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is not in a group of {size}")
        self.rank, self.size = rank, size
        self.timeout_s, self.check_interval_s = timeout_s, check_interval_s
        self.seq = 0
        fd, self.layout = _open_segment(store, rank, Layout(size, slot_bytes))
        self._fd_finalizer = weakref.finalize(self, os.close, fd)  # rank 0's name for the others
        self._mmap = mmap.mmap(fd, self.layout.total_bytes)  # keeps its own dup of fd
        if rank:
            self._fd_finalizer()  # a follower needs no fd once mapped
        self._words = memoryview(self._mmap)[:self.layout.header_bytes].cast("q")
        with torch.inference_mode(False):  # an inference tensor could not be written outside that mode
            data = torch.frombuffer(self._mmap, dtype=torch.uint8, offset=self.layout.header_bytes)
            self._slots = data.view(2, size, self.layout.slot_bytes)  # [parity, rank, byte]
        self._typed: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}
        self._words[self.layout.word(rank, PID)] = os.getpid()
        self._seq_words = [self.layout.word(r, SEQ) for r in range(size)]

    # -- the collectives ------------------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place; returns it. 16-bit floats are summed in float32
        and rounded once (gloo rounds after each addition: the same for two ranks)."""
        work = tensor.contiguous()
        flat = work.view(-1)
        for lo, hi in self._chunks(flat):
            piece = self._piece(flat, lo, hi)
            _sum_in_rank_order(self._exchange(piece, self.timeout_s), out=piece)
        if work.data_ptr() != tensor.data_ptr():
            tensor.copy_(work)
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` [..., N] side by side in rank order: [..., size * N]."""
        flat = tensor.contiguous().view(-1)
        chunks = self._chunks(flat)
        if len(chunks) <= 1:
            gathered = self._exchange(flat, self.timeout_s)  # [size, numel], in the segment
        else:
            gathered = flat.new_empty(self.size, flat.numel())
            for lo, hi in chunks:
                gathered[:, lo:hi] = self._exchange(flat[lo:hi], self.timeout_s)
        return torch.cat(gathered.view(self.size, *tensor.shape).unbind(0), dim=-1)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank ``src``'s ``tensor`` into every rank's ``tensor``, in place. Waits without a time
        limit (a follower idles here), raising only when a rank it waits for is gone."""
        work = tensor.contiguous()
        flat = work.view(-1)
        for lo, hi in self._chunks(flat):
            piece = self._piece(flat, lo, hi)
            slots = self._exchange(piece if self.rank == src else None, None, dtype=flat.dtype, numel=hi - lo)
            if self.rank != src:
                piece.copy_(slots[src])
        if work.data_ptr() != tensor.data_ptr():
            tensor.copy_(work)
        return tensor

    def close(self) -> None:
        """Tell the peers this rank has left (their waits raise), and unmap. Idempotent; a rank
        that never calls it frees nothing less: the segment goes with its last mapping."""
        if self._words is None:
            return
        self._words[self.layout.word(self.rank, CLOSED)] = 1
        self._fd_finalizer()
        self._words.release()
        self._words = self._slots = self._typed = None
        try:
            self._mmap.close()
        except BufferError:  # a tensor still views the segment: unmapped when it is freed
            pass

    # -- one step -------------------------------------------------------------------------------

    def _chunks(self, flat: torch.Tensor) -> list[tuple[int, int]]:
        step, numel = self.layout.slot_bytes // flat.element_size(), flat.numel()
        if numel <= step:
            return [(0, numel)] if numel else []
        return [(lo, min(lo + step, numel)) for lo in range(0, numel, step)]

    @staticmethod
    def _piece(flat: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        return flat if hi - lo == flat.numel() else flat[lo:hi]  # a slice costs a microsecond

    def _exchange(self, mine: torch.Tensor | None, timeout_s: float | None,
                  dtype: torch.dtype | None = None, numel: int | None = None) -> torch.Tensor:
        """One step: publish ``mine`` (this rank's values, or nothing), wait for every rank, and
        return the step's slots [size, numel], valid until this rank's step after next."""
        dtype = mine.dtype if mine is not None else dtype
        numel = mine.numel() if mine is not None else numel
        self.seq += 1
        slots = self._typed_slots(dtype)[self.seq % 2][:, :numel]  # [size, numel]
        if mine is not None:
            slots[self.rank] = mine
        self._words[self._seq_words[self.rank]] = self.seq  # after the data (module docstring)
        if not self._arrived(self.seq):
            self._wait(self.seq, timeout_s)
        return slots

    def _typed_slots(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The slots of each parity as ``dtype``: two [size, slot_bytes / itemsize], made once."""
        if dtype not in self._typed:
            with torch.inference_mode(False):  # views usable in and out of inference mode
                self._typed[dtype] = self._slots.view(dtype).unbind(0)
        return self._typed[dtype]

    def _arrived(self, seq: int) -> bool:
        words = self._words
        for i in self._seq_words:
            if words[i] < seq:
                return False
        return True

    def _wait(self, seq: int, timeout_s: float | None) -> None:
        start = time.monotonic()
        next_check = start + self.check_interval_s
        while not self._arrived(seq):
            now = time.monotonic()
            if now >= next_check:
                self._check_peers(seq, now - start, timeout_s)
                next_check = now + self.check_interval_s
            if now - start < YIELD_S:
                os.sched_yield()  # also lets go of the GIL, for ranks that are threads
            else:
                time.sleep(min(MAX_NAP_S, NAP_SHARE * (now - start)))

    def _check_peers(self, seq: int, waited_s: float, timeout_s: float | None) -> None:
        """Raise when a rank that has not reached step ``seq`` is gone, closed, or too late."""
        words, layout = self._words, self.layout
        late = [r for r in range(self.size) if words[layout.word(r, SEQ)] < seq]
        for r in late:
            pid = words[layout.word(r, PID)]
            if words[layout.word(r, CLOSED)]:
                raise RuntimeError(f"rank {r} (pid {pid}) closed its collectives while rank {self.rank} "
                                   f"waited {waited_s:.1f} s for it at step {seq}")
            if pid and not is_alive(pid):
                raise RuntimeError(f"rank {r} (pid {pid}) is gone: rank {self.rank} waited {waited_s:.1f} s "
                                   f"for it at step {seq}")
        if timeout_s is not None and waited_s > timeout_s:
            steps = [words[layout.word(r, SEQ)] for r in late]
            raise RuntimeError(f"rank {self.rank} timed out after {timeout_s:.0f} s at step {seq}: ranks {late} "
                               f"are at steps {steps}")


def _sum_in_rank_order(slots: torch.Tensor, out: torch.Tensor) -> None:
    """out = slots[0] + slots[1] + ... in this order, the same bits on every rank; slots [size, n]."""
    if slots.shape[0] == 1:
        out.copy_(slots[0])
    elif out.dtype in (torch.bfloat16, torch.float16):
        acc = slots[0].float()
        for part in slots[1:]:
            acc += part
        out.copy_(acc)
    else:
        torch.add(slots[0], slots[1], out=out)
        for part in slots[2:]:
            out += part


def _open_segment(store, rank: int, layout: Layout) -> tuple[int, Layout]:
    """Rank 0 makes the segment and publishes where it is; the others open it. Returns the fd and
    rank 0's layout (its slot size rules)."""
    if rank == 0:
        try:
            fd = os.memfd_create("tandem-tp-collectives", os.MFD_CLOEXEC)
            os.ftruncate(fd, layout.total_bytes)
        except OSError:
            store.set("segment", "")  # the others stop waiting, and fail too
            raise
        store.set("segment", f"/proc/{os.getpid()}/fd/{fd} {layout.slot_bytes}")
        return fd, layout
    where = store.get("segment").decode()
    if not where:
        raise RuntimeError("rank 0 could not make the shared-memory segment")
    path, slot_bytes = where.split()
    return os.open(path, os.O_RDWR | os.O_CLOEXEC), Layout(layout.size, int(slot_bytes))


def is_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie does not: it is dead, only not yet reaped)."""
    if pid == os.getpid():
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return False
    except OSError:  # no /proc to read: at least whether the pid exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True
    state = stat[stat.rindex(b")") + 2:][:1]  # the field after "(comm)", which may hold spaces
    return state not in (b"Z", b"X")


def host_id() -> str:
    """This host, as ranks compare it: hostname and boot id (two containers may share a name)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def join_shared_memory(store, rank: int, size: int, timeout_s: float = 600.0) -> SharedMemoryCollectives | None:
    """Shared-memory collectives for this rank, or None on every rank alike when the ranks are not
    all on this host, the CPU is not x86, or a rank could not map the segment (then: gloo). A
    collective call: every rank of the group makes it, with a store of its own (keys ``host*``,
    ``segment``, ``mapped*``)."""
    store.set(f"host{rank}", host_id())
    hosts = [store.get(f"host{r}").decode() for r in range(size)]
    if len(set(hosts)) > 1:
        log.info("tensor-parallel ranks on %d hosts: no shared memory", len(set(hosts)))
        return None
    if platform.machine().lower() not in X86:
        log.info("no shared-memory collectives on a %s CPU (they rely on x86 store order)", platform.machine())
        return None
    try:
        shm = SharedMemoryCollectives(store, rank, size, timeout_s)
    except (OSError, RuntimeError) as exc:
        log.warning("rank %d could not map the shared-memory segment: %s", rank, exc)
        shm = None
    store.set(f"mapped{rank}", "1" if shm else "0")
    if all(store.get(f"mapped{r}") == b"1" for r in range(size)):
        return shm
    if shm is not None:
        shm.close()
    return None
