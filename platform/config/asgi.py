"""ASGI entry point: Channels ``ProtocolTypeRouter``.

WebSockets (live usage dashboards) go to ``usage.routing``; the ASGI lifespan to ``gateway.lifespan`` (the
admission lease and reaper start with the process). HTTP requests under the gateway prefixes (``/v1/``, ``/health``, ``/tokenize``, ...) go to the gateway's
Channels consumers; everything else (admin, REST control API, dashboards) goes to Django's ASGI handler.

A configuration the platform refuses (config/startup_checks.py: an example secret, a TLS proxy without trusted proxy
addresses, a trusted proxy list uvicorn would misread) ends the process at import with one line on stderr and
uvicorn's start-up failure status, so uvicorn's worker supervisor stops rather than restarting the worker forever.
"""

import faulthandler
import os
import signal

from django.core.asgi import get_asgi_application
from django.core.exceptions import ImproperlyConfigured

from config.startup_checks import refuse_start, untrusted_proxy_problem

# ``kill -USR2 <pid>`` writes every thread's Python stack to the process's log (faulthandler, from C: it works while
# the loop or a thread is stuck); the render workers do the same (inference/workers/render_limits.py)
faulthandler.register(signal.SIGUSR2, all_threads=True)

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
try:
    django_asgi_app = get_asgi_application()
except ImproperlyConfigured as exc:  # e.g. an example secret (config/startup_checks.py): the same on every restart
    refuse_start(str(exc))

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402

from django.conf import settings  # noqa: E402

# the proxies the api believes X-Forwarded-For from: listed behind a TLS proxy, never '*' (config/startup_checks.py)
if (_problem := untrusted_proxy_problem(behind_tls_proxy=settings.BEHIND_TLS_PROXY,
                                        forwarded_allow_ips=settings.FORWARDED_ALLOW_IPS)):
    refuse_start(f"Refusing to start the api: {_problem}")

from config.body_limit import BodyLimitMiddleware  # noqa: E402
from gateway import handoff, ingress  # noqa: E402
from gateway.http import MAX_BODY_BYTES  # noqa: E402
from gateway.lifespan import lifespan  # noqa: E402  (admission lease and reaper from start-up)
from gateway.routing import GATEWAY_PREFIXES, http_urlpatterns  # noqa: E402
from usage.routing import websocket_application  # noqa: E402  (live dashboard updates)

_gateway = URLRouter(http_urlpatterns)
# Django's routes: bodies over DJANGO_MAX_BODY_BYTES are refused before they are read (config/body_limit.py).
_django = BodyLimitMiddleware(django_asgi_app, settings.DJANGO_MAX_BODY_BYTES)


async def http_router(scope, receive, send):
    """Send gateway paths to the Channels consumers (image chats to the multimodal api process when this process
    has one: gateway/handoff.py) and the rest to Django. Gateway requests are first checked (size, route) and
    authenticated from their headers, before any body byte is read, and their body must arrive within the body deadlines
    (gateway/ingress.py); the hand-off header is believed only on a unix-socket listener."""
    if scope["path"].startswith(GATEWAY_PREFIXES):
        scope = ingress.trusted_handoff_scope(scope, handoff.HANDED_OFF_HEADER)
        if await ingress.early_refuse(scope, send) or await ingress.early_authenticate(scope, send):
            return None
        receive = ingress.BodyDeadline(receive, send, dialect=ingress.dialect_for(scope["path"]))
        if handoff.wants_handoff(scope):
            return await handoff.route(scope, receive, send, _gateway, MAX_BODY_BYTES)
        if handoff.handed_off(scope):
            await handoff.count("forwarded")
        return await _gateway(scope, receive, send)
    return await _django(scope, receive, send)


application = ProtocolTypeRouter({"http": http_router, "websocket": websocket_application, "lifespan": lifespan})

from config.gc_tuning import freeze_startup_objects  # noqa: E402

freeze_startup_objects()  # start-up objects leave the collector's walks (config/gc_tuning.py)
