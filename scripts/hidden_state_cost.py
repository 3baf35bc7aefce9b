"""What sending an EAGLE-3 head the target's hidden states adds to a round:
bytes per committed token, and the target's step with and without them
(the features gathered at three layers and packed as bfloat16), at 1 and 8
sessions, K = 0 and K = 4; each the median of many steps, in turns.

    python scripts/hidden_state_cost.py [--model M] [--repeats N]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from outrider import model_specs
from outrider.eagle.head import default_aux_layers
from outrider.engine.causal_lm import load_causal_lm
from outrider.engine.hidden_states import pack
from outrider.engine.kv_cache import BlockPool
from outrider.engine.llama import LlamaForward
from outrider.engine.runner import PagedRunner
from outrider.engine.scheduler import Row
from outrider.v1 import worker_pb2
from outrider.wire import hidden_states_to_pb


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="target (default: the default model)")
    parser.add_argument("--repeats", type=int, default=40, help="timed steps per shape")
    parser.add_argument("--context", type=int, default=256, help="cached tokens per session")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_causal_lm(args.model, fast_small_batch=False)
    layers = default_aux_layers(model.config.num_hidden_layers)
    width = len(layers) * model.config.hidden_size
    print(
        f"{model_specs.resolve(args.model)}: layers {layers}, {width} values a row, "
        f"{2 * width} bytes"
    )
    runner = PagedRunner(LlamaForward(copy.deepcopy(model)), BlockPool(256, 16))
    runner.warm_up(max_rows=1, max_tokens_per_row=1)
    for rows, k in ((1, 0), (1, 4), (8, 0), (8, 4)):
        caches = []
        for _ in range(rows):
            kv = runner.new_kv()
            kv.reserve(args.context + k + 1)
            with torch.inference_mode():
                runner.execute([Row(kv, [1] * args.context, 0)])
            caches.append(kv)
        times: dict[bool, list[float]] = {False: [], True: []}
        wire = 0
        for i in range(2 * args.repeats + 4):
            with_features = bool(i % 2)
            sinks: list[list[torch.Tensor]] = [[] for _ in caches]
            for kv in caches:
                kv.reserve(args.context + k + 1)  # as the engine does before every feed
            started = time.perf_counter()
            with torch.inference_mode():
                runner.execute(
                    [
                        Row(kv, [1] * (k + 1), k + 1, None, sink, layers)
                        if with_features
                        else Row(kv, [1] * (k + 1), k + 1)
                        for kv, sink in zip(caches, sinks, strict=True)
                    ]
                )
                if with_features:  # a verdict accepting half the drafts sends k // 2 + 1 rows
                    messages = [
                        hidden_states_to_pb(pack(torch.cat(sink)[: k // 2 + 1])) for sink in sinks
                    ]
                    wire = sum(
                        len(worker_pb2.Verdict(hidden_states=m).SerializeToString())
                        for m in messages
                    )
            elapsed = time.perf_counter() - started
            for kv in caches:
                kv.crop(args.context)
            if i >= 4:
                times[with_features].append(elapsed)
        for kv in caches:
            kv.free()
        plain, featured = (statistics.median(times[f]) * 1e3 for f in (False, True))
        added = featured - plain
        print(
            f"{rows} session(s), K = {k}: step {plain:.2f} ms, with hidden states "
            f"{featured:.2f} ms (+{added:.2f} ms, {100 * added / plain:+.1f}%); "
            f"{wire} bytes on the wire"
        )


if __name__ == "__main__":
    main()
