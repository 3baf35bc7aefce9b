"""Hugging Face in the bench process: plain ``generate`` and assisted generation.

The Hugging Face rows count rounds and drafts with a hook on the target's
forward (each call is one round; its input length and cache length give the
number of drafts it verified and how many were committed), so their
acceptance rate and mean acceptance length are comparable with Outrider's;
they have no time split and no bound.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

from outrider.bench.configs import BASELINE, Config, Drafter
from outrider.bench.measurements import Measurement
from outrider.bench.prompts import Prompt, chat_prompt_ids


def rounds_from_forward_calls(
    calls: Sequence[tuple[int, int]], prompt_tokens: int, total_tokens: int
) -> tuple[int, int, tuple[int, ...]]:
    """(draft tokens, accepted tokens, accepted per position) of a Hugging Face generation.

    ``calls`` holds (input length, cached length) of each target forward call.
    Call r verifies c_r = cached_r + input_r − L_r drafts, where L_r is the
    committed length before it; after it the cache is cropped to the new
    committed length minus one, so L_(r+1) = cached_(r+1) + 1, and the last
    round ends at ``total_tokens``. A round commits its accepted drafts plus
    one token.
    """
    draft_tokens = accepted_tokens = 0
    per_position: list[int] = []
    committed = prompt_tokens
    for r, (input_len, cached) in enumerate(calls):
        drafts = max(0, cached + input_len - committed)
        after = calls[r + 1][1] + 1 if r + 1 < len(calls) else total_tokens
        accepted = min(drafts, max(0, after - committed - 1))
        draft_tokens += drafts
        accepted_tokens += accepted
        if len(per_position) < accepted:
            per_position += [0] * (accepted - len(per_position))
        for i in range(accepted):
            per_position[i] += 1
        committed = after
    return draft_tokens, accepted_tokens, tuple(per_position)


class HuggingFace:
    """The stock target (and its assistants: bfloat16, int4) in this process."""

    def __init__(
        self, model_dir: str, dtype: str, device: str = "auto", *, ignore_eos: bool = False
    ) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from outrider.device import resolve_device

        self._torch = torch
        self.model_dir = model_dir
        self.device = resolve_device(device)
        self.ignore_eos = ignore_eos
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = (
            AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
            .to(self.device)
            .eval()
        )
        self._assistants: dict[str, Any] = {}
        self._calls: list[tuple[int, int]] = []
        eos = self.model.generation_config.eos_token_id
        self.eos_token_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)

    @property
    def stop_kwargs(self) -> dict[str, Any]:
        """``generate``'s end-of-sequence setting: the model's own, or with
        ``ignore_eos`` none at all.

        ``eos_token_id=[]`` generates past an end-of-sequence token without
        masking it, as Outrider's ``ignore_eos`` does, so the tokens stay
        comparable; ``min_new_tokens`` would mask it and change them.
        """
        return {"eos_token_id": []} if self.ignore_eos else {}

    @contextmanager
    def _counting_calls(self):
        """Records (input length, cached length) of each target forward call in ``self._calls``."""
        self._calls.clear()
        hook = self.model.register_forward_pre_hook(self._record_call, with_kwargs=True)
        try:
            yield
        finally:
            hook.remove()

    def _record_call(self, module, args, kwargs) -> None:
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        cache = kwargs.get("past_key_values")
        self._calls.append(
            (int(input_ids.shape[1]), int(cache.get_seq_length()) if cache is not None else 0)
        )

    def assistant(self, kind: str):
        """The target's checkpoint as an assistant, loaded on first use:
        ``"bf16"`` in bfloat16, ``"int4"`` with the int4 drafter's weights
        (:func:`outrider.quantize.quantize_linears`)."""
        if kind not in self._assistants:
            from transformers import AutoModelForCausalLM

            from outrider.quantize import quantize_linears

            dtype = self._torch.bfloat16 if kind == "bf16" else self.model.dtype
            model = (
                AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=dtype)
                .to(self.device)
                .eval()
            )
            if kind == "int4":
                quantize_linears(model)
            self._assistants[kind] = model
        return self._assistants[kind]

    def _set_assistant_k(self, assistant, k: int | None) -> None:
        """Fixed K (constant schedule, no confidence stop), or for None the
        checkpoint's own settings, as the target's generation config (the
        same checkpoint, never changed here) holds them.

        Set before every call: a "heuristic" schedule would carry K over from call to call.
        """
        config = assistant.generation_config
        defaults = self.model.generation_config
        values = (
            (
                defaults.num_assistant_tokens,
                defaults.num_assistant_tokens_schedule,
                defaults.assistant_confidence_threshold,
            )
            if k is None
            else (k, "constant", 0.0)
        )
        (
            config.num_assistant_tokens,
            config.num_assistant_tokens_schedule,
            config.assistant_confidence_threshold,
        ) = values

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        return chat_prompt_ids(self.tokenizer, prompt)

    def generate(self, prompt: Prompt, max_new_tokens: int, **assisted: Any) -> Measurement:
        torch = self._torch
        ids = self.prompt_ids(prompt)
        inputs = torch.tensor([ids], device=self.device)
        started = time.perf_counter()
        with torch.inference_mode(), self._counting_calls():
            out = self.model.generate(
                inputs,
                attention_mask=torch.ones_like(inputs),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                **self.stop_kwargs,
                **assisted,
            )
        wall_s = time.perf_counter() - started
        generated = out[0, len(ids) :].tolist()
        draft, accepted, per_position = rounds_from_forward_calls(
            self._calls, len(ids), len(ids) + len(generated)
        )
        return Measurement(
            token_ids=tuple(self.cut_at_eos(generated)),
            prompt_tokens=len(ids),
            wall_s=wall_s,
            rounds=len(self._calls),
            draft_tokens=draft,
            accepted_tokens=accepted,
            accepted_per_position=per_position,
        )

    def cut_at_eos(self, tokens: list[int]) -> list[int]:
        """Up to and including the first end-of-sequence token (assisted generation
        can commit drafts past one, and a padded batch pads after one); all with ``ignore_eos``."""
        if self.ignore_eos:
            return tokens
        for i, token in enumerate(tokens):
            if token in self.eos_token_ids:
                return tokens[: i + 1]
        return tokens

    def configs(self, drafters: Sequence[Drafter], ks: Sequence[int]) -> list[Config]:
        configs = [Config(BASELINE, "hf", lambda p, n: self.generate(p, n), k=0)]
        for drafter in drafters:
            if drafter.hf_peer in ("bf16", "int4"):
                for k in ks:
                    configs.append(
                        Config(
                            f"hf-assisted-{drafter.label}-k{k}",
                            "hf",
                            self._assisted(drafter.hf_peer, k),
                            drafter.label,
                            k,
                        )  # fmt: skip
                    )
                configs.append(
                    Config(
                        f"hf-assisted-{drafter.label}-default",
                        "hf",
                        self._assisted(drafter.hf_peer, None),
                        drafter.label,
                    )
                )
            elif drafter.hf_peer == "prompt-lookup":
                for k in ks:
                    configs.append(
                        Config(
                            f"hf-assisted-prompt-lookup-k{k}",
                            "hf",
                            partial(self.generate, prompt_lookup_num_tokens=k),
                            drafter.label,
                            k,
                        )
                    )
        return configs

    def _assisted(self, kind: str, k: int | None) -> Callable[[Prompt, int], Measurement]:
        def run(prompt: Prompt, max_new_tokens: int) -> Measurement:
            assistant = self.assistant(kind)
            self._set_assistant_k(assistant, k)
            return self.generate(prompt, max_new_tokens, assistant_model=assistant)

        return run
