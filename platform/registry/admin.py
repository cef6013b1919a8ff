"""Admin for the model registry."""

from __future__ import annotations

from django import forms
from django.contrib import admin
from django.core.exceptions import ValidationError

from .models import ServedModel
from .services import model_dir_max_model_len, served_model_dirs_validate


class ServedModelAdminForm(forms.ModelForm):
    """ServedModel form that checks the directories and reads ``max_model_len`` from config.json when blank."""

    max_model_len = forms.IntegerField(
        min_value=1, required=False, help_text="Blank = max_position_embeddings from the model's config.json."
    )

    class Meta:
        model = ServedModel
        fields = "__all__"

    def clean(self):
        cleaned = super().clean()
        model_dir = cleaned.get("model_dir")
        if model_dir:
            try:
                model_dir_abs, tokenizer_dir_abs = served_model_dirs_validate(
                    model_dir=model_dir, tokenizer_dir=cleaned.get("tokenizer_dir") or None
                )
                cleaned["model_dir"], cleaned["tokenizer_dir"] = model_dir_abs, tokenizer_dir_abs
                if not cleaned.get("max_model_len"):
                    cleaned["max_model_len"] = model_dir_max_model_len(model_dir_abs)
            except ValidationError as exc:
                for field, messages in exc.message_dict.items():
                    for message in messages:
                        self.add_error(field if field in self.fields else None, message)
        return cleaned


@admin.register(ServedModel)
class ServedModelAdmin(admin.ModelAdmin):
    """List, filter and edit served models."""

    form = ServedModelAdminForm
    list_display = (
        "served_model_name", "task", "backend", "enabled", "device", "dtype", "max_model_len", "max_num_seqs",
        "num_replicas", "model_dir", "updated_at",
    )
    list_filter = ("enabled", "task", "backend", "device", "dtype", "allow_request_chat_template")
    search_fields = ("served_model_name", "model_dir", "tokenizer_dir")
    readonly_fields = ("created_at", "updated_at")
    fieldsets = (
        (None, {"fields": ("served_model_name", "task", "enabled")}),
        ("Files", {"fields": ("model_dir", "tokenizer_dir")}),
        ("Serving", {"fields": ("backend", "max_model_len", "max_num_seqs", "num_replicas", "dtype", "device")}),
        ("Chat template", {"fields": ("chat_template", "allow_request_chat_template",
                                       "allow_control_tokens_in_content")}),
        ("Output parsing", {"fields": ("reasoning_parser", "tool_call_parser")}),
        ("Timestamps", {"fields": ("created_at", "updated_at")}),
    )
