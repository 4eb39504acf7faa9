"""Upload throughput of the Drive API store to the loopback Drive server of the tests, clean and with
faults injected (one per upload), and the retries it took.

    python scripts/bench_drive.py --sizes 15,200 --repeats 5

The server is tests/fakedrive/ (real HTTP over 127.0.0.1, the real pydrive2 stack); no network is used.
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

from resumable.storage.gdrive import DriveLocation, GDriveStore  # noqa: E402
from resumable.storage.retry import RetryPolicy  # noqa: E402

FAULTS = ("503", "userRateLimitExceeded", "html502", "drop")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="15,200", help="file sizes in MB")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with FakeDrive() as fake, tempfile.TemporaryDirectory() as tmp:
        policy = RetryPolicy(attempts=8, base_s=0.05)
        store = GDriveStore(make_drive(fake, timeout=30), DriveLocation.parse("gdrive://root/bench"), policy)
        for size in (float(s) for s in args.sizes.split(",")):
            source = Path(tmp) / "payload"
            source.write_bytes(os.urandom(int(size * 1e6)))
            for label in ("clean", "faults"):
                times, retries_before = [], policy.retries
                for repeat in range(args.repeats):
                    if label == "faults":
                        fake.inject(FAULTS[repeat % len(FAULTS)], match="/upload/")
                    started = time.perf_counter()
                    store.put_file(f"step-{repeat:09d}", "state.pt", source)
                    times.append(time.perf_counter() - started)
                rate = size / statistics.median(times)
                print(f"{size:6.0f} MB {label:>6}: median {statistics.median(times) * 1000:8.1f} ms per upload, "
                      f"{rate:7.1f} MB/s, retries {policy.retries - retries_before} in {args.repeats} uploads")


if __name__ == "__main__":
    main()
