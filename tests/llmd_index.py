"""llm-d's KV-event decoding, indexing and scoring path, re-implemented for kvtier's tests.

The router that credits kvtier's pages is Go (llm-d/llm-d-router) and Go modules cannot be
fetched here, so this module follows its code line by line instead, so that a test can ask
"which endpoint and tier would llm-d credit for what we published, and how would it score a
request" without a Go toolchain. It follows llm-d/llm-d-router at commit ebab687927f5
(2026-08-22):

    pkg/kvevents/zmq_subscriber.go            parseEventFrame: 3 frames, sequence >= 8 bytes
    pkg/kvevents/engineadapter/common.go      parseTopic, getHashAsUint64, convertExtraKeys
    pkg/kvevents/engineadapter/vllm_adapter.go ParseMessage, mapEventToFields, the converters
    pkg/kvevents/pool.go                      processRawMessage, processEventBatch,
                                              handleDeviceTierUpdate, normalizeDeviceTier,
                                              blockStoredEventDigestible, realignExtraFeatures
    pkg/kvevents/event_dedup_filter.go        reference-counted removes
    pkg/kvcache/kvblock/token_processor.go    TokensToKVBlockKeys (cbor-fnv and xxh64)
    pkg/kvcache/kvblock/extra_keys.go         ParseRawExtraKeys
    pkg/kvcache/kvblock/index.go, in_memory.go engineToRequestMapping, Add, Evict, Lookup,
                                              Clear, GetRequestKey (the default index)
    pkg/kvcache/kvblock_scorer.go, backend.go LongestPrefixScorer, fillMaxWeights, defaults
    pkg/epp/.../preciseprefixcache/producer.go, extractor.go
                                              the pod id `<address>:<port>`, int(score)

and github.com/vmihailenco/msgpack/v5 v5.4.1's rules where they decide what is refused: an
array-encoded batch must have exactly 3 elements; an integer hash is accepted only as a
msgpack uint64/int64, which with the minimal encoding msgspec and vLLM use means values
>= 2**32 or < -2**31 (smaller ones decode as narrower Go ints, which getHashAsUint64 refuses).

Left out: the ZMQ transport and replay (sequence numbers matter only with a replay
endpoint, which is off by default), the SGLang adapter, the Redis and cost-aware indexes,
the in-memory index's bound of 1e8 keys, speculative indexing, metrics, and the worker
sharding (one pod's messages are processed in order, as here).
"""
from __future__ import annotations

import struct
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any

import msgspec
import xxhash

MASK64 = (1 << 64) - 1
TOPIC_FILTER = "kv@"  # kvevents.DefaultConfig().TopicFilter: the ZMQ subscription prefix
DEFAULT_TIER = "gpu"  # pool.go defaultEventSourceDeviceTier: an event without a medium
POD_CACHE_SIZE = 10  # in_memory.go defaultPodsPerKey: (pod, tier) entries kept per key, LRU
DEFAULT_WEIGHTS = {"gpu": 1.0, "cpu": 0.8}  # backend.go DefaultKVCacheBackendConfig
UNCONFIGURED_WEIGHT = 1.0  # kvblock_scorer.go fillMaxWeights: a medium not configured
PREFIX_KINDS = {"full_attention", "mla_attention", "sink_full_attention"}  # isPrefixIndexableSpecKind
STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                 "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window")
REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")


class DecodeError(ValueError):
    """A message llm-d's vLLM adapter refuses; the whole batch is dropped."""


@dataclass(frozen=True)
class PodEntry:
    """kvblock.PodEntry: who holds a block, in which tier (lower case), for which KV group."""

    pod: str
    tier: str
    group: int | None = None


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


def normalize_tier(medium: str) -> str:
    return medium.lower() if medium else DEFAULT_TIER


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


