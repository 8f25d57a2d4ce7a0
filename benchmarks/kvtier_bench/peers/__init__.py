"""kvtier next to the stores engines use for KV pages today: one adapter module per system
(kvtier, redis, mooncake, lmcache, grpc), each a PageStore (base.py), run by bench.py."""
