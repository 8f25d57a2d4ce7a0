"""Mechanism: tiers that hold page bytes by slot number, and the moves between them. No decisions."""
