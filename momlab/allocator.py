"""PyTorch's CUDA caching allocator, replayed: what a step's allocations *reserve*, not only what they hold.

A GPU runs out of memory when the caching allocator cannot reserve a new
segment, not when the live tensors exceed the card: freed blocks stay cached
in their segments, a segment is returned to the driver only when it is wholly
free, and a request fits only a free block at least its size. So a step whose
live bytes fit can still fail, by the allocator's fragmentation (reserved
beyond allocated). `replay` runs a step's allocation and free events, in
order, through the allocator's rules as c10/cuda/CUDACachingAllocator.cpp
states them for the default configuration (no ``PYTORCH_CUDA_ALLOC_CONF``):

- a request is rounded up to 512 bytes (``kMinBlockSize``); requests up to
  1 MiB (``kSmallSize``) use the small pool, larger ones the large pool;
- a request takes the smallest cached free block of its pool that is at
  least its size (best fit; ties: the lower segment, then address);
- a block is split when the rest is at least 512 bytes (small pool) or more
  than 1 MiB (large pool); the rest stays cached as a free block;
- with no fitting block a segment is reserved from the driver: 2 MiB
  (``kSmallBuffer``) for the small pool, 20 MiB (``kLargeBuffer``) for a
  request under 10 MiB (``kMinLargeAlloc``), else the request rounded up to
  2 MiB (``kRoundLarge``);
- a freed block merges with free neighbours in its segment;
- when a segment would exceed the capacity, every wholly free cached segment
  is released (``release_cached_blocks``) and the reservation retried once;
  failing that, the request is an out-of-memory.

One stream, no expandable segments, no ``max_split_size_mb``, no CUDA-graph
pools. The events come from `momlab.estimate`'s traced steps (fake tensors:
every storage's allocation and free, in order); checking this model against
``torch.cuda.max_memory_reserved`` on a GPU is one of ``make gpu-check``'s
invariants.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass

MIN_BLOCK = 512  # kMinBlockSize: every request rounds up to a multiple
SMALL_SIZE = 1 << 20  # kSmallSize: requests up to this use the small pool
SMALL_BUFFER = 2 << 20  # kSmallBuffer: a small-pool segment
LARGE_BUFFER = 20 << 20  # kLargeBuffer: a large-pool segment for requests under MIN_LARGE_ALLOC
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc
ROUND_LARGE = 2 << 20  # kRoundLarge: larger requests get a segment of their size rounded up to this

FREE = -1  # the size of a free event in an event list


class _Block:
    __slots__ = ("segment", "offset", "size", "free", "prev", "next", "small")

    def __init__(self, segment: int, offset: int, size: int, small: bool):
        self.segment, self.offset, self.size, self.small = segment, offset, size, small
        self.free, self.prev, self.next = True, None, None

    def key(self) -> tuple:
        return (self.size, self.segment, self.offset)


def round_size(nbytes: int) -> int:
    """A request as the allocator books it.

    >>> round_size(1), round_size(512), round_size(513)
    (512, 512, 1024)
    """
    return MIN_BLOCK if nbytes < MIN_BLOCK else -(-nbytes // MIN_BLOCK) * MIN_BLOCK


def segment_size(size: int) -> int:
    """The segment the allocator reserves from the driver for a (rounded) request no cached block fits.

    >>> [segment_size(s) >> 20 for s in (512, 2 << 20, 12 << 20, (12 << 20) + 512)]
    [2, 20, 12, 14]
    """
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


class CachingAllocator:
    """The allocator's state: segments, their blocks, the free blocks of each pool (see the module docstring).

    >>> a = CachingAllocator(capacity=64 << 20)
    >>> a.malloc("x", 3 << 20), a.reserved >> 20, a.allocated >> 20
    (True, 20, 3)
    >>> a.free("x"); a.reserved >> 20, a.allocated
    (20, 0)
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.reserved = self.allocated = 0
        self.peak_reserved = self.peak_allocated = 0
        self._pools: dict[bool, list] = {True: [], False: []}  # small? -> sorted [(size, segment, offset, block)]
        self._live: dict = {}  # key -> block
        self._segments = itertools.count()

    def _insert(self, b: _Block) -> None:
        bisect.insort(self._pools[b.small], (*b.key(), b))

    def _remove(self, b: _Block) -> None:
        pool = self._pools[b.small]
        i = bisect.bisect_left(pool, b.key())
        assert pool[i][3] is b
        pool.pop(i)

    def malloc(self, key, nbytes: int) -> bool:
        """Allocate `nbytes` for `key`; False (and nothing allocated) where the allocator runs out of memory."""
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        pool = self._pools[small]
        i = bisect.bisect_left(pool, (size,))
        if i < len(pool):
            block = pool.pop(i)[3]
        else:
            seg = segment_size(size)
            if self.reserved + seg > self.capacity:
                self.release()
                if self.reserved + seg > self.capacity:
                    return False
            block = _Block(next(self._segments), 0, seg, small)
            self.reserved += seg
            self.peak_reserved = max(self.peak_reserved, self.reserved)
        rest = block.size - size
        if (rest >= MIN_BLOCK) if small else (rest > SMALL_SIZE):
            tail = _Block(block.segment, block.offset + size, rest, small)
            tail.prev, tail.next = block, block.next
            if block.next is not None:
                block.next.prev = tail
            block.next, block.size = tail, size
            self._insert(tail)
        block.free = False
        self._live[key] = block
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return True

    def free(self, key) -> None:
        """Return `key`'s block to its pool, merged with free neighbours in its segment."""
        block = self._live.pop(key)
        self.allocated -= block.size
        block.free = True
        prev, nxt = block.prev, block.next
        if prev is not None and prev.free:
            self._remove(prev)
            prev.size += block.size
            prev.next = nxt
            if nxt is not None:
                nxt.prev = prev
            block = prev
        if nxt is not None and nxt.free:
            self._remove(nxt)
            block.size += nxt.size
            block.next = nxt.next
            if nxt.next is not None:
                nxt.next.prev = block
        self._insert(block)

    def release(self) -> None:
        """Give every wholly free cached segment back to the driver (what an allocation does before failing)."""
        for small, pool in self._pools.items():
            whole = [t for t in pool if t[3].prev is None and t[3].next is None]
            self.reserved -= sum(t[3].size for t in whole)
            self._pools[small] = [t for t in pool if not (t[3].prev is None and t[3].next is None)]


