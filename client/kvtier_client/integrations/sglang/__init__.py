"""SGLang: a HiCache storage backend (L3) that keeps SGLang's host KV pages in a kvtier daemon.

Select it with SGLang's dynamic backend loader; nothing in SGLang needs patching:

    python -m sglang.launch_server --model-path ... --enable-hierarchical-cache \\
        --hicache-mem-layout page_first \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "kvtier",
            "module_path": "kvtier_client.integrations.sglang", "class_name": "KVTierStorage",
            "interface_v1": 1, "target": "unix:///run/kvtier/kvtier.sock"}'

What it does (docs/sglang.md has the full story):

* Pages: one HiCache page (page_size tokens, every layer of the rank) is one kvtier page,
  stored in kvtier's order whatever the host layout (host_pages.py: MHA layer_first,
  page_first, page_first_direct, page_head; MLA layer_first, page_first, page_first_direct).
* Keys: SGLang's page hash (a sha256 chained over the prompt) plus a tag of the model and the
  rank's shard (config.KeyScope): each tensor-parallel rank has its own pages, MLA ranks
  share one copy.
* `batch_exists` is a kvtier lookup (the cached prefix, any tier); `batch_set_v1` borrows
  pages, copies the host pool's pages in and commits them; `batch_get_v1` acquires the cached
  prefix (loading it from disk) and copies it into the host pool (page_io.py).

Configuration (the extra config, beside the loader's keys), every key optional:

    target          "unix:///abs/path.sock" (default $KVTIER_TARGET, else
                    unix://$XDG_RUNTIME_DIR/kvtier/kvtier.sock); a same-host daemon only
    namespace       isolation unit (default $KVTIER_NAMESPACE, else "sglang/<model>")
    salt            per-tenant string mixed into every key (default "")
    token_file      file holding the bearer token (default $KVTIER_TOKEN_FILE)
    token           the bearer token itself (default $KVTIER_TOKEN; prefer token_file)
    connect_timeout seconds of retries before the daemon counts as unavailable (default 10)
    batch_pages     pages one borrow or acquire holds at most (default 32)
"""
from kvtier_client.integrations.sglang.backend import KVTierStorage

__all__ = ["KVTierStorage"]
