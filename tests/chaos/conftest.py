from tests.integration.celery_harness import broker, fleet

__all__ = ["broker", "fleet"]
