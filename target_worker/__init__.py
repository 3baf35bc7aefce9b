"""The target worker: holds the target model and each session's target KV
cache, and verifies K draft tokens in one forward pass of K + 1 positions."""
