"""``GET /api/v1/usage``: a tenant's usage from the rollups (scope ``usage:read`` or the owner's session).

Query parameters (all optional):

================  ==============================================================================
``range``         ``hour`` | ``day`` | ``30d``: sets start, end and granularity (minute/hour/day)
``start``/``end`` ISO-8601 datetimes (UTC when no offset); default: the last 24 hours. A year before 1000 or
                  after 9998 is taken as that bound; ``end`` not after ``start``: no points; a range of
                  more than ``MAX_POINTS`` buckets: its last ``MAX_POINTS`` (the answer's ``start`` says
                  where it begins) (D-178)
``granularity``   ``minute`` | ``hour`` | ``day`` (default ``hour``)
``api_key_id``    one of the tenant's key ids (another tenant's id: 404); default all the tenant's keys
``model``         served model name
``group_by``      ``key`` | ``model``: per-group totals under ``groups``
================  ==============================================================================

A tenant only ever sees rows of its own ``tenant_id``: the filter is applied from the credential, not
from a parameter.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone as dt_timezone

from django.utils import timezone
from django.utils.dateparse import parse_datetime
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, inline_serializer
from rest_framework import exceptions, serializers
from rest_framework.response import Response

from tenancy.api.base import TenantAPIView, api_doc
from tenancy.models import ApiKey
from usage.models import GRANULARITIES
from usage.buckets import GRANULARITY_STEP
from usage.selectors import MAX_POINTS, RANGES, usage_range, usage_series

_FIGURES = {name: serializers.FloatField(allow_null=True) for name in (
    "requests", "prompt_tokens", "completion_tokens", "cached_tokens", "total_tokens", "status_429", "status_503",
    "errors", "aborted", "error_rate", "ttft_p50_ms", "ttft_p95_ms", "ttft_mean_ms", "e2e_p50_ms", "e2e_p95_ms",
    "e2e_mean_ms")}
_POINT = inline_serializer("UsagePoint", {"t": serializers.DateTimeField(), **_FIGURES}, many=True)
_TOTALS = inline_serializer("UsageTotals", dict(_FIGURES))
_SERIES = inline_serializer("UsageSeries", {
    "granularity": serializers.ChoiceField(choices=GRANULARITIES), "start": serializers.DateTimeField(),
    "end": serializers.DateTimeField(), "points": _POINT, "totals": _TOTALS,
    "groups": serializers.DictField(child=_TOTALS),
})


_EARLIEST = datetime(1000, 1, 1, tzinfo=dt_timezone.utc)
_LATEST = datetime(9998, 12, 31, tzinfo=dt_timezone.utc)


def _when(value: str, name: str):
    """``value`` as an aware datetime (UTC when it has no offset); 400 naming ``name`` when it is not an
    ISO-8601 datetime or names an impossible date or time (``2026-13-45T99:00``: ``parse_datetime`` raises
    ``ValueError``). A year before 1000 or after 9998 is taken as 1000-01-01 or 9998-12-31 UTC (keeps the
    bucket arithmetic clear of ``datetime``'s limits; every schema-valid date-time is answered). The result is
    in UTC whatever offset ``value`` carries."""
    try:
        parsed = parse_datetime(value)
    except ValueError as exc:
        raise exceptions.ValidationError({name: f"not a valid ISO-8601 datetime ({exc})"}) from exc
    if parsed is None:
        raise exceptions.ValidationError({name: "not an ISO-8601 datetime"})
    if parsed.year < 1000:
        return _EARLIEST
    if parsed.year > 9998:
        return _LATEST
    # In UTC: buckets are UTC (a -20:29 offset would floor to a bucket no rollup has), and PostgreSQL refuses a
    # bound whose offset is beyond +-15:59 (``timezone displacement out of range``: a 500 before this).
    return (parsed if parsed.tzinfo else parsed.replace(tzinfo=dt_timezone.utc)).astimezone(dt_timezone.utc)


def _bounded_start(start, end, granularity: str):
    """``start`` moved forward so that ``[start, end)`` holds at most ``MAX_POINTS`` buckets of ``granularity``
    (one less, as ``usage_series`` floors ``start`` to its bucket)."""
    earliest = end - GRANULARITY_STEP[granularity] * (MAX_POINTS - 1)
    return max(start, earliest)


def _present(params, name: str) -> str | None:
    """Query parameter ``name``: ``None`` when absent; 400 when sent empty (``?end=`` is no date-time, no enum
    member, no id: an empty value is refused rather than read as absent, as the schema says)."""
    value = params.get(name)
    if value == "":
        raise exceptions.ValidationError({name: "must not be empty (leave the parameter out for its default)"})
    return value


def series_params(params) -> dict:
    """Parse the query parameters above into ``usage_series`` keyword arguments (400 on bad input)."""
    granularity = _present(params, "granularity") or "hour"
    range_name = _present(params, "range")
    end_text, start_text = _present(params, "end"), _present(params, "start")
    if range_name is not None:
        try:
            start, end, granularity = usage_range(range_name)
        except ValueError as exc:
            raise exceptions.ValidationError({"range": str(exc)}) from exc
    else:
        if granularity not in GRANULARITIES:
            raise exceptions.ValidationError({"granularity": f"must be one of {list(GRANULARITIES)}"})
        end = _when(end_text, "end") if end_text is not None else timezone.now()
        start = _when(start_text, "start") if start_text is not None else end - timedelta(days=1)
        start = _bounded_start(start, end, granularity)
    group_by = _present(params, "group_by")
    if group_by not in (None, "key", "model"):
        raise exceptions.ValidationError({"group_by": "must be key or model"})
    model = params.get("model") or None  # empty: every model
    if model is not None and (len(model) > 256 or "\x00" in model):
        raise exceptions.ValidationError({"model": "must be at most 256 characters without NUL"})
    return {"granularity": granularity, "start": start, "end": end, "served_model_name": model,
            "group_by": group_by}


class UsageView(TenantAPIView):
    """The tenant's usage over time (points per bucket, totals, optional groups)."""

    required_scope = "usage:read"

    @api_doc(
        summary="Usage of the tenant's keys over time (from minute/hour/day rollups)",
        parameters=[
            OpenApiParameter("range", OpenApiTypes.STR, enum=sorted(RANGES),
                             description="sets start, end and granularity; the others are then ignored"),
            OpenApiParameter("start", OpenApiTypes.DATETIME,
                             description="default: end - 24 h; moved forward to keep at most "
                                         f"{MAX_POINTS} buckets; a year before 1000 is taken as 1000-01-01"),
            OpenApiParameter("end", OpenApiTypes.DATETIME,
                             description="default: now; a year after 9998 is taken as 9998-12-31; "
                                         "not after start: no points"),
            OpenApiParameter("granularity", OpenApiTypes.STR, enum=list(GRANULARITIES)),
            OpenApiParameter("api_key_id", {"type": "integer", "minimum": 1, "maximum": 2**63 - 1},
                             description="one of the tenant's key ids (another id: 404)"),
            OpenApiParameter("model", {"type": "string", "maxLength": 256, "pattern": "^[^\\u0000]*$"},
                             description="a served model name"),
            OpenApiParameter("group_by", OpenApiTypes.STR, enum=["key", "model"]),
        ],
        responses=_SERIES, errors=(400, 404),
    )
    def get(self, request):
        kwargs = series_params(request.query_params)
        tenant = self.principal.tenant
        key_ids = None
        raw_key = request.query_params.get("api_key_id")
        if raw_key is not None:
            if not (raw_key.isascii() and raw_key.isdigit() and 0 < int(raw_key) < 2**63):
                raise exceptions.ValidationError({"api_key_id": "must be a positive integer id"})
            if not ApiKey.objects.filter(pk=int(raw_key), tenant=tenant).exists():
                raise exceptions.NotFound("No such API key for this tenant.")
            key_ids = [int(raw_key)]
        try:
            data = usage_series(tenant_id=tenant.pk, api_key_ids=key_ids, **kwargs)
        except ValueError as exc:
            raise exceptions.ValidationError({"non_field_errors": [str(exc)]}) from exc
        data["tenant_id"] = tenant.pk
        return Response(data)
