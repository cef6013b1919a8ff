"""Configurations the platform refuses to start with (issue 39). Plain functions of the values they judge, so that
``config.settings`` can use them before Django is set up.

* Example secrets: a secret that still holds the placeholder of ``deploy/``'s example files (``CHANGE_ME...`` in
  ``env.example``, ``compose.env.example``, ``k8s/secret.yaml``) is public knowledge. ``config.settings`` refuses to
  load with one when ``DEBUG`` is off, so every Django process (api, workers, beat, ``migrate``, ``serve``) refuses.
* A TLS-terminating proxy without a trusted proxy list: with ``DJANGO_BEHIND_TLS_PROXY`` on and
  ``FORWARDED_ALLOW_IPS`` empty, uvicorn ignores the proxy's ``X-Forwarded-For`` (or believes it only from
  loopback), so every client has the proxy's address: django-axes locks every client out after one client's failed
  logins and the audit log names the proxy. Only the api serves clients, so only it refuses: ``config.asgi`` (under
  uvicorn, as ``deploy/`` starts it, and under ``manage.py serve``), ``serve`` itself before it starts anything,
  and ``manage.py check --deploy`` (``ops.checks``).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import NoReturn

#: the placeholder every secret of deploy/'s example files starts with (compared case-insensitively)
EXAMPLE_SECRET_MARKER = "CHANGE_ME"
#: uvicorn's exit status for an application that cannot load (``uvicorn.config.STARTUP_FAILURE``): with
#: ``--workers N`` its supervisor then stops instead of restarting the worker forever
STARTUP_FAILURE = 3


def example_secret_names(values: Mapping[str, str | None]) -> list[str]:
    """Names among ``values`` (variable name -> its value, None when unset) whose value holds
    ``EXAMPLE_SECRET_MARKER``, in the mapping's order. A URL counts as a whole (its password is the secret)."""
    marker = EXAMPLE_SECRET_MARKER.lower()
    return [name for name, value in values.items() if value and marker in value.lower()]


def example_secrets_message(names: list[str]) -> str:
    """One line saying that ``names`` still hold the example value and how to set them."""
    verb = "holds" if len(names) == 1 else "hold"
    return (f"Refusing to start: {', '.join(names)} still {verb} the example value {EXAMPLE_SECRET_MARKER}... of "
            "deploy/'s example files (env.example, compose.env.example, k8s/secret.yaml). Set each to a secret of "
            "your own, e.g. the output of: python -c 'import secrets; print(secrets.token_urlsafe(50))' (a password "
            "in REDIS_URL or DATABASE_URL must be the server's too: compose's REDIS_PASSWORD, POSTGRES_PASSWORD). "
            "DJANGO_DEBUG=1 starts anyway, for development only.")


def untrusted_proxy_problem(*, behind_tls_proxy: bool, forwarded_allow_ips: str) -> str | None:
    """What is wrong when the platform is behind a TLS-terminating proxy (``DJANGO_BEHIND_TLS_PROXY``) with no
    trusted proxy list (``FORWARDED_ALLOW_IPS``, which uvicorn reads too), and what to set; None when nothing is."""
    if not behind_tls_proxy or forwarded_allow_ips.strip():
        return None
    return ("DJANGO_BEHIND_TLS_PROXY is on but FORWARDED_ALLOW_IPS is empty: the api would see every client at the "
            "proxy's address (one client's failed logins would lock every client out; the audit log would name the "
            "proxy). Set FORWARDED_ALLOW_IPS to the proxy's addresses or networks, comma-separated (e.g. the "
            "ingress controller's pod network, 10.0.0.0/8, on Kubernetes; 127.0.0.1 for a proxy on this machine): "
            "uvicorn then takes each client's address from the X-Forwarded-For the proxy appends.")


def refuse_start(message: str) -> NoReturn:
    """End the starting api process: ``message`` on stderr, exit status ``STARTUP_FAILURE``."""
    print(message, file=sys.stderr, flush=True)
    raise SystemExit(STARTUP_FAILURE)
