"""``outrider bench``: Outrider against its peers, in one run, on the same prompts.

Every configuration decodes every prompt greedily (temperature 0), so all of
them must produce the same tokens; the bench checks that and reports each
mismatch loudly (it does not abort). The configurations:

* ``hf-generate`` — plain Hugging Face ``generate(do_sample=False)`` on the
  stock target (no Outrider patches): the baseline a user would otherwise run.
  **speedup = tokens/s of a configuration ÷ tokens/s of hf-generate.**
* ``outrider-k0`` — target-only decoding through Outrider's services (K=0).
* ``outrider-<drafter>-k<K>`` and ``outrider-<drafter>-adaptive`` — Outrider
  with each drafter, each fixed K and adaptive K, against real services
  started as processes: one target worker shared by all, one draft worker and
  one coordinator per drafter. They send ``pipeline=False``.
* ``outrider-<drafter>-k<K>-pipelined`` and ``outrider-<drafter>-adaptive-pipelined``
  — the same with pipelined rounds (``pipeline=True``: the draft drafts round
  i+1 while the target verifies round i); ``--no-pipelined`` skips them. A
  configuration whose warm-up says the coordinator ignored ``pipeline`` (or
  ``adaptive``) is left out with a warning.
* ``hf-assisted-...`` — the peer: Hugging Face assisted generation in this
  process on the same models and prompts: ``assistant_model=`` the target in
  bfloat16 (``bf16``) or with the int4 drafter's weights (``int4``,
  :func:`outrider.quantize.quantize_linears`), with K fixed (``-k<K>``) or
  transformers' own default schedule
  (``-default``: up to 20 tokens, drafting stops early when the assistant's
  confidence falls below 0.4), and ``prompt_lookup_num_tokens=K``.

Prompts are JSONL rows with ``turns`` (the first turn is used) or ``prompt``;
each is sent as one user message rendered with the target's chat template,
HumanEval's code prompts included. A row's ``category`` names its category,
else the file's stem does (``HumanEval_prompts.jsonl`` → ``humaneval``).

Configurations run interleaved — for each prompt, every configuration in
turn, the order rotated or reversed from prompt to prompt — so that
machine noise hits all alike; one untimed warm-up request per
configuration comes first. With
``--repeat R`` each prompt goes round R times, and each configuration's
request of median wall time on it is the one reported.
tokens/s = generated tokens ÷ wall time of the requests (client-side for
Outrider, ``generate()`` for Hugging Face), both summed over prompts.

The analytic bound each Outrider configuration is held against is explained
in :mod:`outrider.bench.bound`; how the Hugging Face rows count rounds and
drafts, in :mod:`outrider.bench.hf`.

With ``--concurrency`` the bench measures throughput and latency with N
streams at once instead: :mod:`outrider.bench.concurrency` explains how.
``--ignore-eos`` makes every request generate exactly max_new_tokens:
Outrider's ``ignore_eos``, and Hugging Face with no end-of-sequence token,
which keeps generating past one without masking it, as Outrider does (so the
outputs stay comparable).

Beside the bench, ``outrider bench TOOL`` runs the measurements around it:
``steps`` (what one forward step costs, :mod:`outrider.bench.steps`),
``pool`` (several runs' reports pooled, :mod:`outrider.bench.pooled_runs`),
``http`` (the OpenAI HTTP API against gRPC, :mod:`outrider.bench.http_overhead`)
and ``memory`` (each service's resident memory,
:mod:`outrider.bench.resident_memory`).

The modules, in the order a run uses them: ``cli`` and ``options`` (the
command line, and the options dataclasses its flags come from), ``prompts``
(the prompt set), ``configs`` (configuration names, drafters), ``hf`` and
``endpoints`` (the Hugging Face and Outrider configurations), ``runner`` (the
interleaved run), ``measurements`` and ``bound`` (sums and the bound),
``report`` (the JSON), ``render`` and ``plot`` (the terminal tables and the
figure), ``command`` (services, the whole run); ``concurrency/`` holds the
same steps for N streams at once.
"""
