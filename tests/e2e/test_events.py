"""Events and webhooks through the official client: a sandbox's lifecycle in
`runtime.events.list`, signed deliveries to a loopback receiver (which the
fixture's `--webhook-allow-host 127.0.0.1` lets webhooks reach) that
`verify_webhook` accepts, rotation, `:test`, a retry after a 500, the URL
policy and tenant isolation. The fixture also passes
`--webhook-test-second-ms`, so a minute of the retry schedule is about a
second."""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from withruntime import InvalidRequestError, NotFoundError, WebhookVerificationError, verify_webhook

from conftest import client_for


class Receiver:
    """An HTTP server on 127.0.0.1 in a thread: answers each POST with the
    next of `answers[path]` (then 204) and keeps (headers, body) of each,
    the path in a `path` header."""

    def __init__(self) -> None:
        self.got: list[tuple[dict[str, str], bytes]] = []
        self.answers: dict[str, list[int]] = {}
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                with outer.lock:
                    headers = {k.lower(): v for k, v in self.headers.items()}
                    headers["path"] = self.path
                    outer.got.append((headers, body))
                    queue = outer.answers.get(self.path, [])
                    status = queue.pop(0) if queue else 204
                self.send_response(status)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.url = f"{self.base}/hooks/runtime"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def of_type(self, event_type: str, path: str = "/hooks/runtime") -> list[tuple[dict[str, str], bytes]]:
        with self.lock:
            return [(h, b) for h, b in self.got if h.get("runtime-event-type") == event_type and h["path"] == path]

    def wait_for(self, event_type: str, count: int = 1, timeout: float = 30,
                 path: str = "/hooks/runtime") -> list[tuple[dict[str, str], bytes]]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = self.of_type(event_type, path)
            if len(got) >= count:
                return got
            time.sleep(0.1)
        with self.lock:
            seen = [h.get("runtime-event-type") for h, _ in self.got]
        raise AssertionError(f"{count} {event_type} deliveries did not arrive; got {seen}")

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def receiver():
    r = Receiver()
    yield r
    r.close()


@pytest.fixture(scope="module")
def hook(runtime, receiver):
    created = runtime.webhooks.create(url=receiver.url, description="e2e")
    yield created
    try:
        runtime.webhooks.delete(created["id"])
    except NotFoundError:
        pass


@pytest.fixture(scope="module")
def life(runtime, hook):
    """One sandbox made, paused, woken and deleted while the webhook listens."""
    sbx = runtime.sandboxes.create()
    sbx.pause()
    sbx.wake()
    sbx.delete()
    return sbx.id


def test_the_lifecycle_is_listed_newest_first(runtime, life):
    page = runtime.events.list(resource_id=life)
    types = [e["type"] for e in page["data"]]
    assert types == ["sandbox.deleted", "sandbox.stopped", "sandbox.woken", "sandbox.paused",
                     "sandbox.running", "sandbox.created"], types
    assert all(e["data"]["sandbox"]["id"] == life for e in page["data"])
    assert page["data"][3]["data"]["sandbox"]["stopReason"] == "requested"
    stamps = [e["createdAt"] for e in page["data"]]
    assert stamps == sorted(stamps, reverse=True)
    # Two at a time, following the cursor, gives the same list.
    seen, cursor = [], None
    while True:
        part = runtime.events.list(resource_id=life, limit=2, cursor=cursor)
        seen += [e["id"] for e in part["data"]]
        cursor = part["nextCursor"]
        if cursor is None:
            break
    assert seen == [e["id"] for e in page["data"]]
    paused = runtime.events.list(resource_id=life, type="sandbox.paused")["data"]
    assert [e["type"] for e in paused] == ["sandbox.paused"]


def test_deliveries_are_signed_with_the_secret(runtime, hook, receiver, life):
    assert hook["secret"].startswith("whsec_")
    assert "secret" not in runtime.webhooks.get(hook["id"])
    assert hook["id"] in [w["id"] for w in runtime.webhooks.list()["data"]]
    for event_type in ("sandbox.created", "sandbox.paused", "sandbox.woken", "sandbox.deleted"):
        deliveries = [(h, b) for h, b in receiver.wait_for(event_type)
                      if life in b.decode()]
        assert deliveries, event_type
        headers, body = deliveries[0]
        event = verify_webhook(body, headers["runtime-signature"], hook["secret"])
        assert event["type"] == event_type and event["data"]["sandbox"]["id"] == life
        assert headers["runtime-webhook-id"] == event["id"]
        with pytest.raises(WebhookVerificationError):
            verify_webhook(body, headers["runtime-signature"], "whsec_not-the-secret")
    log = runtime.webhooks.deliveries(hook["id"], state="succeeded")
    assert log["data"] and all(d["state"] == "succeeded" for d in log["data"])


