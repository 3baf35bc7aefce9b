"""The draft worker: holds a drafter (:mod:`outrider.drafters`: a small
model, the target's checkpoint in 4 bits or as its GGUF on llama.cpp, its
first layers, or an EAGLE-3 head) and each session's draft cache, and
proposes K tokens a round."""
