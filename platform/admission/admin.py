"""Admin of admission policies: limits, live queue state, refusals and sizing help (read from Redis)."""

from __future__ import annotations

from django.contrib import admin, messages
from django.utils.html import format_html_join

from .models import AdmissionPolicy
from .selectors import model_admission_state, model_prefill_throughput, tenant_rows
from .services import admission_policy_apply_suggested, suggested_max_num_queued_tokens


def _unbounded(value):
    return "unbounded" if value is None else value


@admin.register(AdmissionPolicy)
class AdmissionPolicyAdmin(admin.ModelAdmin):
    """Per-model limits; each row also shows live counters from Redis (not the database)."""

    list_display = ("served_model", "limit_reqs", "limit_tokens", "target_ttft_ms", "fair_share_threshold_pct",
                    "high_tier_reserve_pct", "low_tier_ceiling_pct", "queued_reqs", "queued_tokens", "refused_reqs",
                    "refused_tokens", "refused_tier", "refused_fair", "prefill_tokens_per_s", "suggested_tokens",
                    "updated_at")
    fields = ("served_model", "max_num_queued_reqs", "max_num_queued_tokens", "target_ttft_ms",
              "fair_share_threshold_pct", "high_tier_reserve_pct", "low_tier_ceiling_pct", "queued_reqs",
              "queued_tokens", "refused_reqs", "refused_tokens", "refused_tier", "refused_fair", "tenants_live",
              "prefill_tokens_per_s", "suggested_tokens")
    readonly_fields = ("queued_reqs", "queued_tokens", "refused_reqs", "refused_tokens", "refused_tier",
                       "refused_fair", "tenants_live", "prefill_tokens_per_s", "suggested_tokens")
    actions = ["apply_suggested"]

    def _state(self, obj) -> dict:
        cache = getattr(self, "_state_cache", None)
        if cache is None:
            cache = self._state_cache = {}
        name = obj.served_model.served_model_name
        if name not in cache:
            cache[name] = model_admission_state(served_model_name=name)
            cache[name]["tps"] = model_prefill_throughput(served_model_name=name)
        return cache[name]

    def changelist_view(self, request, extra_context=None):
        self._state_cache = {}
        return super().changelist_view(request, extra_context)

    def change_view(self, request, object_id, form_url="", extra_context=None):
        self._state_cache = {}
        return super().change_view(request, object_id, form_url, extra_context)

    def get_readonly_fields(self, request, obj=None):
        ro = super().get_readonly_fields(request, obj)
        return ro + ("served_model",) if obj is not None else ro

    @admin.display(description="max queued reqs")
    def limit_reqs(self, obj):
        return _unbounded(obj.max_num_queued_reqs)

    @admin.display(description="max queued tokens")
    def limit_tokens(self, obj):
        return _unbounded(obj.max_num_queued_tokens)

    @admin.display(description="queued requests (live)")
    def queued_reqs(self, obj):
        return self._state(obj)["queued_reqs"] if obj and obj.pk else "-"

    @admin.display(description="queued prompt tokens (live)")
    def queued_tokens(self, obj):
        return self._state(obj)["queued_tokens"] if obj and obj.pk else "-"

    @admin.display(description="refused: max_num_queued_reqs")
    def refused_reqs(self, obj):
        return self._state(obj)["refused"]["max_num_queued_reqs"] if obj and obj.pk else "-"

    @admin.display(description="refused: max_num_queued_tokens")
    def refused_tokens(self, obj):
        return self._state(obj)["refused"]["max_num_queued_tokens"] if obj and obj.pk else "-"

    @admin.display(description="refused: priority_tier")
    def refused_tier(self, obj):
        return self._state(obj)["refused"]["priority_tier"] if obj and obj.pk else "-"

    @admin.display(description="refused: fair_share")
    def refused_fair(self, obj):
        return self._state(obj)["refused"]["fair_share"] if obj and obj.pk else "-"

    @admin.display(description="tenants (live: queued reqs / prompt tokens, weight, admitted, refused)")
    def tenants_live(self, obj):
        if not (obj and obj.pk):
            return "-"
        rows = tenant_rows(self._state(obj)["tenants"])
        if not rows:
            return "none yet"
        return format_html_join(
            "\n", "<div>{} (id {}): {} reqs / {} tokens queued, weight {}, admitted {}, refused {}</div>",
            ((r["name"], r["tenant"], r["queued_reqs"], r["queued_tokens"], r["weight"], r["admitted"], r["refused"])
             for r in rows))

    @admin.display(description="prefill tokens/s (engines)")
    def prefill_tokens_per_s(self, obj):
        return f"{self._state(obj)['tps']:.0f}" if obj and obj.pk else "-"

    @admin.display(description="suggested max queued tokens")
    def suggested_tokens(self, obj):
        if not (obj and obj.pk):
            return "-"
        value = suggested_max_num_queued_tokens(target_ttft_ms=obj.target_ttft_ms,
                                                prefill_tokens_per_s=self._state(obj)["tps"])
        return "no throughput measured yet" if value is None else value

    @admin.action(description="Apply suggested max_num_queued_tokens (target TTFT × prefill throughput)")
    def apply_suggested(self, request, queryset):
        for policy in queryset.select_related("served_model"):
            value = admission_policy_apply_suggested(policy=policy)
            if value is None:
                self.message_user(request, f"{policy.served_model}: no engine has measured prefill throughput "
                                           "yet; unchanged", messages.WARNING)
            else:
                self.message_user(request, f"{policy.served_model}: max_num_queued_tokens = {value}")
