"""Drive uploads cut half-way: bytes sent again with the resumable protocol (storage/upload.py) against the old
restart-from-0 upload (pydrive2 SetContentFile + Upload, retried whole), and clean throughput of both.

    python scripts/bench_upload_resume.py --size-mb 200 --repeats 5 --latency-ms 0,20

The server is tests/fakedrive/ (real HTTP over 127.0.0.1, the real pydrive2/googleapiclient stack; no network).
A cut resets the connection once the upload session has received half the file; the bytes of the cut request
that arrived are dropped (the worst case for the client). --latency-ms adds a delay before each request, like
the round trip to Drive, which is what a smaller chunk costs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from fakedrive import FakeDrive, make_drive  # noqa: E402

from resumable.storage.base import RemoteFile  # noqa: E402
from resumable.storage.gdrive import DriveLocation, GDriveStore  # noqa: E402
from resumable.storage.retry import RetryPolicy  # noqa: E402

FOLDER, NAME = "step-000000001", "state.pt"


def old_put(store: GDriveStore, source: Path) -> RemoteFile:
    """The upload GDriveStore.put_file did before the resumable protocol: one pydrive2 Upload (100 MiB chunks),
    and a retry after an error uploads the whole file again in a new session."""
    parent = store._folder_id(store._parts(FOLDER), create=True)

    def upload() -> RemoteFile:
        existing = store._children(parent, NAME, folders=False)
        remote = store.drive.CreateFile({"id": existing[0]["id"]} if existing else
                                        {"title": NAME, "parents": [{"id": parent}],
                                         "mimeType": "application/octet-stream"})
        try:
            remote.SetContentFile(str(source))
            remote.Upload()
        finally:
            if getattr(remote, "content", None) is not None:
                remote.content.close()
        return RemoteFile(int(remote["fileSize"]), remote["md5Checksum"])

    return store._call(upload, "uploading (old)")


def one(fake: FakeDrive, store: GDriveStore, source: Path, protocol: str, cut: bool) -> tuple[float, int]:
    """(seconds, bytes re-sent) of one upload of ``source``."""
    size = source.stat().st_size
    received = fake.received_upload_bytes()
    if cut:
        fake.cut_upload(size // 2)
    started = time.perf_counter()
    got = store.put_file(FOLDER, NAME, source) if protocol == "resumable" else old_put(store, source)
    seconds = time.perf_counter() - started
    assert got.size == size and not fake.server_errors, fake.server_errors
    return seconds, fake.received_upload_bytes() - received - size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=float, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--latency-ms", default="0,20", help="added before each request, comma-separated")
    parser.add_argument("--chunk-mib", type=float, default=8)
    args = parser.parse_args()
    with FakeDrive() as fake, tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / NAME
        source.write_bytes(os.urandom(int(args.size_mb * 1e6)))
        store = GDriveStore(make_drive(fake, timeout=60), DriveLocation.parse("gdrive://root/bench"),
                            RetryPolicy(attempts=8, base_s=0.05), sessions_dir=Path(tmp) / "sessions",
                            chunk_size=int(args.chunk_mib * 1024 * 1024))
        print(f"{args.size_mb:.0f} MB upload, {args.chunk_mib:g} MiB chunks, median of {args.repeats}")
        for latency in (float(x) / 1000 for x in args.latency_ms.split(",")):
            fake.latency_s = latency
            results = {}
            for protocol in ("old", "resumable"):
                for cut in (False, True):
                    runs = [one(fake, store, source, protocol, cut) for _ in range(args.repeats)]
                    results[protocol, cut] = (statistics.median(s for s, _ in runs),
                                              statistics.median(b for _, b in runs))
            for protocol in ("old", "resumable"):
                clean_s = results[protocol, False][0]
                cut_s, resent = results[protocol, True]
                print(f"latency {latency * 1000:3.0f} ms {protocol:>9}: clean {args.size_mb / clean_s:6.1f} MB/s "
                      f"({clean_s:5.2f} s); cut at 50%: {resent / 1e6:6.1f} MB re-sent, {cut_s:5.2f} s")
            ratio = results["old", False][0] / results["resumable", False][0]
            print(f"latency {latency * 1000:3.0f} ms: resumable/old clean throughput ratio {ratio:.2f}; bytes re-sent "
                  f"after the cut {results['resumable', True][1] / 1e6:.1f} MB vs {results['old', True][1] / 1e6:.1f}"
                  f" MB (one chunk: {args.chunk_mib * 1.048576:.1f} MB)")


if __name__ == "__main__":
    main()
