"""Channels WebSocket routes of the usage dashboards.

``websocket_urlpatterns``: ``/ws/usage/`` → ``UsageLiveConsumer``. ``websocket_application`` wraps them
with the Django session auth and an allowed-hosts origin check; ``config.asgi`` mounts it with
``ProtocolTypeRouter({"http": ..., "websocket": websocket_application})``.
"""

from channels.auth import AuthMiddlewareStack
from channels.routing import URLRouter
from channels.security.websocket import AllowedHostsOriginValidator
from django.urls import path

from .consumers import UsageLiveConsumer

websocket_urlpatterns = [path("ws/usage/", UsageLiveConsumer.as_asgi())]

websocket_application = AllowedHostsOriginValidator(AuthMiddlewareStack(URLRouter(websocket_urlpatterns)))
