"""Named parts a daemon can be given from outside kvtier: page codecs, eviction policies,
cluster backends. One `Registry` per kind, filled in one place (its package's __init__)
with the built-in entries; nothing else lists their names.

An entry from outside kvtier comes in by one of two doors, as vLLM's KV connectors
(`kv_connector_module_path`) and SGLang's storage backends do:

- a module path in place of a name, `package.module:Attribute`: imported the first time
  it is named, then known under that spelling (a kind may turn this door off);
- an entry point in the kind's group, e.g. in the plugin's pyproject.toml
  `[project.entry-points."kvtier.policies"] mine = "mypkg.policies:MyPolicy"`: its name
  is then a name like a built-in's (a built-in name is never shadowed).

Each kind checks an entry from outside before it is used (`admit`), so a plugin that does
not fit fails when it is named (at configuration), not on the first page it meets.
"""
from __future__ import annotations

import importlib
import logging
import re
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Generic, TypeVar

if TYPE_CHECKING:
    from importlib.metadata import EntryPoint

log = logging.getLogger(__name__)

T = TypeVar("T")

#: `package.module:Attribute` (the attribute may be dotted: `mod:Outer.Inner`).
MODULE_PATH = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")


class RegistryError(ValueError):
    """A name no entry answers to, a module path that does not load, or an entry that does
    not fit its kind; the message says which, lists the known names and how to add one."""


class Registry(Generic[T]):
    """The entries of one kind by name. `registry[name]` resolves a name (built-in, entry
    point, or module path) or raises RegistryError; iterating gives the names known now."""

    def __init__(self, kind: str, group: str, docs: str, builtins: Mapping[str, T], *,
                 module_paths: bool = True, admit: Callable[[str, T], None] | None = None) -> None:
        """`kind` names an entry in messages ("eviction policy"); `group` is the entry point
        group; `docs` where adding one is explained; `admit(name, entry)` checks an entry
        from outside (raises RegistryError) and may index it; with `module_paths` off,
        entry points are the only door."""
        self.kind, self.group, self.docs = kind, group, docs
        self.builtin: tuple[str, ...] = tuple(builtins)
        self.module_paths = module_paths
        self._admit = admit
        self._entries: dict[str, T] = dict(builtins)
        self._lock = threading.RLock()

    # -- lookups ------------------------------------------------------------------
    def __getitem__(self, name: str) -> T:
        entry = self._entries.get(name)  # a dict read: no lock on the hot path
        if entry is not None:
            return entry
        with self._lock:
            if name in self._entries:
                return self._entries[name]
            if self.module_paths and MODULE_PATH.fullmatch(name):
                loaded = self._load(name, lambda: _import_attribute(name))
            else:
                point = self._entry_points().get(name)
                if point is None:
                    raise RegistryError(f"unknown {self.kind} {name!r}; {self.known()}. {self.how_to_add()}")
                loaded = self._load(name, point.load)
            self.register(name, loaded)
            return loaded

    def __contains__(self, name: object) -> bool:
        """Whether `name` resolves (loading it if it is a plugin's)."""
        try:
            self[name]  # type: ignore[index]
        except RegistryError:
            return False
        return True

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())

    def names(self) -> tuple[str, ...]:
        """The built-in names, then those registered since and those of the group's entry
        points (module paths are spellings, not names: never listed)."""
        named = [n for n in self._entries if not MODULE_PATH.fullmatch(n)]
        return tuple(dict.fromkeys([*named, *self._entry_points()]))

    def known(self) -> str:
        return f"known: {', '.join(self.names())}"

    def how_to_add(self) -> str:
        path = "give its module path (mypkg.module:Name) or " if self.module_paths else ""
        return f'To add one, {path}register it under the entry point group "{self.group}" ({self.docs})'

    # -- adding -------------------------------------------------------------------
    def register(self, name: str, entry: T) -> None:
        """Add an entry from outside kvtier under `name`, once `admit` accepts it; the
        same entry again is a no-op, another under a taken name is refused."""
        with self._lock:
            held = self._entries.get(name)
            if held is entry:
                return
            if held is not None:
                raise RegistryError(f"{self.kind} name {name!r} is taken (by {_spelled(held)}); choose another name")
            if self._admit is not None:
                self._admit(name, entry)
            self._entries[name] = entry

    def load_group(self) -> None:
        """Load every entry point of the group not loaded yet (one that fails is logged
        and skipped): for lookups by something other than the name, e.g. a codec's id."""
        for name in self._entry_points():
            try:
                self[name]
            except RegistryError as exc:
                log.warning("%s", exc)

    def _load(self, name: str, load: Callable[[], T]) -> T:
        try:
            return load()
        except Exception as exc:  # a plugin's import may raise anything: say which and why
            raise RegistryError(f"{self.kind} {name!r} does not load: {type(exc).__name__}: {exc}. "
                                f"Is its package installed or on PYTHONPATH? ({self.docs})") from None

    def _entry_points(self) -> dict[str, EntryPoint]:
        """The group's entry points by name, read afresh (a plugin may be installed while a
        process runs); one that takes a built-in's name is skipped and logged. (Imported
        here: a command that names only built-ins never pays for importlib.metadata.)"""
        from importlib import metadata

        points = {}
        for point in metadata.entry_points(group=self.group):
            if point.name in self.builtin:
                log.warning("entry point %s = %s in group %s is ignored: %r is a built-in %s", point.name,
                            point.value, self.group, point.name, self.kind)
            else:
                points.setdefault(point.name, point)
        return points


def _import_attribute(path: str) -> object:
    module, _, attribute = path.partition(":")
    found: object = importlib.import_module(module)
    for part in attribute.split("."):
        found = getattr(found, part)
    return found


def _spelled(entry: object) -> str:
    return f"{getattr(entry, '__module__', '?')}.{getattr(entry, '__qualname__', type(entry).__qualname__)}"
