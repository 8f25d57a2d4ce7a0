"""tests/llmd_index.py and llmd_events.py, the Python model of llm-d's KV-event path, checked against llm-d's
own vectors and Go tests (ported case by case, named after them), fed with batches that
kvtier's encoder and vLLM's own event classes make."""
from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path

import msgspec
import pytest
from kvtier_client.event_media import DEFAULT_MEDIA
from kvtier_client.tiers import Tier
from llmd_events import DecodeError, decode_batch, engine_key, parse_topic
from llmd_index import (
    DEFAULT_WEIGHTS,
    ROUTER_CONFIG,
    LlmdIndex,
    PodEntry,
    cbor,
    configured_weights,
    fnv64a,
    longest_prefix_score,
    normalize_tier,
)

from kvtier.events.records import Event, EventKind
from kvtier.events.wire import Encoder, EventFormat

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
POD, POD_B = "10.0.0.1:8000", "10.0.0.2:8000"
MODEL = "Qwen/Qwen3-0.6B"
TOPIC = f"kv@{POD}@{MODEL}".encode()
SEQ = (0).to_bytes(8, "big")


def key(i: int) -> bytes:
    """A kvtier block key: 32 bytes, of which llm-d keeps the last 8."""
    return i.to_bytes(32, "big")


def tokens(n: int, start: int = 1) -> list[int]:
    return list(range(start, start + n))  # makeTokens in pool_test.go


def stored(tier: Tier, keys: list[bytes], ids: list[int] | None, parent: bytes | None = None, block: int = 16) -> Event:
    return Event(EventKind.STORED, "ns", tier, keys, parent, ids, block)


def removed(tier: Tier, keys: list[bytes]) -> Event:
    return Event(EventKind.REMOVED, "ns", tier, keys)


def publish(index: LlmdIndex, *events: Event, topic: bytes = TOPIC, layout: EventFormat = EventFormat.MAP,
            source_endpoint: str | None = None) -> None:
    index.feed(topic, SEQ, Encoder(layout).encode(1.0, list(events)), source_endpoint)


def tier_of(tier: Tier) -> str:
    return normalize_tier(DEFAULT_MEDIA[tier])


# -- hashing: llm-d-kv-cache's golden vectors (tests/e2e/uds_tokenizer at 7be76e119ca5) --------

def test_golden_text_request_keys():
    """uds_e2e_test.go goldenRequestKeys: granite's tokens of "What is the capital of
    France?", blockSizeTokens 4, hashSeed "", cbor-fnv; the partial second block is dropped."""
    index = LlmdIndex(block_size_tokens=4)
    keys = index.request_keys("ibm-granite/granite-3.1-8b-instruct", [8197, 438, 322, 18926, 432, 45600, 49])
    assert keys == [1334984470577408192]


