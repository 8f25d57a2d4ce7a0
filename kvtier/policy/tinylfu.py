"""W-TinyLFU with an adaptive window (Einziger, Friedman & Manes, "TinyLFU: A Highly
Efficient Cache Admission Policy", ACM TOS 2017; Einziger, Eytan, Friedman & Manes,
"Adaptive Software Cache Management", Middleware 2018; as built in Caffeine's
BoundedLocalCache). A candidate for the adaptive policy.

New refs enter a small LRU window (1% of the capacity to start). What overflows the window
lands in the main area, a segmented LRU: probation, and protected (80% of main) for refs
hit while on probation; protected's overflow drops back to probation. A frequency sketch
counts every access, cached or not, and halves its counters every 10 x capacity accesses
so that old popularity fades (the paper's reset).

Eviction is TinyLFU's admission duel: when the window is full, its LRU ref (the candidate
that the next arrival pushes into main) meets probation's LRU ref (main's victim). The one
with the lower estimated frequency goes; a tie evicts the candidate, as in Caffeine. With
the window below its size, the victim comes from main: probation's LRU, else protected's.
Every missed block is inserted here (the engine has already computed it), so the duel does
not refuse an arrival; it picks which of the two refs is evicted. A candidate that wins
enters probation when the next `add` overflows the window, so `victims` changes nothing.

The window size is tuned online by Caffeine's hill climber: every 10 x capacity accesses it
compares the sample's hit rate with the previous one, keeps moving the window the same way
if the hit rate rose and reverses if it fell, by a step of 6.25% of the capacity that
decays by 2% per sample and restarts when the hit rate changes by 5 points or more.
Growing the window takes main's LRU refs into it; shrinking it sends the window's LRU refs
to probation; the window stays within [1, window + protected share].
Unlike Caffeine, the climber runs from the first access, not from when the cache is half full.
Each cached ref keeps its sketch cells, so a hit hashes nothing.

No prefix rule: like `lru`, this may evict a block whose child is cached in the tier.
"""
from __future__ import annotations

import zlib
from collections import OrderedDict
from collections.abc import Callable
from itertools import chain

from kvtier.policy.base import Ref

_PERCENT_MAIN = 0.99
_PERCENT_PROTECTED = 0.80
_STEP_PERCENT = 0.0625
_STEP_DECAY = 0.98
_RESTART_THRESHOLD = 0.05
_HALVE = bytes(count >> 1 for count in range(256))


class FrequencySketch:
    """A count-min sketch (Cormode & Muthukrishnan 2005) of 4-bit counters, as in TinyLFU.

    Four rows of 4 x next_power_of_two(capacity) one-byte counters capped at 15 (Caffeine
    keeps the same number of counters, packed). A ref's cell in each row comes from a
    CRC-32 of its bytes (stable across runs, unlike Python's hash) by double hashing. The
    estimate is the row minimum, which never undercounts between resets. Every
    `sample_size` increments all counters are halved (the reset, O(table) in C).
    """

    def __init__(self, capacity: int) -> None:
        self._width = 4 << max(0, capacity - 1).bit_length()
        self._table = bytearray(4 * self._width)
        self.sample_size = 10 * max(1, capacity)
        self._additions = 0

    def cells(self, ref: Ref) -> tuple[int, int, int, int]:
        """The ref's counter in each row; the policy keeps them for its cached refs."""
        spread = zlib.crc32(ref[1], zlib.crc32(ref[0].encode())) * 0x9E3779B97F4A7C15
        h1, h2 = spread & 0xFFFFFFFF, (spread >> 32 & 0xFFFFFFFF) | 1
        w, mask = self._width, self._width - 1
        return (
            h1 & mask,
            w + ((h1 + h2) & mask),
            2 * w + ((h1 + 2 * h2) & mask),
            3 * w + ((h1 + 3 * h2) & mask),
        )

    def increment(self, cells: tuple[int, int, int, int]) -> None:
        table = self._table
        for cell in cells:
            if table[cell] < 15:
                table[cell] += 1
        self._additions += 1
        if self._additions >= self.sample_size:
            self._table = table.translate(_HALVE)
            self._additions = 0

    def estimate(self, cells: tuple[int, int, int, int]) -> int:
        table = self._table
        a, b, c, d = cells
        return min(table[a], table[b], table[c], table[d])


