"""Deleting a platform's or a test's keys from a Redis it shares with others (every key lives under a prefix)."""

from __future__ import annotations

import redis


def delete_matching(url: str, pattern: str) -> None:
    """Delete every key matching the glob ``pattern`` (Redis ``SCAN MATCH`` syntax) in the Redis at ``url``."""
    client = redis.Redis.from_url(url)
    try:
        keys = list(client.scan_iter(match=pattern, count=1000))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


def delete_prefix(url: str, prefix: str) -> None:
    """Delete every key under ``prefix:`` in the Redis at ``url``."""
    delete_matching(url, f"{prefix}:*")
