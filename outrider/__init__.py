"""Outrider: disaggregated speculative decoding with lossless output.

The client SDK::

    from outrider import Client

    with Client("127.0.0.1:50051") as client:
        result = client.generate(messages=[{"role": "user", "content": "Hi!"}])
        print(result.text, result.stats.mean_acceptance_length)
"""

from outrider.client import (
    AsyncClient,
    ChatMessage,
    Chunk,
    Client,
    Generation,
    GenerationStats,
    ModelInfo,
    StructuredOutput,
    TokenLogprobs,
)

__all__ = [
    "AsyncClient",
    "ChatMessage",
    "Chunk",
    "Client",
    "Generation",
    "GenerationStats",
    "ModelInfo",
    "StructuredOutput",
    "TokenLogprobs",
]
__version__ = "0.1.0"
