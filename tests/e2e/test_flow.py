"""Flow control of file bytes on the guest link (issue 13): a large read by a
slow reader and a large upload's commit keep the server's memory bounded,
and the bytes arrive exact."""
from __future__ import annotations

import hashlib
import os
import threading
import time
import urllib.parse
import urllib.request

MIB = 1 << 20
# What the server's resident memory may grow by while 200 MiB pass through
# it: a read holds one window (2 MiB) and a few pieces, a commit a few pieces
# and the link's queue (8 MiB); the rest is slack for the allocator.
RSS_BOUND_KIB = 64 * 1024
BIG = 200 * MIB


def guest_sha256(sbx, path: str) -> str:
    return sbx.exec(f"sha256sum {path}", check=True).stdout.split()[0]


class PeakRss:
    """Samples the server's VmRSS every 50 ms in a thread; `.peak` is the
    highest seen."""

    def __init__(self, server) -> None:
        self.server, self.peak, self._stop = server, server.rss_kib(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.server.rss_kib())
            time.sleep(0.05)

    def __enter__(self) -> "PeakRss":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.server.rss_kib())


def test_a_slow_reader_of_a_large_file_holds_a_window_not_the_file(sbx, server):
    path = "/workspace/flow-read-200m"
    sbx.exec(f"head -c {BIG} /dev/urandom > {path}", check=True, timeout_ms=600_000)
    want = guest_sha256(sbx, path)
    query = urllib.parse.urlencode({"path": path})
    request = urllib.request.Request(
        f"{server.url}/v1/sandboxes/{sbx.id}/files/content?{query}",
        headers={"Authorization": f"Bearer {server.admin_key()}", "Accept": "application/octet-stream"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    before = server.rss_kib()
    digest, got = hashlib.sha256(), 0
    with opener.open(request, timeout=600) as answer, PeakRss(server) as rss:
        assert answer.status == 200
        assert int(answer.headers["x-content-length"]) == BIG
        # A deliberately slow reader: 64 KiB, then a pause, for 8 seconds.
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline:
            piece = answer.read(64 * 1024)
            assert piece, "the body ended early"
            digest.update(piece)
            got += len(piece)
            time.sleep(0.05)
        slow_peak, slow_got = rss.peak, got
        assert got < BIG // 4, f"the slow reader read {got} bytes: not slow enough to show anything"
        # Then the rest, as fast as it comes.
        while piece := answer.read(MIB):
            digest.update(piece)
            got += len(piece)
    grown = slow_peak - before
    print(f"[flow] read: slow phase read {slow_got} bytes; RSS grew {grown} KiB while slow, {rss.peak - before} KiB at most")
    assert grown < RSS_BOUND_KIB, f"the server grew by {grown} KiB while a reader lagged a 200 MiB file"
    assert rss.peak - before < RSS_BOUND_KIB, f"the server grew by {rss.peak - before} KiB"
    assert got == BIG
    assert digest.hexdigest() == want
    sbx.exec(f"rm -f {path}", check=True)


def test_a_large_upload_commits_streamed_with_the_bytes_exact(sbx, server):
    path = "/workspace/flow-upload-200m"
    data = os.urandom(BIG)
    want = hashlib.sha256(data).hexdigest()
    before = server.rss_kib()
    with PeakRss(server) as rss:
        # Larger than a chunk: the client's write takes the uploads route
        # (begin, chunks, commit).
        sbx.files.write(path, data)
    del data
    grown = rss.peak - before
    print(f"[flow] upload: RSS grew {grown} KiB at most")
    assert grown < RSS_BOUND_KIB, f"the server grew by {grown} KiB for a 200 MiB upload"
    assert guest_sha256(sbx, path) == want
    assert sbx.exec(f"stat -c %s {path}", check=True).stdout.strip() == str(BIG)
    sbx.exec(f"rm -f {path}", check=True)
