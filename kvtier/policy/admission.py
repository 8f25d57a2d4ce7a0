"""Admission to the disk tier: which host pages are worth a disk write when they leave host.

Every host page that leaves host with no disk copy used to be written to disk. On chat
traffic most of them are never read again (on the Mooncake conversation trace, 77% of
the pages written are never read back), and each costs disk bandwidth and wear.

`reuse` measures, per class of page (used once, twice, three times or more in host), how
often a page of that class comes back to host within a disk's worth of departures (a
page that returns later would have left the disk first), and writes a class only while
that rate is at least `threshold`: the break-even of a write against the hits it buys
(0.1: a write pays when one page in ten is read back). The rate is measured on a sample
of the pages, written or not, so a class that was refused is still measured and is
written again when its pages start coming back. Until a class has been seen enough, its
pages are written.

Deciding by class keeps the choice coherent along a prefix: the blocks of one request
share their history, so a refused request is refused whole rather than leaving holes
that would break every prefix through them.

An admission policy hears the host tier's events (`add`, `touch`, `remove`, as the host
eviction policy does) and answers `admit(ref)` for a page about to leave host dirty.
"""
from __future__ import annotations

import zlib
from collections import OrderedDict
from collections.abc import Callable
from enum import Enum
from typing import Protocol

from kvtier.policy.base import EvictionPolicy, Ref
from kvtier.policy.uses import UseCounts


class AdmissionName(str, Enum):
    ALL = "all"
    REUSE = "reuse"

    def __str__(self) -> str:
        return self.value


class Admission(Protocol):
    name: str
    #: Whether it learns from the host tier's events (the store relays them only then).
    listens: bool

    def add(self, ref: Ref, parent: Ref | None) -> None: ...

    def touch(self, ref: Ref) -> None: ...

    def remove(self, ref: Ref) -> None: ...

    def admit(self, ref: Ref) -> bool:
        """Write `ref`'s host page to disk as it leaves host?"""


class AdmitAll:
    """Every page is written (the behaviour before admission existed)."""

    name = "all"
    listens = False

    def add(self, ref: Ref, parent: Ref | None) -> None:
        pass

    def touch(self, ref: Ref) -> None:
        pass

    def remove(self, ref: Ref) -> None:
        pass

    def admit(self, ref: Ref) -> bool:
        return True


#: Pages are classed by their use count in host, capped here (1, 2, 3 or more).
CLASSES = 3
#: Break-even share of pages read back for a class to be written (see the module docstring).
DEFAULT_THRESHOLD = 0.1
#: Settled sampled departures per class before its rate decides.
MIN_SAMPLES = 64
#: Departures remembered (sampled) at most: the sample rate is this over the disk's pages.
SAMPLE_PAGES = 4096


class ReuseAdmission:
    name = "reuse"
    listens = True

    def __init__(self, host_pages: int, disk_pages: int, threshold: float = DEFAULT_THRESHOLD,
                 min_samples: int = MIN_SAMPLES) -> None:
        if not 0 <= threshold <= 1:
            raise ValueError(f"the admission threshold is a share of pages read back, in [0, 1]; got {threshold}")
        self.threshold = threshold
        self.min_samples = min_samples
        self.uses = UseCounts(4 * host_pages)
        rate = min(1.0, SAMPLE_PAGES / max(1, disk_pages))
        self._sample = int(rate * 2**32)
        #: Sampled departures a disk of `disk_pages` would still hold.
        self._window = max(1, round(disk_pages * rate))
        # hash(ref) -> (class, came back yet), oldest first
        self._departed: OrderedDict[int, tuple[int, bool]] = OrderedDict()
        self._left = [0.0] * CLASSES  # settled sampled departures per class (decayed)
        self._back = [0.0] * CLASSES  # of those, came back within their window
        self._since_decay = 0

    def _sampled(self, ref: Ref) -> bool:
        return zlib.crc32(ref[1]) < self._sample

    def add(self, ref: Ref, parent: Ref | None) -> None:
        key = hash(ref)
        departure = self._departed.get(key)
        if departure is not None and not departure[1]:
            self._departed[key] = (departure[0], True)  # back within its window
        self.uses.used(ref)

    def touch(self, ref: Ref) -> None:
        self.uses.used(ref)

    def remove(self, ref: Ref) -> None:
        uses = self.uses[ref]
        self.uses.left(ref)
        if not self._sampled(ref):
            return
        key = hash(ref)
        earlier = self._departed.pop(key, None)
        if earlier is not None:  # it came back and leaves again: the earlier departure is settled
            self._settled(*earlier)
        self._departed[key] = (min(uses, CLASSES) - 1, False)
        if len(self._departed) > self._window:
            _, (cls, back) = self._departed.popitem(last=False)
            self._settled(cls, back)

    def _settled(self, cls: int, back: bool) -> None:
        """A sampled departure's window passed (or it left again): count it, and whether it
        came back within the window. Departures still in their window are not counted
        either way: counting them early would bias the rate while traffic is new."""
        self._left[cls] += 1
        self._back[cls] += back
        self._since_decay += 1
        # Follow the traffic: older counts weigh half every window (never so often that a
        # class could not reach min_samples).
        if self._since_decay >= max(self._window, 4 * self.min_samples):
            self._since_decay = 0
            self._left = [n / 2 for n in self._left]
            self._back = [n / 2 for n in self._back]

    def admit(self, ref: Ref) -> bool:
        cls = min(self.uses[ref], CLASSES) - 1
        left = self._left[cls]
        return left < self.min_samples or self._back[cls] >= self.threshold * left

    @property
    def return_rates(self) -> list[float | None]:
        """Per class (used once, twice, three times or more): the share of departed pages
        that came back (None: not measured yet)."""
        return [b / n if n else None for b, n in zip(self._back, self._left)]


class Watched:
    """The host tier's eviction policy, with an admission policy hearing its events."""

    def __init__(self, policy: EvictionPolicy, admission: Admission) -> None:
        self.policy = policy
        self.admission = admission
        self.name = policy.name

    def add(self, ref: Ref, parent: Ref | None) -> None:
        self.policy.add(ref, parent)
        self.admission.add(ref, parent)

    def touch(self, ref: Ref) -> None:
        self.policy.touch(ref)
        self.admission.touch(ref)

    def remove(self, ref: Ref) -> None:
        self.policy.remove(ref)
        self.admission.remove(ref)

    def victims(self, n: int, protected: Callable[[Ref], bool]) -> list[Ref]:
        return self.policy.victims(n, protected)

    def __len__(self) -> int:
        return len(self.policy)


def make_admission(name: AdmissionName | str, host_pages: int, disk_pages: int,
                   threshold: float = DEFAULT_THRESHOLD) -> Admission:
    """A new admission policy for a host tier of `host_pages` over a disk of `disk_pages`."""
    try:
        name = AdmissionName(name)
    except ValueError:
        raise ValueError(f"unknown disk admission {name!r}; use one of {', '.join(AdmissionName)}") from None
    return ReuseAdmission(host_pages, disk_pages, threshold) if name is AdmissionName.REUSE else AdmitAll()