@dataclass(frozen=True)
class Replay:
    """The outcome of `replay`: whether every allocation was served, and the peaks (bytes)."""

    fits: bool
    peak_reserved: int  # most the allocator held from the driver (segments)
    peak_allocated: int  # most held by live blocks (what torch.cuda.max_memory_allocated reports)
    failed_request: int = 0  # the rounded size of the allocation that ran out of memory (0: none did)

    @property
    def fragmentation(self) -> float:
        """Reserved beyond allocated at their peaks, as a fraction of allocated."""
        return self.peak_reserved / self.peak_allocated - 1 if self.peak_allocated else 0.0


def replay(events, capacity: int) -> Replay:
    """Run `events` ((key, nbytes) allocations and (key, FREE) frees, in order) through the allocator with
    `capacity` bytes the driver can give it.

    >>> MiB = 1 << 20
    >>> ev = [("a", 12 * MiB), ("b", 12 * MiB), ("a", FREE), ("c", 14 * MiB)]
    >>> replay(ev, 64 * MiB).peak_reserved // MiB  # c fits no hole: 12 + 12 + 14
    38
    >>> r = replay(ev, 30 * MiB); r.fits, r.peak_reserved // MiB  # a's cached segment released for c
    (True, 26)
    >>> replay(ev, 25 * MiB).fits  # 12 + 14 MiB: no room for c even then
    False
    """
    alloc = CachingAllocator(capacity)
    for key, nbytes in events:
        if nbytes == FREE:
            alloc.free(key)
        elif not alloc.malloc(key, nbytes):
            return Replay(False, alloc.peak_reserved, alloc.peak_allocated, round_size(nbytes))
    return Replay(True, alloc.peak_reserved, alloc.peak_allocated)
