"""The admin with a second factor (``DJANGO_ADMIN_OTP=1``): django-otp's ``OTPAdminSite`` as the default site.

``settings`` swaps ``django.contrib.admin`` for ``config.admin_apps.OTPAdminConfig`` when the switch is on, so ``admin.site`` (and
every ``@admin.register``) is this site: staff log in with username, password and a current TOTP code of one
of their confirmed devices (django-otp's ``TOTPDevice``, RFC 6238); users without one cannot enter.
"""

from django_otp.admin import OTPAdminSite


class PlatformOTPAdminSite(OTPAdminSite):
    """``OTPAdminSite`` under the usual instance name ``admin`` (so ``reverse("admin:...")`` is unchanged)."""

    def __init__(self, name: str = "admin"):
        super().__init__(name)
