"""llm-d's KV-event indexing and scoring path, re-implemented for kvtier's tests.

The router that credits kvtier's pages is Go (llm-d/llm-d-router) and Go modules cannot be
fetched here, so this module and tests/llmd_events.py (which decodes the messages) follow
its code line by line instead: a test can ask "which endpoint and tier would llm-d credit
for what we published, and how would it score a request" without a Go toolchain. It follows
llm-d/llm-d-router at commit ebab687927f5 (2026-08-22), with the scoring of PR #2809 (merged
2026-09-11): a medium without a configured weight scores 0 (it scored 1.0 before), and the
default weights add `shared_storage` 0.4 and `object_store` 0.2 to `gpu` 1.0 and `cpu` 0.8:

    pkg/kvevents/zmq_subscriber.go            parseEventFrame: 3 frames, sequence >= 8 bytes
    pkg/kvevents/engineadapter/*.go           (tests/llmd_events.py)
    pkg/kvevents/pool.go                      processRawMessage, processEventBatch,
                                              handleDeviceTierUpdate, normalizeDeviceTier,
                                              blockStoredEventDigestible, realignExtraFeatures
    pkg/kvevents/event_dedup_filter.go        reference-counted removes
    pkg/kvcache/kvblock/token_processor.go    TokensToKVBlockKeys (cbor-fnv and xxh64)
    pkg/kvcache/kvblock/extra_keys.go         ParseRawExtraKeys
    pkg/kvcache/kvblock/hma.go                GroupCatalog (KV-cache groups learned per pod)
    pkg/kvcache/kvblock/index.go, in_memory.go engineToRequestMapping, Add, Evict, Lookup,
                                              Clear, GetRequestKey (the default index)
    pkg/kvcache/kvblock_scorer.go, backend.go LongestPrefixScorer, fillMaxWeights, defaults
    pkg/epp/framework/plugins/requestcontrol/dataproducer/preciseprefixcache/producer.go,
    extractor.go                              the pod id `<address>:<port>`, int(score)

Checked against llm-d-kv-cache's golden request keys (tests/e2e/uds_tokenizer at
7be76e119ca5) and ports of llm-d's Go tests (tests/test_llmd_index.py).

Left out: the ZMQ transport and replay (sequence numbers matter only with a replay
endpoint, which is off by default), the SGLang adapter, the Redis and cost-aware indexes,
the in-memory index's bound of 1e8 keys, speculative indexing, metrics, and the worker
sharding (one pod's messages are processed in order, as here).
"""
from __future__ import annotations

import struct
from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash
import yaml
from llmd_events import (
    MASK64,
    DecodeError,
    Removed,
    Stored,
    decode_batch,
    engine_key,
    parse_topic,
)

TOPIC_FILTER = "kv@"  # kvevents.DefaultConfig().TopicFilter: the ZMQ subscription prefix
DEFAULT_TIER = "gpu"  # pool.go defaultEventSourceDeviceTier: an event without a medium
POD_CACHE_SIZE = 10  # in_memory.go defaultPodsPerKey: (pod, tier) entries kept per key, LRU
#: backend.go DefaultKVCacheBackendConfig (PR #2809: shared_storage and object_store added)
DEFAULT_WEIGHTS = {"gpu": 1.0, "cpu": 0.8, "shared_storage": 0.4, "object_store": 0.2}
UNCONFIGURED_WEIGHT = 0.0  # the scorer's weight for a medium not configured (PR #2809; 1.0 before)
PREFIX_KINDS = {"full_attention", "mla_attention", "sink_full_attention"}  # isPrefixIndexableSpecKind
#: kvtier's configuration of llm-d's router (its medium weights are what this module scores with).
ROUTER_CONFIG = Path(__file__).resolve().parents[1] / "deploy" / "routers" / "llm-d-precise-prefix-cache.yaml"


def configured_weights(path: Path = ROUTER_CONFIG) -> dict[str, float]:
    """The medium weights an EndpointPickerConfig gives the precise-prefix-cache producer
    (indexerConfig.kvCacheBackendConfigs), which replace llm-d's DEFAULT_WEIGHTS."""
    config = yaml.safe_load(path.read_text())
    producer = next(p for p in config["plugins"] if p["type"] == "precise-prefix-cache-producer")
    backends = producer["parameters"]["indexerConfig"]["kvCacheBackendConfigs"]
    return {b["name"]: float(b["weight"]) for b in backends}


@dataclass(frozen=True)
class PodEntry:
    """kvblock.PodEntry: who holds a block, in which tier (lower case), for which KV group."""

    pod: str
    tier: str
    group: int | None = None


def normalize_tier(medium: str) -> str:
    return medium.lower() if medium else DEFAULT_TIER


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
