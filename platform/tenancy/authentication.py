"""DRF authentication with API keys (``Authorization: Bearer sk-...``), via ``api_key_authenticate``."""

from __future__ import annotations

from rest_framework import authentication, exceptions

from .selectors import AuthContext, api_key_authenticate


class ApiKeyPrincipal:
    """The ``request.user`` of an API-key request: a tenant's key, not a Django user."""

    is_authenticated = True
    is_anonymous = False
    is_active = True
    is_staff = False
    is_superuser = False

    def __init__(self, auth: AuthContext):
        self.auth = auth
        self.pk = self.id = None
        self.tenant_id = auth.tenant_id
        self.username = f"{auth.tenant_name}:{auth.key_prefix}"

    def __str__(self) -> str:
        return self.username


class ApiKeyAuthentication(authentication.BaseAuthentication):
    """``request.user`` = ``ApiKeyPrincipal``, ``request.auth`` = ``AuthContext``.

    No ``Authorization`` header or a non-Bearer scheme: returns None (other classes may try).
    A Bearer token that does not authenticate: 401 ``AuthenticationFailed``.
    """

    keyword = "Bearer"

    def authenticate(self, request):
        header = authentication.get_authorization_header(request).split()
        if not header or header[0].lower() != self.keyword.lower().encode():
            return None
        if len(header) != 2:
            raise exceptions.AuthenticationFailed("Invalid Authorization header.")
        try:
            secret = header[1].decode("ascii")
        except UnicodeDecodeError as exc:
            raise exceptions.AuthenticationFailed("Invalid API key.") from exc
        auth = api_key_authenticate(secret)
        if auth is None:
            raise exceptions.AuthenticationFailed("Invalid API key.")
        return ApiKeyPrincipal(auth), auth

    def authenticate_header(self, request) -> str:
        return self.keyword