class TinyLFUPolicy:
    name = "tinylfu"

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"W-TinyLFU needs a capacity of at least 1 block, not {capacity}")
        self._capacity = capacity
        self._window_max = max(1, capacity - int(_PERCENT_MAIN * capacity))
        self._protected_max = int(_PERCENT_PROTECTED * (capacity - self._window_max))
        # LRU first; OrderedDicts make every move O(1).
        self._window: OrderedDict[Ref, None] = OrderedDict()
        self._probation: OrderedDict[Ref, None] = OrderedDict()
        self._protected: OrderedDict[Ref, None] = OrderedDict()
        self._sketch = FrequencySketch(capacity)
        self._cells: dict[Ref, tuple[int, int, int, int]] = {}  # cached refs -> sketch cells
        # Hill climber state: this sample's hits and misses, the last sample's hit rate,
        # and the signed step (Caffeine starts by shrinking the window).
        self._hits = self._misses = 0
        self._last_hit_rate = 0.0
        self._step = -_STEP_PERCENT * capacity

    def add(self, ref: Ref, parent: Ref | None) -> None:
        cells = self._cells[ref] = self._sketch.cells(ref)
        self._sketch.increment(cells)
        self._window[ref] = None
        while len(self._window) > self._window_max:
            self._probation[self._window.popitem(last=False)[0]] = None
        self._misses += 1
        if self._hits + self._misses >= self._sketch.sample_size:
            self._climb()

    def touch(self, ref: Ref) -> None:
        self._sketch.increment(self._cells[ref])
        if ref in self._window:
            self._window.move_to_end(ref)
        elif ref in self._probation:
            del self._probation[ref]
            self._protected[ref] = None
            self._demote()
        else:
            self._protected.move_to_end(ref)
        self._hits += 1
        if self._hits + self._misses >= self._sketch.sample_size:
            self._climb()

    def remove(self, ref: Ref) -> None:
        del self._cells[ref]
        for queue in (self._window, self._probation):
            if ref in queue:
                del queue[ref]
                return
        del self._protected[ref]

    def victims(self, n: int, protected: Callable[[Ref], bool]) -> list[Ref]:
        """The duel n times over the queues as they are: each choice from the window
        shortens it, so once it is below its size the rest come from main."""
        chosen: list[Ref] = []
        if n <= 0:
            return chosen
        window = (ref for ref in self._window if not protected(ref))
        main = (ref for ref in chain(self._probation, self._protected) if not protected(ref))
        candidate, victim = next(window, None), next(main, None)
        window_size = len(self._window)  # protected refs count: they stay in the window
        estimate, cells = self._sketch.estimate, self._cells
        while len(chosen) < n and (candidate is not None or victim is not None):
            if candidate is not None and (
                victim is None  # the duel, once the window is full:
                or (window_size >= self._window_max and estimate(cells[candidate]) <= estimate(cells[victim]))
            ):
                chosen.append(candidate)
                window_size -= 1
                candidate = next(window, None)
            else:
                chosen.append(victim)
                victim = next(main, None)
        return chosen

    def _demote(self) -> None:
        while len(self._protected) > self._protected_max:
            self._probation[self._protected.popitem(last=False)[0]] = None

    def _climb(self) -> None:
        """Caffeine's hill climber (BoundedLocalCache.determineAdjustment, increaseWindow,
        decreaseWindow): resize the window by one step and move the refs across."""
        hit_rate = self._hits / (self._hits + self._misses)
        change = hit_rate - self._last_hit_rate
        amount = self._step if change >= 0 else -self._step
        if abs(change) >= _RESTART_THRESHOLD:
            self._step = _STEP_PERCENT * self._capacity * (1 if amount >= 0 else -1)
        else:
            self._step = _STEP_DECAY * amount
        self._last_hit_rate = hit_rate
        self._hits = self._misses = 0
        quota = int(amount)
        moved = 0
        if quota > 0:  # grow the window with main's LRU refs (probation first)
            for _ in range(min(quota, self._protected_max)):
                source = self._probation or self._protected
                if not source:
                    break
                self._window[source.popitem(last=False)[0]] = None
                moved += 1
        elif quota < 0:  # shrink it into probation
            for _ in range(min(-quota, self._window_max - 1)):
                if not self._window:
                    break
                self._probation[self._window.popitem(last=False)[0]] = None
                moved -= 1
        self._window_max += moved
        self._protected_max -= moved
        self._demote()

    def __len__(self) -> int:
        return len(self._window) + len(self._probation) + len(self._protected)
