"""``manage.py enrol_totp USERNAME [--name NAME]``: give an operator a TOTP device for the admin's second factor.

With ``DJANGO_ADMIN_OTP=1`` the admin asks staff for a code of a confirmed django-otp ``TOTPDevice`` (RFC 6238:
6 digits, 30 s steps). This creates one and prints its ``otpauth://`` URL once on stdout (add it to an
authenticator app, e.g. as a QR code); details go to stderr. Devices can also be added in the admin
(``OTP_TOTP`` section), by a user already verified.
"""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError
from django_otp.plugins.otp_totp.models import TOTPDevice


class Command(BaseCommand):
    help = "Create a confirmed TOTP device for USERNAME and print its otpauth:// URL (the secret) once on stdout."

    def add_arguments(self, parser):
        parser.add_argument("username")
        parser.add_argument("--name", default="authenticator", help="device name shown in the admin")

    def handle(self, *args, **options):
        user = get_user_model().objects.filter(username=options["username"]).first()
        if user is None:
            raise CommandError(f"no user {options['username']!r}")
        device = TOTPDevice.objects.create(user=user, name=options["name"], confirmed=True)
        if not user.is_staff:
            self.stderr.write(f"warning: {user.username} is not staff; the admin will refuse them anyway")
        self.stderr.write(f"created TOTP device {device.pk} ({device.name}) for {user.username}")
        self.stdout.write(device.config_url)
