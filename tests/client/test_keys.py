"""Block keys: published vectors, the byte-level spec re-derived by hand, chain properties."""
from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest
import xxhash
from kvtier_client.keys import ALGORITHMS, ROOT_TAG, block_keys, hash_fingerprint, root_key

TOKENS = list(range(32))

# Published vectors. Any change here breaks every client in every language: never edit
# them to make a test pass; a new hash needs a new ROOT_TAG and new vectors.
VECTORS = {
    "xxh3-128": {
        "root": "6eedb418f891cd13d01b62c81c10fb38",
        "salted root": "dcf709867468e90bf1cee054f289d48b",
        "probe": ["0a5f38af3acdea1fbce030e6d0547d28", "8eb4c7cef7bc3167f0edbaefee0ce668"],
        "chain": ["64cfe407263f52ded92a449797f627db", "8dd0d1c3d1d4c19e64abfa63c148279b"],
        "salted": ["2e24b7766f16eec65df52bb3614e33c2", "17c3b1f915ccf314ff07200dcc4ee748"],
        "fingerprint": "8eb4c7cef7bc3167f0edbaefee0ce668",
    },
    "sha256": {
        "root": "ee4d2d2a872caf5cd47b66a1199abf851f6a1372415bd1bba25ed64d5dfad449",
        "salted root": "72e78ef65b8fae64cbeaaa68e81f849ed47c470f55c50f6668b8766701045396",
        "probe": [
            "628a036c286be5d1c0361c01dadae5996dd9c411395b0353b397caf1e9125efe",
            "64055811b2df4928cb64beb85b19b74f0a47af77aaeb0e1fc6627dddcccb5b95",
        ],
        "chain": [
            "8e4b5bceb5b4f488a7fc4d82b975b710bd6bddd389eebbae3e64589fd3028069",
            "a3a8899b570c9a51f4bb80a92441e82c8581302885bc507d77eb5b789d9798ea",
        ],
        "salted": [
            "6f292d2cc3630b44813faecea3350e3be4f5b351402bf2dcbf9791b2cdee03d7",
            "c93711c6a2fbe445dc03ec08be60e240795c8ac03cf24c190f4ce6eb492d40fc",
        ],
        "fingerprint": "64055811b2df4928cb64beb85b19b74f0a47af77aaeb0e1fc6627dddcccb5b95",
    },
}
SALT = b"tenant-42"
EXTRAS = [[b"lora:7"], [b"img:abc", b""]]


# -- the specification, written out independently of kvtier_client.keys -------------
def _h(algorithm: str, message: bytes) -> bytes:
    if algorithm == "sha256":
        return hashlib.sha256(message).digest()
    # xxh3-128 digests are the canonical (big-endian) 16 bytes of the 128-bit value.
    return xxhash.xxh3_128(message).intdigest().to_bytes(16, "big")


def _u32(value: int) -> bytes:
    return struct.pack("<I", value)


def spec_root(algorithm: str, salt: bytes = b"") -> bytes:
    return _h(algorithm, b"kvtier-block-key-v1" + _u32(len(salt)) + salt)


