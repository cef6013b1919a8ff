"""``manage.py register_model NAME MODEL_DIR [options]``: create or update a served model."""

from __future__ import annotations

from pathlib import Path

from django.core.exceptions import ValidationError
from django.core.management.base import CommandError

from audit.commands import AuditedCommand
from registry.models import ServedModel
from registry.services import served_model_register


def _bool(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off"}:
        return False
    raise ValueError(value)


class Command(AuditedCommand):
    help = "Register (or update, keyed on NAME) a served model from a Hugging Face-format directory."

    def add_arguments(self, parser):
        parser.add_argument("name", help="served_model_name clients send as \"model\"")
        parser.add_argument("model_dir", help="directory with config.json (and tokenizer.json unless --tokenizer-dir)")
        parser.add_argument("--tokenizer-dir", default=None)
        parser.add_argument("--max-model-len", type=int, default=None,
                            help="default: max_position_embeddings from config.json")
        parser.add_argument("--chat-template-file", default=None, help="file whose text overrides the chat template")
        parser.add_argument("--allow-request-chat-template", type=_bool, default=None, metavar="BOOL")
        parser.add_argument("--allow-control-tokens-in-content", type=_bool, default=None, metavar="BOOL",
                            help="special-token strings in request text become control tokens (default false)")
        parser.add_argument("--reasoning-parser", default=None,
                            help="auto (from the chat template; default), none, or a reasoning parser name")
        parser.add_argument("--tool-call-parser", default=None,
                            help="auto (from the chat template; default), none, or a tool-call parser name")
        parser.add_argument("--dtype", choices=ServedModel.Dtype.values, default=None)
        parser.add_argument("--device", choices=ServedModel.Device.values, default=None)
        parser.add_argument("--max-num-seqs", type=int, default=None)
        parser.add_argument("--num-replicas", type=int, default=None,
                            help="engine processes `manage.py serve` runs for this model (default 1)")
        parser.add_argument("--task", choices=ServedModel.Task.values, default=None)
        parser.add_argument("--backend", choices=ServedModel.Backend.values, default=None,
                            help="engine backend: native (default) or vllm (README, 'Engine backends')")
        parser.add_argument("--enabled", type=_bool, default=None, metavar="BOOL")

    def handle(self, *args, **options):
        chat_template = None
        if options["chat_template_file"]:
            chat_template = Path(options["chat_template_file"]).read_text()
        try:
            served_model = served_model_register(
                served_model_name=options["name"],
                model_dir=options["model_dir"],
                tokenizer_dir=options["tokenizer_dir"],
                max_model_len=options["max_model_len"],
                chat_template=chat_template,
                allow_request_chat_template=options["allow_request_chat_template"],
                allow_control_tokens_in_content=options["allow_control_tokens_in_content"],
                reasoning_parser=options["reasoning_parser"],
                tool_call_parser=options["tool_call_parser"],
                dtype=options["dtype"],
                device=options["device"],
                max_num_seqs=options["max_num_seqs"],
                num_replicas=options["num_replicas"],
                task=options["task"],
                backend=options["backend"],
                enabled=options["enabled"],
            )
        except ValidationError as exc:
            raise CommandError("; ".join(f"{k}: {' '.join(v)}" for k, v in exc.message_dict.items())) from exc
        self.stdout.write(
            f"registered {served_model.served_model_name}: model_dir={served_model.model_dir} "
            f"tokenizer_dir={served_model.tokenizer_dir_resolved} max_model_len={served_model.max_model_len} "
            f"device={served_model.device} dtype={served_model.dtype} task={served_model.task} "
            f"backend={served_model.backend} enabled={served_model.enabled}"
        )
