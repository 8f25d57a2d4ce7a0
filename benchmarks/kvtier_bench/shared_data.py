"""Where the shared data sets are (the Mooncake conversation trace), found from the
repository, never by one machine's absolute path, so that a clone anywhere finds them.

The shared folder sits beside the clone: `<repository>/../shared/data` (CI puts a copy of
`shared/` there too). `KVTIER_SHARED_DATA` names another data folder. The data is read
where it is, never copied into the repository; results files name it relative to the
repository root (`shown`), whatever folder held it on the machine that ran.
"""
from __future__ import annotations

import os
from pathlib import Path

#: The variable that names the data folder when it is not beside the clone.
ENV = "KVTIER_SHARED_DATA"
#: The repository this package is in (benchmarks/kvtier_bench/ -> the root).
REPOSITORY = Path(__file__).resolve().parents[2]
#: The data folder beside the clone, as results files name it (relative to REPOSITORY).
BESIDE_THE_CLONE = Path("..", "shared", "data")
#: The Mooncake conversation trace, under the data folder.
MOONCAKE_TRACE = ("mooncake", "conversation_trace.jsonl")


def shared_data(*parts: str) -> Path:
    """A path under the shared data folder: `$KVTIER_SHARED_DATA`, else the one beside the clone."""
    root = os.environ.get(ENV)
    return Path(root, *parts) if root else (REPOSITORY / BESIDE_THE_CLONE).resolve().joinpath(*parts)


def mooncake_trace() -> Path:
    return shared_data(*MOONCAKE_TRACE)


def shown(path: str | os.PathLike) -> str:
    """`path` as a results file names it: a file of the shared data folder relative to the
    repository root (`../shared/data/...`), any other path as given."""
    try:
        inside = Path(path).resolve().relative_to(shared_data().resolve())
    except ValueError:
        return str(path)
    return str(BESIDE_THE_CLONE / inside)


def absent(path: str | os.PathLike) -> str:
    """Why a run that needs the trace at `path` cannot go on, and where the data is looked for."""
    return (f"{path} is absent: the Mooncake conversation trace is needed, looked for in the shared data folder "
            f"(${ENV}, or else <repository>/{BESIDE_THE_CLONE.as_posix()}: see its mooncake/README.md)")
