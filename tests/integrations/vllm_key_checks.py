"""Block keys of multimodal prompts against vLLM's own prefix-cache hashing, for
tests/integrations/vllm_checks.py (`keys`; no daemon needed).

Three requests with the same 4 blocks of token ids (32-token blocks): A with an image whose
placeholder tokens are 40..59 (blocks 1 and 2), B with another image at the same place, C
text only. For every pair and block, kvtier's keys must agree exactly where vLLM's block
hashes agree: equal before the image, different from the block it starts in on.
"""
from __future__ import annotations

BLOCK = 32


def keys() -> dict:
    from vllm import SamplingParams
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    from kvtier_client.integrations.vllm.extra_keys import block_extras
    from kvtier_client.keys import block_keys

    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK, sha256)
    tokens = [(7 * i) % 500 for i in range(4 * BLOCK + 3)]

    def request(name: str, image: str | None) -> Request:
        features = None
        if image is not None:
            features = [MultiModalFeatureSpec(data=None, modality="image", identifier=image,
                                              mm_position=PlaceholderRange(offset=40, length=20))]
        return Request(name, list(tokens), SamplingParams(max_tokens=1), None, mm_features=features,
                       block_hasher=hasher)

    requests = {"A": request("A", "image-a"), "B": request("B", "image-b"), "C": request("C", None)}
    ours = {n: block_keys(r.prompt_token_ids, BLOCK, salt=b"s", extras=block_extras(r, BLOCK))
            for n, r in requests.items()}
    theirs = {n: list(r.block_hashes) for n, r in requests.items()}
    pairs = [("A", "B"), ("A", "C"), ("B", "C")]
    return {
        "blocks": len(ours["A"]),
        "ours_equal": {f"{x}{y}": [a == b for a, b in zip(ours[x], ours[y])] for x, y in pairs},
        "vllm_equal": {f"{x}{y}": [a == b for a, b in zip(theirs[x], theirs[y])] for x, y in pairs},
        "text_only_extras": block_extras(requests["C"], BLOCK),
    }


def weights() -> dict:
    """The checkpoint fingerprint every key carries (weights.py), on real files: a checkpoint
    and its copy at another path agree; another checkpoint of the same architecture and
    size, another dtype, or a hub id not on disk differ."""
    import os
    import shutil
    import tempfile
    from types import SimpleNamespace

    from kvtier_client.integrations.vllm.weights import checkpoint_fingerprint

    def engine(path: str, dtype: str = "float32") -> SimpleNamespace:  # the fields vLLM's config has
        return SimpleNamespace(model_config=SimpleNamespace(model=path, dtype=dtype, quantization=None, revision=None))

    root = tempfile.mkdtemp(prefix="kvtier-weights-")
    try:
        a, b, c = (os.path.join(root, n) for n in ("a", "mounted-elsewhere", "fine-tune"))
        os.makedirs(a)
        with open(os.path.join(a, "config.json"), "w") as f:
            f.write('{"model_type": "llama", "num_hidden_layers": 2}')
        with open(os.path.join(a, "model.safetensors"), "wb") as f:
            f.write(os.urandom(3 << 20))
        shutil.copytree(a, b)
        shutil.copytree(a, c)
        with open(os.path.join(c, "model.safetensors"), "wb") as f:  # same size and config, other weights
            f.write(os.urandom(3 << 20))
        fp = {name: checkpoint_fingerprint(engine(path)).hex() for name, path in (("a", a), ("b", b), ("c", c))}
        fp["a_bf16"] = checkpoint_fingerprint(engine(a, "bfloat16")).hex()
        fp["hub"] = checkpoint_fingerprint(engine("org/not-downloaded")).hex()
        return fp
    finally:
        shutil.rmtree(root)
