"""The usage flush on the default backend (SQLite: multi-row ``VALUES ... ON CONFLICT ... RETURNING``).

The rest of the suite runs on ``DATABASE_URL`` (PostgreSQL in CI, which takes the ``unnest`` path), so
this runs the flush in a child process on a fresh SQLite file against the same real Redis.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = r'''
import json, time
import django
django.setup()
from django.core.management import call_command
call_command("migrate", verbosity=0)
import redis
from django.conf import settings
from tenancy.models import Tenant
from tenancy.services import api_key_create
from usage.events import usage_event_emit_sync, usage_stream_key
from usage.models import UsageRecord, UsageRollup
from usage.services import usage_events_flush

r = redis.Redis.from_url(settings.REDIS_URL)
tenant = Tenant.objects.create(name="s")
key, _ = api_key_create(tenant=tenant, name="k")
now = time.time()
def ev(i):
    return {"request_id": f"sq-{i}", "tenant_id": tenant.pk, "api_key_id": key.pk, "served_model_name": "m",
            "prompt_tokens": 3, "completion_tokens": 2, "ttft_ms": 5.0, "e2e_latency_ms": 9.0,
            "created_at": now - 0.01, "finished_at": now}
for i in range(150):  # more than one VALUES chunk
    usage_event_emit_sync(r, ev(i))
usage_event_emit_sync(r, ev(7))  # duplicate
first = usage_events_flush(redis_client=r, max_batch=1000)
rec = UsageRecord.objects.get(request_id="sq-7")
out = {"handled": first, "rows": UsageRecord.objects.count(),
       "minute": list(UsageRollup.objects.filter(granularity="minute").values_list("requests", "prompt_tokens")),
       "rec": [rec.tenant_id == tenant.pk, rec.api_key_id == key.pk, rec.rolled_up,
               abs((rec.finished_at - rec.created_at).total_seconds() - 0.01) < 0.002]}
r.delete(usage_stream_key())
print("RESULT " + json.dumps(out))
'''


def test_flush_on_sqlite(tmp_path, redis_url):
    env = dict(os.environ, DATABASE_URL=f"sqlite:///{tmp_path / 'db.sqlite3'}", REDIS_URL=redis_url,
               LINK_PREFIX=f"sqlitetest{uuid.uuid4().hex[:8]}", DJANGO_SETTINGS_MODULE="config.settings",
               PYTHONPATH=os.pathsep.join([str(REPO / "platform"), str(REPO)]))
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120,
                          cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("RESULT "))
    out = json.loads(line[len("RESULT "):])
    # all events share one created_at, so one minute row holds them all, counted once
    assert out == {"handled": 151, "rows": 150, "minute": [[150, 450]], "rec": [True, True, True, True]}
