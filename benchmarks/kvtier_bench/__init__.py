"""Benchmarks that measure kvtier's real tiers against the raw operations they are built on."""
