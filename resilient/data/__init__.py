"""Resumable, exactly-once data delivery."""

from .fetch import DataFetchError
from .loader import ElasticLoader

__all__ = ["DataFetchError", "ElasticLoader"]
