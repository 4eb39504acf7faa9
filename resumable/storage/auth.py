"""Credentials for the Drive API (pydrive2), in the order a user expects them to be found.

1. ``RESUMABLE_DRIVE_TOKEN``: a ready OAuth access token (minted elsewhere; also what tests use),
   optionally with ``RESUMABLE_DRIVE_ENDPOINT`` to send API calls to another base URL.
2. In Colab: the notebook user's own credentials (``google.colab.auth``).
3. ``--drive-credentials FILE`` or ``RESUMABLE_DRIVE_CREDENTIALS``: a service-account JSON key, or a
   token file written by ``resumable drive-login``.
4. The token saved by ``resumable drive-login`` in the default place.
Tokens are never printed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .. import platforms
from .retry import StorageError

DRIVE_SCOPE = "https://www.googleapis.com/auth/drive"
DEFAULT_TOKEN = Path(os.environ.get("XDG_CONFIG_HOME", Path.home() / ".config")) / "resumable" / "drive-token.json"
_GOOGLE_API = "https://www.googleapis.com"


def _endpoint_http_class():
    import httplib2

    class EndpointHttp(httplib2.Http):
        """Sends googleapis.com requests to RESUMABLE_DRIVE_ENDPOINT instead."""

        endpoint = ""

        def request(self, uri, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003 - httplib2's signature
            if self.endpoint and uri.startswith(_GOOGLE_API):
                uri = self.endpoint + uri[len(_GOOGLE_API):]
            return super().request(uri, *args, **kwargs)

    return EndpointHttp


def _gauth_class(endpoint: str | None):
    from pydrive2.auth import GoogleAuth

    http_class = _endpoint_http_class()

    class ResumableAuth(GoogleAuth):
        def _build_http(self):  # noqa: ANN202 - pydrive2 hook
            http = http_class(timeout=self.http_timeout)
            http.endpoint = (endpoint or "").rstrip("/")
            http.redirect_codes = http.redirect_codes - {308}  # resumable uploads answer 308
            return http

    return ResumableAuth


def make_gauth(credentials: str | None = None, timeout: float = 60.0) -> Any:
    """An authorised pydrive2 GoogleAuth with an HTTP timeout, or StorageError saying what to do."""
    endpoint = os.environ.get("RESUMABLE_DRIVE_ENDPOINT")
    settings = {"client_config_backend": "settings", "oauth_scope": [DRIVE_SCOPE], "save_credentials": False,
                "client_config": {"client_id": "unused", "client_secret": "unused"}}
    token = os.environ.get("RESUMABLE_DRIVE_TOKEN")
    credentials = credentials or os.environ.get("RESUMABLE_DRIVE_CREDENTIALS")
    gauth_class = _gauth_class(endpoint)
    if token:
        from oauth2client.client import AccessTokenCredentials

        gauth = gauth_class(settings=settings, http_timeout=timeout)
        gauth.credentials = AccessTokenCredentials(token, "resumable")
    elif _in_colab() and not credentials:
        from google.colab import auth as colab_auth  # type: ignore[import-not-found]
        from oauth2client.client import GoogleCredentials

        colab_auth.authenticate_user()
        gauth = gauth_class(settings=settings, http_timeout=timeout)
        gauth.credentials = GoogleCredentials.get_application_default()
    else:
        path = Path(credentials) if credentials else DEFAULT_TOKEN
        if not path.is_file():
            raise StorageError(
                "no Google Drive credentials found. In Colab they come from the notebook user; from a shell "
                "pass --drive-credentials KEY.json (a service-account key, with the Drive folder shared to "
                "its e-mail) or run `resumable drive-login --client-secrets client_secrets.json` once")
        gauth = _from_file(gauth_class, settings, path, timeout)
    gauth.Authorize()
    return gauth


def _from_file(gauth_class, settings: dict, path: Path, timeout: float) -> Any:
    try:
        kind = json.loads(path.read_text(encoding="utf-8")).get("type")
    except (OSError, ValueError, AttributeError) as e:
        raise StorageError(f"{path} is not a readable JSON credentials file ({type(e).__name__})") from e
    if kind == "service_account":
        gauth = gauth_class(settings={**settings, "client_config_backend": "service",
                                      "service_config": {"client_json_file_path": str(path)}},
                            http_timeout=timeout)
        gauth.ServiceAuth()
        return gauth
    gauth = gauth_class(settings=settings, http_timeout=timeout)
    gauth.LoadCredentialsFile(str(path))
    if gauth.credentials is None:
        raise StorageError(f"{path} holds no usable Drive token; run `resumable drive-login` again")
    return gauth


def drive_login(client_secrets: str, token_path: Path = DEFAULT_TOKEN) -> Path:
    """Command-line OAuth flow; saves the user token with 0600 permissions and returns its path."""
    from pydrive2.auth import GoogleAuth

    gauth = GoogleAuth(settings={"client_config_backend": "file", "client_config_file": client_secrets,
                                 "oauth_scope": [DRIVE_SCOPE], "save_credentials": False,
                                 "get_refresh_token": True})
    gauth.CommandLineAuth()
    token_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(token_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.close(fd)
    os.chmod(token_path, 0o600)  # before the secret is written into it
    gauth.SaveCredentialsFile(str(token_path))
    os.chmod(token_path, 0o600)
    return token_path


def _in_colab() -> bool:
    return platforms.in_colab()