def test_test_send_reports_the_answer_and_rotation_signs_twice(runtime, hook, receiver):
    answer = runtime.webhooks.test(hook["id"])
    assert answer["ok"] is True and answer["status"] == 204, answer
    rotated = runtime.webhooks.rotate_secret(hook["id"])
    new = rotated["secret"]
    assert new != hook["secret"] and rotated["previousSecretExpiresAt"]
    runtime.webhooks.test(hook["id"])
    headers, body = receiver.wait_for("webhook.test", 2)[-1]
    signature = headers["runtime-signature"]
    assert signature.count("v1=") == 2, signature
    verify_webhook(body, signature, hook["secret"])
    verify_webhook(body, signature, new)
    verify_webhook(body, signature, [new, "whsec_other"])
    # The receiver answering 418 is what :test reports.
    with receiver.lock:
        receiver.answers["/hooks/runtime"] = [418]
    answer = runtime.webhooks.test(hook["id"])
    assert answer["ok"] is False and answer["status"] == 418, answer


def test_a_500_is_retried(runtime, receiver):
    flaky = runtime.webhooks.create(url=receiver.base + "/flaky", events=["volume.ready"])
    try:
        with receiver.lock:
            receiver.answers["/flaky"] = [500]
        volume = runtime.volumes.create(64)
        try:
            got = [(h, b) for h, b in receiver.wait_for("volume.ready", 2, path="/flaky") if volume["id"] in b.decode()]
            assert [h["runtime-delivery-attempt"] for h, _ in got[:2]] == ["1", "2"], got
            assert got[0][1] == got[1][1]
            log = runtime.webhooks.deliveries(flaky["id"])["data"]
            deadline = time.monotonic() + 10
            while log[0]["state"] != "succeeded" and time.monotonic() < deadline:
                time.sleep(0.1)
                log = runtime.webhooks.deliveries(flaky["id"])["data"]
            assert log[0]["state"] == "succeeded", log
            assert [a["status"] for a in log[0]["attempts"]] == [500, 204], log
        finally:
            runtime.volumes.delete(volume["id"])
    finally:
        runtime.webhooks.delete(flaky["id"])


@pytest.mark.parametrize("url", ["https://10.0.0.1/hooks", "https://169.254.169.254/latest",
                                 "http://example.com/hooks", "https://localhost/hooks"])
def test_a_refused_url_is_a_400_naming_url(runtime, url):
    with pytest.raises(InvalidRequestError) as refused:
        runtime.webhooks.create(url=url)
    assert [i["field"] for i in refused.value.details["issues"]] == ["url"]


def test_unknown_event_types_are_named(runtime):
    with pytest.raises(InvalidRequestError) as refused:
        runtime.webhooks.create(url="https://example.com/h", events=["sandbox.stopped", "sandbox.exploded"])
    assert [i["field"] for i in refused.value.details["issues"]] == ["events[1]"]


def test_another_key_sees_neither_events_nor_webhooks(server, hook, life):
    other = client_for(server, server.create_key(name="e2e-events-other"))
    try:
        assert other.events.list(resource_id=life)["data"] == []
        assert other.webhooks.list()["data"] == []
        with pytest.raises(NotFoundError):
            other.webhooks.get(hook["id"])
        with pytest.raises(NotFoundError):
            other.webhooks.update(hook["id"], enabled=False)
        with pytest.raises(NotFoundError):
            other.webhooks.deliveries(hook["id"])
    finally:
        other.close()


def test_a_watch_with_webhook_sends_what_changed(runtime, hook, receiver):
    sbx = runtime.sandboxes.create()
    try:
        sbx.exec("mkdir -p /workspace/app")
        handle = sbx.files.watch("/workspace/app", recursive=True, id="sync", webhook=True, timeout_ms=0)
        listed = {w["id"]: w for w in sbx.files.watches.list()}
        assert listed["sync"]["webhook"] is True, listed
        sbx.exec("echo one > /workspace/app/a.txt && mv /workspace/app/a.txt /workspace/app/b.txt")
        deadline = time.monotonic() + 60
        changes = []
        while time.monotonic() < deadline:
            bodies = [json.loads(b) for _, b in receiver.of_type("sandbox.files.changed")]
            mine = [b["data"] for b in bodies if b["data"]["sandbox"]["id"] == sbx.id]
            changes = [e for d in mine for e in d["events"]]
            if any(e["type"] == "rename" for e in changes):
                break
            time.sleep(0.2)
        assert mine and mine[0]["watch"] == {"id": "sync", "path": "/workspace/app"}, mine
        assert {"type": "create", "path": "/workspace/app/a.txt", "isDir": False} in [
            {k: e[k] for k in ("type", "path", "isDir")} for e in changes], changes
        renamed = [e for e in changes if e["type"] == "rename"]
        assert renamed and renamed[0]["path"] == "/workspace/app/b.txt", changes
        assert renamed[0]["oldPath"] == "/workspace/app/a.txt"
        assert all(d["more"] == 0 and d["overflow"] is False for d in mine), mine
        # Its end is the last event it sends.
        handle.stop()
        deadline = time.monotonic() + 30
        ended = []
        while not ended and time.monotonic() < deadline:
            ended = [json.loads(b)["data"]["ended"] for _, b in receiver.of_type("sandbox.files.changed")
                     if json.loads(b)["data"]["sandbox"]["id"] == sbx.id and json.loads(b)["data"]["ended"]]
            time.sleep(0.2)
        assert ended == ["stopped"], ended
        # Logged as an event of the sandbox too.
        logged = runtime.events.list(resource_id=sbx.id, type="sandbox.files.changed")
        assert logged["data"] and all(e["type"] == "sandbox.files.changed" for e in logged["data"]), logged
    finally:
        sbx.delete()
