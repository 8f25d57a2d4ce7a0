"""Trace replay: drive the block store and its policies with a request trace, moving no bytes."""
