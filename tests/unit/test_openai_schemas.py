"""The HTTP API's translation, without a server: pydantic's findings become
one error naming the field, OpenAI's unimplemented parameters are refused
unless they change nothing, a response's speculation adds up its
generations, and the request builder names fields as the HTTP API does."""

import pytest
from pydantic import ValidationError

from outrider import errors
from outrider.coordinator.openai.app import body_params
from outrider.coordinator.openai.errors import body_error, status_and_error
from outrider.coordinator.openai.generation import speculative_decoding, usage
from outrider.coordinator.openai.schemas import ChatCompletionRequest, CompletionRequest
from outrider.coordinator.request_stats import Stats
from outrider.coordinator.requests import (
    FieldNames,
    RequestBuilder,
    RequestParams,
    SpeculationDefaults,
)
from outrider.coordinator.served_models import Models
from outrider.coordinator.workers.protocol import WorkerInfo

CHAT = [{"role": "user", "content": "Hi"}]


def problem(model, body: dict) -> errors.InvalidArgument:
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    return body_error([{**e, "loc": ("body", *e["loc"])} for e in info.value.errors()])


@pytest.mark.parametrize(
    "model, body, param, message",
    [
        (ChatCompletionRequest, {"messages": CHAT, "temperature": "1"}, "temperature",
         "temperature: input should be a valid number, not str"),
        (ChatCompletionRequest, {"messages": [{"role": "user", "content": 3}]},
         "messages[0].content", "must be a string or a list of text parts"),
        (ChatCompletionRequest, {}, "messages", "messages: this field is required"),
        (ChatCompletionRequest, {"messages": CHAT, "stop": [1]}, "stop",
         "must be a string or a list"),
        (CompletionRequest, {"prompt": [[1], "a"]}, "prompt", "must be a string, a list of token"),
        (CompletionRequest, {"prompt": "a", "best_of": 1, "bogus": 2}, "bogus",
         "Unrecognized request argument supplied: bogus"),
    ],
)  # fmt: skip
def test_a_bad_body_is_one_error_naming_its_field(model, body, param, message):
    error = problem(model, body)
    assert error.param == param and message in str(error)


@pytest.mark.parametrize(
    "body",
    [
        {"frequency_penalty": 0.0, "logprobs": False, "n": 1, "tools": [], "tool_choice": "none"},
        {"response_format": {"type": "text"}, "top_logprobs": 0, "user": "u", "metadata": {}},
        {"repetition_penalty": 1, "spaces_between_special_tokens": False, "guided_json": None},
    ],
)
def test_unimplemented_parameters_at_their_neutral_value_pass(body):
    ChatCompletionRequest.model_validate({"messages": CHAT, **body}).check_supported()


@pytest.mark.parametrize(
    "body, kind",
    [
        ({"response_format": {"type": "json_object"}}, "json_object"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
         "json_schema"),
        ({"guided_choice": ["a", "b"]}, "choice"),
        ({"guided_regex": "a+"}, "regex"),
        ({"structured_outputs": {"grammar": "start: /a+/"}}, "grammar"),
    ],
)  # fmt: skip
def test_each_way_to_ask_for_structured_output_gives_its_constraint(body, kind):
    output, field = ChatCompletionRequest.model_validate(
        {"messages": CHAT, **body}
    ).structured_output()
    assert output is not None and output.kind == kind
    assert field.split(".")[0] in body


def test_best_of_passes_only_equal_to_n():
    CompletionRequest(prompt="a", n=3, best_of=3).check_supported()
    with pytest.raises(errors.InvalidArgument) as info:
        CompletionRequest(prompt="a", n=2, best_of=3).check_supported()
    assert info.value.param == "best_of" and "unless it equals n (2)" in str(info.value)


@pytest.mark.parametrize(
    "model, body, param",
    [
        (ChatCompletionRequest, {"messages": CHAT, "presence_penalty": 0.1}, "presence_penalty"),
        (CompletionRequest, {"prompt": "a", "echo": True}, "echo"),
        (CompletionRequest, {"prompt": "a", "best_of": 2}, "best_of"),
        (CompletionRequest, {"prompt": "a", "repetition_penalty": 1.2}, "repetition_penalty"),
        (ChatCompletionRequest, {"messages": CHAT, "guided_decoding_backend": "xgrammar"},
         "guided_decoding_backend"),
    ],
)  # fmt: skip
def test_unimplemented_parameters_that_would_change_the_output_are_refused(model, body, param):
    with pytest.raises(errors.InvalidArgument) as info:
        model.model_validate(body).check_supported()
    assert info.value.param == param


