"""File watches through the official client: the native `sbx.files.watch`
(polled and followed), E2B's `watch_dir`, Modal's `filesystem.watch` and
Blaxel's `fs.watch`, bad input, a flood, and the end a pause brings. One
sandbox is shared by the module; the pause comes last."""
from __future__ import annotations

import threading
import time

import pytest
from withruntime import NotFoundError
from withruntime import RuntimeError as ClientError

from conftest import assert_error_body, http


def _until(watch, want, seconds: float = 60) -> list[dict]:
    """Events from `watch` until one satisfies `want`."""
    seen: list[dict] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        seen += watch.get_new_events(wait_ms=2000)
        if any(want(e) for e in seen):
            return seen
    raise AssertionError(f"not seen in {seconds} s: {seen}")


def _has(events, kind: str, path: str) -> bool:
    return any(e["type"] == kind and e["path"] == path for e in events)


@pytest.fixture(scope="module", autouse=True)
def _root(sbx):
    sbx.exec("mkdir -p /workspace/w /workspace/e2bw /workspace/modalw /workspace/blw")


def test_a_watch_sees_writes_subdirectories_removals_and_renames(sbx):
    watch = sbx.files.watch("/workspace/w", recursive=True)
    try:
        assert watch.id and watch.path == "/workspace/w" and watch.cursor == 0
        assert [w["id"] for w in sbx.files.watches.list()] == [watch.id]
        sbx.exec("echo hi > /workspace/w/a.txt")
        seen = _until(watch, lambda e: e["path"] == "/workspace/w/a.txt" and e["type"] == "write")
        assert _has(seen, "create", "/workspace/w/a.txt"), seen
        # A subdirectory made now, and a file in it.
        sbx.exec("mkdir /workspace/w/sub && echo x > /workspace/w/sub/b.txt")
        seen = _until(watch, lambda e: e["path"] == "/workspace/w/sub/b.txt")
        assert _has(seen, "create", "/workspace/w/sub"), seen
        assert any(e["isDir"] for e in seen if e["path"] == "/workspace/w/sub"), seen
        sbx.exec("echo y > /workspace/w/sub/c.txt")
        _until(watch, lambda e: e["path"] == "/workspace/w/sub/c.txt" and e["type"] == "create")
        sbx.exec("mv /workspace/w/a.txt /workspace/w/d.txt && rm /workspace/w/sub/b.txt")
        seen = _until(watch, lambda e: e["type"] == "remove")
        renames = [e for e in seen if e["type"] == "rename"]
        assert renames and renames[0]["path"] == "/workspace/w/d.txt", seen
        assert renames[0]["oldPath"] == "/workspace/w/a.txt", seen
        assert _has(seen, "remove", "/workspace/w/sub/b.txt"), seen
        # The client's own whole-file write shows as a create (E2B code waits for it).
        sbx.files.write("/workspace/w/e.txt", b"e")
        seen = _until(watch, lambda e: e["path"] == "/workspace/w/e.txt")
        assert _has(seen, "create", "/workspace/w/e.txt"), seen
        assert not any("agent-tmp" in e["path"] for e in seen), seen
        assert watch.notices == []
    finally:
        assert watch.stop() is True
    assert watch.id not in [w["id"] for w in sbx.files.watches.list()]


def test_get_new_events_waits_for_the_next_change(sbx):
    watch = sbx.files.watch("/workspace/w")
    try:
        assert watch.get_new_events() == []
        threading.Timer(1.0, lambda: sbx.exec("touch /workspace/w/late.txt")).start()
        started = time.monotonic()
        events = watch.get_new_events(wait_ms=8000)
        while not events and time.monotonic() - started < 30:
            events = watch.get_new_events(wait_ms=8000)
        assert _has(events, "create", "/workspace/w/late.txt"), events
    finally:
        watch.stop()


def test_exclude_and_events_filter(sbx):
    sbx.exec("mkdir -p /workspace/w/node_modules/pkg")
    watch = sbx.files.watch("/workspace/w", recursive=True, exclude=["node_modules"], events=["create"])
    try:
        sbx.exec("echo 1 > /workspace/w/node_modules/pkg/i.js && echo 2 > /workspace/w/kept.js")
        seen = _until(watch, lambda e: e["path"] == "/workspace/w/kept.js")
        assert not any("node_modules" in e["path"] for e in seen), seen
        assert all(e["type"] == "create" for e in seen), seen
    finally:
        watch.stop()


def test_bad_input_answers_in_the_error_shape(server, sbx):
    with pytest.raises(NotFoundError) as caught:
        sbx.files.watch("/workspace/no-such-dir")
    assert caught.value.status == 404 and "/workspace/no-such-dir" in str(caught.value)
    with pytest.raises(ClientError) as caught:
        sbx.files.watch("/workspace/w", batch_ms=-5)
    assert caught.value.status == 400 and "batchMs" in str(caught.value)
    answer = http(server, "POST", f"/v1/sandboxes/{sbx.id}/files/watches",
                  {"path": "/workspace/w", "timeoutMs": -1, "events": ["explode"], "webhook": "yes"})
    error = assert_error_body(answer, 400, "invalid_request")
    fields = sorted(i["field"] for i in error["details"]["issues"])
    assert fields == ["events[0]", "timeoutMs", "webhook"], error
    with pytest.raises(NotFoundError):
        sbx.files.watches.stop("no-such-watch")
    answer = http(server, "GET", f"/v1/sandboxes/{sbx.id}/files/watches/no-such-watch/events?cursor=0")
    assert_error_body(answer, 404, "not_found")
    # Root's files are not the sandbox user's to watch.
    with pytest.raises(ClientError) as caught:
        sbx.files.watch("/root")
    assert caught.value.status == 403, caught.value


