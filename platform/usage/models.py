"""Usage models: one ``UsageRecord`` per request (docs/ARCHITECTURE.md §7), written in batches by
``usage_events_flush``."""

from __future__ import annotations

from django.db import models


class UsageRecord(models.Model):
    """What one request used and how it went. ``request_id`` is unique, so re-delivered events are no-ops.

    Written only in bulk by ``usage.record_insert`` (PostgreSQL: ``unnest`` of typed arrays); the
    dashboards read ``UsageRollup``, so this table carries only the indexes the admin list needs.
    """

    request_id = models.CharField(max_length=255)
    # db_index=False: the (key, created_at) and (tenant, created_at) indexes below serve FK lookups too.
    tenant = models.ForeignKey(
        "tenancy.Tenant", null=True, blank=True, on_delete=models.SET_NULL, related_name="usage_records",
        db_index=False,
    )
    api_key = models.ForeignKey(
        "tenancy.ApiKey", null=True, blank=True, on_delete=models.SET_NULL, related_name="usage_records",
        db_index=False,
    )
    served_model_name = models.CharField(max_length=128, blank=True, default="")
    endpoint = models.CharField(max_length=64, blank=True, default="")
    prompt_tokens = models.PositiveIntegerField(default=0)
    completion_tokens = models.PositiveIntegerField(default=0)
    cached_tokens = models.PositiveIntegerField(default=0)
    status_code = models.PositiveSmallIntegerField(default=200)
    finish_reason = models.CharField(max_length=16, blank=True, default="")
    ttft_ms = models.FloatField(null=True, blank=True, help_text="first token time - arrival time, ms")
    e2e_latency_ms = models.FloatField(default=0.0, help_text="finish time - arrival time, ms")
    n = models.PositiveSmallIntegerField(default=1)
    created_at = models.DateTimeField(help_text="request arrival")
    finished_at = models.DateTimeField()
    rolled_up = models.BooleanField(
        default=False, editable=False, help_text="added to the UsageRollup rows (in the same transaction)")

    class Meta:
        ordering = ["-created_at"]
        # A constraint rather than unique=True: on PostgreSQL unique=True adds a second, LIKE-only index
        # (varchar_pattern_ops) that every insert would maintain. Few indexes: rows come in bulk.
        constraints = [models.UniqueConstraint(fields=["request_id"], name="usage_request_id_uniq")]
        indexes = [
            models.Index(fields=["api_key", "created_at"], name="usage_key_created_idx"),
            models.Index(fields=["tenant", "created_at"], name="usage_tenant_created_idx"),
            models.Index(fields=["served_model_name", "created_at"], name="usage_model_created_idx"),
            models.Index(fields=["created_at"], name="usage_created_idx"),
            models.Index(fields=["id"], condition=models.Q(rolled_up=False), name="usage_not_rolled_idx"),
        ]

    def __str__(self) -> str:
        return self.request_id

    @property
    def total_tokens(self) -> int:
        """``prompt_tokens + completion_tokens``."""
        return self.prompt_tokens + self.completion_tokens


GRANULARITIES = ("minute", "hour", "day")


class UsageFigures(models.Model):
    """What a rollup row sums (abstract): request count, tokens, status classes, latency sums and histograms.

    Status classes: ``status_429`` (key limits), ``status_503`` (capacity), ``errors`` (any other status
    >= 400 but 499, or finish_reason ``error``), ``aborted`` (finish_reason ``abort``: client gone).
    Latency percentiles come from fixed log-spaced histograms (``usage.histogram``): ``ttft_hist``/``e2e_hist``
    are lists of counts, mergeable by addition across rows.
    """

    granularity = models.CharField(max_length=8, choices=[(g, g) for g in GRANULARITIES])
    bucket_start = models.DateTimeField()
    served_model_name = models.CharField(max_length=128, default="", blank=True)
    requests = models.PositiveIntegerField(default=0)
    prompt_tokens = models.PositiveBigIntegerField(default=0)
    completion_tokens = models.PositiveBigIntegerField(default=0)
    cached_tokens = models.PositiveBigIntegerField(default=0)
    status_429 = models.PositiveIntegerField(default=0)
    status_503 = models.PositiveIntegerField(default=0)
    errors = models.PositiveIntegerField(default=0)
    aborted = models.PositiveIntegerField(default=0)
    ttft_count = models.PositiveIntegerField(default=0)
    ttft_sum_ms = models.FloatField(default=0.0)
    ttft_hist = models.JSONField(default=list)
    e2e_sum_ms = models.FloatField(default=0.0)
    e2e_hist = models.JSONField(default=list)

    class Meta:
        abstract = True


