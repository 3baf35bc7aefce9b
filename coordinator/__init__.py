"""The coordinator: the public gRPC API, tokenization and streaming
detokenization, the authoritative token history of every request, and the
speculative round loop over a draft worker and a target worker."""
