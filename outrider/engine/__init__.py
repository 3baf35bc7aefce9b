"""The engine inside a worker (docs/design.md#engine): a scheduler, a model runner and a
paged KV cache, driven by one loop that runs every session's pending work as
one forward pass per step.

==========================  =================================================
``engine.core``             the loop (:class:`Engine`) and the jobs it runs
``engine.scheduler``        which feeds run in a step, under a token budget
``engine.runner``           rows of a step → tensors → one forward pass
``engine.gguf_runner``      rows of a step → one llama.cpp decode (a GGUF)
``engine.llama``            the Llama family's forward over the paged cache
``engine.ops``              the CPU linears, each on its fastest path
``engine.cuda_graphs``      captured CUDA graphs of uniform steps
``engine.kv_cache``         the block pool and each session's blocks
``engine.build``            a runner for a loaded model, sized from memory
``engine.causal_lm``        a model spec's causal LM, loaded for the engine
``engine.parallel``         tensor-parallel ranks around one control plane
``engine.shards``           one rank's slices of a checkpoint
==========================  =================================================
"""

from outrider.engine.core import Engine, InlineEngine, Job, StepStats
from outrider.engine.runner import Logits
from outrider.engine.scheduler import Feed

__all__ = ["Engine", "Feed", "InlineEngine", "Job", "Logits", "StepStats"]
