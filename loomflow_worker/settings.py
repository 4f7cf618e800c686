"""One settings object, read from ``LOOMFLOW_WORKER_*`` environment variables."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict


class Settings(BaseSettings):
    """Where the fleet's services are and how runs behave.

    Every field reads ``LOOMFLOW_WORKER_<NAME>``; e.g.
    ``LOOMFLOW_WORKER_DATABASE_URL``. ``AGENTS`` is a comma-separated list
    of modules that register agents, imported by every worker at start and
    by an application before it enqueues."""

    model_config = SettingsConfigDict(env_prefix="LOOMFLOW_WORKER_", extra="ignore")

    database_url: SecretStr = SecretStr("postgresql://postgres@127.0.0.1:5432/postgres")
    broker_url: SecretStr = SecretStr("redis://127.0.0.1:6379/0")
    result_backend: SecretStr = SecretStr("redis://127.0.0.1:6379/1")
    agents: Annotated[list[str], NoDecode] = Field(default_factory=list)
    queue: str = "loomflow"
    redis_key_prefix: str = ""

    # Retries of errors that are not crashes, with jittered exponential backoff.
    max_retries: int = Field(default=3, ge=0)
    retry_backoff: float = Field(default=1.0, gt=0)
    retry_backoff_max: float = Field(default=60.0, gt=0)
    # A request whose worker died this many times while running it ends `dead`.
    max_crashes: int = Field(default=3, ge=1)

    # Bad input refused at enqueue.
    max_prompt_chars: int = Field(default=200_000, ge=1)
    max_metadata_bytes: int = Field(default=65_536, ge=2)

    # How long a request parked behind an older one waits before it
    # dispatches that older request again (when its dispatch looks lost).
    redispatch_after: float = Field(default=30.0, gt=0)
    # The broker's visibility timeout: longer than the longest run, so the
    # broker itself never starts a second copy of a running request.
    visibility_timeout: int = Field(default=6 * 3600, gt=0)
    # Extra kombu transport options, as JSON (e.g. Redis sentinel settings).
    broker_transport_options: dict[str, Any] = Field(default_factory=dict)

    pool_min_size: int = Field(default=1, ge=0)
    pool_max_size: int = Field(default=4, ge=1)
    connect_timeout: int = Field(default=10, ge=1)
    lock_io_timeout: float = Field(default=30.0, gt=0)

    @field_validator("agents", mode="before")
    @classmethod
    def _split_agents(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @model_validator(mode="after")
    def _check_backoff(self) -> Settings:
        if self.retry_backoff_max < self.retry_backoff:
            raise ValueError(
                f"retry_backoff_max ({self.retry_backoff_max}) is below retry_backoff "
                f"({self.retry_backoff})"
            )
        return self

    @property
    def is_redis_broker(self) -> bool:
        return self.broker_url.get_secret_value().startswith(("redis://", "rediss://"))
