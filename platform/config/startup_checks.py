"""Configurations the platform refuses to start with (issue 39). Plain functions of the values they judge, so that
``config.settings`` can use them before Django is set up.

* Example secrets: a secret that still holds the placeholder of ``deploy/``'s example files (``CHANGE_ME...`` in
  ``env.example``, ``compose.env.example``, ``k8s/secret.yaml``) is public knowledge. ``config.settings`` refuses to
  load with one when ``DEBUG`` is off, so every Django process (api, workers, beat, ``migrate``, ``serve``) refuses.
* A TLS-terminating proxy without a trusted proxy list: with ``DJANGO_BEHIND_TLS_PROXY`` on and
  ``FORWARDED_ALLOW_IPS`` empty, uvicorn ignores the proxy's ``X-Forwarded-For``, so every client has the proxy's
  address: django-axes locks every client out after one client's failed logins and the audit log names the proxy.
* A trusted proxy list uvicorn would misread (with or without the TLS proxy): ``*``, or a network of every
  address, makes uvicorn believe ``X-Forwarded-For`` from any peer (the deployed api listens on 0.0.0.0), so any
  client could pick the address that login throttling counts and the audit log records; an entry that is neither
  an IP address nor a network (a host name, a network with host bits set, a ``*`` among addresses) is kept by
  uvicorn as a literal that no TCP client matches, so the proxy is not believed. uvicorn's ``--forwarded-allow-ips`` accepts exactly: ``*`` alone, IP addresses, networks
  (``ipaddress.ip_network``, strict) and such literals (``uvicorn.middleware.proxy_headers._TrustedHosts``).

  Only the api serves clients, so only it refuses: ``config.asgi`` (under uvicorn, as ``deploy/`` starts it, and
  under ``manage.py serve``), ``serve`` itself before it starts anything, and ``manage.py check --deploy``
  (``ops.checks``). Every deploy form hands uvicorn this same ``FORWARDED_ALLOW_IPS`` (empty: no proxy is believed),
  as ``serve`` does, so what is checked here is what uvicorn trusts.
"""

from __future__ import annotations

import ipaddress
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


#: what every refusal of the trusted proxy list asks for
_LIST_THE_PROXIES = ("List the proxy's addresses or networks in FORWARDED_ALLOW_IPS, comma-separated (e.g. "
                     "127.0.0.1 for a proxy on this machine; on Kubernetes the ingress controller's pod addresses or "
                     "ranges, a whole pod network only where the CNI enforces NetworkPolicy: deploy/README.md): "
                     "uvicorn then takes each client's address from the X-Forwarded-For the proxy appends.")


def untrusted_proxy_problem(*, behind_tls_proxy: bool, forwarded_allow_ips: str) -> str | None:
    """What is wrong with the api's trusted proxies (``FORWARDED_ALLOW_IPS``, which every deploy form hands to
    uvicorn's ``--forwarded-allow-ips``; ``behind_tls_proxy``: ``DJANGO_BEHIND_TLS_PROXY``) and what to set; None
    when nothing is. Wrong: an empty list behind a TLS proxy (every client would have the proxy's address), ``*`` or
    a network of every address (every peer believed), an entry that is neither an IP address nor a network (uvicorn
    keeps it as a literal that matches no client)."""
    value = forwarded_allow_ips.strip()
    if not value:
        if not behind_tls_proxy:
            return None
        return ("DJANGO_BEHIND_TLS_PROXY is on but FORWARDED_ALLOW_IPS is empty: the api would see every client at "
                "the proxy's address (one client's failed logins would lock every client out; the audit log would "
                f"name the proxy). {_LIST_THE_PROXIES}")
    entries = [item.strip() for item in value.split(",") if item.strip()]
    if value == "*" or any(_every_address(item) for item in entries):
        return (f"FORWARDED_ALLOW_IPS={value!r} trusts every address: uvicorn would believe X-Forwarded-For from "
                "any peer, so any client that reaches the api could pick the address that login throttling counts "
                f"and the audit log records. {_LIST_THE_PROXIES}")
    misread = [item for item in entries if not _address_or_network(item)]
    if misread:
        return (f"FORWARDED_ALLOW_IPS={value!r}: uvicorn reads {', '.join(misread)} as neither an IP address nor "
                "a network (such as 10.244.3.7 or 10.244.3.0/24, no host bits set) but as a name, which matches no "
                f"client, so the proxy would not be believed. {_LIST_THE_PROXIES}")
    return None


def _address_or_network(item: str) -> bool:
    """Whether uvicorn reads ``item`` as an IP address or network (its ``_TrustedHosts``: a ``/`` makes it a
    network, strict; anything it cannot parse is a literal)."""
    try:
        ipaddress.ip_network(item) if "/" in item else ipaddress.ip_address(item)
    except ValueError:
        return False
    return True


def _every_address(item: str) -> bool:
    """Whether ``item`` is a network holding every address of its family (``0.0.0.0/0``, ``::/0``)."""
    return "/" in item and _address_or_network(item) and ipaddress.ip_network(item).prefixlen == 0


def refuse_start(message: str) -> NoReturn:
    """End the starting api process: ``message`` on stderr, exit status ``STARTUP_FAILURE``."""
    print(message, file=sys.stderr, flush=True)
    raise SystemExit(STARTUP_FAILURE)
