"""Pointing the real client stack (httplib2, googleapiclient, pydrive2) at a running ``FakeDrive``.

Only the host is rewritten (``RewritingHttp``); everything above the socket runs unmodified.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

import httplib2
from googleapiclient.discovery import build
from oauth2client.client import AccessTokenCredentials
from pydrive2.auth import GoogleAuth
from pydrive2.drive import GoogleDrive

from .server import DEFAULT_TOKEN, FakeDrive

USER_AGENT = "resumable-tests"
_LOOPBACK = {"127.0.0.1", "localhost", "::1"}


class RewritingHttp(httplib2.Http):
    """httplib2.Http that sends every ``https://*.googleapis.com`` request to the fake instead.

    Any other non-loopback host raises, so a test can never reach the real network (e.g. a token refresh).
    """

    def __init__(self, base_url: str, timeout: float | None = 5.0) -> None:
        super().__init__(timeout=timeout)
        self.base_url = base_url.rstrip("/")
        # Drive answers resumable-upload chunks with 308 "Resume Incomplete", which is not a redirect
        # (pydrive2's own _build_http does the same).
        self.redirect_codes = self.redirect_codes - {308}

    def rewrite(self, uri: str) -> str:
        parts = urlsplit(uri)
        host = parts.hostname or ""
        if host == "googleapis.com" or host.endswith(".googleapis.com"):
            return self.base_url + uri[len(f"{parts.scheme}://{parts.netloc}") :]
        if host not in _LOOPBACK:
            raise RuntimeError(f"fakedrive: refusing to contact {host!r} from tests ({uri})")
        return uri

    def request(  # type: ignore[override]
        self,
        uri: str,
        method: str = "GET",
        body: Any = None,
        headers: dict[str, str] | None = None,
        redirections: int = httplib2.DEFAULT_MAX_REDIRECTS,
        connection_type: Any = None,
    ) -> tuple[httplib2.Response, bytes]:
        return super().request(self.rewrite(uri), method, body, headers, redirections, connection_type)


def _base_url(target: FakeDrive | str) -> str:
    return target if isinstance(target, str) else target.base_url


def make_http(fake: FakeDrive | str, timeout: float | None = 5.0, token: str | None = DEFAULT_TOKEN) -> httplib2.Http:
    """A rewriting Http, authorized with a static bearer token unless ``token`` is None."""
    http = RewritingHttp(_base_url(fake), timeout)
    if token is None:
        return http
    return AccessTokenCredentials(token, USER_AGENT).authorize(http)


class FakeGoogleAuth(GoogleAuth):
    """GoogleAuth whose every Http (the shared one and pydrive2's per-thread ones) is a RewritingHttp.

    pydrive2 builds all its Http objects through ``_build_http``, so overriding it is the single injection point.
    Credentials are a static access token with no expiry, so no refresh or OAuth flow ever runs.
    """

    def __init__(self, base_url: str, http_timeout: float | None = 5.0, token: str = DEFAULT_TOKEN) -> None:
        super().__init__(settings_file=None, http_timeout=http_timeout, settings=dict(GoogleAuth.DEFAULT_SETTINGS))
        self.base_url = base_url
        self.credentials = AccessTokenCredentials(token, USER_AGENT)

    def _build_http(self) -> httplib2.Http:
        return RewritingHttp(self.base_url, timeout=self.http_timeout)


def make_gauth(fake: FakeDrive | str, timeout: float | None = 5.0, token: str = DEFAULT_TOKEN) -> FakeGoogleAuth:
    gauth = FakeGoogleAuth(_base_url(fake), http_timeout=timeout, token=token)
    # Builds the v2 service from googleapiclient's bundled discovery document (static_discovery defaults to True).
    gauth.Authorize()
    return gauth


def make_drive(fake: FakeDrive | str, timeout: float | None = 5.0, token: str = DEFAULT_TOKEN) -> GoogleDrive:
    return GoogleDrive(make_gauth(fake, timeout, token))


def make_service(fake: FakeDrive | str, timeout: float | None = 5.0, token: str | None = DEFAULT_TOKEN) -> Any:
    """A raw googleapiclient Drive v2 service talking to the fake."""
    return build("drive", "v2", http=make_http(fake, timeout, token), static_discovery=True, cache_discovery=False)
