"""Run in a fresh process with ``DJANGO_ADMIN_OTP=1`` (the admin site is chosen at start-up): migrate a scratch
SQLite database, enrol a TOTP device with ``manage.py enrol_totp``, try admin logins, print the outcomes as JSON.
"""

from __future__ import annotations

import io
import json
import os
import sys
from urllib.parse import parse_qs, urlsplit

import django


def main() -> None:
    assert os.environ.get("DJANGO_ADMIN_OTP") == "1"
    django.setup()
    from django.contrib import admin
    from django.contrib.auth import get_user_model
    from django.core.management import call_command
    from django.test import Client
    from django.test.utils import setup_test_environment
    from django_otp.oath import totp
    from django_otp.plugins.otp_totp.models import TOTPDevice

    setup_test_environment()  # the test client's host "testserver" is allowed
    call_command("migrate", verbosity=0)
    get_user_model().objects.create_superuser("root", "root@example.com", "pw-root-12345")
    out = io.StringIO()
    call_command("enrol_totp", "root", stdout=out, stderr=io.StringIO())
    url = out.getvalue().strip()
    device = TOTPDevice.objects.get(user__username="root")
    result = {"site": admin.site.__class__.__name__, "url_secret_matches": parse_qs(urlsplit(url).query)["secret"][0] != ""}

    def attempt(token: str | None) -> dict:
        client = Client()
        data = {"username": "root", "password": "pw-root-12345", "next": "/admin/"}
        if token is not None:  # the device is picked from a list the form shows after the password step
            data.update({"otp_device": device.persistent_id, "otp_token": token})
        response = client.post("/admin/login/", data)
        index = client.get("/admin/")
        return {"status": response.status_code, "location": response.get("Location"), "index": index.status_code}

    result["no_token"] = attempt(None)
    good = totp(device.bin_key, device.step, device.t0, device.digits)
    result["good_token"] = attempt(f"{good:0{device.digits}d}")
    # a wrong code last (a failure makes django-otp throttle the device for a while)
    result["wrong_token"] = attempt(f"{(good + 1) % 10 ** device.digits:0{device.digits}d}")
    print(json.dumps(result))


if __name__ == "__main__":
    sys.exit(main())
