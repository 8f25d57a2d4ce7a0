"""kvtier client: everything an engine needs to use a kvtier daemon."""
from kvtier_client.keys import ALGORITHMS, DEFAULT_ALGORITHM, BlockKey, block_keys, hash_fingerprint, root_key
from kvtier_client.layout import PageLayout

__all__ = [
    "ALGORITHMS",
    "DEFAULT_ALGORITHM",
    "BlockKey",
    "PageLayout",
    "block_keys",
    "hash_fingerprint",
    "root_key",
]
