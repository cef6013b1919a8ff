"""System checks of the deployment (``manage.py check --deploy``), from the same rules the processes refuse to start
with (config/startup_checks.py)."""

from __future__ import annotations

from django.conf import settings
from django.core.checks import Error, Tags, register

from config.startup_checks import untrusted_proxy_problem


@register(Tags.security, deploy=True)
def trusted_proxies_check(app_configs, **kwargs) -> list[Error]:
    """``ops.E001`` when the platform is behind a TLS proxy without trusted proxy addresses (the api refuses to
    start then: config.asgi)."""
    problem = untrusted_proxy_problem(behind_tls_proxy=settings.BEHIND_TLS_PROXY,
                                      forwarded_allow_ips=settings.FORWARDED_ALLOW_IPS)
    return [Error(problem, id="ops.E001")] if problem else []
