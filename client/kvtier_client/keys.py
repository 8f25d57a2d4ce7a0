"""Block keys: the prefix-chained hash that names a page's content.

The byte-for-byte specification is docs/block-keys.md; this module is the one
implementation. In short, with ``u32`` meaning a 4-byte little-endian unsigned integer:

    root   = H(b"kvtier-block-key-v1" || u32(len(salt)) || salt)
    key[i] = H(key[i-1] || u32(n) || u32(tok_0) .. u32(tok_n-1)
               || u32(len(extra_i)) || for e in extra_i: u32(len(e)) || e)

where key[-1] is the root, n is the block size in tokens and extra_i holds what else
changes block i's KV (a LoRA id, multimodal input hashes). Only full blocks get keys.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Callable, NewType

import numpy as np
import xxhash

#: A block key: opaque bytes (16 for xxh3-128, 32 for sha256). A NewType so that a key
#: is never confused with token bytes or a namespace in signatures.
BlockKey = NewType("BlockKey", bytes)

ROOT_TAG = b"kvtier-block-key-v1"
DEFAULT_ALGORITHM = "xxh3-128"

_HASHES: dict[str, Callable[[bytes], bytes]] = {
    "xxh3-128": xxhash.xxh3_128_digest,
    "sha256": lambda data: hashlib.sha256(data).digest(),
}
ALGORITHMS = tuple(_HASHES)

_U32_MAX = 2**32 - 1


def _hash_fn(algorithm: str) -> Callable[[bytes], bytes]:
    try:
        return _HASHES[algorithm]
    except KeyError:
        raise ValueError(f"unknown block-key algorithm {algorithm!r}; use one of {', '.join(ALGORITHMS)}") from None


def _u32(value: int) -> bytes:
    return value.to_bytes(4, "little")


def root_key(salt: bytes = b"", algorithm: str = DEFAULT_ALGORITHM) -> BlockKey:
    """The key before block 0. A per-tenant salt enters here, so it changes every key."""
    return BlockKey(_hash_fn(algorithm)(ROOT_TAG + _u32(len(salt)) + bytes(salt)))


def block_keys(
    token_ids: Sequence[int] | np.ndarray,
    block_tokens: int,
    *,
    salt: bytes = b"",
    extras: Sequence[Sequence[bytes]] | None = None,
    algorithm: str = DEFAULT_ALGORITHM,
    parent: BlockKey | None = None,
) -> list[BlockKey]:
    """Keys of every full block of `token_ids`.

    `extras[i]` (optional) holds block i's extra keys. `parent` continues a chain from a
    known key instead of the root (then `salt` is ignored: it is already in the parent).
    """
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be positive, got {block_tokens}")
    h = _hash_fn(algorithm)
    tokens = np.asarray(token_ids)
    if tokens.ndim != 1:
        raise ValueError(f"token_ids must be one-dimensional, got shape {tokens.shape}")
    if tokens.size and (tokens.dtype.kind not in "iu" or tokens.min() < 0 or tokens.max() > _U32_MAX):
        raise ValueError("token ids must be integers in [0, 2**32)")
    n_blocks = tokens.size // block_tokens
    if extras is not None and len(extras) < n_blocks:
        raise ValueError(f"extras has {len(extras)} entries but there are {n_blocks} full blocks")
    raw = tokens[: n_blocks * block_tokens].astype("<u4").tobytes()
    stride = 4 * block_tokens
    count = _u32(block_tokens)
    prev = parent if parent is not None else root_key(salt, algorithm)
    keys: list[BlockKey] = []
    for i in range(n_blocks):
        items = extras[i] if extras is not None else ()
        tail = _u32(len(items)) + b"".join(_u32(len(e)) + bytes(e) for e in items)
        prev = BlockKey(h(prev + count + raw[i * stride : (i + 1) * stride] + tail))
        keys.append(prev)
    return keys


#: The fixed probe whose last key is a client's fingerprint: tokens 0..31, 16-token blocks,
#: salt b"kvtier-probe", block 1 carrying one extra b"lora:7".
_PROBE = dict(token_ids=list(range(32)), block_tokens=16, salt=b"kvtier-probe", extras=[[], [b"lora:7"]])


def hash_fingerprint(algorithm: str = DEFAULT_ALGORITHM) -> str:
    """Hex of the probe's last key. A client sends it at registration; a daemon that
    computes a different value refuses the client instead of missing every lookup."""
    return block_keys(algorithm=algorithm, **_PROBE)[-1].hex()
