"""The deploy files (``deploy/``), checked without a Docker engine or a cluster.

- every YAML file parses, and every Kubernetes manifest validates against the Kubernetes API's
  OpenAPI schemas, offline and strict (an unknown or misspelt field fails): kubernetes-validate
  ships them; KEDA's ScaledObject and TriggerAuthentication are CRDs, checked by hand;
- every ``LOOMFLOW_WORKER_*`` name the files use is a field of :class:`Settings`, every other
  variable one of a short list, and the values configured parse as the package parses them;
- every command is the console script of ``[project.scripts]`` with a subcommand it has, and the
  probes ping the node name the worker really takes;
- every worker is one process on the threads pool (or prefork, never gevent or eventlet) at the
  default concurrency, KEDA's target per pod is that concurrency, a pod's resources are those
  OPERATIONS.md gives for it, and the Postgres connection counts stated in the files are the
  formula's for the settings configured beside them;
- the grace periods (Compose's ``stop_grace_period``, Kubernetes'
  ``terminationGracePeriodSeconds``) exceed the soft shutdown timeout configured in the same
  files, with margin; KEDA watches the Redis list of the configured queue, on the broker's
  Redis;
- the Dockerfile runs as a non-root user and bakes in no secret; the Secret is placeholders;
- a deploy that changes an agent: each release is its own Deployment and ScaledObject
  (``k8s/release``, the fleet ``k8s-releases``), named and labelled after it, sharing the rest;
  a draining release takes no new request (``TAKE_NEW``, a setting) and KEDA scales it, down to
  zero, on what it owes: ``loomflow_worker_version_demand`` of its own pods' host names. The
  same in Compose (``worker-previous``).
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
import typing
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import urlsplit

import anyio
import click
import kubernetes_validate  # type: ignore[import-untyped]  # no py.typed
import pytest
import yaml
from celery import Celery
from pydantic import SecretStr

from loomflow_worker.settings import Settings
from loomflow_worker.testing import DeterministicModel
from tests.needs import KUBECTL

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
DOCKERFILE = DEPLOY / "Dockerfile"
DOCKERIGNORE = DEPLOY / "Dockerfile.dockerignore"
COMPOSE = DEPLOY / "compose.yaml"
KUSTOMIZATION = K8S / "kustomization.yaml"
# One release's workers, the draining release, the fleet's shared objects (components), and a
# fleet of releases made with them.
RELEASE = K8S / "release"
DRAINING = RELEASE / "draining"
FLEET_COMPONENT = RELEASE / "fleet"
RELEASES = DEPLOY / "k8s-releases"
RELEASE_LABEL = "loomflow-worker/release"
# The setting a draining release's workers set false, and the function its KEDA trigger calls.
TAKE_NEW = "take_new"
DEMAND_FUNCTION = "loomflow_worker_version_demand"

ENV_PREFIX = "LOOMFLOW_WORKER_"
# Variables the deploy files may set besides the package's own settings.
OTHER_ENV = frozenset({
    "ANTHROPIC_API_KEY",
    "POSTGRES_USER", "POSTGRES_PASSWORD", "POSTGRES_DB",
    "PATH", "PYTHONPATH", "PYTHONDONTWRITEBYTECODE", "PYTHONUNBUFFERED", "VIRTUAL_ENV",
    "PIP_DISABLE_PIP_VERSION_CHECK", "PIP_NO_CACHE_DIR",
})
# What the workers' Secret must hold.
WORKER_SECRETS = frozenset({
    "LOOMFLOW_WORKER_DATABASE_URL", "LOOMFLOW_WORKER_BROKER_URL",
    "LOOMFLOW_WORKER_RESULT_BACKEND", "ANTHROPIC_API_KEY",
})
PLACEHOLDER = "CHANGE_ME"
# After its soft shutdown a worker stops and requeues its runs, closes its pool children and
# stops its sweeper (which waits up to 10 s): the orchestrator's grace period must leave it
# this much more (deploy/OPERATIONS.md).
SHUTDOWN_MARGIN = 15.0
# Postgres keeps these for superusers (superuser_reserved_connections' default).
RESERVED_CONNECTIONS = 3
# Runs one worker process carries at once on the threads pool (the CONCURRENCY default), and
# LOCK_CONNECTIONS' default: the lock connections that hold the session locks of all its runs.
DEFAULT_CONCURRENCY = 100
DEFAULT_LOCK_CONNECTIONS = 2
# Celery pools a worker may run: threads (the default) carries many runs per process, prefork
# one run per child, solo one run. The worker refuses gevent and eventlet at start.
POOLS = frozenset({"threads", "prefork", "solo"})
REFUSED_POOLS = frozenset({"gevent", "eventlet"})
# A pod's resources at DEFAULT_CONCURRENCY, safe per deploy/OPERATIONS.md; more runs, more.
MEMORY_REQUEST = "512Mi"
MEMORY_LIMIT = "1Gi"
K8S_VERSIONS = ("1.29", kubernetes_validate.latest_version())
# A Kubernetes resource quantity: 500m, 1.5, 768Mi, 2G.
QUANTITY = re.compile(r"\d+(\.\d+)?(m|k|M|G|T|P|Ki|Mi|Gi|Ti|Pi)?")
KEDA_API = "keda.sh/v1alpha1"
KEDA_KINDS = frozenset({"ScaledObject", "TriggerAuthentication"})
# ScaledObject fields (KEDA 2.x CRD), to catch a misspelt one: KEDA would ignore it.
SCALED_OBJECT_SPEC = frozenset({
    "scaleTargetRef", "pollingInterval", "cooldownPeriod", "initialCooldownPeriod",
    "idleReplicaCount", "minReplicaCount", "maxReplicaCount", "fallback", "advanced", "triggers",
})
TRIGGER_FIELDS = frozenset(
    {"type", "name", "metadata", "authenticationRef", "metricType", "useCachedMetrics"}
)
COMPOSE_CONDITIONS = frozenset(
    {"service_started", "service_healthy", "service_completed_successfully"}
)

Doc = dict[str, Any]


# ---- what the package reads ---------------------------------------------------------------


def setting_names() -> set[str]:
    return {ENV_PREFIX + name.upper() for name in Settings.model_fields}


def secret_setting_names() -> set[str]:
    """Settings typed ``SecretStr`` (or ``SecretStr | None``): never in a ConfigMap."""
    names = set()
    for name, field in Settings.model_fields.items():
        annotation = field.annotation
        if annotation is SecretStr or SecretStr in typing.get_args(annotation):
            names.add(ENV_PREFIX + name.upper())
    return names


def console_script() -> tuple[str, click.Group]:
    """The console script of ``[project.scripts]`` and the click group it runs
    (``cli.run`` runs the group ``cli.main``, then leaves)."""
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert len(scripts) == 1, scripts
    ((name, target),) = scripts.items()
    module, _, attr = target.partition(":")
    assert attr == "run", target
    group = importlib.import_module(module).main
    assert isinstance(group, click.Group)
    return name, group


def subcommands() -> set[str]:
    return set(console_script()[1].commands)


def settings_from(env: Mapping[str, str], monkeypatch: pytest.MonkeyPatch) -> Settings:
    """The settings a process with exactly these LOOMFLOW_WORKER_* variables reads."""
    with monkeypatch.context() as patch:
        for name in list(os.environ):
            if name.upper().startswith(ENV_PREFIX):
                patch.delenv(name)
        for name, value in env.items():
            patch.setenv(name, value)
        return Settings()


def check_env_names(names: Iterable[str], where: str) -> None:
    valid = setting_names()
    for name in names:
        if "LOOMFLOW" in name.upper():
            assert name in valid, f"{where}: {name} is no setting (valid: {sorted(valid)})"
        else:
            assert name in OTHER_ENV, f"{where}: unexpected variable {name}"


def worst_case_connections(settings: Settings, pool: str = "threads", concurrency: int = 1) -> int:
    """Postgres connections one worker can hold (deploy/OPERATIONS.md), whatever its runs:
    its lock connections, its pool, a LISTEN connection while a run waits for a signal and
    the sweeper's. A prefork worker has all but the sweeper's per pool child."""
    per_process = settings.lock_connections + settings.pool_max_size + 1
    return (concurrency if pool == "prefork" else 1) * per_process + 1


def stated_connections_per_process(text: str) -> int:
    """The number a file's comment gives for a worker process's Postgres connections, checked
    against its parts as the comment names them."""
    comments = " ".join(
        line.split("#", 1)[1] for line in text.splitlines() if line.lstrip().startswith("#")
    )
    found = re.findall(
        r"Postgres connections per worker process: at most (\d+) = LOCK_CONNECTIONS (\d+)"
        r" \+ POOL_MAX_SIZE (\d+) \+ 1 sweeper \+ 1 signal listener",
        " ".join(comments.split()),
    )
    assert len(found) == 1, "state the connections per worker process once, in its parts"
    total, locks, pool = (int(n) for n in found[0])
    assert total == locks + pool + 2
    return total


def operations_text() -> str:
    """deploy/OPERATIONS.md with its whitespace runs made single spaces."""
    return " ".join((DEPLOY / "OPERATIONS.md").read_text().split())


def quantity(text: str) -> float:
    """A Kubernetes resource quantity as a number: ``500m`` -> 0.5, ``1Gi`` -> 2**30."""
    match = QUANTITY.fullmatch(text)
    assert match, f"not a quantity: {text!r}"
    suffixes = {"": 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15,
                "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50}
    return float(text[: len(text) - len(match.group(2) or "")]) * suffixes[match.group(2) or ""]


def option_value(args: list[str], *flags: str) -> str | None:
    for index, arg in enumerate(args):
        for flag in flags:
            if arg == flag:
                return args[index + 1]
            if flag.startswith("--") and arg.startswith(flag + "="):
                return arg.split("=", 1)[1]
    return None


def worker_pool(args: list[str]) -> str:
    """The Celery pool a worker started with ``args`` runs: threads unless it says otherwise."""
    return option_value(args, "-P", "--pool") or "threads"


def check_worker_args(args: list[str], where: str) -> int:
    """A ``loomflow-worker`` argument list: a real subcommand; a worker's pool and concurrency."""
    assert args, f"{where}: no subcommand"
    assert args[0] in subcommands(), f"{where}: {args[0]!r} is no subcommand of the CLI"
    concurrency = option_value(args, "-c", "--concurrency")
    if args[0] == "worker":
        pool = worker_pool(args)
        assert pool not in REFUSED_POOLS, f"{where}: -P {pool} is refused; use the threads pool"
        assert pool in POOLS, f"{where}: unknown pool {pool!r}"
        assert concurrency is not None, f"{where}: set the worker's concurrency explicitly"
        assert int(concurrency) >= 1, where
        return int(concurrency)
    return 0


