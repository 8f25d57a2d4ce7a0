"""llm-d's reading of one KV-event message: the ZMQ frames' topic, and the msgpack batch of
vLLM events in either layout, as llm-d/llm-d-router at commit ebab687927f5 reads them:

    pkg/kvevents/engineadapter/common.go      parseTopic, getHashAsUint64, convertExtraKeys
    pkg/kvevents/engineadapter/vllm_adapter.go ParseMessage, mapEventToFields, the converters

with github.com/vmihailenco/msgpack/v5 v5.4.1's rules where they decide what is refused: an
array-encoded batch must have exactly 3 elements; an integer hash is accepted only as a
msgpack uint64/int64, which with the minimal encoding msgspec and vLLM use means values
>= 2**32 or < -2**31 (smaller ones decode as narrower Go ints, which getHashAsUint64
refuses). A producer writing small integers at full width (Go's own encoder does) is
accepted by llm-d and refused here; Python producers never do. tests/llmd_index.py indexes
what this decodes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

MASK64 = (1 << 64) - 1
STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                 "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window")
REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")


class DecodeError(ValueError):
    """A message llm-d's vLLM adapter refuses; the whole batch is dropped."""


@dataclass(frozen=True)
class Stored:
    hashes: list[int]
    tokens: list[int]
    parent: int  # 0: a root
    block_size: int
    medium: str
    lora_name: str | None
    extra_keys: list[list[Any] | None] | None
    group: int | None
    kind: str
    window: int | None


@dataclass(frozen=True)
class Removed:
    hashes: list[int]
    medium: str
    group: int | None


@dataclass(frozen=True)
class Cleared:
    pass


def parse_topic(topic: str) -> tuple[str, str]:
    """(pod id, model): `kv@<pod>@<model>` in exactly three parts, else (topic, "")."""
    parts = topic.split("@")
    return (parts[1], parts[2]) if len(parts) == 3 else (topic, "")


def engine_key(raw: Any) -> int:
    """getHashAsUint64: a hash as bytes is its last 8 bytes, big-endian (left-padded)."""
    if isinstance(raw, bytes):
        if not raw:
            raise DecodeError("hash byte slice is empty")
        return int.from_bytes(raw[-8:], "big")
    if isinstance(raw, int) and not isinstance(raw, bool) and (raw >= 1 << 32 or raw < -(1 << 31)):
        return raw & MASK64
    raise DecodeError(f"unsupported hash type: {type(raw).__name__} {raw!r} (llm-d takes bytes, uint64, int64)")


def _int(raw: Any, what: str) -> int:
    if isinstance(raw, int) and not isinstance(raw, bool):
        return raw
    raise DecodeError(f"{what}: unsupported numeric type: {type(raw).__name__}")


def _at(fields: list[Any], i: int) -> Any:
    return fields[i] if i < len(fields) else None


def _opt_str(fields: list[Any], i: int, what: str) -> str | None:
    raw = _at(fields, i)
    if raw is not None and not isinstance(raw, str):
        raise DecodeError(f"{what} is not a string: {type(raw).__name__}")
    return raw


def _opt_int(fields: list[Any], i: int, what: str) -> int | None:
    raw = _at(fields, i)
    return None if raw is None else _int(raw, what)


def _hashes(raw: Any, what: str) -> list[int]:
    if not isinstance(raw, list):
        raise DecodeError(f"{what}: block_hashes is not an array: {type(raw).__name__}")
    return [engine_key(h) for h in raw]


def _group(fields: list[Any], i: int, what: str) -> int | None:
    group = _opt_int(fields, i, f"{what}: group_idx")
    if group is not None and group < 0:
        raise DecodeError(f"{what}: group_idx: negative value: {group}")
    return group


