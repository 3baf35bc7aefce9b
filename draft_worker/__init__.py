"""The draft worker: holds a drafter (a small model, early exit, or prompt
lookup) and each session's draft KV cache, and proposes K tokens a round."""
