"""Request bodies of a million bad elements: refused at their first, not after a million errors.
Before, a 4 MiB body of [[], [], ...] as `prompt` made 4.2 M validation errors, each converted for
the 400: the API process (and /health) was held 33 s and grew by 5.7 GB; one of a million
`stop_token_ids` was accepted and scanned after every token of every choice, slowing every
other stream's tokens 120-fold."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvfleet_engine.sampling import MAX_STOP_TOKEN_IDS, SamplingParams
from kvfleet_engine.server.errors import invalid_request
from kvfleet_engine.server.protocol import ChatCompletionRequest, CompletionRequest

MILLION = 1_000_000
USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"prompt": [[]] * MILLION}, "prompt.0", "at least 1 item"),
        ({"prompt": [[1]] * 257}, "prompt", "at most 256 items"),
        ({"prompt": ["a"] * 257}, "prompt", "at most 256 items"),
        ({"prompt": [1.5] * MILLION}, "prompt", "must be a string, a list of strings"),
        ({"prompt": [[1, -1]] * 100}, "prompt.0.1", "greater than or equal to 0"),
        ({"prompt": "hi", "stop_token_ids": [-1] * MILLION}, "stop_token_ids.0", ">= 0"),
        ({"prompt": "hi", "stop_token_ids": [5] * (MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids",
         f"at most {MAX_STOP_TOKEN_IDS} items"),
        ({"prompt": "hi", "logit_bias": {str(i): 1.0 for i in range(301)}}, "logit_bias",
         "at most 300 items"),
        ({"messages": [{"role": "user", "content": [1] * MILLION}]}, "messages.0.content",
         "a list of {\"type\": \"text\""),
        ({"messages": USER, "tools": [1] * MILLION}, "tools.0", "valid dictionary"),
        ({"messages": USER, "tools": [{}] * 129}, "tools", "at most 128 items"),
    ],
)  # fmt: skip
def test_a_long_bad_list_is_refused_at_its_first_element(body, param, message) -> None:
    model = ChatCompletionRequest if "messages" in body else CompletionRequest
    with pytest.raises(ValidationError) as error:
        model.model_validate({"model": "m", **body})
    errors = error.value.errors()
    assert len(errors) <= 4  # one per shape the field takes, not one per element
    located = [{**e, "loc": ("body", *e["loc"])} for e in errors]
    refusal = invalid_request(located, "application/json")
    assert refusal.status_code == 400 and refusal.param == param
    assert message.replace(">= 0", "greater than or equal to 0") in str(refusal)


def test_long_valid_lists_still_pass() -> None:
    ids = list(range(200_000))  # a long prompt as token ids: no cap below the context
    assert CompletionRequest.model_validate({"model": "m", "prompt": ids}).prompt == ids
    stops = list(range(MAX_STOP_TOKEN_IDS))
    body = {"model": "m", "prompt": "hi", "stop_token_ids": stops}
    assert CompletionRequest.model_validate(body).stop_token_ids == stops


def test_the_offline_api_holds_the_same_cap() -> None:
    with pytest.raises(ValueError, match=f"stop_token_ids must be at most {MAX_STOP_TOKEN_IDS}"):
        SamplingParams(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1)))
