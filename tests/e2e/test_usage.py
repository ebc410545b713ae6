"""The account's usage through the official client against real VMs: this
month's outbound bytes grow when a sandbox sends something out through the
egress proxy (to a local server standing for example.net) and cost what
passed the allowance; the API answers a key made are counted per hour; the
export's CSV pages hold the settled minutes of a sandbox that ran."""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from withruntime import InvalidRequestError, NotFoundError

from conftest import Server, client_for

ALLOWANCE = 1000
# One microdollar a byte past the allowance.
PRICE_PER_GIB = 1 << 30
SENT = 200_000


@pytest.fixture(scope="module")
def priced():
    """A server of this module's own, with an outbound allowance and price."""
    root = Path(tempfile.mkdtemp(prefix="runtime-e2e-usage-"))
    os.chmod(root, 0o711)
    srv = Server(root, ("--outbound-allowance-bytes", str(ALLOWANCE),
                        "--price-outbound-gib", str(PRICE_PER_GIB)))
    srv.start()
    try:
        yield srv
    finally:
        srv.delete_all_sandboxes()
        srv.stop()
        srv.egress.close()
        srv.kill_leftover_qemu()
        shutil.rmtree(root, ignore_errors=True)


def utc(t: datetime) -> str:
    return t.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def export_all(rt, since: str, until: str, limit: int) -> list[dict]:
    pages, cursor = [], None
    while True:
        pages.append(rt.usage_export(since, until, cursor=cursor, limit=limit))
        cursor = pages[-1]["nextCursor"]
        if cursor is None:
            return pages
        assert len(pages) < 1000, "the cursor never ends"


def test_outbound_grows_with_what_a_sandbox_sends_and_the_export_holds_its_minutes(priced):
    started = datetime.now(timezone.utc) - timedelta(minutes=1)
    key = priced.create_key(name="e2e-outbound")
    other = priced.create_key(name="e2e-other")
    with client_for(priced, key) as rt, client_for(priced, other) as rt_other:
        before = rt.usage()
        out = before["outbound"]
        assert (out["bytes"], out["chargedMicros"], out["allowanceBytes"]) == ("0", "0", str(ALLOWANCE)), out
        assert before["rates"]["egress"]["outbound"]["microsPerGib"] == str(PRICE_PER_GIB)
        assert before["available"] is None and before["trial"] is None and before["credited"] == "0"
        sbx = rt.sandboxes.create(vcpu=1, memory_mib=1024, disk_mib=3072)
        try:
            r = sbx.exec(f"head -c {SENT} /dev/zero | curl -sSf --max-time 60 -X POST "
                         "--data-binary @- -o /dev/null -w '%{http_code}' http://example.net/echo/usage",
                         timeout_ms=120_000)
            assert (r.exit_code, r.stdout) == (0, "200"), (r.stdout, r.stderr)
            out = rt.usage()["outbound"]
            sent = int(out["bytes"])
            # The body and the request's head, nothing received counted.
            assert SENT < sent < SENT + 4096, out
            assert out["coveredBytes"] == str(ALLOWANCE)
            assert out["chargedMicros"] == str(sent - ALLOWANCE), out
            assert [k["keyId"] for k in out["keys"]] == [rt.me()["credentialId"]]
            # Another key sees none of it.
            assert rt_other.usage()["outbound"]["bytes"] == "0"
            # The account-wide admin key sees it too.
            with client_for(priced, priced.admin_key()) as admin:
                assert int(admin.usage()["outbound"]["bytes"]) >= sent

            # The minutes it ran settle into the export.
            since, until = utc(started), utc(datetime.now(timezone.utc) + timedelta(hours=1))
            deadline = time.monotonic() + 150
            while True:
                pages = export_all(rt, since, until, limit=1)
                rows = [row for p in pages for row in p["data"]]
                if any(row["resourceId"] == sbx.id for row in rows):
                    break
                assert time.monotonic() < deadline, pages
                time.sleep(5)
            csv = "".join(p["csv"] for p in pages)
            lines = csv.splitlines()
            assert lines[0].startswith("intervalId,resourceId,keyId,"), csv
            assert len(lines) == len(rows) + 1, csv
            assert all(row["resourceId"] == sbx.id and not row["final"] for row in rows), rows
            assert all(int(row["chargedMicros"]) >= 0 for row in rows)
            assert sum(int(row["chargedMicros"]) for row in rows) > 0, rows
            assert all(p["finalThrough"] < p["until"] for p in pages)
            # The other key's export has none of this key's rows.
            theirs = export_all(rt_other, since, until, limit=100)
            assert all(row["resourceId"] != sbx.id for p in theirs for row in p["data"])
        finally:
            rt.sandboxes.delete(sbx.id)
        # Deleted, its rows are final.
        rows = [row for p in export_all(rt, since, until, limit=100) for row in p["data"]]
        assert rows and all(row["final"] for row in rows), rows
        with pytest.raises(InvalidRequestError):
            rt.usage_export("yesterday", until)


def test_usage_requests_counts_the_calls_a_key_made(server):
    key = server.create_key(name="e2e-requests")
    with client_for(server, key) as rt:
        for _ in range(3):
            rt.me()
        with pytest.raises(NotFoundError):
            rt.sandboxes.get("sbx_does_not_exist")
        answer = rt.usage_requests("24h")
        assert answer["range"] == "24h"
        assert (answer["calls"], answer["clientErrors"], answer["serverErrors"]) == ("4", "1", "0"), answer
        assert answer["errorPercent"] == 25
        ops = {o["operation"]: o for o in answer["operations"]}
        assert ops["me.get"]["calls"] == "3" and ops["me.get"]["errorPercent"] == 0, ops
        assert ops["sandboxes.get"]["clientErrors"] == "1", ops
        # The call to usage_requests itself is counted by the next one.
        assert rt.usage_requests("7d")["calls"] == "5"
        with pytest.raises(InvalidRequestError):
            rt.usage_requests("2d")
    fresh = server.create_key(name="e2e-requests-none")
    with client_for(server, fresh) as rt:
        answer = rt.usage_requests()
        assert (answer["calls"], answer["errorPercent"], answer["operations"]) == ("0", None, []), answer