def _event_fields(raw: Any) -> list[Any]:
    """decodeVLLMEvent: an array is used as is; a map is put in positional order by its tag."""
    if isinstance(raw, dict):
        if not all(isinstance(k, str) for k in raw):
            raise DecodeError("event is neither an array nor a map with string keys")
        if "type" not in raw:
            raise DecodeError('map-encoded event is missing the "type" tag')
        tag = raw["type"]
        if not isinstance(tag, str):
            raise DecodeError(f'map-encoded event tag ("type") is not a string: {type(tag).__name__}')
        order = {"BlockStored": STORED_FIELDS, "BlockRemoved": REMOVED_FIELDS}.get(tag, ())
        return [tag, *(raw.get(name) for name in order)]
    if isinstance(raw, list):
        return raw
    raise DecodeError(f"event is neither an array nor a map: {type(raw).__name__}")


def _stored(f: list[Any]) -> Stored:
    if len(f) < 5:
        raise DecodeError(f"BlockStored: need at least 5 fields, got {len(f)}")
    if not isinstance(f[3], list):
        raise DecodeError(f"BlockStored: token_ids is not an array: {type(f[3]).__name__}")
    extra = _at(f, 8)
    if extra is not None and not (isinstance(extra, list) and all(k is None or isinstance(k, list) for k in extra)):
        raise DecodeError("BlockStored: extra_keys is not an array of arrays or nils")
    _opt_int(f, 5, "BlockStored: lora_id")
    return Stored(
        hashes=_hashes(f[1], "BlockStored"), parent=0 if f[2] is None else engine_key(f[2]),
        tokens=[_int(t, f"token_ids[{i}]") & 0xFFFFFFFF for i, t in enumerate(f[3])],
        block_size=_int(f[4], "BlockStored: block_size"), medium=_opt_str(f, 6, "BlockStored: medium") or "",
        lora_name=_opt_str(f, 7, "BlockStored: lora_name"), extra_keys=extra, group=_group(f, 9, "BlockStored"),
        kind=_opt_str(f, 10, "BlockStored: kv_cache_spec_kind") or "",
        window=_opt_int(f, 11, "BlockStored: kv_cache_spec_sliding_window"))


def _removed(f: list[Any]) -> Removed:
    if len(f) < 2:
        raise DecodeError(f"BlockRemoved: need at least 2 fields, got {len(f)}")
    return Removed(_hashes(f[1], "BlockRemoved"), _opt_str(f, 2, "BlockRemoved: medium") or "",
                   _group(f, 3, "BlockRemoved"))


def decode_batch(payload: bytes) -> list[Stored | Removed | Cleared]:
    """VLLMAdapter.ParseMessage's payload half: every event, or DecodeError for the batch."""
    try:
        batch = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as err:
        raise DecodeError(f"failed to decode vLLM event batch: {err}") from None
    if batch is None or batch == []:
        return []  # vmihailenco: a nil or empty array leaves the struct zero
    if isinstance(batch, dict):  # a map fills the Go struct by its field names, ignoring others
        ts, events, rank = batch.get("TS"), batch.get("Events"), batch.get("DataParallelRank")
    elif isinstance(batch, list):
        if len(batch) != 3:
            raise DecodeError(f"msgpack: array-encoded batch has {len(batch)} elements; llm-d's struct needs "
                              "exactly 3 [ts, events, data_parallel_rank]")
        ts, events, rank = batch
    else:
        raise DecodeError(f"batch is neither an array nor a map: {type(batch).__name__}")
    if not (ts is None or isinstance(ts, (int, float))) or isinstance(ts, bool):
        raise DecodeError(f"batch ts is not a number: {type(ts).__name__}")
    if rank is not None:
        _int(rank, "data_parallel_rank")
    if events is not None and not isinstance(events, list):
        raise DecodeError(f"batch events is not an array: {type(events).__name__}")
    out: list[Stored | Removed | Cleared] = []
    for raw in events or []:
        fields = _event_fields(raw)
        if not fields:
            raise DecodeError("malformed tagged union: no tag")
        tag = fields[0]
        if not isinstance(tag, str):
            raise DecodeError(f"event tag is not a string: {type(tag).__name__}")
        if tag == "BlockStored":
            out.append(_stored(fields))
        elif tag == "BlockRemoved":
            out.append(_removed(fields))
        elif tag == "AllBlocksCleared":
            out.append(Cleared())
        else:
            raise DecodeError(f"unknown vLLM event tag: {tag}")
    return out
