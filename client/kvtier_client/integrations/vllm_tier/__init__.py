"""A kvtier secondary tier for vLLM's OffloadingConnector (TieringOffloadingSpec): vLLM keeps
its own CPU tier, and kvtier's shared host, disk and cluster tiers sit behind it. Loaded by
module path; nothing in vLLM needs patching:

    kv_transfer_config=KVTransferConfig(
        kv_connector="OffloadingConnector", kv_role="kv_both",
        kv_connector_extra_config={
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": 8 << 30,
            "secondary_tiers": [{
                "type": "KVTierSecondaryTier",
                "module_path": "kvtier_client.integrations.vllm_tier",
                "target": "unix:///run/kvtier/kvtier.sock",
            }],
        },
    )

Settings of the tier's entry, every one optional:

    target           the daemon's socket, "unix:///abs/path.sock" (default $KVTIER_TARGET,
                     else unix://$XDG_RUNTIME_DIR/kvtier/kvtier.sock)
    namespace        default "vllm-offload/<model name>"
    token, token_file   the bearer token (for a daemon run with --tokens-file)
    salt             a string mixed into every key (pages of other salts never match)
    connect_timeout  seconds one call retries an unreachable daemon (default 5)
    io_threads       threads running stores and loads (default 2)
    locality         LOCAL or REMOTE, for vLLM's per-request tier filters

A page is one row of vLLM's CPU tier as bytes (identity.py); pages are keyed by vLLM's
offload keys (block hash + group), so they are not shared with kvtier's own vLLM connector,
whose keys chain token ids. docs/vllm-offloading.md has the whole story.
"""
from kvtier_client.integrations.vllm_tier.manager import KVTierSecondaryTier

__all__ = ["KVTierSecondaryTier"]
