"""JSON error pages for Django's side of the URL map, so every unknown path answers the OpenAI envelope
(written by ``inference.protocol.errors.error_dict``, the one writer of it)."""

from django.http import JsonResponse

from inference.protocol.errors import INTERNAL_ERROR_MESSAGE, ErrorCode, ErrorType, error_dict


def not_found(request, exception=None):
    """``handler404``: 404 ``not_found_error`` envelope (HTML 404 pages are of no use to API clients)."""
    return JsonResponse(error_dict(f"Unknown route: {request.method} {request.path}", ErrorType.NOT_FOUND, None,
                                   ErrorCode.UNKNOWN_ROUTE), status=404)


def server_error(request):
    """``handler500``: 500 envelope; the traceback goes to the log, never to the client."""
    return JsonResponse(error_dict(INTERNAL_ERROR_MESSAGE, ErrorType.SERVER, None, ErrorCode.INTERNAL_ERROR),
                        status=500)
