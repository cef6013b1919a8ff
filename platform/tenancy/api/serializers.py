"""Serializers of ``/api/v1/keys``: a key is shown by prefix and name, never by secret (except once)."""

from __future__ import annotations

from django.core.validators import RegexValidator
from django.utils import timezone
from rest_framework import serializers

from inference.protocol.openai import SERVED_MODEL_NAME_RE
from tenancy.models import BUDGET_PERIOD_CHOICES, ApiKey
from tenancy.services import API_KEY_NAME_MAX_LEN, API_KEY_NAME_RULE, SCOPES_TENANT


class StrictCharField(serializers.CharField):
    """A ``CharField`` that takes only a JSON string (DRF's turns a number into its text: a request the schema
    refuses would be accepted)."""

    def to_internal_value(self, data):
        if not isinstance(data, str):
            self.fail("invalid")
        return super().to_internal_value(data)


class StrictIntegerField(serializers.IntegerField):
    """An ``IntegerField`` that takes only a JSON integer (DRF's takes ``"5"``, ``5.0`` and ``true``)."""

    def to_internal_value(self, data):
        if isinstance(data, bool) or not isinstance(data, int):
            self.fail("invalid")
        return super().to_internal_value(data)


# The schema's pattern for a key name: tenancy.services.API_KEY_NAME_RE and "not only spaces" in one pattern (the length is
# max_length's), so a schema-valid name is a valid name (tenancy.services still checks it).
API_KEY_NAME_PATTERN = r"\A *[A-Za-z0-9_\-.:@/()][A-Za-z0-9 _\-.:@/()]*\Z"


class ApiKeySerializer(serializers.ModelSerializer):
    """A key as listed: no secret, no hash."""

    status = serializers.SerializerMethodField()
    effective_priority_tier = serializers.IntegerField(
        read_only=True, help_text="the tier its requests get: 0 high, 1 standard, 2 low (the lower of the key's and "
                                  "its tenant's; the tenant's tier and fair-share weight are set by an operator)")

    class Meta:
        model = ApiKey
        fields = ("id", "prefix", "name", "scopes", "allowed_models", "rpm_limit", "tpm_limit",
                  "max_concurrent_requests", "token_budget", "budget_period", "priority_tier", "effective_priority_tier",
                  "expires_at", "revoked_at", "last_used_at", "replaced_by", "created_at", "status")
        read_only_fields = fields

    def get_status(self, obj: ApiKey) -> str:
        """``active``, ``revoked`` or ``expired``."""
        if obj.revoked_at is not None:
            return "revoked"
        if obj.expires_at is not None and obj.expires_at <= timezone.now():
            return "expired"
        return "active"


class ApiKeyCreatedSerializer(ApiKeySerializer):
    """A key just created or rotated: carries the plaintext ``key`` (shown this once only)."""

    key = serializers.CharField(read_only=True, help_text="the secret; store it now, it is never shown again")

    class Meta(ApiKeySerializer.Meta):
        fields = (*ApiKeySerializer.Meta.fields, "key")
        read_only_fields = fields


class ApiKeyWriteSerializer(serializers.Serializer):
    """Fields a tenant may set on create (``name`` required) or change on PATCH."""

    name = StrictCharField(max_length=API_KEY_NAME_MAX_LEN, trim_whitespace=False, help_text=API_KEY_NAME_RULE,
                           validators=[RegexValidator(API_KEY_NAME_PATTERN, message=f"must be {API_KEY_NAME_RULE}")])
    scopes = serializers.ListField(child=serializers.ChoiceField(choices=SCOPES_TENANT), required=False,
                                   allow_empty=False, min_length=1, help_text="default ['inference']; operator scopes refused")
    allowed_models = serializers.ListField(
        child=StrictCharField(max_length=128, trim_whitespace=False, validators=[
            RegexValidator(SERVED_MODEL_NAME_RE, message="must be a served model name (letters, digits and . _ : / -, "
                                                         "starting with a letter or digit)")]),
        required=False, help_text="served model names; empty = every model")
    expires_at = serializers.DateTimeField(required=False, allow_null=True)
    # max_value: the columns' range on every database (PositiveIntegerField is a 32-bit integer on PostgreSQL);
    # a larger value answers 400 instead of failing in the database (500).
    rpm_limit = StrictIntegerField(required=False, allow_null=True, min_value=1, max_value=2**31 - 1)
    tpm_limit = StrictIntegerField(required=False, allow_null=True, min_value=1, max_value=2**31 - 1)
    max_concurrent_requests = StrictIntegerField(required=False, allow_null=True, min_value=1, max_value=2**31 - 1)
    token_budget = StrictIntegerField(required=False, allow_null=True, min_value=1, max_value=2**63 - 1)
    budget_period = serializers.ChoiceField(choices=[c for c, _ in BUDGET_PERIOD_CHOICES], required=False)
    priority_tier = StrictIntegerField(
        required=False, allow_null=True, min_value=0, max_value=2,
        help_text="0 high, 1 standard, 2 low; null = the tenant's tier. A key never gets a better tier than its "
                  "tenant's, nor (set by a key) than the acting key's.")


class RotateSerializer(serializers.Serializer):
    """``grace_period_s``: how long the old secret keeps working (0 = revoked at once)."""

    grace_period_s = StrictIntegerField(required=False, default=0, min_value=0, max_value=30 * 86_400)
