"""Generated protobuf and gRPC stubs (``make proto``); do not edit by hand."""
