"""Tier names. Lower value = faster tier; demotion moves to a higher value."""
from __future__ import annotations

import enum


class Tier(enum.IntEnum):
    DEVICE = 0
    HOST = 1
    DISK = 2
    CLUSTER = 3  # a store shared by nodes (Redis/Valkey Cluster); never lent, loaded into host

    @property
    def label(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, text: str) -> "Tier":
        try:
            return cls[text.upper()]
        except KeyError:
            raise ValueError(f"unknown tier {text!r}; use one of device, host, disk, cluster") from None
