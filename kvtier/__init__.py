"""kvtier: a KV-cache memory-tiering daemon for LLM inference.

Layers, one package each: `server` (control plane), `core` (index, leases, sessions),
`policy` (eviction decisions, no I/O), `mechanism` (tiers and byte movement).
"""
__version__ = "0.1.0"
