"""The draft worker: holds a drafter (a small model, the target's checkpoint
in 4 bits, early exit, or prompt lookup) and each session's draft KV cache,
and proposes K tokens a round."""