def node_name(args: list[str]) -> str:
    """The Celery node name a worker started with ``args`` takes, as a shell would name it."""
    hostname = option_value(args, "-n", "--hostname")
    return "celery@$HOSTNAME" if hostname is None else hostname.replace("%h", "$HOSTNAME")


def check_ping(tokens: list[str], worker_args: list[str], where: str) -> None:
    """A ``celery ... inspect ping`` probe of the worker started with ``worker_args``."""
    assert tokens[:1] == ["celery"] or tokens[:3] == ["python", "-m", "celery"], (where, tokens)
    app_module = option_value(tokens, "-A", "--app")
    assert app_module is not None, f"{where}: no -A"
    app = getattr(importlib.import_module(app_module), "app", None)
    assert isinstance(app, Celery), f"{where}: {app_module} has no Celery app"
    assert tokens[tokens.index("inspect") + 1] == "ping", f"{where}: {tokens}"
    destination = option_value(tokens, "-d", "--destination")
    assert destination == node_name(worker_args), (
        f"{where}: pings {destination}, the worker is {node_name(worker_args)}"
    )
    timeout = option_value(tokens, "-t", "--timeout")
    assert timeout is not None, f"{where}: without -t the ping waits 1 s only"


# ---- YAML ---------------------------------------------------------------------------------