def test_each_prompt_of_a_completion_is_a_string_or_token_ids():
    assert CompletionRequest(prompt="a").prompts == ["a"]
    assert CompletionRequest(prompt=[1, 2]).prompts == [[1, 2]]
    assert CompletionRequest(prompt=["a", "b"]).prompts == ["a", "b"]
    assert CompletionRequest(prompt=[[1], [2, 3]]).prompts == [[1], [2, 3]]


def test_domain_errors_get_their_status_and_other_errors_a_500_naming_no_detail():
    assert status_and_error(errors.ResourceExhausted("full"))[0] == 429
    assert status_and_error(errors.SessionExpired("idle"))[0] == 503
    status, body = status_and_error(errors.InvalidArgument("bad", param="top_p"))
    assert (status, body["error"]["param"]) == (400, "top_p")
    status, body = status_and_error(KeyError("secret detail"))
    assert status == 500 and "secret" not in body["error"]["message"]


def test_a_response_speculation_adds_up_its_generations():
    one = Stats(rounds=2, num_drafts=2, draft_tokens=8, accepted_tokens=6, generated_tokens=8)
    one.accepted_per_position = [2, 2, 1, 1]
    two = Stats(rounds=3, num_drafts=1, draft_tokens=2, accepted_tokens=0, generated_tokens=3)
    two.accepted_per_position = [0, 0]
    assert speculative_decoding([one, two]) == {
        "rounds": 5,
        "num_drafts": 3,
        "num_draft_tokens": 10,
        "num_accepted_tokens": 6,
        "num_accepted_tokens_per_pos": [2, 2, 1, 1],
        "acceptance_rate": 0.6,
        "mean_acceptance_length": 11 / 5,
    }


def test_usage_counts_each_prompt_once_whatever_n():
    stats = [
        Stats(prompt_tokens=p, generated_tokens=g, cached_prompt_tokens=c)
        for p, g, c in ((5, 3, 0), (5, 4, 0), (7, 2, 4), (7, 1, 4))
    ]
    assert usage(stats, n=2) == {
        "prompt_tokens": 12,
        "completion_tokens": 10,
        "total_tokens": 22,
        "prompt_tokens_details": {"cached_tokens": 4},
    }
    assert usage(stats)["prompt_tokens"] == 24  # four prompts


def test_vllm_fields_reach_the_request_params():
    body = CompletionRequest(
        prompt="a", min_tokens=3, include_stop_str_in_output=True, skip_special_tokens=False,
        top_k=-1,
    )  # fmt: skip
    params = body_params(body)
    assert params.min_tokens == 3 and params.include_stop_str_in_output
    assert not params.skip_special_tokens and params.top_k == 0  # vLLM's -1: off


def test_the_builder_names_fields_as_the_receiving_api_does():
    target = WorkerInfo(model="t", drafter="", vocab_size=100, vocab_fingerprint="", max_context=64)
    builder = RequestBuilder(
        Models(tokenizer=None, eos_token_ids=frozenset(), target=target),
        SpeculationDefaults(
            default_num_speculative_tokens=4,
            max_num_speculative_tokens=8,
            default_max_new_tokens=16,
        ),
        drafts=True,
    )
    http = FieldNames(text="prompt[1]", token_ids="prompt[1]", max_new_tokens="max_tokens")
    with pytest.raises(errors.InvalidArgument) as info:
        builder.build(RequestParams(token_ids=[1, 100]), http)
    assert info.value.param == "prompt[1]" and str(info.value).startswith("prompt[1][1] = 100")
    with pytest.raises(errors.InvalidArgument) as info:
        builder.build(RequestParams(token_ids=[1], max_new_tokens=64), http)
    assert info.value.param == "max_tokens" and "at most 63" in str(info.value)
    with pytest.raises(errors.InvalidArgument) as info:
        builder.build(RequestParams(token_ids=[1], max_new_tokens=64))
    assert str(info.value).startswith("max_new_tokens = 64")
    with pytest.raises(errors.InvalidArgument) as info:
        builder.build(RequestParams(token_ids=[1], max_new_tokens=8, min_tokens=9), http)
    assert info.value.param == "min_tokens"
    assert str(info.value).startswith("min_tokens = 9 is more than the 8 tokens")
    assert "raise max_tokens" in str(info.value)
    with pytest.raises(errors.InvalidArgument) as info:
        builder.build(RequestParams(token_ids=[1], min_tokens=-1))
    assert info.value.param == "min_tokens" and "0 or more" in str(info.value)
    assert builder.build(RequestParams(token_ids=[1], min_tokens=16)).sampling.min_tokens == 16
    assert not builder.build(
        RequestParams(token_ids=[1], skip_special_tokens=False)
    ).skip_special_tokens
