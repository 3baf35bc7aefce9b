"""The draft worker: holds a draft model (a small model, the target's
checkpoint in 4 bits, or its first layers) and each session's draft KV
cache, and proposes K tokens a round. (Prompt lookup needs no worker: it
runs in the coordinator, ``outrider.coordinator.lookup``.)"""
