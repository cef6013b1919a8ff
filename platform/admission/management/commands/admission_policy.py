"""``manage.py admission_policy MODEL [--max-num-queued-reqs N|none] [--max-num-queued-tokens N|none]
[--target-ttft-ms MS] [--fair-share-threshold-pct P] [--high-tier-reserve-pct P] [--low-tier-ceiling-pct P]
[--apply-suggested]``: set a model's admission limits, tier ceilings and fair-share threshold (published at once)."""

from __future__ import annotations

from django.core.exceptions import ValidationError
from django.core.management.base import CommandError

from admission.services import (
    admission_policy_apply_suggested,
    admission_policy_get_or_create,
    admission_policy_update,
)
from audit.commands import AuditedCommand
from registry.selectors import served_model_get


def _limit(value: str | None):
    if value is None or value.lower() in ("", "none", "unbounded"):
        return None
    return int(value)


class Command(AuditedCommand):
    help = "Set a served model's admission limits (none = unbounded) and publish them to Redis."

    def add_arguments(self, parser):
        parser.add_argument("model")
        parser.add_argument("--max-num-queued-reqs", default="__unset__")
        parser.add_argument("--max-num-queued-tokens", default="__unset__")
        parser.add_argument("--target-ttft-ms", type=int, default=None)
        parser.add_argument("--fair-share-threshold-pct", type=int, default=None,
                            help="above this percent of a limit, a tenant over its weighted share is refused (100 = off)")
        parser.add_argument("--high-tier-reserve-pct", type=int, default=None,
                            help="top percent of each limit only the high tier may fill")
        parser.add_argument("--low-tier-ceiling-pct", type=int, default=None,
                            help="the low tier is refused above this percent of each limit")
        parser.add_argument("--apply-suggested", action="store_true")

    def handle(self, *args, **opts):
        sm = served_model_get(opts["model"])
        if sm is None:
            raise CommandError(f"unknown model {opts['model']!r}")
        policy = admission_policy_get_or_create(served_model=sm)
        fields = {}
        for name in ("max_num_queued_reqs", "max_num_queued_tokens"):
            if opts[name] != "__unset__":
                fields[name] = _limit(opts[name])
        for name in ("target_ttft_ms", "fair_share_threshold_pct", "high_tier_reserve_pct", "low_tier_ceiling_pct"):
            if opts[name] is not None:
                fields[name] = opts[name]
        try:
            admission_policy_update(policy=policy, **fields)
        except ValidationError as exc:
            raise CommandError(str(exc)) from exc
        if opts["apply_suggested"]:
            if admission_policy_apply_suggested(policy=policy) is None:
                raise CommandError("no engine has measured prefill throughput yet")
        self.stdout.write(f"{sm.served_model_name}: max_num_queued_reqs={policy.max_num_queued_reqs} "
                          f"max_num_queued_tokens={policy.max_num_queued_tokens} "
                          f"target_ttft_ms={policy.target_ttft_ms} "
                          f"fair_share_threshold_pct={policy.fair_share_threshold_pct} "
                          f"tier_ceilings_pct={policy.tier_ceilings()}")
