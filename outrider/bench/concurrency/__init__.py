"""``outrider bench --concurrency LIST``: throughput and latency with N streams at once.

For each concurrency N of the list (1 always runs: it is the reference for
the outputs and for the speedup) and each configuration in turn — the order
rotated from N to N, after one untimed warm-up request per configuration —
one *batch* (``--repeat R``: R of them, the order rotated or reversed each
time, and the one of median tokens/s reported, with the range of all R):

* **Requests.** With P prompts a batch sends max(N, P) requests; request j
  asks prompt j mod P, so every prompt is asked at least once and, with more
  streams than prompts, prompts repeat. N streams run at once, closed loop,
  taking the requests in order from one queue: the first N at once, and each
  later one as soon as a stream's previous request has ended (as vLLM's
  benchmark does under ``--max-concurrency``).
* **Outrider** (``outrider-k0``, ``outrider-<drafter>-k<K>``,
  ``outrider-<drafter>-adaptive``, and those two ``-pipelined``): N streaming
  clients (the asyncio SDK, one task a stream) in the bench process, spread
  round-robin over the ``--coordinators`` replicas in front of the drafter's
  workers; every replica shares the same target and draft workers.
* **hf-generate**: Hugging Face ``generate`` on left-padded batches of N
  requests (attention mask, greedy, the same max_new_tokens), one batch after
  the other. A row is sent when its batch's ``generate()`` call starts; a
  streamer notes when each step's tokens reach the host, so TTFT is the
  batch's first step (≈ its prefill) and the inter-token gaps are its later
  steps. At N = 1 nothing is padded: that is the reference output.
* **hf-generate-batch**: transformers' continuous batching,
  ``model.generate_batch`` on all the requests with at most N in a forward
  pass (``max_requests_per_batch=N``); each token's time comes from
  ``record_timestamps``, a request counts as sent when N closed-loop streams
  would have sent it, and the manager's start-up stays out of the wall time.
  Where it does not run, the report says "did not run (<error>)" and the run
  goes on without it. Hugging Face assisted generation takes one sequence at
  a time, so it has no row here.

Reported per configuration × N (client-side for every configuration):

* **tokens/s** = all streams' generated tokens ÷ wall time of the batch
  (first request sent → last stream ended);
* **speedup vs concurrency 1** = tokens/s ÷ tokens/s of the same
  configuration at N = 1;
* **TTFT** p50/p99 over the requests: request sent → first streamed chunk;
* **ITL** p50/p99 over all gaps: between consecutive streamed chunks.
  Outrider streams one chunk per round (its accepted drafts plus the
  recovered or bonus token), so — as in vLLM's benchmark — a speculative
  configuration's chunk ITL spans several tokens; **ITL per token** = each
  gap ÷ the tokens of the chunk that ends it is reported next to it, with
  the mean tokens per chunk. Hugging Face streams a token a step: its two
  ITLs are the same.

Percentiles interpolate linearly between order statistics (numpy's default).

Outputs: decoding is greedy, so every request's tokens must equal those of
``hf-generate`` at N = 1 on the same prompt (``outrider-k0`` at N = 1 with
``--no-hf``) and, at N > 1, those of the same configuration at N = 1. Each
difference is reported, loudly, and nothing aborts. Padding and batching
change the order of floating-point sums, so in float32 (more so in bfloat16)
a near-tie can flip an argmax: such a difference is a fact about the numerics
to report, not to hide; the float64 tiny test models show none.
"""
