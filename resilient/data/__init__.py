"""Resumable, exactly-once data delivery."""

from .loader import ElasticLoader

__all__ = ["ElasticLoader"]
