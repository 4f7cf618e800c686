"""Which model errors make a call wait, and for how long (pure rules)."""

from __future__ import annotations

import anthropic
import httpx
import pytest
from loomflow.core.types import Message

from loomflow_worker.execution.pacing import MAX_PROVIDER_WAIT, estimate_tokens, provider_wait

REQUEST = httpx.Request("POST", "http://127.0.0.1/v1/messages")


def _error(kind: type[anthropic.APIStatusError], status: int, **headers: str
           ) -> anthropic.APIStatusError:
    response = httpx.Response(status, headers=headers, request=REQUEST)
    return kind("refused", response=response, body=None)


def test_a_rate_limit_waits_as_long_as_the_provider_asks() -> None:
    assert provider_wait(_error(anthropic.RateLimitError, 429, **{"retry-after": "7"}), 1) == 7.0
    asked = _error(anthropic.RateLimitError, 429, **{"retry-after": "86400"})
    assert provider_wait(asked, 1) == MAX_PROVIDER_WAIT


def test_an_overload_without_retry_after_backs_off_more_each_time() -> None:
    overloaded = _error(anthropic.InternalServerError, 529)
    first, fifth = provider_wait(overloaded, 1), provider_wait(overloaded, 5)
    assert first is not None and 0.5 <= first <= 1.0
    assert fifth is not None and 8.0 <= fifth <= 16.0


@pytest.mark.parametrize(("kind", "status"), [
    (anthropic.BadRequestError, 400), (anthropic.AuthenticationError, 401),
    (anthropic.InternalServerError, 500),
])
def test_other_errors_fail_the_step_as_before(
    kind: type[anthropic.APIStatusError], status: int
) -> None:
    assert provider_wait(_error(kind, status), 1) is None
    assert provider_wait(ValueError("not a model error"), 1) is None


def test_a_calls_tokens_are_estimated_from_its_messages() -> None:
    messages = [Message(role="user", content="x" * 400), Message(role="assistant", content="")]
    assert estimate_tokens(messages) == 100
    assert estimate_tokens([]) == 1
