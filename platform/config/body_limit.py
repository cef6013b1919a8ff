"""ASGI middleware capping request bodies on Django's routes (``settings.DJANGO_MAX_BODY_BYTES``).

Django's ``ASGIHandler`` reads a whole request body before the view runs, spooling what exceeds
``FILE_UPLOAD_MAX_MEMORY_SIZE`` to a temporary file, whatever its size. This middleware, in front of it,
answers 413 in the OpenAI error envelope without reading a body whose ``Content-Length`` is over the cap, and
stops reading a body without one (chunked) as soon as it passes the cap; bodies within it are read into
memory and handed to Django unchanged. The body must arrive within the gateway's deadlines
(``REQUEST_BODY_TIMEOUT_S`` in all, ``REQUEST_BODY_IDLE_TIMEOUT_S`` between chunks; gateway/ingress.py
``BodyDeadline``): past one, 408 in the envelope, connection closed, and Django never runs.
"""

from __future__ import annotations

import orjson

from gateway.ingress import BodyDeadline
from inference.protocol.errors import ErrorCode, ErrorType, error_dict

class BodyLimitMiddleware:
    """Wrap an ASGI app: HTTP bodies over ``max_bytes`` get 413 (``request_too_large``) before the app runs."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def _refuse(self, send) -> None:
        body = orjson.dumps(error_dict(f"Request body larger than {self.max_bytes} bytes.",
                                       ErrorType.INVALID_REQUEST, None, ErrorCode.REQUEST_TOO_LARGE))
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = self.max_bytes + 1
                if declared > self.max_bytes:
                    return await self._refuse(send)
        messages = []
        size = 0
        body_receive = BodyDeadline(receive, send)
        while True:  # bounded: ends at the body's end, a disconnect, a body deadline, or past max_bytes
            message = await body_receive()
            if body_receive.timed_out:
                return None  # 408 sent, connection closing: Django never sees this request
            if message["type"] != "http.request":
                messages.append(message)  # http.disconnect: let the app see it
                break
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                return await self._refuse(send)
            messages.append(message)
            if not message.get("more_body", False):
                break

        async def replay():
            if messages:
                return messages.pop(0)
            return await receive()

        return await self.app(scope, replay, send)
