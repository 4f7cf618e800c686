from .celery_harness import fleet

__all__ = ["fleet"]