def test_golden_multimodal_request_keys():
    """uds_e2e_mm_test.go goldenMMRequestKeys: Qwen2-VL's 418 tokens with one image at
    [15, 406), its hash tainting every 4-token block it overlaps (ComputeBlockExtraFeatures)."""
    ids = ([151644, 8948, 198, 2610, 525, 264, 10950, 17847, 13, 151645, 198, 151644, 872, 198, 151652]
           + [151655] * 391 + [151653, 3838, 374, 304, 419, 2168, 30, 151645, 198, 151644, 77091, 198])
    image = "f9a38a66df90291515d7ea4de3175b262c1da7668ad1cc32e3dbb98be86388ac"
    extra = [[image] if 4 * i < 15 + 391 and 4 * i + 4 > 15 else None for i in range(len(ids) // 4)]
    keys = LlmdIndex(block_size_tokens=4).request_keys("Qwen/Qwen2-VL-2B-Instruct", ids, extra=extra)
    assert len(keys) == 104
    assert keys[:4] == [0xc3bf05790f422f47, 0xff0c0a9eb95b87cc, 0x99550d577537f9f3, 0x9aa30b0444712b0a]
    assert keys[-4:] == [0xad81bd8f5ba4cac7, 0x3208cb3b4f2f9d3d, 0x6b72ebd4a0c5a575, 0xb34057dd9ecec7fd]


def test_cbor_and_fnv_match_their_specifications():
    """RFC 8949 appendix A examples; FNV-1a 64's published vectors."""
    assert cbor(1000000).hex() == "1a000f4240"
    assert cbor(18446744073709551615).hex() == "1bffffffffffffffff"
    assert cbor(-1000).hex() == "3903e7"
    assert cbor("IETF").hex() == "6449455446"
    assert cbor(None).hex() == "f6"
    assert cbor([1, [2, 3], [4, 5]]).hex() == "8301820203820405"
    assert cbor({"b": [2, 3], "a": 1}).hex() == "a26161016162820203"
    assert fnv64a(b"") == 0xcbf29ce484222325
    assert fnv64a(b"a") == 0xaf63dc4c8601ec8c
    assert fnv64a(b"foobar") == 0x85944171f73967e8


def test_xxh64_chain_continues_from_a_parent():
    """TestXXH64_ParentKeyContinuation: the keys of a longer prompt continue its prefix's."""
    index = LlmdIndex(hash_algorithm="xxh64", hash_seed="test-seed")
    whole = index.request_keys(MODEL, tokens(48))
    assert len(whole) == 3 and whole != LlmdIndex(hash_seed="test-seed").request_keys(MODEL, tokens(48))
    assert index._keys(whole[0], tokens(32, 17), MODEL, None) == whole[1:]


# -- decoding: common_test.go, vllm_adapter_test.go ----------------------------------------

@pytest.mark.parametrize("topic, expected", [
    ("kv@pod-123@llama-2-7b", ("pod-123", "llama-2-7b")),  # TestParseTopic_Valid
    ("pod-123@llama-2-7b", ("pod-123@llama-2-7b", "")),  # TestParseTopic_NoModel
    ("fallback", ("fallback", "")),  # TestParseTopic_Plain
    ("kv@10.0.0.1:8000@org/model", ("10.0.0.1:8000", "org/model")),
    ("kv@10.0.0.1:8000@model@x", ("kv@10.0.0.1:8000@model@x", "")),
])
def test_parse_topic(topic, expected):
    assert parse_topic(topic) == expected


def test_engine_key_takes_the_last_eight_bytes_big_endian():
    """TestGetHashAsUint64; msgpack ints under 2**32 decode as narrow Go ints, refused."""
    assert engine_key((12345).to_bytes(8, "big")) == 12345
    assert engine_key(b"\xff" * 24 + (7).to_bytes(8, "big")) == 7
    assert engine_key(b"\x01\x02") == 0x0102
    assert engine_key(1 << 40) == 1 << 40
    assert engine_key(-(1 << 40)) == (1 << 64) - (1 << 40)
    for bad in (b"", "not a hash", 42, None):
        with pytest.raises(DecodeError):
            engine_key(bad)


def test_parse_message_valid_array_batch():
    """TestVLLMParseMessage_Valid, with uint64-sized hashes (what msgspec writes as uint64)."""
    payload = msgspec.msgpack.encode([1234567890.0, [["BlockStored", [1 << 40, (1 << 40) + 1], 1 << 39,
                                                      [1, 2, 3], 16, None, "gpu", None, None]], None])
    (event,) = decode_batch(payload)
    assert event.hashes == [1 << 40, (1 << 40) + 1] and event.parent == 1 << 39 and event.tokens == [1, 2, 3]


@pytest.mark.parametrize("batch, reason", [
    ([0.0, [["BlockStored", [1 << 40], None, [1], 16, None, "gpu"]]], "2 elements"),  # a batch without data_parallel_rank
    ([0.0, [{"type": "Unknown"}], 0], "unknown vLLM event tag"),  # TestVLLMUnknownTag
    ([0.0, [{"block_hashes": []}], 0], "missing the \"type\" tag"),  # TestVLLMParseMessage_MapEncodedErrors
    ([0.0, [[]], 0], "no tag"),
    ([0.0, [["BlockStored", [1 << 40], None, None, 16]], 0], "token_ids is not an array"),
    ([0.0, [{"type": "BlockStored", "block_hashes": [1 << 40], "parent_block_hash": None,
             "block_size": 16}], 0], "token_ids is not an array"),  # a map without token_ids
    ([0.0, [["BlockRemoved", [b"\x01"], None, -1]], 0], "negative value"),  # TestDecodeVLLMEvent_BlockRemovedInvalidGroupIdx
    ([0.0, [["BlockStored", [7], None, [1], 16]], 0], "unsupported hash type"),  # a hash under 2**32
])
def test_undecodable_batches_are_dropped_whole(batch, reason):
    index = LlmdIndex()
    index.feed(TOPIC, SEQ, msgspec.msgpack.encode(batch))
    assert index.dropped == {"undecodable": 1} and reason in index.last_error


def test_frames_and_topics_outside_the_subscription_are_dropped():
    index = LlmdIndex()
    payload = Encoder().encode(1.0, [stored(Tier.DEVICE, [key(1)], tokens(16))])
    index.feed(TOPIC, b"\x00" * 4, payload)
    index.feed(b"kvtier@" + POD.encode() + b"@" + MODEL.encode(), SEQ, payload)
    assert index.dropped == {"bad_frame": 1, "filtered_topic": 1}
    assert index.score(MODEL, tokens(16)) == {}


def test_a_topic_without_a_model_credits_the_whole_topic_hashed_with_no_model():
    """parseTopic: not exactly 3 parts -> the topic is the pod id, the model "" (kept)."""
    index = LlmdIndex()
    publish(index, stored(Tier.HOST, [key(1)], tokens(16)), topic=f"kv@{POD}".encode())
    assert index.dropped == {"bad_topic": 1}
    assert index.score(MODEL, tokens(16)) == {}
    assert index.score("", tokens(16)) == {f"kv@{POD}": 0.8}


# -- the pool and index: pool_test.go ------------------------------------------------------

@pytest.mark.parametrize("layout", list(EventFormat))
def test_stored_chain_is_credited_to_the_topics_pod_and_tier(layout):
    """TestProcessRawMessage_FallsBackToTopicEndpoint, in both of kvtier's layouts and every tier."""
    index = LlmdIndex()
    ids = tokens(64)
    for n, tier in enumerate(Tier):
        publish(index, stored(tier, [key(100 * n + i) for i in range(4)], ids), layout=layout)
    assert index.dropped == {}
    for request_key in index.request_keys(MODEL, ids):
        assert index.pods_holding(request_key) == {POD: {tier_of(t) for t in Tier}}


def test_source_endpoint_replaces_the_topics_pod():
    """TestProcessRawMessage_UsesSubscriberSourceEndpoint: in pod-discovery mode the
    subscriber's endpoint (<pod IP>:<serving port>) is the pod, whatever the topic says."""
    index = LlmdIndex()
    for i, endpoint in enumerate((POD, "10.0.0.1:8003")):
        publish(index, stored(Tier.DEVICE, [key(i)], tokens(16)), source_endpoint=endpoint)
    (request_key,) = index.request_keys(MODEL, tokens(16))
    assert index.pods_holding(request_key) == {POD: {"hbm"}, "10.0.0.1:8003": {"hbm"}}


def test_unknown_parent_is_dropped_and_a_known_one_continues_the_chain():
    index = LlmdIndex()
    ids = tokens(32)
    publish(index, stored(Tier.HOST, [key(2)], ids[16:], parent=key(1)))
    assert index.dropped == {"unknown_parent": 1} and index.score(MODEL, ids) == {}
    publish(index, stored(Tier.HOST, [key(1)], ids[:16]), stored(Tier.HOST, [key(2)], ids[16:], parent=key(1)))
    assert index.score(MODEL, ids) == {POD: pytest.approx(1.6)}
    assert index.request_key_of(key(2)) == index.request_keys(MODEL, ids)[1]


def test_token_less_store_adds_a_tier_and_removal_takes_exactly_that_tier():
    """TestBlockStoredEvent_OffloadingEmptyTokens and _EvictionOrderGPUThenCPU."""
    index = LlmdIndex()
    ids, keys = tokens(64), [key(700 + i) for i in range(4)]
    request_keys = index.request_keys(MODEL, ids)
    publish(index, stored(Tier.DEVICE, keys, ids))
    publish(index, stored(Tier.HOST, keys, None))  # kvtier's copy to host, no token ids
    assert all(index.pods_holding(k) == {POD: {"hbm", "cpu"}} for k in request_keys)
    publish(index, removed(Tier.DEVICE, keys))
    assert all(index.pods_holding(k) == {POD: {"cpu"}} for k in request_keys)
    assert index.request_key_of(keys[0]) == request_keys[0]
    publish(index, removed(Tier.HOST, keys))
    assert all(index.pods_holding(k) == {} for k in request_keys)
    assert index.request_key_of(keys[0]) is None


def test_token_less_store_of_unknown_blocks_is_dropped():
    """TestBlockStoredEvent_OffloadingUnknownEngineKeys."""
    index = LlmdIndex()
    publish(index, stored(Tier.HOST, [key(900 + i) for i in range(4)], None))
    assert index.dropped == {"unresolved_tier_update": 1}


def test_token_less_store_credits_only_the_last_request_key_of_a_larger_block():
    """TestCanonicalWritePath_OneToMany: a 64-token engine block maps to four 16-token
    request keys and resolves to the last, so a token-less store credits every fourth key."""
    index = LlmdIndex()
    ids = tokens(128)
    request_keys = index.request_keys(MODEL, ids)
    publish(index, stored(Tier.DEVICE, [key(1), key(2)], ids, block=64))
    publish(index, stored(Tier.HOST, [key(1), key(2)], None, block=64))
    assert [bool(index.pods_holding(k)[POD] & {"cpu"}) for k in request_keys] == [False, False, False, True] * 2
    publish(index, removed(Tier.DEVICE, [key(1), key(2)]))
    assert index.score(MODEL, ids) == {}


def test_partial_block_is_dropped():
    """TestCanonicalWritePath_PartialBlockDrop."""
    index = LlmdIndex(block_size_tokens=64)
    publish(index, stored(Tier.DEVICE, [key(1), key(2), key(3)], tokens(48)))
    assert index.dropped == {"partial_block": 1} and index.score(MODEL, tokens(64)) == {}


def test_duplicate_store_survives_the_first_remove():
    """TestPool_DuplicateStoreSurvivesFirstRemove: a block announced twice in one tier (a
    re-announcement) needs two BlockRemoved before llm-d stops crediting it."""
    index = LlmdIndex()
    ids, keys = tokens(64), [key(800 + i) for i in range(4)]
    publish(index, stored(Tier.HOST, keys, ids))
    publish(index, stored(Tier.HOST, keys, ids))
    publish(index, removed(Tier.HOST, keys))
    assert index.score(MODEL, ids) == {POD: pytest.approx(3.2)}
    publish(index, removed(Tier.HOST, keys))
    assert index.score(MODEL, ids) == {}
    assert index.request_key_of(keys[0]) is None


def test_every_reannouncement_adds_a_remove_llm_d_waits_for():
    """The dedup filter counts every BlockStored that lands, repeats included: a block told
    once and re-announced twice stays credited after its one BlockRemoved."""
    index = LlmdIndex()
    ids, keys = tokens(32), [key(1), key(2)]
    for _ in range(3):  # the first store, then two re-announcements of the whole state
        publish(index, stored(Tier.HOST, keys, ids))
    publish(index, removed(Tier.HOST, keys))
    assert index.score(MODEL, ids) == {POD: pytest.approx(1.6)}


def test_two_publishers_of_one_medium_under_one_pod_share_one_entry():
    """PodEntry is (pod, tier): had kvtier's device tier said GPU, as vLLM's own cache does
    under the same pod id, its BlockRemoved would take the engine's credit too. It says HBM
    (kvtier_client.event_media), so the engine's GPU blocks stay credited."""
    index = LlmdIndex()
    ids = tokens(32)
    vllm_store = ["BlockStored", [1 << 40, (1 << 40) + 1], None, ids, 16, None, "GPU", None]
    index.feed(TOPIC, SEQ, msgspec.msgpack.encode([0.0, [vllm_store], 0]))
    publish(index, stored(Tier.DEVICE, [key(1), key(2)], ids))
    publish(index, removed(Tier.DEVICE, [key(1), key(2)]))
    assert index.score(MODEL, ids) == {POD: 2.0}  # vLLM's two GPU blocks
    vllm_removed = ["BlockRemoved", [1 << 40, (1 << 40) + 1], "GPU", None]
    same_medium = ["BlockStored", [1 << 41, (1 << 41) + 1], None, ids, 16, None, "GPU", None]
    index.feed(TOPIC, SEQ, msgspec.msgpack.encode([0.0, [same_medium, vllm_removed], 0]))
    assert index.score(MODEL, ids) == {}  # one GPU entry for both: either's removal takes it


def test_all_blocks_cleared_clears_one_pod_and_its_reference_counts():
    """TestAllBlocksCleared_Dispatch and TestPool_AllBlocksClearedResetsDedup."""
    index = LlmdIndex()
    ids, keys = tokens(64), [key(500 + i) for i in range(4)]
    publish(index, stored(Tier.DEVICE, keys, ids), stored(Tier.DEVICE, keys, ids))
    publish(index, stored(Tier.HOST, [key(900 + i) for i in range(4)], ids), topic=f"kv@{POD_B}@{MODEL}".encode())
    publish(index, Event(EventKind.CLEARED, "ns", None, []))
    assert index.score(MODEL, ids) == {POD_B: pytest.approx(3.2)}
    publish(index, stored(Tier.DEVICE, keys, ids))
    publish(index, removed(Tier.DEVICE, keys))  # one store since the clear: one remove evicts
    assert index.score(MODEL, ids) == {POD_B: pytest.approx(3.2)}


def test_hma_groups_of_other_kinds_are_skipped():
    """TestHMAGroupKindFilter and _IgnoresRejectedGroupRemoval, in the map layout."""
    index = LlmdIndex()

    def store(group: int, kind: str) -> dict:
        return {"type": "BlockStored", "block_hashes": [key(group)], "parent_block_hash": None,
                "token_ids": tokens(16), "block_size": 16, "medium": "GPU", "group_idx": group,
                "kv_cache_spec_kind": kind}
    index.feed(TOPIC, SEQ, msgspec.msgpack.encode([0.0, [store(0, "full_attention"), store(1, "sliding_window")], 0]))
    assert index.dropped == {"store_skipped:unsupported_cache_kind": 1}
    (request_key,) = index.request_keys(MODEL, tokens(16))
    assert index.pods_holding(request_key) == {POD: {"gpu"}}
    removes = [{"type": "BlockRemoved", "block_hashes": [key(g)], "medium": "GPU", "group_idx": g} for g in (1, 2)]
    index.feed(TOPIC, SEQ, msgspec.msgpack.encode([0.0, removes, 0]))
    assert index.dropped["remove_skipped:unsupported_cache_kind"] == 1
    assert index.dropped["remove_skipped:unknown_group"] == 1


def test_lora_name_replaces_the_model_in_the_keys():
    index = LlmdIndex()
    event = ["BlockStored", [key(1)], None, tokens(16), 16, None, "GPU", "my-adapter"]
    index.feed(TOPIC, SEQ, msgspec.msgpack.encode([0.0, [event], 0]))
    assert index.score(MODEL, tokens(16)) == {}
    assert index.score(MODEL, tokens(16), lora_name="my-adapter") == {POD: 1.0}


def test_the_shared_storage_pseudo_pod_is_credited_to_no_endpoint():
    """kv@SHARED_STORAGE@<model> (llm-d's own shared-storage publisher's topic) indexes its
    blocks under the pod id SHARED_STORAGE; the producer looks up only the candidate
    endpoints' `<address>:<port>` (utils.go extractEndpointSet), so no endpoint gains."""
    index = LlmdIndex()
    ids = tokens(32)
    publish(index, stored(Tier.CLUSTER, [key(1), key(2)], ids), topic=f"kv@SHARED_STORAGE@{MODEL}".encode())
    assert index.score(MODEL, ids) == {"SHARED_STORAGE": pytest.approx(0.8)}  # 2 blocks of shared_storage
    assert index.score(MODEL, ids, pods=[POD, POD_B]) == {}


def test_a_key_keeps_the_ten_latest_pod_entries():
    """in_memory.go defaultPodsPerKey: an eleventh (pod, tier) on one key evicts the oldest."""
    index = LlmdIndex()
    for n in range(11):
        publish(index, stored(Tier.CLUSTER, [key(1)], tokens(16)), source_endpoint=f"10.0.1.{n}:8000")
    (request_key,) = index.request_keys(MODEL, tokens(16))
    assert sorted(index.pods_holding(request_key)) == sorted(f"10.0.1.{n}:8000" for n in range(1, 11))


# -- scoring: kvblock_scorer_test.go -------------------------------------------------------

@pytest.mark.parametrize("tier_1003, expected_a", [(("gpu", "cpu"), 3.0), (("cpu",), 2.5)])
def test_longest_prefix_scorer(tier_1003, expected_a):
    """TestLongestPrefixScorer and TestLongestPrefixScorerDifferentTiers (gpu 1.0, cpu 0.5)."""
    a, b = "pod-a", "pod-b"
    hits = {1001: [PodEntry(a, "gpu")], 1002: [PodEntry(a, "gpu")], 1003: [PodEntry(a, t) for t in tier_1003],
            1004: [PodEntry(b, "cpu")], 1005: [PodEntry(b, "cpu")], 1006: [PodEntry(a, "gpu")]}
    scores = longest_prefix_score(list(range(1001, 1007)), hits, {"gpu": 1.0, "cpu": 0.5})
    assert scores == {a: pytest.approx(expected_a)}


def test_scoring_order_follows_prefix_length_and_tier_weight():
    """PR #2809's defaults: gpu 1.0, cpu 0.8, shared_storage 0.4, and 0 for a medium not
    configured (kvtier's HBM and DISK): their pods are candidates that earn nothing."""
    index = LlmdIndex()
    ids = tokens(64)
    endpoints = {Tier.DEVICE: "10.0.0.1:8000", Tier.HOST: "10.0.0.2:8000", Tier.DISK: "10.0.0.3:8000",
                 Tier.CLUSTER: "10.0.0.5:8000"}
    for n, (tier, endpoint) in enumerate(endpoints.items()):
        publish(index, stored(tier, [key(10 * n + i) for i in range(4)], ids), source_endpoint=endpoint)
    engine = ["BlockStored", [key(90), key(91)], None, ids[:32], 16, None, "GPU", None]
    index.feed(TOPIC, SEQ, msgspec.msgpack.encode([0.0, [engine], 0]), "10.0.0.4:8000")
    scores = index.score(MODEL, ids)
    assert scores == {"10.0.0.1:8000": 0.0, "10.0.0.2:8000": pytest.approx(3.2), "10.0.0.3:8000": 0.0,
                      "10.0.0.5:8000": pytest.approx(1.6), "10.0.0.4:8000": 2.0}
    assert index.match_blocks(MODEL, ids) == {"10.0.0.1:8000": 0, "10.0.0.2:8000": 3, "10.0.0.3:8000": 0,
                                              "10.0.0.5:8000": 1, "10.0.0.4:8000": 2}
    assert index.score(MODEL, ids, pods=["10.0.0.2:8000", "10.0.0.4:8000"]) == {
        "10.0.0.2:8000": pytest.approx(3.2), "10.0.0.4:8000": 2.0}


def test_llm_d_weighs_the_cluster_tiers_medium_without_configuration():
    """A router without kvtier's configuration still credits the shared cluster tier: its
    medium is the one llm-d's defaults weigh for shared storage (SHARED_STORAGE, 0.4)."""
    assert DEFAULT_MEDIA[Tier.CLUSTER] == "SHARED_STORAGE"
    assert DEFAULT_WEIGHTS[tier_of(Tier.CLUSTER)] == 0.4
    assert DEFAULT_WEIGHTS[tier_of(Tier.HOST)] == 0.8


def test_kvtiers_router_configuration_weighs_every_medium_kvtier_sends():
    """deploy/routers/ replaces llm-d's defaults, so it must name each tier's medium (an
    unnamed one scores 0), rank them from the engine's GPU down to the cluster, and keep
    llm-d's default weight for shared storage."""
    weights = configured_weights()
    media = [tier_of(t) for t in (Tier.DEVICE, Tier.HOST, Tier.DISK, Tier.CLUSTER)]
    assert set(media) <= set(weights), f"{ROUTER_CONFIG.name} has no weight for {set(media) - set(weights)}"
    ranked = [weights["gpu"], *(weights[m] for m in media)]
    assert ranked == sorted(ranked, reverse=True) and min(ranked) > 0
    assert weights[tier_of(Tier.CLUSTER)] == DEFAULT_WEIGHTS["shared_storage"]


# -- vLLM's own classes --------------------------------------------------------------------

VLLM_ENCODER = textwrap.dedent(
    """
    import json, sys
    import msgspec
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
    keys = [bytes.fromhex(k) for k in json.loads(sys.argv[1])]
    ids = list(range(1, 65))
    batches = [
        [BlockStored(block_hashes=keys, parent_block_hash=None, token_ids=ids, block_size=16, lora_id=None,
                     medium="GPU", lora_name=None)],
        [BlockStored(block_hashes=keys, parent_block_hash=None, token_ids=[], block_size=16, lora_id=None,
                     medium="CPU", lora_name=None, locality="REMOTE", ownership="kvtier")],
        [BlockRemoved(block_hashes=keys, medium="GPU", ownership="kvtier")],
        [AllBlocksCleared()],
    ]
    encoder = msgspec.msgpack.Encoder()
    print(json.dumps([encoder.encode(KVEventBatch(ts=1.0, events=b, data_parallel_rank=0)).hex() for b in batches]))
    """
)


@pytest.fixture(scope="module")
def vllm_batches() -> list[bytes]:
    if not VLLM_PYTHON.exists():
        pytest.skip(f"no vLLM environment at {VLLM_PYTHON.parent.parent} (scripts/setup_vllm.sh makes it)")
    keys = json.dumps([key(300 + i).hex() for i in range(4)])
    out = subprocess.run([str(VLLM_PYTHON), "-c", VLLM_ENCODER, keys], capture_output=True, text=True, timeout=240,
                         check=True)
    return [bytes.fromhex(h) for h in json.loads(out.stdout.strip().splitlines()[-1])]


def test_batches_encoded_by_vllm_are_credited(vllm_batches):
    """vLLM's map layout, with locality and ownership set: llm-d reads the medium alone."""
    stored_gpu, offloaded_cpu, removed_gpu, cleared = vllm_batches
    index = LlmdIndex()
    request_keys = index.request_keys(MODEL, tokens(64))
    for payload, held in ((stored_gpu, {"gpu"}), (offloaded_cpu, {"gpu", "cpu"}), (removed_gpu, {"cpu"})):
        index.feed(TOPIC, SEQ, payload)
        assert all(index.pods_holding(k) == {POD: held} for k in request_keys)
    index.feed(TOPIC, SEQ, cleared)
    assert index.dropped == {} and all(index.pods_holding(k) == {} for k in request_keys)