def fnv64a(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for byte in data:
        h = ((h ^ byte) * 0x100000001B3) & MASK64
    return h


def _cbor_head(major: int, n: int) -> bytes:
    if n < 24:
        return bytes([major << 5 | n])
    for info, fmt in ((24, ">B"), (25, ">H"), (26, ">I"), (27, ">Q")):
        if n < 1 << (8 * struct.calcsize(fmt)):
            return bytes([major << 5 | info]) + struct.pack(fmt, n)
    raise ValueError(f"{n} does not fit a CBOR head")


def cbor(value: Any) -> bytes:
    """Canonical CBOR (RFC 7049 canonical, as fxamacker's CanonicalEncOptions) of what the
    token processor hashes: unsigned ints, text, arrays, nil, and maps (MMHash structs)."""
    if value is None:
        return b"\xf6"
    if isinstance(value, bool) or not isinstance(value, (int, str, list, tuple, dict)):
        raise TypeError(f"no canonical CBOR here for {type(value).__name__}")
    if isinstance(value, int):
        return _cbor_head(0, value) if value >= 0 else _cbor_head(1, -1 - value)
    if isinstance(value, str):
        data = value.encode()
        return _cbor_head(3, len(data)) + data
    if isinstance(value, dict):
        items = sorted(((cbor(k), cbor(v)) for k, v in value.items()), key=lambda kv: (len(kv[0]), kv[0]))
        return _cbor_head(5, len(items)) + b"".join(k + v for k, v in items)
    return _cbor_head(4, len(value)) + b"".join(cbor(v) for v in value)


def parse_extra_keys(raw: list[list[Any] | None] | None) -> list[list[str] | None] | None:
    """ParseRawExtraKeys: per block, every string (or [string, ...]) is a multimodal hash;
    anything else is skipped. vLLM's LoRA name and cache salt are strings, so they count."""
    if raw is None:
        return None
    out: list[list[str] | None] = []
    for block in raw:
        hashes = [e if isinstance(e, str) else e[0] for e in block or ()
                  if isinstance(e, str) or (isinstance(e, list) and e and isinstance(e[0], str))]
        out.append(hashes or None)
    return out


def realign(features: list[list[str] | None], blocks: int) -> list[list[str] | None] | None:
    """realignExtraFeatures: engine-block features onto `blocks` canonical blocks."""
    n = len(features)
    if blocks == 0:
        return None
    if n in (0, blocks):
        return features
    if n < blocks:
        return [features[i * n // blocks] for i in range(blocks)]
    out: list[list[str] | None] = [None] * blocks
    for i, feature in enumerate(features):
        if feature is not None:
            out[i * blocks // n] = (out[i * blocks // n] or []) + feature
    return out


def engine_to_request(engine: list[int], request: list[int]) -> dict[int, list[int]]:
    """index.go engineToRequestMapping: 1:1, many:1 or 1:many by the ratio of lengths."""
    out: dict[int, list[int]] = {}
    if engine and request:
        n = max(len(engine), len(request))
        for i in range(n):
            out.setdefault(engine[i * len(engine) // n], []).append(request[i * len(request) // n])
    return out


def longest_prefix_score(keys: list[int], key_to_pods: dict[int, list[PodEntry]], weights: dict[str, float],
                         unconfigured_weight: float = UNCONFIGURED_WEIGHT) -> dict[str, float]:
    """LongestPrefixScorer.Score: pods holding keys[0] are scored; each keeps adding its
    best tier's weight per block until the first block it does not hold."""
    def best(entries: list[PodEntry]) -> dict[str, float]:
        out: dict[str, float] = {}
        for e in entries:
            w = weights.get(e.tier, unconfigured_weight)
            if e.pod not in out or w > out[e.pod]:
                out[e.pod] = w
        return out

    if not keys:
        return {}
    scores = best(key_to_pods.get(keys[0], []))
    active = set(scores)
    for key in keys[1:]:
        if not active:
            break
        current = best(key_to_pods.get(key, []))
        for pod in list(active):
            if pod in current:
                scores[pod] += current[pod]
            else:
                active.discard(pod)
    return scores


class LlmdIndex:
    """One llm-d router's view: its event pool, in-memory index and longest-prefix scorer.
    `dropped` counts what llm-d drops and why (the keys are listed in `feed`)."""

    def __init__(self, block_size_tokens: int = 16, hash_seed: str = "", weights: dict[str, float] | None = None,
                 unconfigured_weight: float = UNCONFIGURED_WEIGHT, hash_algorithm: str = "cbor-fnv",
                 topic_filter: str = TOPIC_FILTER, pod_cache_size: int = POD_CACHE_SIZE) -> None:
        if block_size_tokens <= 0:
            raise ValueError(f"blockSizeTokens must be greater than 0, got {block_size_tokens}")
        if hash_algorithm not in ("cbor-fnv", "xxh64"):
            raise ValueError(f"unsupported hashAlgorithm {hash_algorithm!r}: accepted values are cbor-fnv and xxh64")
        self.block_size_tokens = block_size_tokens
        self.weights = dict(DEFAULT_WEIGHTS if weights is None else weights)
        self.unconfigured_weight = unconfigured_weight
        self.topic_filter = topic_filter.encode()
        self.pod_cache_size = pod_cache_size
        self._xxh = hash_algorithm == "xxh64"
        self._seed_hash = xxhash.xxh64_intdigest(hash_seed.encode()) if self._xxh else fnv64a(hash_seed.encode())
        self._holders: dict[int, OrderedDict[PodEntry, None]] = {}  # request key -> entries, oldest first
        self._engine_to_request: dict[int, list[int]] = {}
        self._groups: dict[tuple[str, int], str] = {}  # (pod, group) -> the kind learned (GroupCatalog)
        self._refs: dict[str, Counter[tuple[str, int | None, int]]] = {}  # pod -> (tier, group, hash) -> stores
        self.dropped: Counter[str] = Counter()
        self.last_error = ""

    # -- hashing (token_processor.go) --------------------------------------------------
    def _hash(self, parent: int, tokens: list[int] | None, extra: str | list[str] | None) -> int:
        if self._xxh:
            strings = [extra] if isinstance(extra, str) else extra or []
            data = parent.to_bytes(8, "little") + b"".join(t.to_bytes(4, "little") for t in tokens or [])
            data += b"".join(len(s.encode()).to_bytes(8, "little") + s.encode() for s in strings)
            return xxhash.xxh64_intdigest(data)
        if isinstance(extra, list):
            extra = [{"Hash": h} for h in extra]  # []MMHash: each struct a map by field name
        return fnv64a(cbor([parent, tokens, extra]))

    def _keys(self, parent: int, tokens: list[int], model: str, features: list[list[str] | None] | None) -> list[int]:
        bs = self.block_size_tokens
        chunks = [tokens[i:i + bs] for i in range(0, len(tokens) - bs + 1, bs)]
        if not chunks:
            return []
        if features is not None and len(features) != len(chunks):
            raise ValueError(f"extraFeatures length {len(features)} does not match token chunk count {len(chunks)}")
        prefix = parent or self._hash(self._seed_hash, None, model)
        keys = []
        for chunk, feature in zip(chunks, features or [None] * len(chunks)):
            prefix = self._hash(prefix, chunk, feature)
            keys.append(prefix)
        return keys

    def request_keys(self, model: str, token_ids: list[int], lora_name: str | None = None,
                     extra: list[list[str] | None] | None = None) -> list[int]:
        """The keys llm-d computes for a request (or a stored chain from the root); the LoRA
        name replaces the model name; `extra` is per block, its multimodal hashes or None."""
        return self._keys(0, [t & 0xFFFFFFFF for t in token_ids], lora_name or model, extra)

    # -- events (zmq_subscriber.go, vllm_adapter.go, pool.go) ----------------------------
    def feed(self, topic: bytes, seq: bytes, payload: bytes, source_endpoint: str | None = None) -> None:
        """One ZMQ message. `source_endpoint` is set in pod-discovery mode (the default),
        where it replaces the topic's pod id. Counted in `dropped`: bad_frame (sequence under
        8 bytes), filtered_topic (not under the subscription prefix), undecodable (the whole
        batch), bad_topic (not kv@<pod>@<model>: llm-d keeps it, hashing with model ""),
        unknown_parent, partial_block, unresolved_tier_update, request_key_error,
        store_skipped:<reason>, remove_skipped:<reason>."""
        if len(seq) < 8:
            self.dropped["bad_frame"] += 1
            return
        if not topic.startswith(self.topic_filter):
            self.dropped["filtered_topic"] += 1
            return
        pod, model = parse_topic(topic.decode("utf-8", "surrogateescape"))
        try:
            events = decode_batch(payload)
        except DecodeError as err:
            self.dropped["undecodable"] += 1
            self.last_error = str(err)
            return
        if len(topic.split(b"@")) != 3:
            self.dropped["bad_topic"] += 1
        pod = source_endpoint or pod
        for event in events:
            if isinstance(event, Stored):
                self._on_stored(event, pod, model)
            elif isinstance(event, Removed):
                self._on_removed(event, pod)
            else:
                self.clear_pod(pod)

    def _on_stored(self, ev: Stored, pod: str, model: str) -> None:
        tier, kind = normalize_tier(ev.medium), ev.kind
        if ev.group is not None:
            if kind == "":
                kind = self._groups.get((pod, ev.group), "")
            else:
                self._groups[(pod, ev.group)] = kind
        entry = PodEntry(pod, tier, ev.group)
        reason = self._undigestible(ev, kind)
        if reason:
            self.dropped[f"store_skipped:{reason}"] += 1
            return
        parent = 0
        if ev.parent != 0:
            parent = self._request_key(ev.parent)
            if parent is None:
                self.dropped["unknown_parent"] += 1
                return
        features = parse_extra_keys(ev.extra_keys)
        if features is not None:
            features = realign(features, len(ev.tokens) // self.block_size_tokens)
        try:
            keys = self._keys(parent, ev.tokens, ev.lora_name or model, features)
        except ValueError as err:
            self.dropped["request_key_error"] += 1
            self.last_error = str(err)
            return
        if keys:
            self._add(ev.hashes, keys, entry)
        elif not self._tier_update(ev.tokens, ev.hashes, entry):
            self.dropped["partial_block" if ev.tokens else "unresolved_tier_update"] += 1
            return
        if ev.hashes:
            refs = self._refs.setdefault(pod, Counter())
            refs.update((tier, ev.group, h) for h in ev.hashes)

    @staticmethod
    def _undigestible(ev: Stored, kind: str) -> str:
        if ev.group is None:
            return ""
        if kind not in PREFIX_KINDS:
            return "unsupported_cache_kind"
        if not ev.tokens:
            return ""
        if ev.block_size <= 0:
            return "invalid_block_size"
        if len(ev.tokens) % ev.block_size or len(ev.tokens) // ev.block_size != len(ev.hashes):
            return "non_dense_block_span"
        return ""

    def _tier_update(self, tokens: list[int], hashes: list[int], entry: PodEntry) -> bool:
        """handleDeviceTierUpdate: a token-less store adds the tier to the request key each
        engine key resolves to (the last of its keys), when there is one."""
        if tokens or not hashes:
            return False
        resolved = [k for k in dict.fromkeys(map(self._request_key, hashes)) if k is not None]
        if resolved:
            self._add(None, resolved, entry)
        return bool(resolved)

    def _on_removed(self, ev: Removed, pod: str) -> None:
        if ev.group is not None:
            kind = self._groups.get((pod, ev.group))
            if kind is None or kind not in PREFIX_KINDS:
                self.dropped["remove_skipped:" + ("unknown_group" if kind is None else "unsupported_cache_kind")] += 1
                return
        entry = PodEntry(pod, normalize_tier(ev.medium), ev.group)
        refs = self._refs.get(pod)
        for h in ev.hashes:
            key = (entry.tier, entry.group, h)
            if refs is not None and refs.get(key, 0) > 1:
                refs[key] -= 1  # another store still references it: the remove is suppressed
                continue
            if refs is not None:
                refs.pop(key, None)
            self._evict(h, entry)
        if refs is not None and not refs:
            del self._refs[pod]

    def clear_pod(self, pod: str) -> None:
        """AllBlocksCleared, or an endpoint deleted: every entry of the pod, in every tier."""
        for key in list(self._holders):
            for entry in [e for e in self._holders[key] if e.pod == pod]:
                del self._holders[key][entry]
            if not self._holders[key]:
                del self._holders[key]
        self._refs.pop(pod, None)

    # -- the in-memory index (in_memory.go) -----------------------------------------------
    def _request_key(self, engine: int) -> int | None:
        keys = self._engine_to_request.get(engine)
        return keys[-1] if keys else None

    def _add(self, engine: list[int] | None, request: list[int], entry: PodEntry) -> None:
        if engine is not None:
            self._engine_to_request.update(engine_to_request(engine, request))
        for key in request:
            holders = self._holders.setdefault(key, OrderedDict())
            holders[entry] = None
            holders.move_to_end(entry)
            if len(holders) > self.pod_cache_size:
                holders.popitem(last=False)

    def _evict(self, engine: int, entry: PodEntry) -> None:
        keys = self._engine_to_request.get(engine)
        if keys is None:
            return
        for key in keys:
            holders = self._holders.get(key)
            if holders is not None:
                holders.pop(entry, None)
                if not holders:
                    del self._holders[key]
        if all(key not in self._holders for key in keys):
            del self._engine_to_request[engine]

    def _lookup(self, keys: list[int], pods: set[str]) -> dict[int, list[PodEntry]]:
        found = {}
        for key in keys:
            entries = [e for e in self._holders.get(key, ()) if not pods or e.pod in pods]
            if entries:
                found[key] = entries
        return found

    # -- what a test asks ---------------------------------------------------------------
    def pods_holding(self, request_key: int) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        for entry in self._holders.get(request_key, ()):
            out.setdefault(entry.pod, set()).add(entry.tier)
        return out

    def request_key_of(self, block_hash: bytes | int) -> int | None:
        """The request key llm-d maps an engine block hash to (GetRequestKey), if any."""
        return self._request_key(engine_key(block_hash))

    def score(self, model: str, token_ids: list[int], pods: list[str] | None = None,
              lora_name: str | None = None, extra: list[list[str] | None] | None = None) -> dict[str, float]:
        """Indexer.ScoreTokens: the weighted longest-prefix score of each pod holding block 0."""
        keys = self.request_keys(model, token_ids, lora_name, extra)
        return longest_prefix_score(keys, self._lookup(keys, set(pods or ())), self.weights, self.unconfigured_weight)

    def match_blocks(self, model: str, token_ids: list[int], pods: list[str] | None = None) -> dict[str, int]:
        """What the precise-prefix-cache producer hands the scheduler: int(score), truncated."""
        return {pod: int(s) for pod, s in self.score(model, token_ids, pods).items()}
