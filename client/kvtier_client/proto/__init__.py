"""Generated protobuf and gRPC stubs (scripts/gen_proto.sh)."""