def test_e2b_watch_dir_polls_as_e2b_users_write_it(sbx):
    from withruntime.e2b import FilesystemEventType, Sandbox

    e2b = Sandbox.connect(sbx.id)
    handle = e2b.files.watch_dir("/workspace/e2bw", recursive=True)
    try:
        e2b.files.write("/workspace/e2bw/note.txt", "hello")
        events = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(e.name == "note.txt" for e in events):
            events += handle.get_new_events()
            time.sleep(0.5)
        kinds = {e.type for e in events if e.name == "note.txt"}
        assert FilesystemEventType.CREATE in kinds and FilesystemEventType.WRITE in kinds, events
    finally:
        handle.stop()


def test_modal_filesystem_watch_yields_until_its_timeout(sbx):
    import withruntime.modal as modal
    from withruntime.modal.types import FileWatchEventType

    box = modal.Sandbox.from_id(sbx.id)
    threading.Timer(3.0, lambda: sbx.exec("echo m > /workspace/modalw/m.txt")).start()
    events = list(box.filesystem.watch("/workspace/modalw", timeout=12))
    assert any(e.type == FileWatchEventType.Create and "/workspace/modalw/m.txt" in e.paths for e in events), events


def test_blaxel_fs_watch_calls_back(runtime, sbx):
    from withruntime.blaxel import SyncSandboxInstance as SandboxInstance
    from withruntime.blaxel import use_client

    use_client(runtime)
    try:
        box = SandboxInstance.get(sbx.id)
        seen = []
        handle = box.fs.watch("/workspace/blw", seen.append)
        try:
            time.sleep(3)
            sbx.exec("echo b > /workspace/blw/b.txt")
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not any(c.name == "b.txt" for c in seen):
                time.sleep(0.5)
            assert any(c.op == "CREATE" and c.name == "b.txt" and c.path == "/workspace/blw" for c in seen), seen
        finally:
            handle.close()
    finally:
        use_client(None)
    # Blaxel's close() ends its polling thread, not the watch, which runs
    # on to its timeout: stopped here so the next tests have room.
    left = sbx.files.watches.list()
    assert [w["path"] for w in left] == ["/workspace/blw"], left
    for w in left:
        sbx.files.watches.stop(w["id"])


def test_at_most_four_watches_run_at_once(sbx):
    watches = [sbx.files.watch("/workspace/w") for _ in range(4)]
    try:
        with pytest.raises(ClientError) as caught:
            sbx.files.watch("/workspace/w")
        assert (caught.value.status, caught.value.code) == (409, "quota_exceeded"), caught.value
    finally:
        for w in watches:
            w.stop()
    assert sbx.files.watches.list() == []


def test_a_flood_is_bounded_and_says_what_it_lost(server, sbx):
    sbx.exec("mkdir -p /workspace/flood")
    watch = sbx.files.watch("/workspace/flood")
    try:
        before = server.rss_kib()
        # 6,000 files with long names: ~1.7 MB of events, more than the 1 MiB
        # the server keeps (an emulated guest makes files slowly).
        sbx.exec("python3 -c \"[open('/workspace/flood/f%05d' % i + 'x' * 180, 'w').close() for i in range(6000)]\"",
                 timeout_ms=300_000)
        time.sleep(2)
        events = []
        while True:
            batch = watch.get_new_events()
            if not batch:
                break
            events += batch
        # Some were lost (the guest's rate, or the server's 1 MiB), and it says so.
        assert watch.notices and {n["k"] for n in watch.notices} <= {"overflow", "lost"}, watch.notices
        assert 0 < len(events) < 6000, len(events)
        assert events[-1]["path"].startswith("/workspace/flood/f"), events[-1]
        assert server.rss_kib() - before < 64 * 1024
    finally:
        watch.stop()
        sbx.exec("rm -rf /workspace/flood", timeout_ms=300_000)


def test_a_followed_watch_ends_with_paused_when_the_sandbox_pauses(sbx):
    watch = sbx.files.watch("/workspace/w", recursive=True)
    got: list[dict] = []

    def follow():
        for event in watch.events():
            got.append(event)

    reader = threading.Thread(target=follow, daemon=True)
    reader.start()
    sbx.exec("echo f > /workspace/w/followed.txt")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not any(e["path"] == "/workspace/w/followed.txt" for e in got):
        time.sleep(0.2)
    assert any(e["path"] == "/workspace/w/followed.txt" for e in got), got
    sbx.pause()
    reader.join(timeout=120)
    assert not reader.is_alive()
    assert watch.exit_reason == "paused"
    # Reading does not wake it; the ended watch says why, and is not listed.
    read = watch.get_new_events()
    assert read == [] and watch.exit_reason == "paused"
    assert sbx.refresh().state == "paused"
    assert sbx.files.watches.list() == []
