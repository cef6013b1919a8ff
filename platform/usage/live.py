"""Live dashboard updates: the usage flush tells Channels group ``usage.live`` that new rollups exist."""

from __future__ import annotations

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer

LIVE_GROUP = "usage.live"


def usage_live_notify() -> None:
    """Send ``{"type": "usage.updated"}`` to the group (sync; call from Celery tasks, not from a loop)."""
    layer = get_channel_layer()
    if layer is not None:
        async_to_sync(layer.group_send)(LIVE_GROUP, {"type": "usage.updated"})
