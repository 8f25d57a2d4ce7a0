"""A pool's hint keeper: ends hints whose TTL passed, keeps the hints with a TTL in the
pool's hints file, so a restarted daemon — warm, with the keeper's host memory, or from
disk — ranks those blocks as before, and sees that hard pins hold what they pin.

Once a second (`interval`) it expires hints, writes the file when the hints with a TTL
changed (never under the store's lock; a crash loses at most the last interval's hints),
and sweeps the hard-pinned blocks still waiting for a host copy into host
(kvtier.core.pin_loads says why a sweep). Its first sweep runs as soon as the hints are
restored: after a cold restart the pinned blocks are loaded with no client asking.
`close` writes the file a last time. With no path (no cache_dir) it writes no file.

The file (format: kvtier.mechanism.formats.HINTS) is written whole to a temporary file
and renamed over the old one, so a crash leaves the old file or the new one. Losing it
loses hints, never pages: an unreadable file is logged and read as empty.
"""
from __future__ import annotations

import json
import logging
import os
import threading

from kvtier_client.errors import KVTierError

from kvtier.core.hints import Hint
from kvtier.core.store import BlockStore
from kvtier.mechanism.formats import HINTS, Reading
from kvtier.policy import Ref
from kvtier.policy.classes import Rank

log = logging.getLogger(__name__)


class HintKeeper:
    def __init__(self, store: BlockStore, path: str | None, *, interval: float = 1.0, name: str = "kvtier-hints") -> None:
        self.store = store
        self.path = path
        self._interval = interval
        self._saved: list | None = []  # what the file holds (None: unknown, write it)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def restore(self) -> int:
        """Set the hints the file kept on the blocks cached now (call once the pool's
        quotas are set), then start keeping them. Returns how many were restored."""
        saved = load(self.path) if self.path else []
        restored = self.store.control.restore(saved)
        self._saved = None if saved else []  # rewritten without what did not come back
        if saved:
            log.info("hints restored", extra={"path": self.path, "kept": len(saved), "restored": restored})
        self._thread.start()
        return restored

    def _run(self) -> None:
        self._sweep()  # the restored hard pins start loading now
        while not self._stopped.wait(self._interval):
            self.tick()

    def tick(self) -> None:
        self.store.control.expire()
        self._save()
        self._sweep()

    def _sweep(self) -> None:
        try:
            self.store.control.pins.sweep()
        except KVTierError as exc:  # the keeper goes on: the next sweep tries again
            log.warning("could not start loading hard-pinned blocks; retrying", extra={"reason": str(exc)})

    def _save(self) -> None:
        lasting = self.store.control.lasting()
        if self.path is None or lasting == self._saved:
            return
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            save(self.path, lasting)
            self._saved = lasting
        except OSError as exc:
            log.warning("could not write the hints file; retrying", extra={"path": self.path, "reason": str(exc)})

    def close(self) -> None:
        """Stop (no load is started after this returns: the pool closes its readers next),
        and write the file a last time. A second call does nothing."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join()
        self.store.control.expire()
        self._save()


def save(path: str, hints: list[tuple[Ref, Hint]]) -> None:
    """Replace the file at `path` with `hints` (durably: fsync of file and directory)."""
    body = {"format": HINTS.current, "hints": [
        {"namespace": ns, "key": key.hex(), "rank": h.rank.name, "expires": h.expires, "reason": h.reason}
        for (ns, key), h in hints
    ]}
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(body, f, separators=(",", ":"))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    directory = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def load(path: str) -> list[tuple[Ref, Hint]]:
    """The hints kept at `path`; [] when there is no file, or one this kvtier cannot read
    (logged once: the hints are lost, the daemon starts)."""
    try:
        with open(path, encoding="utf-8") as f:
            body = json.load(f)
        found = body.get("format") if isinstance(body, dict) else None
        if HINTS.reading(found if isinstance(found, int) else None) is not Reading.READ:
            raise ValueError(HINTS.refusal(path, found if isinstance(found, int) else None, "let the hints go"))
        return [((e["namespace"], bytes.fromhex(e["key"])), Hint(Rank[e["rank"]], float(e["expires"]), None, str(e["reason"])))
                for e in body["hints"]]
    except FileNotFoundError:
        return []
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("ignoring a hints file it cannot read: its hints are lost", extra={"path": path, "reason": str(exc)})
        return []
