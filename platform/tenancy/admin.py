"""Admin for tenants and API keys. A key's secret is generated on save and shown exactly once."""

from __future__ import annotations

from django import forms
from django.conf import settings
from django.contrib import admin, messages

from .models import ApiKey, Tenant
from .services import KeyRuleError, api_key_create, api_key_name_validate, api_key_revoke, api_keys_active_count

LIMIT_FIELDS = ("rpm_limit", "tpm_limit", "max_concurrent_requests", "token_budget", "budget_period")


class CommaListField(forms.CharField):
    """A list of strings edited as comma-separated text."""

    def prepare_value(self, value):
        if isinstance(value, (list, tuple)):
            return ", ".join(value)
        return value

    def to_python(self, value):
        text = super().to_python(value) or ""
        return list(dict.fromkeys(item.strip() for item in text.split(",") if item.strip()))


class ApiKeyAdminForm(forms.ModelForm):
    """Key fields an operator chooses; there is no secret field (the secret is generated on save)."""

    allowed_models = CommaListField(required=False, help_text="Comma-separated served model names; blank = all.")
    scopes = CommaListField(required=False, initial="inference", help_text="Comma-separated, e.g. inference, operator.")

    class Meta:
        model = ApiKey
        fields = ("tenant", "name", "allowed_models", "scopes", "expires_at", *LIMIT_FIELDS, "priority_tier")

    def clean_name(self):
        """The name rule of ``tenancy.services.api_key_name_validate`` (a form error, not a 500)."""
        try:
            return api_key_name_validate(self.cleaned_data.get("name"))
        except KeyRuleError as exc:
            raise forms.ValidationError(str(exc)) from exc

    def clean(self):
        """On add: the tenant must be under ``settings.MAX_API_KEYS_PER_TENANT`` active keys."""
        cleaned = super().clean()
        tenant = cleaned.get("tenant")
        cap = getattr(settings, "MAX_API_KEYS_PER_TENANT", 1000)
        if self.instance._state.adding and tenant is not None and api_keys_active_count(tenant.pk) >= cap:
            raise forms.ValidationError(f"Tenant {tenant.name} already has {cap} active API keys "
                                        "(MAX_API_KEYS_PER_TENANT); revoke one first.")
        return cleaned


class ApiKeyInline(admin.TabularInline):
    model = ApiKey
    fields = ("name", "prefix", "scopes", "expires_at", "revoked_at", "last_used_at")
    readonly_fields = fields
    extra = 0
    can_delete = False
    show_change_link = True

    def has_add_permission(self, request, obj=None):
        return False


@admin.register(Tenant)
class TenantAdmin(admin.ModelAdmin):
    list_display = ("name", "is_active", "owner", "cache_group", "priority_tier", "fair_share_weight", "rpm_limit",
                    "tpm_limit", "max_concurrent_requests", "token_budget", "created_at")
    list_filter = ("is_active", "priority_tier")
    search_fields = ("name", "owner__username", "cache_group")
    raw_id_fields = ("owner",)
    inlines = [ApiKeyInline]


@admin.action(description="Revoke selected API keys")
def revoke_keys(modeladmin, request, queryset):
    """Admin action: revoke every selected key (already revoked ones are left as they are)."""
    count = 0
    for api_key in queryset.filter(revoked_at__isnull=True):
        api_key_revoke(api_key=api_key)
        count += 1
    modeladmin.message_user(request, f"Revoked {count} API key(s).", messages.SUCCESS)


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    form = ApiKeyAdminForm
    list_display = (
        "prefix", "name", "tenant", "scopes", "allowed_models", "expires_at", "revoked_at", "last_used_at",
        "created_at",
    )
    list_filter = ("tenant", ("revoked_at", admin.EmptyFieldListFilter), "expires_at", "created_at")
    search_fields = ("prefix", "name", "tenant__name")
    list_select_related = ("tenant",)
    actions = [revoke_keys]

    def get_readonly_fields(self, request, obj=None):
        if obj is None:
            return ()
        return ("tenant", "prefix", "revoked_at", "last_used_at", "replaced_by", "created_at")

    def get_fields(self, request, obj=None):
        if obj is None:
            return ("tenant", "name", "allowed_models", "scopes", "expires_at", *LIMIT_FIELDS, "priority_tier")
        return ("tenant", "prefix", "name", "allowed_models", "scopes", "expires_at", *LIMIT_FIELDS, "priority_tier",
                "revoked_at", "last_used_at", "replaced_by", "created_at")

    def save_model(self, request, obj, form, change):
        if change:
            super().save_model(request, obj, form, change)
            return
        api_key, plaintext = api_key_create(
            tenant=form.cleaned_data["tenant"],
            name=form.cleaned_data["name"],
            allowed_models=form.cleaned_data.get("allowed_models") or [],
            scopes=form.cleaned_data.get("scopes") or None,
            expires_at=form.cleaned_data.get("expires_at"),
            limits={f: form.cleaned_data.get(f) for f in (*LIMIT_FIELDS, "priority_tier") if f in form.cleaned_data},
        )
        # The admin goes on to log and redirect with ``obj``: make it the saved row.
        obj.__dict__.update({k: v for k, v in api_key.__dict__.items() if k != "_state"})
        obj._state.adding = False
        obj._state.db = api_key._state.db
        messages.success(
            request,
            f"API key {api_key.prefix} created. Copy the secret now, it will not be shown again: {plaintext}",
        )
