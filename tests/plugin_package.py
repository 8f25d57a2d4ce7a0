"""A plugin package written from outside kvtier, for the tests of kvtier.registry: a codec,
an eviction policy and a cluster backend, in a module of its own under a directory, with
an entry point table beside it (a dist-info directory, as pip would install one), so that
a directory on sys.path or PYTHONPATH is all it takes. Nothing here is imported by kvtier.
"""
from __future__ import annotations

import textwrap
import uuid
from dataclasses import dataclass
from pathlib import Path

#: The plugin's source: what a user would write (only kvtier's public seams imported).
SOURCE = textwrap.dedent('''
    """Out-of-tree parts for kvtier (a test plugin)."""
    import os
    import threading
    import zlib
    from collections import OrderedDict
    from pathlib import Path

    from kvtier.codecs import Encoded
    from kvtier.mechanism.cluster.remote import RemoteMemory


    class ZlibCodec:
        """Lossless: zlib at level 1; a page that does not shrink is stored under identity."""

        id = CODEC_ID
        name = "zlib"
        lossy = False

        def __init__(self, layout):
            self.layout = layout

        def bound(self):
            return self.layout.page_bytes

        def encode(self, page):
            data = zlib.compress(page, 1)
            return Encoded(self.id, data) if len(data) < len(page) else Encoded(0, page)

        def decode_into(self, data, out):
            try:
                page = zlib.decompress(data)
            except zlib.error:
                return False
            if len(page) != len(out):
                return False
            out[:] = page
            return True


    class MruPolicy:
        """Most recently used first: the newest block is the first to go (what LRU keeps)."""

        name = "mru"

        def __init__(self, capacity):
            self._order = OrderedDict()

        def add(self, ref, parent):
            self._order[ref] = None

        def touch(self, ref):
            self._order.move_to_end(ref)

        def remove(self, ref):
            del self._order[ref]

        def victims(self, n, protected):
            chosen = []
            for ref in reversed(self._order):
                if len(chosen) == n:
                    break
                if not protected(ref):
                    chosen.append(ref)
            return chosen

        def __len__(self):
            return len(self._order)


    class DirStore:
        """A store every node shares as a directory: one file per key, head length first."""

        def __init__(self, root):
            self.root = Path(root)
            self.root.mkdir(parents=True, exist_ok=True)

        def _path(self, key):
            return self.root / key.hex()

        def exists(self, keys):
            return [self._path(k).exists() for k in keys]

        def get(self, keys):
            values = []
            for key in keys:
                try:
                    data = self._path(key).read_bytes()
                except FileNotFoundError:
                    values.append(None)
                    continue
                n = int.from_bytes(data[:4], "little")
                values.append((data[4:4 + n], data[4 + n:]))
            return values

        def put(self, items):
            for key, (head, body) in items:
                tmp = self.root / f".{key.hex()}.{threading.get_ident()}"
                tmp.write_bytes(len(head).to_bytes(4, "little") + bytes(head) + bytes(body))
                os.replace(tmp, self._path(key))  # head and body appear together
            return [True] * len(items)

        def delete(self, keys):
            gone = []
            for key in keys:
                try:
                    self._path(key).unlink()
                    gone.append(True)
                except FileNotFoundError:
                    gone.append(False)
            return gone

        def memory(self):
            return RemoteMemory(sum(p.stat().st_size for p in self.root.iterdir()), 0)

        def close(self):
            pass


    class DirBackend:
        def check(self, url):
            if not url.partition("://")[2].startswith("/"):
                raise ValueError("a SCHEME URL names an absolute directory: SCHEME:///path")

        def open(self, url, settings):
            return DirStore(url.partition("://")[2])


    BACKEND = DirBackend()
''')


@dataclass(frozen=True)
class Plugin:
    """Where the plugin lies and the names it answers to."""

    path: Path  # the directory to put on sys.path / PYTHONPATH
    module: str
    codec_id: int
    codec_entry: str  # the entry point names: kvtier.codecs, kvtier.policies, kvtier.cluster_backends
    policy_entry: str
    scheme: str

    @property
    def codec(self) -> str:
        return f"{self.module}:ZlibCodec"

    @property
    def policy(self) -> str:
        return f"{self.module}:MruPolicy"

    def env(self) -> dict[str, str]:
        return {"PYTHONPATH": str(self.path)}


def write_plugin(directory: Path, *, codec_id: int = 200, entry_points: bool = True) -> Plugin:
    """The plugin under `directory`, its module and entry point names unique to this call
    (a process that loads two never mixes them up)."""
    tag = uuid.uuid4().hex[:8]
    module = f"kvtier_test_plugin_{tag}"
    directory.mkdir(parents=True, exist_ok=True)
    scheme = f"dir{tag}"
    (directory / f"{module}.py").write_text(SOURCE.replace("CODEC_ID", str(codec_id)).replace("SCHEME", scheme))
    plugin = Plugin(directory, module, codec_id, f"zlib{tag}", f"mru{tag}", scheme)
    if entry_points:
        info = directory / f"{module}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 1.0\n")
        (info / "entry_points.txt").write_text(
            f"[kvtier.codecs]\n{plugin.codec_entry} = {module}:ZlibCodec\n\n"
            f"[kvtier.policies]\n{plugin.policy_entry} = {module}:MruPolicy\n\n"
            f"[kvtier.cluster_backends]\n{scheme} = {module}:BACKEND\n")
    return plugin
