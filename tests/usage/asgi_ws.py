"""ASGI app for the live tests: ``config.asgi.application`` plus the usage WebSocket routes.

Used until ``config.asgi`` mounts ``usage.routing.websocket_application`` itself; when it does, this module
returns that application unchanged.
"""

from channels.routing import ProtocolTypeRouter

from config.asgi import application as _base
from usage.routing import websocket_application

if "websocket" in getattr(_base, "application_mapping", {}):
    application = _base
else:
    application = ProtocolTypeRouter({"http": _base, "websocket": websocket_application})
