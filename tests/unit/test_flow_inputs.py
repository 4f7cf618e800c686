"""Bad flow-control input is refused with a clear error and nothing registered."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from loomflow_worker import register_agent
from loomflow_worker.execution.registry import agent_limits, agent_model_key
from loomflow_worker.runtime.errors import InvalidInput
from loomflow_worker.settings import Settings


@pytest.mark.parametrize(("kwargs", "says"), [
    ({"limits": "anthropic"}, "a list of limit names"),
    ({"limits": ["per_key"]}, "applies by itself"),
    ({"limits": ["agent:x"]}, "applies by itself"),
    ({"limits": ["x" * 65]}, "at most 64 bytes"),
    ({"limits": [""]}, "non-empty"),
    ({"model_key": "k" * 65}, "at most 64 bytes"),
    ({"model_key": " "}, "non-empty"),
    ({"limits": ["fair_queue"]}, "applies by itself"),
    ({"fairness_key": "t" * 65}, "at most 64 bytes"),
    ({"fairness_key": ""}, "non-empty"),
])
def test_register_agent_refuses_bad_limits_and_model_keys(kwargs: dict[str, object],
                                                          says: str) -> None:
    with pytest.raises(InvalidInput, match=says):
        register_agent("flow-input-check", **kwargs)  # type: ignore[arg-type]
    assert agent_limits("flow-input-check") == ()


def test_an_agents_fairness_key_is_its_requests_unless_the_call_names_one() -> None:
    from loomflow_worker.execution.request import RunRequest

    register_agent("flow-input-tenant", fairness_key="acme")(lambda runtime: None)
    of_agent = RunRequest("hi", "s", "u", "flow-input-tenant", {})
    assert of_agent.fairness_key == "acme"
    assert RunRequest("hi", "s", "u", "flow-input-kept", {}).fairness_key == "u"
    assert RunRequest("hi", "s", None, "flow-input-kept", {}).fairness_key == "s"


def test_register_agent_keeps_its_limits_and_model_key() -> None:
    register_agent("flow-input-kept", limits=["anthropic"], model_key="anthropic")(
        lambda runtime: None)
    assert agent_limits("flow-input-kept") == ("anthropic",)
    assert agent_model_key("flow-input-kept") == "anthropic"


@pytest.mark.parametrize(("variable", "value", "says"), [
    ("LOOMFLOW_WORKER_LIMITS", '{"per_key": 0}', "positive integer"),
    ("LOOMFLOW_WORKER_LIMITS", '{"per_key": true}', "valid integer"),
    ("LOOMFLOW_WORKER_LIMITS", '{"per_key": "5"}', "valid integer"),
    ("LOOMFLOW_WORKER_LIMITS", '{"agent:": 3}', "agent name"),
    ("LOOMFLOW_WORKER_MODEL_LIMITS", '{"k": {}}', "give rpm"),
    ("LOOMFLOW_WORKER_MODEL_LIMITS", '{"k": {"rpm": -1}}', "greater than 0"),
    ("LOOMFLOW_WORKER_MODEL_LIMITS", '{"k": {"rpm": 1, "burst": -1}}', "greater than or equal"),
    ("LOOMFLOW_WORKER_MODEL_LIMITS", '{"k": {"rpm": 1, "per": 2}}', "Extra inputs"),
    ("LOOMFLOW_WORKER_PARK_AFTER", "-1", "greater than or equal"),
])
def test_settings_refuse_bad_limits(monkeypatch: pytest.MonkeyPatch, variable: str, value: str,
                                    says: str) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValidationError, match=says):
        Settings()


@pytest.mark.parametrize("priority", [256, -1, 40_000, "5", 2.5, True])
def test_a_priority_out_of_range_is_refused_before_anything_is_recorded(priority: object) -> None:
    from loomflow_worker.tasks.task import priority_rank

    with pytest.raises(InvalidInput, match="priority must be an integer from 0 to 255"):
        priority_rank({"priority": priority}, "redis://127.0.0.1:6379/0")


def test_a_priority_ranks_as_its_broker_orders_it() -> None:
    from loomflow_worker.tasks.task import priority_rank

    assert priority_rank(None, "redis://h/0") == 0
    assert priority_rank({"priority": 9}, "redis://h/0") == 9
    assert priority_rank({"priority": 9}, "amqp://guest@h//") == -9


@pytest.mark.parametrize("weight", [0, -1, float("nan"), float("inf"), "heavy", True, 2e6])
def test_a_fairness_weight_that_is_not_a_positive_number_is_refused(weight: object) -> None:
    from loomflow_worker.tasks.task import checked_fairness_weight

    with pytest.raises(InvalidInput, match="fairness_weight: a fairness weight is a positive"):
        checked_fairness_weight(weight, {})
    with pytest.raises(InvalidInput, match="fairness_weight"):
        checked_fairness_weight(None, {"headers": {"fairness_weight": weight}})


def test_a_fairness_weight_is_taken_from_the_keyword_else_the_header() -> None:
    from loomflow_worker.tasks.task import checked_fairness_weight

    assert checked_fairness_weight(3, {"headers": {"fairness_weight": 5}}) == 3.0
    assert checked_fairness_weight(None, {"headers": {"fairness_weight": 0.5}}) == 0.5
    assert checked_fairness_weight(None, {"headers": None}) is None


def test_apply_asyncs_fairness_keyword_names_the_key_and_leaves_the_options() -> None:
    from loomflow_worker.tasks.task import checked_fairness_key, checked_fairness_weight

    options: dict[str, object] = {"fairness_key": "acme", "fairness_weight": 2, "priority": 3}
    assert checked_fairness_key(None, options) == "acme"
    assert checked_fairness_weight(None, options) == 2.0
    assert options == {"priority": 3}  # not sent on to Celery as options of its own
    assert checked_fairness_key("beta", {"fairness_key": "acme"}) == "beta"
