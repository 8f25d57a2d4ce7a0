"""Core: the block index, leases and sessions. The only code that mutates residency."""
