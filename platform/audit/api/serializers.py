"""Serializers of ``/api/v1/audit``: one audit entry about a key, as a tenant may see it."""

from __future__ import annotations

from auditlog.models import LogEntry
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

ACTIONS = {LogEntry.Action.CREATE: "create", LogEntry.Action.UPDATE: "update", LogEntry.Action.DELETE: "delete"}
ACTOR_TYPES = ("api_key", "tenant_owner", "operator", "system")


class FieldChangeSerializer(serializers.Serializer):
    """One field's value before and after (``null`` before a creation, after a deletion)."""

    before = serializers.JSONField(allow_null=True)
    after = serializers.JSONField(allow_null=True)


class AuditActorSerializer(serializers.Serializer):
    """Who made the change: one of the tenant's keys (``api_key_id``, ``api_key_prefix``), the tenant's owner
    (``username``), an operator (admin, management command; not named to tenants) or the platform itself."""

    type = serializers.ChoiceField(choices=ACTOR_TYPES)
    api_key_id = serializers.IntegerField(required=False)
    api_key_prefix = serializers.CharField(required=False)
    username = serializers.CharField(required=False)


class AuditEntrySerializer(serializers.Serializer):
    """An audit entry about one of the tenant's keys. Context: ``tenant_owner_id`` and ``tenant_key_ids`` (the
    tenant's owner user id and key ids, which decide what the actor shows)."""

    id = serializers.IntegerField()
    timestamp = serializers.DateTimeField()
    api_key_id = serializers.IntegerField(source="object_id", help_text="the key changed")
    api_key = serializers.CharField(source="object_repr", help_text="the key as it was shown then: prefix (name)")
    action = serializers.SerializerMethodField(help_text="create, update or delete (of the stored row)")
    operation = serializers.SerializerMethodField(
        help_text="what was done: create, update, revoke, rotate (a rotation's entries: the old key revoked or "
                  "given its grace expiry, the successor created), or the action when done by a plain edit")
    source = serializers.SerializerMethodField(help_text="rest, admin, command, web or system")
    actor = serializers.SerializerMethodField()
    changes = serializers.SerializerMethodField()

    def _data(self, entry: LogEntry) -> dict:
        return entry.additional_data if isinstance(entry.additional_data, dict) else {}

    def get_action(self, entry: LogEntry) -> str:
        return ACTIONS.get(entry.action, "update")

    def get_operation(self, entry: LogEntry) -> str:
        return str(self._data(entry).get("operation") or self.get_action(entry))

    def get_source(self, entry: LogEntry) -> str:
        return str(self._data(entry).get("source") or "system")

    @extend_schema_field(AuditActorSerializer)
    def get_actor(self, entry: LogEntry) -> dict:
        data = self._data(entry)
        key = data.get("api_key")
        if isinstance(key, dict) and key.get("id") in self.context.get("tenant_key_ids", ()):
            return {"type": "api_key", "api_key_id": key["id"], "api_key_prefix": str(key.get("prefix", ""))}
        if entry.actor_id is not None and entry.actor_id == self.context.get("tenant_owner_id"):
            return {"type": "tenant_owner", "username": entry.actor.get_username() if entry.actor else ""}
        if entry.actor_id is None and key is None and data.get("source", "system") == "system":
            return {"type": "system"}
        return {"type": "operator"}

    @extend_schema_field(serializers.DictField(child=FieldChangeSerializer(), help_text=(
        "per changed field, its value before and after; secrets (key hashes) are never recorded")))
    def get_changes(self, entry: LogEntry) -> dict:
        out = {}
        for field, pair in (entry.changes_dict or {}).items():
            if isinstance(pair, (list, tuple)) and len(pair) == 2:
                out[field] = {"before": pair[0], "after": pair[1]}
        return out
