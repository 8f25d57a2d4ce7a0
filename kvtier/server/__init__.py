"""Control plane: the gRPC daemon. Validates requests, maps them to core calls and core
errors to status codes. No policy, no byte copying (except the remote slow path)."""
