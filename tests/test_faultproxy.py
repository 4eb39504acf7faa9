"""The fault proxy of `resumable chaos --fault drive` (resumable/tools/faultproxy.py) in front of the loopback fake
Drive: it forwards what it does not fail, and each fault does on the wire what its name says."""

from __future__ import annotations

import http.client
import json
import socket
from pathlib import Path

import pytest
from fakedrive import FakeDrive, make_drive

from resumable.storage.gdrive import DriveLocation, GDriveStore
from resumable.storage.retry import RetryPolicy
from resumable.tools.faultproxy import FaultProxy

LIST = "/drive/v2/files?q=trashed%3Dfalse"
AUTH = {"Authorization": "Bearer fake-token"}


@pytest.fixture
def drive():
    with FakeDrive(upload_chunk_limit=256 * 1024) as fake, FaultProxy(fake.base_url, stall_s=1.0) as proxy:
        yield fake, proxy
        assert not fake.server_errors, fake.server_errors


def _get(proxy: FaultProxy, timeout: float = 5.0) -> tuple[int, dict]:
    connection = http.client.HTTPConnection(proxy.url.removeprefix("http://"), timeout=timeout)
    try:
        connection.request("GET", LIST, headers=AUTH)
        answer = connection.getresponse()
        return answer.status, json.loads(answer.read())
    finally:
        connection.close()


def test_forwards_and_the_status_faults_answer_like_drive(drive) -> None:
    fake, proxy = drive
    assert _get(proxy) == (200, _get(proxy)[1]) and len(fake.requests) == 2  # forwarded, both
    for kind, reason in (("503", "backendError"), ("429", "rateLimitExceeded")):
        proxy.arm(kind)
        status, body = _get(proxy)
        assert status == int(kind) and body["error"]["errors"][0]["reason"] == reason
    assert len(fake.requests) == 2, "a 503 or 429 from the proxy never reaches Drive"
    assert [f.kind for f in proxy.fired] == ["503", "429"]


def test_a_drop_resets_unforwarded_and_a_stall_lands_then_never_answers(drive) -> None:
    fake, proxy = drive
    proxy.arm("drop")
    with pytest.raises((ConnectionError, http.client.RemoteDisconnected)):
        _get(proxy)
    assert fake.requests == []
    proxy.arm("stall")
    with pytest.raises(socket.timeout):
        _get(proxy, timeout=0.5)
    assert fake.requests == [("GET", LIST)], "a stalled request reached Drive; only its answer is lost"
    assert _get(proxy)[0] == 200
    assert proxy.fired[-1].recovered_at is not None and proxy.fired[-1].retries == 1


def test_an_upload_goes_on_through_the_proxy_from_the_bytes_drive_acknowledged(drive, tmp_path: Path) -> None:
    fake, proxy = drive
    store = GDriveStore(make_drive(proxy.url, timeout=0.5), DriveLocation.parse("gdrive://root/runs/p"),
                        RetryPolicy(attempts=6, base_s=0.01), chunk_size=256 * 1024)
    source = tmp_path / "state.pt"
    source.write_bytes(bytes(range(256)) * 4096)  # 1 MiB: four chunks
    store.list_checkpoints()
    proxy.arm("stall", match="PUT ")  # the first chunk lands on Drive, its answer never comes
    assert store.put_file("step-000000001", "state.pt", source).size == source.stat().st_size
    (fired,) = proxy.fired
    assert fired.request == "PUT upload" and fired.retries >= 1
    assert fired.continued_at == 256 * 1024, "the retry asked Drive what it holds (bytes */N) and went on from there"
    store.get_file("step-000000001", "state.pt", tmp_path / "back")
    assert (tmp_path / "back").read_bytes() == source.read_bytes()
