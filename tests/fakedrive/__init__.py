"""A loopback HTTP fake of the Google Drive v2 API subset pydrive2 uses, with fault injection.

The fake is a real ``ThreadingHTTPServer`` on 127.0.0.1, so the real pydrive2 -> googleapiclient -> httplib2 ->
socket stack runs unmodified; only the host is rewritten (``RewritingHttp``). That way tests see the genuine
error types, retries and timeouts those libraries produce, not a mock's idea of them.

Typical use::

    with FakeDrive() as fake:
        drive = make_drive(fake)
        fake.inject("503", match="upload_id=")    # fail the first resumable-upload chunk

Modules, bottom up: ``replies`` (Reply, JSON errors), ``faults`` (fault kinds and knobs), ``store`` (files and
folders), ``query`` (files.list ``q``), ``uploads`` (media/multipart/resumable), ``api`` (routing and metadata
endpoints), ``handler`` (HTTP and connection faults), ``server`` (FakeDrive and its lifecycle), ``client``
(pointing httplib2/googleapiclient/pydrive2 at it).
"""

from .client import FakeGoogleAuth, RewritingHttp, make_drive, make_gauth, make_http, make_service
from .faults import CONNECTION_FAULTS, FAULTS, HTML_FAULTS, STATUS_FAULTS, Fault
from .query import parse_query
from .replies import DriveError, Reply, error_body
from .server import DEFAULT_TOKEN, FakeDrive
from .store import FOLDER_MIME, StoredFile

__all__ = [
    "CONNECTION_FAULTS",
    "DEFAULT_TOKEN",
    "FAULTS",
    "FOLDER_MIME",
    "HTML_FAULTS",
    "STATUS_FAULTS",
    "DriveError",
    "Fault",
    "FakeDrive",
    "FakeGoogleAuth",
    "Reply",
    "RewritingHttp",
    "StoredFile",
    "error_body",
    "make_drive",
    "make_gauth",
    "make_http",
    "make_service",
    "parse_query",
]
