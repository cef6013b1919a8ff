"""App config of the admin with a second factor (``DJANGO_ADMIN_OTP=1``; see ``config.admin_site``).

Kept apart from ``config.admin_site``: an app config module is imported before the app registry is ready.
"""

from django.contrib.admin.apps import AdminConfig


class OTPAdminConfig(AdminConfig):
    """``django.contrib.admin`` with ``config.admin_site.PlatformOTPAdminSite`` as ``admin.site``."""

    default_site = "config.admin_site.PlatformOTPAdminSite"
