"""kvtier control-plane protocol, version 1 (generated from proto/kvtier_client/proto/v1/kvtier.proto)."""
