"""JSON error pages for Django's side of the URL map, so every unknown path answers the OpenAI envelope."""

from django.http import JsonResponse


def not_found(request, exception=None):
    """``handler404``: 404 ``not_found_error`` envelope (HTML 404 pages are of no use to API clients)."""
    return JsonResponse({"error": {"message": f"Unknown route: {request.method} {request.path}",
                                   "type": "not_found_error", "param": None, "code": "unknown_route"}}, status=404)


def server_error(request):
    """``handler500``: 500 envelope; the traceback goes to the log, never to the client."""
    return JsonResponse({"error": {"message": "The server had an error while processing your request.",
                                   "type": "server_error", "param": None, "code": "internal_error"}}, status=500)