def yaml_files() -> list[Path]:
    return sorted([*DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.yml")])


def load_all(path: Path) -> list[Doc]:
    docs = [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    assert all(isinstance(doc, dict) for doc in docs), path
    return docs


@pytest.mark.parametrize("path", yaml_files(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_yaml_file_parses(path: Path) -> None:
    assert load_all(path), f"{path} is empty"


def test_the_deploy_files_exist() -> None:
    for name in ("Dockerfile", "Dockerfile.dockerignore", "compose.yaml", "example_agents.py",
                 "OPERATIONS.md", "k8s/kustomization.yaml"):
        assert (DEPLOY / name).is_file(), name


def test_every_loomflow_worker_name_in_deploy_is_a_setting() -> None:
    """Comments and docs too: a misspelt name in OPERATIONS.md misleads as much."""
    valid = setting_names()
    for path in DEPLOY.rglob("*"):
        if not path.is_file() or path.suffix == ".pyc":
            continue
        for name in re.findall(r"LOOMFLOW_WORKER_[A-Z0-9_]+", path.read_text()):
            assert name in valid, f"{path.relative_to(ROOT)}: {name} is no setting"


# ---- Dockerfile ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Instruction:
    keyword: str
    value: str
    stage: int  # -1: before the first FROM


def dockerfile() -> list[Instruction]:
    instructions: list[Instruction] = []
    stage = -1
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if line.startswith("#") or (not line and not pending):
            continue  # comments (and parser directives), blank lines
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical = pending + line
        pending = ""
        keyword, _, value = logical.partition(" ")
        if keyword.upper() == "FROM":
            stage += 1
        instructions.append(Instruction(keyword.upper(), value.strip(), stage))
    assert not pending, "the Dockerfile ends inside a line continuation"
    return instructions


def final_stage() -> list[Instruction]:
    instructions = dockerfile()
    last = max(i.stage for i in instructions)
    return [i for i in instructions if i.stage == last]


def exec_form(instruction: Instruction) -> list[str]:
    value = json.loads(instruction.value)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), instruction
    return value


def assignments(instruction: Instruction) -> dict[str, str]:
    """``ENV``/``ARG`` pairs: ``K=V ...``, ``ARG K`` or the legacy ``ENV K V``."""
    tokens = shlex.split(instruction.value)
    if instruction.keyword == "ENV" and "=" not in tokens[0]:
        return {tokens[0]: " ".join(tokens[1:])}
    pairs = {}
    for token in tokens:
        name, _, value = token.partition("=")
        pairs[name] = value
    return pairs


def dockerfile_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for instruction in final_stage():
        if instruction.keyword == "ENV":
            env.update(assignments(instruction))
    return env


def test_dockerfile_is_multi_stage_on_python_slim() -> None:
    instructions = dockerfile()
    global_args: dict[str, str] = {}
    for instruction in instructions:
        if instruction.keyword == "ARG" and instruction.stage == -1:
            global_args.update(assignments(instruction))
    froms = [i for i in instructions if i.keyword == "FROM"]
    assert len(froms) >= 2, "build the wheel in one stage, install it in another"
    stage_names = []
    for instruction in froms:
        image, *rest = instruction.value.split()
        image = re.sub(r"\$\{(\w+)\}|\$(\w+)",
                       lambda m: global_args[m.group(1) or m.group(2)], image)
        assert image == "python:3.11-slim", image
        stage_names.append(rest[1] if len(rest) == 2 and rest[0].upper() == "AS" else "")
    final = " ".join(i.value for i in final_stage())
    assert any(
        name and (f"from={name}" in final or f"--from={name}" in final)
        for name in stage_names[:-1]
    ), "the final stage installs nothing from the build stage"
    assert "--find-links" in final and "--no-index" in final, "install the built wheels only"


def test_dockerfile_runs_the_cli_as_a_non_root_user() -> None:
    final = final_stage()
    users = [i.value for i in final if i.keyword == "USER"]
    assert users, "the final stage sets no USER: it runs as root"
    user, _, group = users[-1].partition(":")
    assert user not in ("root", "0") and group not in ("root", "0"), users[-1]
    assert user.isdigit(), "a numeric USER, so that Kubernetes' runAsNonRoot can check it"

    script, _ = console_script()
    (entrypoint,) = [i for i in final if i.keyword == "ENTRYPOINT"]
    assert exec_form(entrypoint) == [script]
    (cmd,) = [i for i in final if i.keyword == "CMD"]
    assert exec_form(cmd)[0] in subcommands()
    (stopsignal,) = [i for i in final if i.keyword == "STOPSIGNAL"]
    assert stopsignal.value == "SIGTERM"


def looks_secret(name: str) -> bool:
    parts = set(name.upper().split("_"))
    return (
        bool(parts & {"PASSWORD", "PASSWD", "SECRET", "TOKEN", "CREDENTIALS"})
        or name.upper().endswith("KEY")
        or name in secret_setting_names()
    )


def carries_credentials(value: str) -> bool:
    return bool(re.search(r"://[^/\s:@]*:[^/\s@]+@", value)) or "sk-ant-" in value


def test_dockerfile_bakes_in_no_secret() -> None:
    for instruction in dockerfile():
        if instruction.keyword not in ("ENV", "ARG", "LABEL"):
            continue
        for name, value in assignments(instruction).items():
            assert not (looks_secret(name) and value), f"{instruction.keyword} {name}={value}"
            assert not carries_credentials(value), f"{instruction.keyword} {name}: credentials"
            if instruction.keyword == "ARG":
                assert not looks_secret(name), f"ARG {name}: build args stay in the history"
    check_env_names(dockerfile_env(), "Dockerfile")


def copy_sources(instruction: Instruction) -> tuple[list[str], str]:
    tokens = [t for t in shlex.split(instruction.value) if not t.startswith("--")]
    return tokens[:-1], tokens[-1]


def test_dockerfile_copies_files_that_exist_and_are_in_the_context() -> None:
    patterns = [
        line.strip() for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert patterns[0] == "*", "the context is an allow-list"
    allowed = [p[1:].rstrip("/") for p in patterns if p.startswith("!")]
    for entry in allowed:
        assert (ROOT / entry).exists(), f"{DOCKERIGNORE.name}: {entry} does not exist"
    for instruction in dockerfile():
        if instruction.keyword not in ("COPY", "ADD") or "--from=" in instruction.value:
            continue
        sources, _ = copy_sources(instruction)
        for source in sources:
            assert (ROOT / source).exists(), f"{instruction.keyword} {source}: no such path"
            assert any(
                source == entry or source.startswith(entry + "/") for entry in allowed
            ), f"{source} is left out of the build context by {DOCKERIGNORE.name}"


def test_the_agents_modules_configured_are_in_the_image() -> None:
    pythonpath = dockerfile_env().get("PYTHONPATH", "").split(":")
    copied: dict[str, str] = {}
    for instruction in final_stage():
        if instruction.keyword == "COPY" and "--from=" not in instruction.value:
            sources, target = copy_sources(instruction)
            for source in sources:
                copied[target if not target.endswith("/") else target + Path(source).name] = source
    configured = {
        "compose": [env.get("LOOMFLOW_WORKER_AGENTS", "") for env in compose_envs().values()],
        "k8s": [worker_env().get("LOOMFLOW_WORKER_AGENTS", "")],
    }
    for where, values in configured.items():
        for value in values:
            for module in filter(None, (m.strip() for m in value.split(","))):
                relative = module.replace(".", "/") + ".py"
                assert any(f"{d.rstrip('/')}/{relative}" in copied for d in pythonpath), (
                    f"{where}: agents module {module} is not copied onto the image's PYTHONPATH"
                )


# ---- the example agents module --------------------------------------------------------------


@pytest.fixture
def example_agents(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    from loomflow_worker.execution import registry

    factories, limits = dict(registry._factories), dict(registry._time_limits)
    monkeypatch.syspath_prepend(str(DEPLOY))
    sys.modules.pop("example_agents", None)
    try:
        yield importlib.import_module("example_agents")
    finally:
        sys.modules.pop("example_agents", None)
        registry._factories.clear()
        registry._factories.update(factories)
        registry._time_limits.clear()
        registry._time_limits.update(limits)


def test_the_example_agent_runs_on_the_deterministic_model_without_a_key(
    example_agents: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    from loomflow_worker.execution.registry import agent_factory

    monkeypatch.setenv("ANTHROPIC_API_KEY", "")
    agent = agent_factory("default")(None)
    assert isinstance(example_agents.model(), DeterministicModel)

    async def run() -> Any:
        return await agent.run('call word_count {"text": "a b c"}\ncall utc_now {}')

    output = anyio.run(run).output
    assert re.fullmatch(r"done: 3, \d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", output), output


def test_the_example_agent_runs_on_claude_with_a_key(
    example_agents: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    from loomflow_worker.execution.registry import agent_factory

    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-test-not-a-key")
    agent = agent_factory("default")(None)
    assert example_agents.model() == "claude-sonnet-4-6"
    assert type(agent.model).__name__ == "AnthropicModel"  # the string resolved, offline


# ---- Compose ------------------------------------------------------------------------------

_INTERPOLATION = re.compile(
    r"\$\$|\$\{(?P<braced>[A-Za-z_]\w*)(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\}|\$(?P<bare>[A-Za-z_]\w*)"
)


def interpolate(value: str, seen: set[str]) -> str:
    """Compose's interpolation, with every variable unset (so defaults apply)."""

    def substitute(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group("braced") or match.group("bare")
        seen.add(name)
        op = match.group("op") or ""
        return match.group("arg") if op in (":-", "-") else ""

    return _INTERPOLATION.sub(substitute, value)


def compose() -> Doc:
    (doc,) = load_all(COMPOSE)
    return doc


def compose_env(service: Doc) -> dict[str, str]:
    assert "env_file" not in service, "teach this test to read env_file"
    raw = service.get("environment") or {}
    if isinstance(raw, list):
        raw = dict(item.partition("=")[::2] for item in raw)
    return {name: "" if value is None else str(value) for name, value in raw.items()}


def compose_envs() -> dict[str, dict[str, str]]:
    """Each of our services' environment, interpolated."""
    seen: set[str] = set()
    return {
        name: {k: interpolate(v, seen) for k, v in compose_env(service).items()}
        for name, service in compose()["services"].items()
        if is_ours(service)
    }


def is_ours(service: Doc) -> bool:
    return "build" in service or str(service.get("image", "")).startswith("loomflow-worker")


def compose_command(service: Doc) -> list[str]:
    command = service["command"]
    assert isinstance(command, list), "use the list form: no shell in between"
    return [str(part) for part in command]


def workers() -> dict[str, Doc]:
    return {
        name: service for name, service in compose()["services"].items()
        if is_ours(service) and compose_command(service)[0] == "worker"
    }


def duration(text: str) -> float:
    """A Compose duration: ``45s``, ``1m30s``, ``1.5h``."""
    units = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
    parts = re.findall(r"(\d+(?:\.\d+)?)(us|ms|s|m|h)", text)
    assert parts and "".join(n + u for n, u in parts) == text, f"bad duration {text!r}"
    return sum(float(n) * units[u] for n, u in parts)


def test_compose_services_and_their_order() -> None:
    services = compose()["services"]
    postgres, redis = services["postgres"], services["redis"]
    assert str(postgres["image"]).split(":")[1].split(".")[0] == "16"
    assert str(redis["image"]).split(":")[1].split(".")[0] == "7"
    assert "pg_isready" in " ".join(postgres["healthcheck"]["test"])
    assert "redis-cli ping" in " ".join(redis["healthcheck"]["test"])
    for name, service in services.items():
        for target, spec in (service.get("depends_on") or {}).items():
            assert target in services, f"{name} depends on unknown {target}"
            assert spec["condition"] in COMPOSE_CONDITIONS, f"{name}: {spec['condition']}"

    (migrate,) = [s for s in services.values() if is_ours(s) and compose_command(s)[0] == "migrate"]
    assert compose_command(migrate) == ["migrate"]
    assert migrate["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert migrate.get("restart", "no") == "no"
    migrate_name = next(n for n, s in services.items() if s is migrate)

    assert len(workers()) >= 2
    for name, worker in workers().items():
        conditions = {t: spec["condition"] for t, spec in worker["depends_on"].items()}
        assert conditions[migrate_name] == "service_completed_successfully", name
        assert conditions["redis"] == "service_healthy", name


def test_compose_commands_are_cli_commands() -> None:
    script, _ = console_script()
    for name, service in compose()["services"].items():
        if not is_ours(service):
            continue
        entrypoint = service.get("entrypoint")
        assert entrypoint in (None, [script]), f"{name}: entrypoint {entrypoint}"
        check_worker_args(compose_command(service), f"compose {name}")


def test_compose_env_names_are_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: set[str] = set()
    for name, service in compose()["services"].items():
        env = {k: interpolate(v, seen) for k, v in compose_env(service).items()}
        check_env_names(env, f"compose {name}")
        if is_ours(service):
            settings_from(env, monkeypatch)  # the values parse as the package parses them
    check_env_names(seen, "compose ${...}")


def test_compose_grace_period_exceeds_the_soft_shutdown(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, worker in workers().items():
        settings = settings_from(compose_envs()[name], monkeypatch)
        grace = duration(str(worker["stop_grace_period"]))
        assert grace >= settings.soft_shutdown_timeout + SHUTDOWN_MARGIN, (
            f"{name}: stop_grace_period {grace}s, soft shutdown {settings.soft_shutdown_timeout}s"
        )


def test_compose_time_limits_are_consistent(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, env in compose_envs().items():
        settings = settings_from(env, monkeypatch)
        assert settings.visibility_timeout > settings.run_time_limit, name


def test_compose_worker_healthcheck_pings_the_worker() -> None:
    for name, worker in workers().items():
        test = [interpolate(str(part), set()) for part in worker["healthcheck"]["test"]]
        assert test[0] == "CMD-SHELL", name
        check_ping(shlex.split(test[1]), compose_command(worker), f"compose {name}")


def test_compose_postgres_has_connections_for_the_workers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    postgres_command = [str(p) for p in compose()["services"]["postgres"].get("command", [])]
    setting = next((p for p in postgres_command if p.startswith("max_connections=")), None)
    max_connections = 100 if setting is None else int(setting.split("=", 1)[1])
    needed = 1  # the migration
    for name, worker in workers().items():
        settings = settings_from(compose_envs()[name], monkeypatch)
        command = compose_command(worker)
        concurrency = check_worker_args(command, name)
        needed += worst_case_connections(settings, worker_pool(command), concurrency)
    assert needed <= max_connections - RESERVED_CONNECTIONS, (needed, max_connections)


def test_compose_workers_are_one_process_each_at_the_default_concurrency() -> None:
    """More cores: more worker services (each with a node name of its own), not prefork."""
    hostnames = []
    for name, worker in workers().items():
        command = compose_command(worker)
        assert worker_pool(command) == "threads", f"{name}: {command}"
        assert check_worker_args(command, name) == DEFAULT_CONCURRENCY, f"{name}: {command}"
        replicas = (worker.get("deploy") or {}).get("replicas", 1)
        assert replicas == 1 or "hostname" not in worker, (
            f"{name}: {replicas} replicas of one hostname share a Celery node name"
        )
        hostnames.append(node_name(command).replace("$HOSTNAME", worker.get("hostname", name)))
    assert len(set(hostnames)) == len(hostnames), hostnames


def test_compose_states_the_connections_per_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    stated = stated_connections_per_process(COMPOSE.read_text())
    for name, worker in workers().items():
        settings = settings_from(compose_envs()[name], monkeypatch)
        command = compose_command(worker)
        assert stated == worst_case_connections(
            settings, worker_pool(command), check_worker_args(command, name)
        ), name
    example = re.search(r"two workers need (\d+) [x\u00d7] (\d+) = (\d+)", operations_text())
    assert example, "OPERATIONS.md: the compose example"
    count, each, total = (int(n) for n in example.groups())
    started = default_workers()  # `docker compose up` starts these
    assert (count, each, total) == (len(started), stated, len(started) * stated)


def default_workers() -> dict[str, Doc]:
    """The workers `docker compose up` starts: those in no profile."""
    return {name: worker for name, worker in workers().items() if not worker.get("profiles")}


def test_compose_previous_release_drains(monkeypatch: pytest.MonkeyPatch) -> None:
    """The old release of a deploy that changed an agent: in a profile of its own, on an image
    tagged before the rebuild, taking only the requests pinned to its versions; the others take
    new ones. Its host names have a prefix no other worker's has: what it owes is the demand of
    that prefix, which its comment gives."""
    envs = compose_envs()
    draining = {name: worker for name, worker in workers().items()
                if not settings_from(envs[name], monkeypatch).take_new}
    assert draining, "no worker of the previous release"
    assert set(draining) == set(workers()) - set(default_workers())
    assert default_workers(), "no worker takes new requests"
    built = {str(s["image"]) for s in compose()["services"].values() if "build" in s}
    text = COMPOSE.read_text()
    prefixes = set(re.findall(rf"{DEMAND_FUNCTION}\('([^']*)'\)", text))
    assert len(prefixes) == 1, f"state the demand query of the previous release once: {prefixes}"
    (prefix,) = prefixes
    for name, worker in draining.items():
        assert envs[name][ENV_PREFIX + TAKE_NEW.upper()] == "false", name
        assert "build" not in worker, f"{name}: built from this tree, it would run the new code"
        assert str(worker["image"]) not in built, f"{name}: the image the rebuild replaces"
        assert worker.get("pull_policy") == "never", f"{name}: a local tag, not a registry's"
        assert str(worker["hostname"]).startswith(prefix), name
    for name, worker in default_workers().items():
        assert not str(worker.get("hostname", name)).startswith(prefix), name


# ---- Kubernetes ---------------------------------------------------------------------------


def kustomization() -> Doc:
    (doc,) = load_all(KUSTOMIZATION)
    return doc


def manifests() -> list[tuple[str, Doc]]:
    return [
        (str(entry), doc)
        for entry in kustomization()["resources"]
        for doc in load_all(K8S / entry)
    ]


def of_kind(kind: str) -> list[Doc]:
    return [doc for _, doc in manifests() if doc["kind"] == kind]


def one(kind: str) -> Doc:
    (doc,) = of_kind(kind)
    return doc


def by_name(kind: str) -> dict[str, Doc]:
    return {doc["metadata"]["name"]: doc for doc in of_kind(kind)}


def secret_data(secret: Doc) -> dict[str, str]:
    assert "data" not in secret, "a template: use stringData, readable placeholders"
    return {k: str(v) for k, v in (secret.get("stringData") or {}).items()}


def containers(workload: Doc) -> list[Doc]:
    spec = workload["spec"]["template"]["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


def container_env(container: Doc) -> dict[str, str]:
    """What the container's environment holds: envFrom first, then env (which wins)."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env.update(by_name("ConfigMap")[source["configMapRef"]["name"]]["data"])
        if "secretRef" in source:
            env.update(secret_data(by_name("Secret")[source["secretRef"]["name"]]))
    for item in container.get("env", []):
        env[item["name"]] = str(item.get("value", ""))
    return env


def worker_container() -> Doc:
    container: Doc
    (container,) = one("Deployment")["spec"]["template"]["spec"]["containers"]
    return container


def worker_env() -> dict[str, str]:
    return container_env(worker_container())


def test_kustomization_lists_every_manifest() -> None:
    listed = set(kustomization()["resources"])
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {KUSTOMIZATION.name}
    assert listed == on_disk
    images = {image["name"] for image in kustomization().get("images", [])}
    for workload in (one("Deployment"), one("Job")):
        for container in containers(workload):
            name = container["image"].rsplit(":", 1)[0]
            assert name in images, f"{name}: kustomization's images would not set its tag"


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_kubernetes_manifests_validate(version: str) -> None:
    for where, doc in manifests():
        if doc["kind"] in KEDA_KINDS and doc["apiVersion"] == KEDA_API:
            continue  # CRDs: checked by hand below
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            pytest.fail(f"{where}: {doc['kind']} {path}: {exc.message} (Kubernetes {version})")
        except kubernetes_validate.SchemaNotFoundError as exc:
            pytest.fail(f"{where}: {exc.message}")


@pytest.mark.slow
def test_kustomize_builds_the_manifests() -> None:
    """Runs only where kubectl is installed (its built-in kustomize)."""
    kubectl = KUBECTL.require()
    built = subprocess.run(
        [kubectl, "kustomize", str(K8S)], check=True, capture_output=True, text=True, timeout=120
    ).stdout
    docs = [doc for doc in yaml.safe_load_all(built) if doc]
    assert sorted(d["kind"] for d in docs) == sorted(d["kind"] for _, d in manifests())
    (image,) = kustomization()["images"]
    for doc in docs:
        if doc["kind"] in ("Deployment", "Job"):
            for container in containers(doc):
                assert container["image"] == f"{image['newName']}:{image['newTag']}"
        if doc["apiVersion"] != KEDA_API:
            kubernetes_validate.validate(doc, K8S_VERSIONS[-1], strict=True)


def test_workloads_use_config_that_exists() -> None:
    config_maps, secrets = by_name("ConfigMap"), by_name("Secret")
    for workload in (one("Deployment"), one("Job")):
        for container in containers(workload):
            for source in container.get("envFrom", []):
                if "configMapRef" in source:
                    assert source["configMapRef"]["name"] in config_maps
                if "secretRef" in source:
                    assert source["secretRef"]["name"] in secrets
            for item in container.get("env", []):
                ref = item.get("valueFrom", {})
                if "secretKeyRef" in ref:
                    key = ref["secretKeyRef"]
                    assert key["key"] in secret_data(secrets[key["name"]]), item
                if "configMapKeyRef" in ref:
                    key = ref["configMapKeyRef"]
                    assert key["key"] in config_maps[key["name"]]["data"], item


def test_kubernetes_env_names_are_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for workload in (one("Deployment"), one("Job")):
        for container in containers(workload):
            env = container_env(container)
            where = f"{workload['kind']} {container['name']}"
            check_env_names(env, where)
            settings_from(env, monkeypatch)  # the values parse as the package parses them


def test_kubernetes_commands_are_cli_commands() -> None:
    script, _ = console_script()
    for workload in (one("Deployment"), one("Job")):
        for container in containers(workload):
            assert container.get("command") in (None, [script]), container["name"]
            check_worker_args(container.get("args", []), f"{workload['kind']} {container['name']}")
    assert worker_container()["args"][0] == "worker"
    job = one("Job")
    assert containers(job)[0]["args"] == ["migrate"]
    # The API server refuses Always for a Job; the schema does not say so.
    assert job["spec"]["template"]["spec"]["restartPolicy"] in ("Never", "OnFailure")
    assert job["spec"]["backoffLimit"] >= 1
    assert job["spec"]["ttlSecondsAfterFinished"] > 0


def test_secrets_are_placeholders_in_the_secret() -> None:
    config = one("ConfigMap")["data"]
    leaked = secret_setting_names() & set(config)
    assert not leaked, f"secrets in the ConfigMap: {sorted(leaked)}"
    for item in worker_container().get("env", []):
        assert not (item["name"] in secret_setting_names() and "value" in item), item["name"]
    secret = by_name("Secret")[next(
        s["secretRef"]["name"] for s in worker_container()["envFrom"] if "secretRef" in s
    )]
    assert set(secret_data(secret)) >= WORKER_SECRETS
    for doc in of_kind("Secret"):
        for key, value in secret_data(doc).items():
            assert value == "" or PLACEHOLDER in value, f"Secret {key}: not a placeholder"


def worker_args() -> list[str]:
    args: list[str] = worker_container()["args"]
    return args


def test_kubernetes_worker_is_one_process_at_the_default_concurrency() -> None:
    args = worker_args()
    assert worker_pool(args) == "threads", args
    assert check_worker_args(args, "Deployment") == DEFAULT_CONCURRENCY, args


def test_the_default_concurrency_is_the_packages() -> None:
    assert Settings.model_fields["concurrency"].default == DEFAULT_CONCURRENCY
    assert Settings.model_fields["lock_connections"].default == DEFAULT_LOCK_CONNECTIONS


def test_kubernetes_pod_is_sized_for_its_runs() -> None:
    """One process: about one core, no CPU limit (throttling delays every run's heartbeat);
    memory at least what OPERATIONS.md calls safe, scaled by the concurrency."""
    resources = worker_container()["resources"]
    assert 0.5 <= quantity(str(resources["requests"]["cpu"])) <= 1.0, resources
    assert "cpu" not in resources["limits"], resources
    scale = max(1.0, check_worker_args(worker_args(), "Deployment") / DEFAULT_CONCURRENCY)
    request = quantity(str(resources["requests"]["memory"]))
    limit = quantity(str(resources["limits"]["memory"]))
    assert request >= scale * quantity(MEMORY_REQUEST), resources
    assert limit >= scale * quantity(MEMORY_LIMIT), resources
    stated = f"{MEMORY_REQUEST} with a {MEMORY_LIMIT} limit per pod"
    stated += f" for concurrency {DEFAULT_CONCURRENCY}"
    assert stated in operations_text(), "OPERATIONS.md states other figures"


def test_kubernetes_connection_budget_matches_the_formula(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = settings_from(worker_env(), monkeypatch)
    args = worker_args()
    per_process = worst_case_connections(settings, worker_pool(args), check_worker_args(args, ""))
    config = (K8S / "configmap.yaml").read_text()
    assert stated_connections_per_process(config) == per_process
    assert f"pods x {per_process}" in config

    operations = operations_text()
    formula = re.search(
        r"per worker process = LOCK_CONNECTIONS \+ POOL_MAX_SIZE \+ 1 \+ 1 = "
        r"(\d+) \+ (\d+) \+ 1 \+ 1 = (\d+)", operations
    )
    assert formula, "OPERATIONS.md: the formula per worker process"
    assert [int(n) for n in formula.groups()] == [
        settings.lock_connections, settings.pool_max_size, per_process
    ]
    example = re.search(r"at most (\d+) \+ (\d+) pods: (\d+) [x\u00d7] (\d+) = (\d+)", operations)
    assert example, "OPERATIONS.md: the example of k8s/'s defaults"
    most, surge, pods, each, total = (int(n) for n in example.groups())
    assert most == keda("ScaledObject")["spec"]["maxReplicaCount"]
    assert surge == one("Deployment")["spec"]["strategy"]["rollingUpdate"]["maxSurge"]
    assert (pods, each, total) == (most + surge, per_process, (most + surge) * per_process)


def test_kubernetes_grace_period_exceeds_the_soft_shutdown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = settings_from(worker_env(), monkeypatch)
    spec = one("Deployment")["spec"]["template"]["spec"]
    grace = spec["terminationGracePeriodSeconds"]
    assert grace >= settings.soft_shutdown_timeout + SHUTDOWN_MARGIN, (
        f"terminationGracePeriodSeconds {grace}, soft shutdown {settings.soft_shutdown_timeout}"
    )
    assert settings.visibility_timeout > settings.run_time_limit


def test_worker_deployment_rolls_one_pod_at_a_time() -> None:
    deployment = one("Deployment")
    spec = deployment["spec"]
    assert spec["strategy"]["type"] == "RollingUpdate"
    assert spec["strategy"]["rollingUpdate"] == {"maxUnavailable": 0, "maxSurge": 1}
    assert "replicas" not in spec, "KEDA owns the replica count"
    labels = spec["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    pdb = one("PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert "maxUnavailable" in pdb["spec"] or "minAvailable" in pdb["spec"]


def test_worker_probes_ping_the_worker() -> None:
    container = worker_container()
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        command = container[probe]["exec"]["command"]
        assert command[:2] == ["sh", "-c"], f"{probe}: $HOSTNAME needs a shell"
        check_ping(shlex.split(command[2]), container["args"], probe)
        assert container[probe]["timeoutSeconds"] > float(
            option_value(shlex.split(command[2]), "-t", "--timeout") or 0
        ), f"{probe}: the kubelet gives up before the ping does"


def test_worker_runs_as_non_root_with_resources() -> None:
    for workload in (one("Deployment"), one("Job")):
        pod = workload["spec"]["template"]["spec"]
        for container in containers(workload):
            merged = {**pod.get("securityContext", {}), **container.get("securityContext", {})}
            assert merged.get("runAsNonRoot") is True, container["name"]
            assert merged.get("runAsUser", 1) != 0, container["name"]
            assert merged.get("allowPrivilegeEscalation") is False, container["name"]
            resources = container["resources"]
            assert {"cpu", "memory"} <= set(resources["requests"]), container["name"]
            assert "memory" in resources["limits"], container["name"]
            for kind in ("requests", "limits"):
                for value in resources[kind].values():
                    # The schema takes any string; the API server parses a quantity.
                    assert QUANTITY.fullmatch(str(value)), f"{container['name']}: {value!r}"


# ---- KEDA ---------------------------------------------------------------------------------


def keda(kind: str) -> Doc:
    (doc,) = [d for d in of_kind(kind) if d["apiVersion"] == KEDA_API]
    return doc


def test_keda_scaled_object_has_its_required_fields() -> None:
    scaled = keda("ScaledObject")
    assert scaled["metadata"]["name"]
    spec = scaled["spec"]
    assert set(spec) <= SCALED_OBJECT_SPEC, f"unknown fields: {set(spec) - SCALED_OBJECT_SPEC}"
    target = spec["scaleTargetRef"]
    deployment = one("Deployment")
    assert target["name"] == deployment["metadata"]["name"]
    assert target.get("kind", "Deployment") == "Deployment"
    assert target.get("apiVersion", "apps/v1") == deployment["apiVersion"]
    minimum, maximum = spec["minReplicaCount"], spec["maxReplicaCount"]
    assert isinstance(minimum, int) and isinstance(maximum, int)
    # Never 0: the sweeper runs in workers, and running requests are not in the list.
    assert 1 <= minimum <= maximum
    triggers = spec["triggers"]
    assert isinstance(triggers, list) and triggers
    auths = {d["metadata"]["name"]: d for d in of_kind("TriggerAuthentication")}
    for trigger in triggers:
        assert set(trigger) <= TRIGGER_FIELDS, set(trigger) - TRIGGER_FIELDS
        assert trigger["type"]
        metadata = trigger["metadata"]
        # The CRD types metadata as map[string]string: a bare number is refused.
        assert all(isinstance(v, str) for v in metadata.values()), metadata
        if "authenticationRef" in trigger:
            assert trigger["authenticationRef"]["name"] in auths


def test_keda_trigger_authentication_reads_secrets_that_exist() -> None:
    secrets = by_name("Secret")
    for auth in of_kind("TriggerAuthentication"):
        refs = auth["spec"]["secretTargetRef"]
        assert refs
        for ref in refs:
            assert {"parameter", "name", "key"} <= set(ref), ref
            assert ref["key"] in secret_data(secrets[ref["name"]]), ref


def test_keda_counts_every_queued_request_in_the_ledger(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Parked requests are in no broker list: a trigger on the ledger counts them,
    # for the Deployment's queue, with the same target per pod as the list's.
    settings = settings_from(worker_env(), monkeypatch)
    (trigger,) = [t for t in keda("ScaledObject")["spec"]["triggers"]
                  if t["type"] == "postgresql"]
    metadata = trigger["metadata"]
    query = " ".join(metadata["query"].split())
    assert query.startswith("SELECT count(*) FROM runs WHERE status = 'queued'")
    assert f"coalesce(routing->>'queue', '{settings.queue}') = '{settings.queue}'" in query
    assert int(metadata["targetQueryValue"]) == check_worker_args(worker_args(), "Deployment")
    auth = by_name("TriggerAuthentication")[trigger["authenticationRef"]["name"]]
    assert [ref["parameter"] for ref in auth["spec"]["secretTargetRef"]] == ["connection"]


def test_keda_watches_the_queue_on_the_brokers_redis(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = settings_from(worker_env(), monkeypatch)
    (trigger,) = [t for t in keda("ScaledObject")["spec"]["triggers"] if t["type"] == "redis"]
    metadata = trigger["metadata"]
    assert metadata["listName"] == settings.redis_key_prefix + settings.queue
    assert int(metadata["listLength"]) >= 1
    # A pod takes as many messages as it has run slots: one more pod per `concurrency` waiting.
    assert int(metadata["listLength"]) == check_worker_args(worker_args(), "Deployment")
    broker = urlsplit(settings.broker_url.get_secret_value())
    assert metadata["address"] == f"{broker.hostname}:{broker.port or 6379}"
    assert metadata.get("databaseIndex", "0") == (broker.path.strip("/") or "0")
    assert (metadata.get("enableTLS", "false") == "true") == (broker.scheme == "rediss")


# ---- releases: a deploy that changes an agent -----------------------------------------------


def kustomization_at(directory: Path) -> Doc:
    (doc,) = load_all(directory / "kustomization.yaml")
    return doc


def component(directory: Path) -> Doc:
    doc = kustomization_at(directory)
    assert (doc["apiVersion"], doc["kind"]) == ("kustomize.config.k8s.io/v1alpha1", "Component")
    return doc


def deleted_kinds(doc: Doc) -> tuple[str, ...]:
    """The kinds a kustomization's ``$patch: delete`` patches match, among deploy/k8s's."""
    (patch,) = doc["patches"]
    assert yaml.safe_load(patch["patch"])["$patch"] == "delete"
    pattern = patch["target"]["kind"]
    return tuple(sorted({d["kind"] for _, d in manifests() if re.fullmatch(pattern, d["kind"])}))


def patch_docs(doc: Doc, directory: Path) -> dict[str, Doc]:
    """A component's patch files, by the kind each targets."""
    found = {}
    for patch in doc["patches"]:
        (body,) = load_all(directory / patch["path"])
        assert body["kind"] == patch["target"]["kind"], patch
        found[body["kind"]] = body
    return found


def replaced(value: str, source: str, options: Doc) -> str:
    """A kustomize replacement with a delimiter: the part at ``index`` of ``value`` becomes
    ``source``."""
    parts = value.split(options["delimiter"])
    parts[options["index"]] = source
    return str(options["delimiter"]).join(parts)


def demand_prefix(query: str) -> str:
    """The host prefix a KEDA query passes to the demand function: its argument, quoted
    strings joined with ``||``."""
    call = re.fullmatch(rf"SELECT {DEMAND_FUNCTION}\((.*)\)", " ".join(query.split()))
    assert call, f"not a call of {DEMAND_FUNCTION}: {query!r}"
    parts = [part.strip() for part in call.group(1).split("||")]
    assert all(re.fullmatch(r"'[^']*'", part) for part in parts), query
    return "".join(part[1:-1] for part in parts)


def draining_trigger() -> Doc:
    (trigger,) = patch_docs(component(DRAINING), DRAINING)["ScaledObject"]["spec"]["triggers"]
    return dict(trigger)


def draining_query(deployment: str) -> str:
    """The draining component's query once its replacement wrote ``deployment`` in it."""
    (replacement,) = component(DRAINING)["replacements"]
    (target,) = replacement["targets"]
    return replaced(draining_trigger()["metadata"]["query"], deployment, target["options"])


def release_name(deployment: str) -> str:
    assert deployment.startswith("loomflow-worker-"), deployment
    return deployment.removeprefix("loomflow-worker-")


def test_a_release_keeps_the_workers_and_shares_the_rest() -> None:
    release = component(RELEASE)
    kinds = {doc["kind"] for _, doc in manifests()}
    # A kind added to deploy/k8s is either shared (deleted here) or a release's own.
    assert set(deleted_kinds(release)) == kinds - {"Deployment", "ScaledObject"}
    (config,) = release["configurations"]
    ((reference,),) = [doc["nameReference"] for doc in load_all(RELEASE / config)]
    assert reference["kind"] == "Deployment"
    assert reference["fieldSpecs"] == [{"kind": "ScaledObject", "path": "spec/scaleTargetRef/name"}]
    assert keda("ScaledObject")["spec"]["scaleTargetRef"]["name"] == \
        one("Deployment")["metadata"]["name"]


def test_the_fleet_leaves_out_deploy_k8s_workers_only() -> None:
    fleet = component(FLEET_COMPONENT)
    assert deleted_kinds(fleet) == ("Deployment", "ScaledObject")
    (patch,) = fleet["patches"]
    target = patch["target"]
    for doc in (one("Deployment"), keda("ScaledObject")):
        assert re.fullmatch(target["name"], doc["metadata"]["name"]), doc["kind"]
        assert RELEASE_LABEL not in doc["metadata"].get("labels", {})
    # kustomize matches a renamed resource by its name before the rename too: the label spares
    # the releases'.
    assert target["labelSelector"] == f"!{RELEASE_LABEL}"


def test_take_new_is_the_setting_a_draining_release_sets(monkeypatch: pytest.MonkeyPatch) -> None:
    field = Settings.model_fields[TAKE_NEW]
    assert field.annotation is bool and field.default is True
    deployment = patch_docs(component(DRAINING), DRAINING)["Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["name"] == worker_container()["name"], "patches no container of the worker"
    env = {item["name"]: item["value"] for item in container["env"]}
    assert env == {ENV_PREFIX + TAKE_NEW.upper(): "false"}
    check_env_names(env, "release/draining")
    assert settings_from(worker_env(), monkeypatch).take_new is True
    assert settings_from({**worker_env(), **env}, monkeypatch).take_new is False


def test_a_draining_release_scales_on_what_it_owes_down_to_zero() -> None:
    draining = component(DRAINING)
    scaled = patch_docs(draining, DRAINING)["ScaledObject"]
    spec = scaled["spec"]
    assert set(spec) <= SCALED_OBJECT_SPEC, set(spec) - SCALED_OBJECT_SPEC
    # 0: the demand counts its running requests too, unlike the queue's list.
    assert spec["minReplicaCount"] == 0
    assert spec["cooldownPeriod"] > 0
    trigger = draining_trigger()
    assert set(trigger) <= TRIGGER_FIELDS, set(trigger) - TRIGGER_FIELDS
    # Only the demand: its workers take nothing from the queue's list.
    assert trigger["type"] == "postgresql"
    metadata = trigger["metadata"]
    assert all(isinstance(v, str) for v in metadata.values()), metadata
    assert int(metadata["targetQueryValue"]) == check_worker_args(worker_args(), "Deployment")
    assert int(metadata.get("activationTargetQueryValue", "0")) == 0
    # deploy/k8s's TriggerAuthentication, shared: a connection string, no other.
    auth = by_name("TriggerAuthentication")[trigger["authenticationRef"]["name"]]
    assert [ref["parameter"] for ref in auth["spec"]["secretTargetRef"]] == ["connection"]

    (replacement,) = draining["replacements"]
    assert replacement["source"] == {"kind": "Deployment", "fieldPath": "metadata.name"}
    (target,) = replacement["targets"]
    assert target["select"] == {"kind": "ScaledObject"}
    assert target["fieldPaths"] == [f"spec.triggers.[name={trigger['name']}].metadata.query"]
    # Written in: the Deployment's name and a dash, so that r4 does not count r41's pods.
    assert demand_prefix(draining_query("loomflow-worker-r41")) == "loomflow-worker-r41-"
    # Not written in (the component used where the name is not final yet): every release's
    # pods, so the release never scales to zero.
    assert demand_prefix(metadata["query"]) == one("Deployment")["metadata"]["name"] + "-"


def test_the_demand_function_is_the_migrations() -> None:
    from loomflow_worker.runtime.sql import migrations

    defined = [m for m in migrations()
               if re.search(rf"FUNCTION {DEMAND_FUNCTION}\(host_prefix TEXT\) RETURNS bigint",
                            m.sql)]
    assert len(defined) == 1, f"{DEMAND_FUNCTION}(host_prefix) is defined by no migration"


def fleet() -> Doc:
    doc = kustomization_at(RELEASES)
    assert (doc["apiVersion"], doc["kind"]) == ("kustomize.config.k8s.io/v1beta1", "Kustomization")
    return doc


def fleet_releases() -> dict[str, bool]:
    """Each release the fleet lists, and whether it drains."""
    releases: dict[str, bool] = {}
    for entry in fleet()["resources"]:
        if entry == "../k8s":
            continue
        doc = kustomization_at(RELEASES / entry)
        if doc.get("components") == ["../../k8s/release/draining"]:
            (base,) = doc["resources"]
            assert base.startswith("../"), entry
            releases[base.removeprefix("../")] = True
        else:
            releases[entry] = False
    return releases


def test_the_fleet_shares_deploy_k8s_and_lists_each_release_once() -> None:
    doc = fleet()
    assert doc["resources"][0] == "../k8s"
    assert doc["components"] == ["../k8s/release/fleet"]
    listed = [e for e in doc["resources"] if e != "../k8s"]
    releases = fleet_releases()
    assert len(releases) == len(listed), f"a release listed twice: {listed}"
    assert not all(releases.values()), "every release drains: none takes new requests"
    on_disk = {p.name for p in RELEASES.iterdir() if p.is_dir()}
    assert on_disk == set(releases) | {e for e in listed if e not in releases}


def test_each_release_is_named_labelled_and_imaged_after_itself() -> None:
    (image,) = kustomization()["images"]
    for name in fleet_releases():
        doc = kustomization_at(RELEASES / name)
        where = f"k8s-releases/{name}"
        # No dash: the draining prefix of r4, loomflow-worker-r4-, would match r4-1's pods.
        assert re.fullmatch(r"[a-z0-9]+", name), f"{where}: lowercase letters and digits only"
        assert doc["resources"] == ["../../k8s"], where
        assert doc["components"] == ["../../k8s/release"], where
        assert doc["nameSuffix"] == f"-{name}", where
        (labels,) = doc["labels"]
        assert labels["pairs"] == {RELEASE_LABEL: name}, where
        # Each release's Deployment selects its own pods only.
        assert labels["includeSelectors"] is True, where
        (own,) = doc["images"]
        # deploy/k8s named the image already: a release sets the tag of that name.
        assert own["name"] == image["newName"] and own["newTag"], where


def test_the_migration_job_runs_the_newest_release() -> None:
    (patch,) = fleet()["patches"]
    assert patch["target"] == {"kind": "Job", "name": one("Job")["metadata"]["name"]}
    (op,) = yaml.safe_load(patch["patch"])
    assert op["path"] == "/spec/template/spec/containers/0/image"
    assert len(containers(one("Job"))) == 1
    (image,) = kustomization()["images"]
    taking_new = [name for name, drains in fleet_releases().items() if not drains]
    tag = kustomization_at(RELEASES / taking_new[-1])["images"][0]["newTag"]
    assert op["value"] == f"{image['newName']}:{tag}"


@pytest.mark.slow
def test_kustomize_builds_the_fleet_of_releases(monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs only where kubectl is installed (its built-in kustomize)."""
    kubectl = KUBECTL.require()
    built = subprocess.run(
        [kubectl, "kustomize", str(RELEASES)], check=True, capture_output=True, text=True,
        timeout=120,
    ).stdout
    docs = [doc for doc in yaml.safe_load_all(built) if doc]
    ids = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert len(set(ids)) == len(ids), ids
    releases = fleet_releases()
    shared = sorted((d["kind"], d["metadata"]["name"]) for _, d in manifests()
                    if d["kind"] not in ("Deployment", "ScaledObject"))
    own = sorted((kind, f"loomflow-worker-{name}") for name in releases
                 for kind in ("Deployment", "ScaledObject"))
    assert sorted(ids) == sorted(shared + own), "the shared objects once, two per release"
    found = {kind: {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}
             for kind in {d["kind"] for d in docs}}
    default_scaled = keda("ScaledObject")["spec"]

    for name, deployment in found["Deployment"].items():
        release = release_name(name)
        drains = releases[release]
        metadata, spec = deployment["metadata"], deployment["spec"]
        assert metadata["labels"][RELEASE_LABEL] == release
        assert spec["selector"]["matchLabels"][RELEASE_LABEL] == release
        assert spec["template"]["metadata"]["labels"][RELEASE_LABEL] == release
        (container,) = containers(deployment)
        tag = kustomization_at(RELEASES / release)["images"][0]["newTag"]
        assert container["image"].rsplit(":", 1)[1] == tag, name
        # Its config is the fleet's shared objects, not copies of them.
        env: dict[str, str] = {}
        for source in container["envFrom"]:
            ref = source.get("configMapRef") or source["secretRef"]
            kind = "ConfigMap" if "configMapRef" in source else "Secret"
            assert ref["name"] in found[kind], f"{name}: {kind} {ref['name']}"
            env.update(found[kind][ref["name"]].get("data")
                       or secret_data(found[kind][ref["name"]]))
        env.update({item["name"]: item["value"] for item in container.get("env", [])})
        check_env_names(env, name)
        assert settings_from(env, monkeypatch).take_new is not drains, name

        scaled = found["ScaledObject"][name]
        assert scaled["spec"]["scaleTargetRef"]["name"] == name
        assert scaled["metadata"]["labels"][RELEASE_LABEL] == release
        for trigger in scaled["spec"]["triggers"]:
            assert trigger["authenticationRef"]["name"] in found["TriggerAuthentication"]
        if drains:
            assert scaled["spec"]["minReplicaCount"] == 0, name
            (trigger,) = scaled["spec"]["triggers"]
            query = trigger["metadata"]["query"]
            assert query == draining_query(name), "kustomize replaced otherwise"
            assert demand_prefix(query) == f"{name}-", f"{name}: counts another's pods"
        else:
            assert scaled["spec"]["triggers"] == default_scaled["triggers"], name
            assert scaled["spec"]["minReplicaCount"] == default_scaled["minReplicaCount"], name
    # No release's pods are under another's prefix.
    names = list(found["Deployment"])
    for name in names:
        assert not any(other != name and f"{other}-".startswith(f"{name}-") for other in names)
    for doc in docs:
        if doc["apiVersion"] != KEDA_API:
            kubernetes_validate.validate(doc, K8S_VERSIONS[-1], strict=True)


# ---- the deploy texts -----------------------------------------------------------------------


def test_every_command_named_in_deploy_is_a_subcommand() -> None:
    script, group = console_script()
    for path in DEPLOY.rglob("*"):
        if not path.is_file() or path.suffix == ".pyc":
            continue
        for name in re.findall(rf"`{script} ([a-z][a-z-]*)", path.read_text()):
            assert name in group.commands, f"{path.relative_to(ROOT)}: {script} {name}"


def test_the_version_queue_named_in_deploy_is_the_workers() -> None:
    from loomflow_worker.execution.versions import queue_suffix

    example = Settings.model_fields["queue"].default + queue_suffix("deploy", "3f2a9c1b0d4e")
    assert queue_suffix("<agent>", "<version>") == "@<agent>@<version>"
    for text in (operations_text(), (DRAINING / "deployment.yaml").read_text()):
        assert example in text and "<queue>@<agent>@<version>" in text