def spec_keys(algorithm: str, tokens, n: int, salt: bytes = b"", extras=None) -> list[bytes]:
    prev = spec_root(algorithm, salt)
    out = []
    for i in range(len(tokens) // n):
        block = tokens[i * n : (i + 1) * n]
        items = extras[i] if extras else []
        message = prev + _u32(n) + struct.pack(f"<{n}I", *block) + _u32(len(items))
        for e in items:
            message += _u32(len(e)) + e
        prev = _h(algorithm, message)
        out.append(prev)
    return out


def test_root_tag_is_the_published_one():
    assert ROOT_TAG == b"kvtier-block-key-v1"
    assert set(ALGORITHMS) == {"xxh3-128", "sha256"}


@pytest.mark.parametrize("algorithm", ["xxh3-128", "sha256"])
def test_spec_derivation_matches_published_vectors(algorithm):
    # The hand-built messages reproduce the pinned hex: the vectors follow the spec.
    v = VECTORS[algorithm]
    assert spec_root(algorithm).hex() == v["root"]
    assert spec_root(algorithm, SALT).hex() == v["salted root"]
    assert [k.hex() for k in spec_keys(algorithm, TOKENS, 16)] == v["chain"]
    assert [k.hex() for k in spec_keys(algorithm, TOKENS, 16, SALT, EXTRAS)] == v["salted"]
    probe = spec_keys(algorithm, TOKENS, 16, b"kvtier-probe", [[], [b"lora:7"]])
    assert [k.hex() for k in probe] == v["probe"]
    assert probe[-1].hex() == v["fingerprint"]


def test_worked_bytes_of_the_spec():
    # docs/block-keys.md, "Worked bytes": the root input is 23 bytes, block 0's input 88.
    root_input = bytes.fromhex("6b7674696572 2d626c6f636b2d6b65792d7631 00000000".replace(" ", ""))
    assert root_input == b"kvtier-block-key-v1" + bytes(4) and len(root_input) == 23
    assert _h("xxh3-128", root_input).hex() == VECTORS["xxh3-128"]["root"]
    block0 = bytes.fromhex(VECTORS["xxh3-128"]["root"]) + bytes([16, 0, 0, 0])
    block0 += b"".join(bytes([t, 0, 0, 0]) for t in range(16)) + bytes(4)
    assert len(block0) == 88
    assert _h("xxh3-128", block0).hex() == VECTORS["xxh3-128"]["chain"][0]
    # The canonical xxh3-128 form is what xxhash's digest() gives.
    assert xxhash.xxh3_128(block0).digest() == _h("xxh3-128", block0)


@pytest.mark.parametrize("algorithm", ["xxh3-128", "sha256"])
def test_implementation_matches_published_vectors(algorithm):
    v = VECTORS[algorithm]
    assert root_key(b"", algorithm).hex() == v["root"]
    assert root_key(SALT, algorithm).hex() == v["salted root"]
    probe = block_keys(TOKENS, 16, salt=b"kvtier-probe", extras=[[], [b"lora:7"]], algorithm=algorithm)
    assert [k.hex() for k in probe] == v["probe"]
    assert [k.hex() for k in block_keys(TOKENS, 16, algorithm=algorithm)] == v["chain"]
    salted = block_keys(TOKENS, 16, salt=SALT, extras=EXTRAS, algorithm=algorithm)
    assert [k.hex() for k in salted] == v["salted"]
    assert hash_fingerprint(algorithm) == v["fingerprint"]


def test_default_algorithm_is_xxh3_128():
    assert root_key().hex() == VECTORS["xxh3-128"]["root"]
    assert [k.hex() for k in block_keys(TOKENS, 16)] == VECTORS["xxh3-128"]["chain"]
    assert hash_fingerprint() == VECTORS["xxh3-128"]["fingerprint"]
    assert {len(k) for k in block_keys(TOKENS, 16)} == {16}
    assert {len(k) for k in block_keys(TOKENS, 16, algorithm="sha256")} == {32}


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_spec_holds_for_other_sizes_and_large_ids(algorithm):
    rng = np.random.default_rng(7)
    tokens = [int(t) for t in rng.integers(0, 2**32, size=45, dtype=np.uint64)] + [2**32 - 1, 0, 0]
    extras = [[bytes([i]) * i] for i in range(6)]
    assert block_keys(tokens, 8, extras=extras, salt=b"s", algorithm=algorithm) == spec_keys(
        algorithm, tokens, 8, b"s", extras
    )


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_only_full_blocks_get_keys(algorithm):
    full = block_keys(TOKENS, 16, algorithm=algorithm)
    assert block_keys(TOKENS + [99] * 15, 16, algorithm=algorithm) == full
    assert block_keys(TOKENS[:15], 16, algorithm=algorithm) == []
    assert block_keys(TOKENS[:31], 16, algorithm=algorithm) == full[:1]
    assert block_keys([], 16, algorithm=algorithm) == []
    assert len(block_keys(TOKENS + [99] * 16, 16, algorithm=algorithm)) == 3


def test_numpy_and_list_inputs_agree():
    expected = block_keys(TOKENS, 16)
    for array in (np.arange(32, dtype=np.uint32), np.arange(32, dtype=np.int64), np.arange(32, dtype=np.uint16)):
        assert block_keys(array, 16) == expected


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_salt_changes_every_key(algorithm):
    plain = block_keys(TOKENS * 2, 16, algorithm=algorithm)
    salted = block_keys(TOKENS * 2, 16, salt=b"tenant", algorithm=algorithm)
    assert root_key(b"tenant", algorithm) != root_key(b"", algorithm)
    assert all(a != b for a, b in zip(plain, salted))
    assert len(salted) == 4


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_extras_change_their_block_and_later_ones_only(algorithm):
    tokens = list(range(64))
    plain = block_keys(tokens, 16, algorithm=algorithm)
    extras = [[], [], [b"lora:1"], []]
    marked = block_keys(tokens, 16, extras=extras, algorithm=algorithm)
    assert marked[:2] == plain[:2]
    assert all(a != b for a, b in zip(marked[2:], plain[2:]))
    # Empty extras are the same as no extras; an empty extra item is not.
    assert block_keys(tokens, 16, extras=[[]] * 4, algorithm=algorithm) == plain
    assert block_keys(tokens, 16, extras=[[b""], [], [], []], algorithm=algorithm)[0] != plain[0]
    # Extras are length-prefixed: splitting one item into two changes the key.
    one = block_keys(TOKENS[:16], 16, extras=[[b"ab"]], algorithm=algorithm)
    two = block_keys(TOKENS[:16], 16, extras=[[b"a", b"b"]], algorithm=algorithm)
    assert one != two


def test_extras_must_cover_every_full_block_and_may_run_longer():
    with pytest.raises(ValueError, match="extras has 1 entries"):
        block_keys(TOKENS, 16, extras=[[]])
    assert block_keys(TOKENS, 16, extras=EXTRAS + [[b"ignored"]]) == block_keys(TOKENS, 16, extras=EXTRAS)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_parent_continues_the_chain(algorithm):
    tokens = list(range(80))
    whole = block_keys(tokens, 16, salt=b"x", algorithm=algorithm)
    for cut in range(1, 5):
        rest = block_keys(tokens[cut * 16 :], 16, parent=whole[cut - 1], algorithm=algorithm)
        assert rest == whole[cut:]
    # The salt is already inside the parent; a salt passed with it is ignored.
    assert block_keys(tokens[16:], 16, parent=whole[0], salt=b"other", algorithm=algorithm) == whole[1:]


@pytest.mark.parametrize(
    "tokens",
    [
        [-1] + TOKENS[1:],
        TOKENS[:-1] + [2**32],
        np.zeros((2, 16), dtype=np.int64),
        [0.5] * 16,
        [2**64] * 16,
        [True] * 16,
        np.arange(16, dtype=np.float32),
    ],
    ids=["negative", "2**32", "2-D", "float", "huge", "bool", "float array"],
)
def test_bad_token_ids_raise(tokens):
    with pytest.raises(ValueError):
        block_keys(tokens, 16)


def test_bad_block_size_and_algorithm_raise():
    with pytest.raises(ValueError, match="block_tokens must be positive"):
        block_keys(TOKENS, 0)
    with pytest.raises(ValueError, match="unknown block-key algorithm 'md5'"):
        block_keys(TOKENS, 16, algorithm="md5")
    with pytest.raises(ValueError, match="unknown block-key algorithm"):
        root_key(b"", "xxh64")
    with pytest.raises(ValueError, match="unknown block-key algorithm"):
        hash_fingerprint("sha1")
