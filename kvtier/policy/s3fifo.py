"""S3-FIFO (Yang, Zhang, Qiu, Yue & Rashmi, "FIFO queues are all you need for cache
eviction", SOSP 2023). A candidate for the adaptive policy.

Three FIFO queues: a small one (10% of the capacity) that every new ref enters, a main one
(the rest), and a ghost queue of refs only (as many as main holds) evicted from small. Each
cached ref has a 2-bit access counter (0..3), bumped by a hit. The paper's point is that
most blocks are one-hit wonders: they should leave quickly, from small, without pushing
older popular blocks out; a ref that comes back while its ghost is remembered was evicted
too early and goes straight to main.

One eviction (Algorithm 1; each eviction yields exactly one victim, as in the authors'
libCacheSim version): while small holds at least its 10%, take small's oldest refs in turn;
one used since it entered (counter > 0) moves to main's head, the first unused one is the
victim and its ref goes to the ghost queue. Otherwise take main's oldest refs in turn; one
with counter > 0 gets a second chance (back to main's head, counter - 1), the first with
counter 0 is the victim. Counters travel with a ref from small to main. When the chosen
queue has nothing evictable (all protected, or small all promoted), the other one gives.
A single hit earns promotion, as the paper's text says; libCacheSim's default asks for two
(on the Mooncake conversation trace the two differ by under half a point of hit rate).

`victims` changes nothing: it does a dry run over the live queues that records, for each
victim, the moves (promotions, second chances) its eviction makes. `remove` of the next
proposed victim performs that victim's moves first, so the queues change only when an
eviction really happens, exactly as the paper's successive evictions; any other call drops
the recorded moves (a later `victims` recomputes them).

Ghost entries are recorded when a ref leaves small, so a deleted block leaves a ghost too.
No prefix rule: like `lru`, S3-FIFO may evict a block whose child is cached in the tier.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable

from kvtier.policy.base import Ref

_MAX_FREQ = 3  # 2-bit counters


class S3FIFOPolicy:
    name = "s3fifo"

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"S3-FIFO needs a capacity of at least 1 block, not {capacity}")
        self._small_size = max(1, capacity // 10)
        self._ghost_size = max(1, capacity - self._small_size)  # main's capacity
        # Each queue is oldest first (its eviction end); an OrderedDict also removes a ref
        # deleted from the middle in O(1).
        self._small: OrderedDict[Ref, None] = OrderedDict()
        self._main: OrderedDict[Ref, None] = OrderedDict()
        self._ghost: OrderedDict[Ref, None] = OrderedDict()
        self._freq: dict[Ref, int] = {}  # cached refs -> access counter
        # The last proposal: (moves made by the eviction, victim) per victim, in order.
        self._plan: deque[tuple[list[Ref], Ref]] = deque()

    def add(self, ref: Ref, parent: Ref | None) -> None:
        self._plan.clear()
        if ref in self._ghost:
            del self._ghost[ref]
            self._main[ref] = None
        else:
            self._small[ref] = None
        self._freq[ref] = 0

    def touch(self, ref: Ref) -> None:
        self._plan.clear()
        if self._freq[ref] < _MAX_FREQ:
            self._freq[ref] += 1

    def remove(self, ref: Ref) -> None:
        if self._plan and self._plan[0][1] == ref:
            for moved in self._plan.popleft()[0]:
                if moved in self._small:  # promotion
                    del self._small[moved]
                    self._main[moved] = None
                else:  # second chance
                    self._main.move_to_end(moved)
                    self._freq[moved] -= 1
        else:
            self._plan.clear()
        del self._freq[ref]
        if ref in self._small:
            del self._small[ref]
            self._ghost[ref] = None
            if len(self._ghost) > self._ghost_size:
                self._ghost.popitem(last=False)
        else:
            del self._main[ref]

    def victims(self, n: int, protected: Callable[[Ref], bool]) -> list[Ref]:
        run = _DryRun(self, protected)
        chosen: list[Ref] = []
        plan: deque[tuple[list[Ref], Ref]] = deque()
        while len(chosen) < n:
            if run.small_size >= self._small_size:
                victim = run.from_small() or run.from_main()
            else:  # main has nothing evictable: small, whose promotions main then reads
                victim = run.from_main() or run.from_small() or run.from_main()
            if victim is None:
                break
            chosen.append(victim)
            plan.append((run.moves, victim))
            run.moves = []
        self._plan = plan
        return chosen

    def __len__(self) -> int:
        return len(self._freq)


class _DryRun:
    """Successive evictions read off the live queues without changing them.

    Each queue is read once, oldest first, skipping protected refs (they stay where they
    are). Refs the run moves to main's head are queued in `moved` and read after main's
    own refs (a second chance can come round again); their changed counters are in `freq`.
    """

    def __init__(self, policy: S3FIFOPolicy, protected: Callable[[Ref], bool]) -> None:
        self.small = (ref for ref in policy._small if not protected(ref))
        self.main = (ref for ref in policy._main if not protected(ref))
        self.moved: deque[Ref] = deque()
        self.freq: dict[Ref, int] = {}
        self.policy_freq = policy._freq
        self.small_size = len(policy._small)  # as the successive evictions leave it
        self.moves: list[Ref] = []  # moves of the eviction under way

    def from_small(self) -> Ref | None:
        for ref in self.small:
            self.small_size -= 1
            if not self.policy_freq[ref]:
                return ref
            self.moves.append(ref)
            self.moved.append(ref)
        return None

    def from_main(self) -> Ref | None:
        while True:
            ref = next(self.main, None)
            if ref is None:
                if not self.moved:
                    return None
                ref = self.moved.popleft()
            count = self.freq.get(ref, self.policy_freq[ref])
            if not count:
                return ref
            self.freq[ref] = count - 1
            self.moves.append(ref)
            self.moved.append(ref)