class UsageRollup(UsageFigures):
    """Usage of one key and model in one minute, hour or day (``bucket_start``, UTC), summed from records.

    ``api_key_id``/``tenant_id`` are plain ids (0 = none) so rows outlive deleted keys and the unique
    constraint holds. Figures: ``UsageFigures``.
    """

    tenant_id = models.BigIntegerField(default=0)
    api_key_id = models.BigIntegerField(default=0)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["granularity", "api_key_id", "tenant_id", "served_model_name", "bucket_start"],
                                    name="usage_rollup_unique"),
        ]
        indexes = [
            models.Index(fields=["granularity", "api_key_id", "bucket_start"], name="rollup_key_idx"),
            models.Index(fields=["granularity", "tenant_id", "bucket_start"], name="rollup_tenant_idx"),
            models.Index(fields=["granularity", "bucket_start"], name="rollup_time_idx"),
        ]
        verbose_name = "usage rollup"
        verbose_name_plural = "usage dashboard"

    def __str__(self) -> str:
        return f"{self.granularity} {self.bucket_start:%Y-%m-%d %H:%M} key={self.api_key_id} {self.served_model_name}"


class UsageTotal(UsageFigures):
    """Usage of every key together for one model in one minute, hour or day: the sum of that bucket's
    ``UsageRollup`` rows, kept in the same transaction as they are (``usage.rollups``).

    The all-tenant charts read these (one row per bucket and model) instead of one row per key and bucket,
    which at 100,000 active keys is hundreds of thousands of rows per range.
    """

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["granularity", "served_model_name", "bucket_start"],
                                    name="usage_total_unique"),
        ]
        indexes = [models.Index(fields=["granularity", "bucket_start"], name="total_time_idx")]
        verbose_name = "usage total"

    def __str__(self) -> str:
        return f"{self.granularity} {self.bucket_start:%Y-%m-%d %H:%M} all keys {self.served_model_name}"


class UsageKeyRange(models.Model):
    """One key's usage over one dashboard range (``hour``/``day``/``30d``, ``usage.buckets.RANGES``): the sum of its
    ``UsageRollup`` rows of that range's granularity with ``bucket_start >= UsageKeyRangeWindow.start``, all models.

    Kept by ``usage.key_ranges``: the rollup writers add to it in their transaction, the advance (every flush
    task) subtracts the buckets that left the window. Only keys with traffic have a row (a row falling to 0
    requests is deleted). ``api_key_id``/``tenant_id`` are plain ids, as in ``UsageRollup``. The operator's key
    table pages these in index order (``keyrange_rank_idx``, ``keyrange_tenant_rank_idx``): no sum per request.
    """

    range_name = models.CharField(max_length=8)
    api_key_id = models.BigIntegerField()
    tenant_id = models.BigIntegerField(default=0)
    requests = models.BigIntegerField(default=0)
    prompt_tokens = models.BigIntegerField(default=0)
    completion_tokens = models.BigIntegerField(default=0)
    status_429 = models.BigIntegerField(default=0)
    status_503 = models.BigIntegerField(default=0)
    errors = models.BigIntegerField(default=0)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["range_name", "api_key_id"], name="usage_keyrange_unique")]
        indexes = [
            models.Index(fields=["range_name", "-requests", "api_key_id"], name="keyrange_rank_idx"),
            models.Index(fields=["range_name", "tenant_id", "-requests", "api_key_id"],
                         name="keyrange_tenant_rank_idx"),
        ]
        verbose_name = "usage per key and range"

    def __str__(self) -> str:
        return f"{self.range_name} key={self.api_key_id} requests={self.requests}"


class UsageKeyRangeWindow(models.Model):
    """Where ``UsageKeyRange`` rows of one range start: ``start`` (a bucket start of the range's granularity) and
    when the advance last checked it (``advanced_at``). No row: that range's totals are not built yet."""

    range_name = models.CharField(max_length=8, primary_key=True)
    start = models.DateTimeField(null=True, blank=True)
    advanced_at = models.DateTimeField()

    def __str__(self) -> str:
        return f"{self.range_name} from {self.start}"
