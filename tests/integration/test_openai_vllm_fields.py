"""vLLM's extra fields and n > 1 on the OpenAI-compatible API, through the
official ``openai`` client (and httpx for the body guidellm sends) against a
real stack of tiny models: continuous usage on every chunk, min_tokens
holding back stop token ids, stop strings and EOS, the stop string kept in
the text when asked, n choices seeded seed + i and numbered prompt-major,
and 400s naming the fields Outrider refuses."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from outrider.client import AsyncClient
from tests.integration.harness import reference_greedy, running_stack
from tests.integration.test_openai_api import CHAT, GREEDY, api, served, streamed
from tests.tiny import EOS_TOKEN_ID

PROMPT_IDS = [5, 17, 42, 99]
MAX_TOKENS = 32
SAMPLED = dict(temperature=0.9, top_p=0.95, max_tokens=16)


@pytest.fixture
def stack(tiny_target_dir, tiny_draft_other_dir):
    """Greedy drafts of an unrelated model: rounds accept some drafts and reject others."""
    return running_stack(
        tiny_target_dir, draft_dir=tiny_draft_other_dir, eos_token_ids={EOS_TOKEN_ID}, http=True
    )


@pytest.fixture(scope="module")
def tokenizer(tiny_target_dir):
    return AutoTokenizer.from_pretrained(tiny_target_dir)


def decoded(tokenizer, ids: list[int]) -> str:
    """The text of ``ids`` generated after PROMPT_IDS, as the coordinator streams it."""
    prefix = tokenizer.decode(PROMPT_IDS, skip_special_tokens=True)
    return tokenizer.decode(PROMPT_IDS + ids, skip_special_tokens=True)[len(prefix) :]


def repeated_token(reference: list[int]) -> tuple[int, int, int]:
    """A token of the greedy reference that comes again later: the token,
    its first index and its next one."""
    for i, token in enumerate(reference):
        if token in reference[i + 1 :] and token not in reference[:i]:
            return token, i, reference.index(token, i + 1)
    raise AssertionError(f"no token repeats in {reference}")


def held_back_greedy(model_dir, banned: int, min_tokens: int) -> list[int]:
    """Target-only greedy decoding of MAX_TOKENS after PROMPT_IDS, ``banned``
    given no mass in the first ``min_tokens`` tokens (Hugging Face's forward)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    ids = list(PROMPT_IDS)
    while len(ids) - len(PROMPT_IDS) < MAX_TOKENS:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        if len(ids) - len(PROMPT_IDS) < min_tokens:
            logits[banned] = -torch.inf
        ids.append(int(logits.argmax()))
    return ids[len(PROMPT_IDS) :]


async def test_min_tokens_holds_back_a_stop_token_id_and_a_stop_string(
    stack, tokenizer, tiny_target_dir
):
    async with stack as s, AsyncClient(s.address) as grpc_client, api(s) as client:
        reference = list(
            (await grpc_client.generate(token_ids=PROMPT_IDS, max_new_tokens=MAX_TOKENS)).token_ids
        )
        stop_id, first, again = repeated_token(reference)
        greedy = dict(model=served(s), prompt=PROMPT_IDS, temperature=0, max_tokens=MAX_TOKENS)

        async def text_and_tokens(**fields) -> tuple[str, int, str]:
            reply = await client.completions.create(**greedy, extra_body=fields)
            (choice,) = reply.choices
            return choice.text, reply.usage.completion_tokens, choice.finish_reason

        stops = dict(stop_token_ids=[stop_id])
        assert await text_and_tokens(**stops) == (
            decoded(tokenizer, reference[:first]),
            first + 1,
            "stop",
        )
        # Held back, the stop token gets no mass in the first min_tokens
        # tokens (vLLM's min_tokens): the target takes its next choice there.
        held = dict(stops, min_tokens=first + 1)
        want = held_back_greedy(tiny_target_dir, stop_id, first + 1)
        end = want.index(stop_id) if stop_id in want else len(want)
        assert await text_and_tokens(**held) == (
            decoded(tokenizer, want[:end]),
            min(end + 1, MAX_TOKENS),
            "stop" if end < len(want) else "length",
        )
        # The stop token's text is kept when asked, as a stop string's is.
        kept = dict(held, include_stop_str_in_output=True)
        assert (await text_and_tokens(**kept))[0] == decoded(tokenizer, want[: end + 1])
        # The gRPC API: the same fields, the same tokens, drafted or not.
        for k in (0, 4):
            via_grpc = await grpc_client.generate(
                token_ids=PROMPT_IDS, max_new_tokens=MAX_TOKENS, stop_token_ids=[stop_id],
                min_tokens=first + 1, num_speculative_tokens=k,
            )  # fmt: skip
            assert list(via_grpc.token_ids) == want[: end + 1]

        # A stop string counts once it ends in the text of a token past min_tokens.
        full = decoded(tokenizer, reference)
        stop = tokenizer.decode([stop_id]).strip()[:2]
        past = len(decoded(tokenizer, reference[: again - 1]))
        cut = full.find(stop, max(past - len(stop) + 1, 0))
        assert 0 <= full.find(stop) < cut  # the premise: an earlier one is held back
        text, _, reason = await text_and_tokens(stop=stop, min_tokens=again - 1)
        assert (text, reason) == (full[:cut], "stop")
        text, _, _ = await text_and_tokens(stop=[stop], include_stop_str_in_output=True)
        assert text == full[: full.find(stop) + len(stop)]
    assert await s.sessions_left() == (0, 0)


async def test_min_tokens_holds_back_eos(tiny_target_dir, tiny_draft_other_dir, tokenizer):
    reference = reference_greedy(tiny_target_dir, PROMPT_IDS, MAX_TOKENS, eos=None)
    eos, first, _ = repeated_token(reference)
    async with (
        running_stack(
            tiny_target_dir, draft_dir=tiny_draft_other_dir, eos_token_ids={eos}, http=True
        ) as s,
        api(s) as client,
    ):
        greedy = dict(model=served(s), prompt=PROMPT_IDS, temperature=0, max_tokens=MAX_TOKENS)
        held = held_back_greedy(tiny_target_dir, eos, first + 1)
        assert eos not in held[: first + 1]
        end = held.index(eos) + 1 if eos in held else MAX_TOKENS  # (tokens, EOS included)
        for fields, tokens, reason, text in (
            ({}, first + 1, "stop", decoded(tokenizer, reference[:first])),
            (
                {"min_tokens": first + 1},
                end,
                "stop" if eos in held else "length",
                decoded(tokenizer, held[:end]),  # (EOS has no text)
            ),
            ({"ignore_eos": True}, MAX_TOKENS, "length", decoded(tokenizer, reference)),
        ):
            reply = await client.completions.create(**greedy, extra_body=fields)
            assert reply.usage.completion_tokens == tokens, fields
            assert reply.choices[0].finish_reason == reason
            assert reply.choices[0].text == text
    assert await s.sessions_left() == (0, 0)


async def test_continuous_usage_stats_put_each_choice_usage_on_every_chunk(stack):
    async with stack as s, api(s) as client:
        usage_options = {"include_usage": True, "continuous_usage_stats": True}
        _, chunks = await streamed(
            await client.chat.completions.create(
                model=served(s), messages=CHAT, stream=True, n=2, seed=3,
                stream_options=usage_options, **SAMPLED,
            )
        )  # fmt: skip
        *content, last = chunks
        assert last.choices == [] and last.usage.completion_tokens == 2 * 16
        prompt_tokens = last.usage.prompt_tokens  # counted once for both choices
        generated = [0, 0]
        for chunk in content:
            (choice,) = chunk.choices
            assert chunk.usage.prompt_tokens == prompt_tokens
            assert chunk.usage.completion_tokens > generated[choice.index]
            generated[choice.index] = chunk.usage.completion_tokens
            assert chunk.usage.total_tokens == prompt_tokens + generated[choice.index]
        assert generated == [16, 16]

        # The body guidellm 0.8.1 sends (it was refused with 400 before).
        body = {
            "model": served(s), "prompt": "Hello world", "max_tokens": 8, "stop": None,
            "ignore_eos": True, "stream": True, "stream_options": usage_options,
        }  # fmt: skip
        async with httpx.AsyncClient(base_url=s.http_url, timeout=30) as http:
            reply = await http.post("/v1/completions", json=body)
        assert reply.status_code == 200, reply.text
        events = [e[len("data: ") :] for e in reply.text.split("\n\n") if e]
        assert events[-1] == "[DONE]"
        usages = [json.loads(e)["usage"] for e in events[:-1]]
        assert [u["completion_tokens"] for u in usages][-1] == 8 and all(usages)
    assert await s.sessions_left() == (0, 0)


async def test_n_choices_are_the_runs_seeded_seed_plus_i_streamed_and_not(stack):
    async with stack as s, api(s) as client:
        solo = [
            (await client.chat.completions.create(
                model=served(s), messages=CHAT, seed=7 + i, **SAMPLED
            )).choices[0].message.content
            for i in range(3)
        ]  # fmt: skip
        assert len(set(solo)) == 3  # the premise: the seeds give different texts
        together = await client.chat.completions.create(
            model=served(s), messages=CHAT, seed=7, n=3, **SAMPLED
        )
        assert [c.index for c in together.choices] == [0, 1, 2]
        assert [c.message.content for c in together.choices] == solo
        single = await client.chat.completions.create(
            model=served(s), messages=CHAT, seed=7, **SAMPLED
        )
        assert together.usage.prompt_tokens == single.usage.prompt_tokens  # counted once
        assert together.usage.completion_tokens == 3 * 16

        stream = await client.chat.completions.create(
            model=served(s), messages=CHAT, seed=7, n=3, stream=True, **SAMPLED
        )
        texts, roles = ["", "", ""], [0, 0, 0]
        async for chunk in stream:
            for choice in chunk.choices:
                texts[choice.index] += choice.delta.content or ""
                roles[choice.index] += choice.delta.role == "assistant"
        assert texts == solo and roles == [1, 1, 1]

        # Unseeded, each choice draws a seed of its own.
        unseeded = await client.chat.completions.create(
            model=served(s), messages=CHAT, n=3, **SAMPLED
        )
        assert len({c.message.content for c in unseeded.choices}) > 1
    assert await s.sessions_left() == (0, 0)


async def test_n_choices_of_several_prompts_are_numbered_prompt_major(stack):
    prompts = ["Hello world", "Once upon a time"]
    async with stack as s, api(s) as client:
        solo = [
            (await client.completions.create(
                model=served(s), prompt=prompt, seed=3 + i, **SAMPLED
            )).choices[0].text
            for prompt in prompts
            for i in range(2)
        ]  # fmt: skip
        together = await client.completions.create(
            model=served(s), prompt=prompts, seed=3, n=2, **SAMPLED
        )
        assert [c.index for c in together.choices] == [0, 1, 2, 3]
        assert [c.text for c in together.choices] == solo
        stream = await client.completions.create(
            model=served(s), prompt=prompts, seed=3, n=2, stream=True, **SAMPLED
        )
        texts = [""] * 4
        async for chunk in stream:
            for choice in chunk.choices:
                texts[choice.index] += choice.text
        assert texts == solo
    assert await s.sessions_left() == (0, 0)


REFUSED = [
    # (fields, param, words of the message)
    ({"extra_body": {"repetition_penalty": 1.2}}, "repetition_penalty", "not supported"),
    (
        {"extra_body": {"guided_decoding_backend": "xgrammar"}},
        "guided_decoding_backend",
        "llguidance",
    ),
    ({"extra_body": {"guided_regex": "(("}}, "guided_regex", "does not compile"),
    ({"extra_body": {"min_tokens": 30}}, "min_tokens", "more than the 24 tokens"),
    ({"extra_body": {"min_tokens": -1}}, "min_tokens", "0 or more"),
    ({"extra_body": {"use_beam_search": True}}, "use_beam_search", "Unrecognized"),
    ({"n": 65}, "n", "at most 64"),
    ({"n": 0}, "n", "at least 1"),
    ({"n": 2, "extra_body": {"best_of": 3}}, "best_of", "unless it equals n"),
]


async def test_refused_fields_get_a_400_naming_them_and_accepted_ones_pass(stack):
    async with stack as s, api(s) as client:
        for fields, param, words in REFUSED:
            with pytest.raises(openai.BadRequestError) as refused:
                await client.completions.create(model=served(s), prompt="Hello", **GREEDY, **fields)
            assert refused.value.param == param, (fields, refused.value.message)
            assert words in refused.value.message, (fields, refused.value.message)
        accepted = {
            "repetition_penalty": 1.0, "skip_special_tokens": True,
            "spaces_between_special_tokens": False, "top_k": -1, "min_p": 0.0,
            "guided_decoding_backend": "auto",
        }  # fmt: skip
        plain = await client.completions.create(model=served(s), prompt="Hello", **GREEDY)
        reply = await client.completions.create(
            model=served(s), prompt="Hello", **GREEDY, extra_body=accepted
        )
        assert reply.choices[0].text == plain.choices[0].text
    assert await s.sessions_left() == (0, 0)
