"""What names a page of this tier: the page layout (one row of vLLM's CPU tier, as bytes),
the namespace, and the block key of each of vLLM's offload keys.

vLLM's offload key is its block hash plus a 4-byte KV cache group index: it carries no token
ids, so these keys cannot equal the token-chained keys kvtier's own vLLM connector computes
(docs/block-keys.md): the two paths never share pages. A key is
``sha256(TAG || fingerprint || offload key)``, where the fingerprint covers what makes the
same hash mean different bytes: the model name and KV dtype, tokens per hash, blocks per
chunk, the KV cache groups and their layers, the parallel shape unless vLLM says the row is
parallelism-agnostic, the canonical layout (vLLM's own storage identity, as its file-system
tier names its directory), the row's size and the configured salt.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import TYPE_CHECKING

from kvtier_client.keys import BlockKey
from kvtier_client.layout import PageLayout

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec, OffloadKey

TAG = b"kvtier-vllm-offload-v1"
#: The block-key algorithm the tier registers (keys are sha256 digests, 32 bytes).
KEY_ALGORITHM = "sha256"


def row_layout(row_bytes: int) -> PageLayout:
    """A page is one row of the CPU tier, whatever vLLM put in it: `row_bytes` bytes (uint8),
    as a `latent` layout of one layer, one head and one token. Codecs see raw bytes: the
    lossy ones leave such pages as they are; the lossless one still applies."""
    return PageLayout(layers=1, kv_heads=1, head_dim=row_bytes, block_tokens=1, dtype="uint8", order="latent")


def storage_identity(spec: OffloadingSpec) -> dict:
    """vLLM's own identity of where a block's bytes may be shared (the fields its file-system
    tier hashes into its directory name)."""
    from vllm.v1.kv_offload.file_mapper import FileMapper

    mapper = FileMapper.from_offloading_spec(
        root_dir="", offloading_spec=spec, blocks_per_file=spec.blocks_per_chunk, parallel_agnostic=True)
    return mapper.get_run_config()


def fingerprint(spec: OffloadingSpec, row_bytes: int, salt: bytes) -> bytes:
    """32 bytes naming what a row's bytes depend on besides the block hash."""
    identity = json.dumps({**storage_identity(spec), "row_bytes": row_bytes}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(TAG + identity.encode() + len(salt).to_bytes(4, "little") + salt).digest()


def default_namespace(spec: OffloadingSpec) -> str:
    """`vllm-offload/<model name>`: engines of one model share pages unless told otherwise."""
    return "vllm-offload/" + spec.config.model.name.lstrip("/")


class TierKeys:
    """vLLM offload keys -> kvtier block keys, under one fingerprint."""

    def __init__(self, fingerprint: bytes) -> None:
        self._prefix = hashlib.sha256(TAG + fingerprint)

    def block_key(self, key: OffloadKey) -> BlockKey:
        h = self._prefix.copy()
        h.update(key)
        return BlockKey(h.digest())

    def block_keys(self, keys: Iterable[OffloadKey]) -> list[BlockKey]:
        return [self.block_key(key) for key in keys]
