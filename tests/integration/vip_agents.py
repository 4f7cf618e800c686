"""An agent only some workers have (LOOMFLOW_WORKER_AGENTS of the workers on
the `vip` queue): a request for it that reaches another worker fails."""

from __future__ import annotations

from typing import Any

from loomflow import Agent

from loomflow_worker import register_agent

from .agents_fixture import build


@register_agent("vip")
def build_vip(runtime: Any) -> Agent:
    return build(runtime)
