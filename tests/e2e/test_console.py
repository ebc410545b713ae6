"""The web console (`/console`, docs/console.md) in Debian's headless
Chromium, driven by Playwright: sign in with a key (and by an admin's
approval), the sandbox list and one sandbox's page with its processes and a
terminal, keys made in the page and shown once, a read-only key refused, and
usage by day. Screenshots are kept in RUNTIME_E2E_ARTIFACTS (or the test's
temporary directory) and their paths printed."""
from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from conftest import http

playwright_api = pytest.importorskip("playwright.sync_api")

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or "/usr/bin/chromium"
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
KEY_SHAPE = re.compile(r"rtcloud_[0-9a-f-]{36}_[A-Za-z0-9_-]{43}")
TIMEOUT_MS = 120_000


@pytest.fixture(scope="module")
def artifacts():
    root = os.environ.get("RUNTIME_E2E_ARTIFACTS")
    path = Path(root) if root else Path(tempfile.mkdtemp(prefix="runtime-console-"))
    path.mkdir(parents=True, exist_ok=True)
    print(f"\n[console] screenshots in {path}")
    return path


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    if not Path(CHROMIUM).exists():
        pytest.fail("chromium is not installed (scripts/host-packages.sh installs Debian's package)")
    profile = tmp_path_factory.mktemp("chromium-profile")
    with playwright_api.sync_playwright() as p:
        # A persistent context gives Chromium a fresh --user-data-dir of ours.
        context = p.chromium.launch_persistent_context(
            str(profile), executable_path=CHROMIUM, headless=True, args=FLAGS,
            viewport={"width": 1280, "height": 900})
        try:
            yield context
        finally:
            context.close()


@pytest.fixture
def page(browser, server):
    pg = browser.new_page()
    pg.set_default_timeout(TIMEOUT_MS)
    seen: list[str] = []
    pg.on("request", lambda r: seen.append(r.url))
    errors: list[str] = []
    pg.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    pg.seen_urls = seen  # type: ignore[attr-defined]
    pg.console_errors = errors  # type: ignore[attr-defined]
    try:
        yield pg
    finally:
        # The key never travels in a URL.
        for key in [server.admin_key(), *server.keys]:
            assert not any(key in u for u in seen), "a key appeared in a URL"
        # Policy violations would show up as console errors.
        assert not [e for e in errors if "Content Security Policy" in e], errors
        pg.evaluate("sessionStorage.clear()")
        pg.close()


def shot(page, artifacts: Path, name: str) -> None:
    path = artifacts / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    print(f"[console] screenshot {path}")


def sign_in(page, server, key: str) -> None:
    page.goto(server.url + "/console")
    page.fill("#key", key)
    page.click("#signin-button")
    page.wait_for_selector("#sandboxes")


def wait_js(page, expression: str, timeout: float = TIMEOUT_MS / 1000):
    """Polls `expression` in the page until it is truthy. (Playwright's
    wait_for_function evaluates a string in the page, which the console's
    CSP refuses, as it should.)"""
    deadline = time.monotonic() + timeout
    while True:
        value = page.evaluate(f"() => ({expression})")
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {expression}"
        time.sleep(0.2)


def storage(page) -> tuple[dict, dict]:
    return tuple(page.evaluate("""() => {
        const dump = (s) => Object.fromEntries(Array.from({length: s.length}, (_, i) => [s.key(i), s.getItem(s.key(i))]));
        return [dump(localStorage), dump(sessionStorage)];
    }"""))


def test_a_wrong_key_is_refused_with_the_apis_message(page, server, artifacts):
    page.goto(server.url + "/console")
    page.fill("#key", "rtcloud_not-a-key")
    page.click("#signin-button")
    error = page.wait_for_selector(".error")
    assert "Missing or invalid API key" in error.inner_text()
    assert page.input_value("#key") == "", "the typed key is not kept in the field"
    assert storage(page) == ({}, {})


def test_the_list_shows_a_sandbox_with_its_state_shape_and_cost(page, server, sbx, artifacts):
    sign_in(page, server, server.admin_key())
    row = page.wait_for_selector(f'#sandbox-rows tr[data-id="{sbx.id}"][data-state="running"]')
    text = row.inner_text()
    assert "running" in text
    assert "vCPU" in text and ("GiB" in text or "MiB" in text)
    assert "$" in text
    assert page.inner_text("#who").startswith("admin")
    # The key is in this tab's sessionStorage, and nowhere else.
    local, sess = storage(page)
    assert local == {} and list(sess.values()) == [server.admin_key()]
    assert server.admin_key() not in page.content()
    shot(page, artifacts, "sandboxes")


def test_a_sandbox_page_shows_its_processes_and_runs_a_terminal(page, server, sbx, artifacts):
    proc = sbx.spawn("sleep 600")
    sign_in(page, server, server.admin_key())
    page.click(f'#sandbox-rows tr[data-id="{sbx.id}"] a')
    page.wait_for_selector("#sandbox-title")
    page.wait_for_selector(f'#processes tr[data-id="{proc.id}"]')
    assert "sleep 600" in page.inner_text("#processes")
    page.wait_for_selector("#network dl")
    wait_js(page, "document.querySelector('#console-log').textContent !== 'Loading…'")
    print(f"[console] console log tail: {page.inner_text('#console-log')[-300:]!r}")

    page.click("#terminal-open")
    wait_js(page, "document.querySelector('#terminal-status').textContent === 'Connected.'")
    wait_js(page, "document.querySelector('#terminal').textContent.length > 0")
    page.click("#terminal")
    page.keyboard.type("echo h''i")
    page.keyboard.press("Enter")
    # The command line echoes `echo h''i`; only the output is `hi` alone.
    wait_js(page, "document.querySelector('#terminal').textContent.split('\\n').some(l => l.trim() === 'hi')")
    shot(page, artifacts, "sandbox")
    # The session that let the socket in is revoked once it is open.
    sessions = http(server, "GET", f"/v1/sandboxes/{sbx.id}/sessions").json()["data"]
    mine = [s for s in sessions if s["name"] == "console terminal"]
    assert mine and all(s["state"] == "revoked" for s in mine), sessions
    page.click("#terminal-close")
    proc.kill()


def test_a_key_made_in_the_page_is_shown_once_then_forgotten(page, server, artifacts):
    sign_in(page, server, server.admin_key())
    page.click('nav a[data-view="keys"]')
    page.wait_for_selector("#keys tbody tr")
    # The API refuses an account-wide key revoking itself; the page does not offer it.
    admin_id = server.admin_key()[len("rtcloud_"):][:36]
    page.wait_for_selector(f'#keys tr[data-id="{admin_id}"]')
    assert page.query_selector(f'#keys tr[data-id="{admin_id}"] button.revoke') is None
    page.fill("#new-key-name", "made-in-console")
    page.check("#new-key-read-only")
    page.fill("#new-key-limit", "2.50")
    page.click("#create-key")
    secret = page.wait_for_selector("#new-key-secret").inner_text().strip()
    assert KEY_SHAPE.fullmatch(secret), secret
    shot(page, artifacts, "key-created")
    server.keys.append(secret)  # the suite's clean-up and URL check know it
    me = http(server, "GET", "/v1/me", key=secret).json()
    assert me["credentialName"] == "made-in-console" and me["access"] == "read"
    row = page.wait_for_selector('#keys tr[data-name="made-in-console"]')
    assert "read-only" in row.inner_text()
    assert row.query_selector("input.limit").input_value() == "2.5"

    page.click("#key-done")
    assert page.query_selector("#new-key-secret") is None
    assert secret not in page.content()
    assert secret not in page.evaluate("document.documentElement.outerHTML")
    local, sess = storage(page)
    assert local == {} and list(sess.values()) == [server.admin_key()]
    assert not any(secret in u for u in page.seen_urls)

    # The limit is changed, then the key revoked, from its row.
    row.query_selector("input.limit").fill("")
    row.query_selector("button.set-limit").click()
    wait_js(page, "document.querySelector('#keys tr[data-name=\"made-in-console\"] input.limit') "
                  "&& document.querySelector('#keys tr[data-name=\"made-in-console\"] input.limit').value === ''")
    keys = {k["name"]: k for k in http(server, "GET", "/v1/keys").json()["data"]}
    assert keys["made-in-console"]["dailyLimitMicros"] is None
    page.click('#keys tr[data-name="made-in-console"] button.revoke')
    page.click('#keys tr[data-name="made-in-console"] button.revoke')
    page.wait_for_selector('#keys tr[data-name="made-in-console"] .badge.revoked')
    assert http(server, "GET", "/v1/me", key=secret).status == 401


def test_a_read_only_key_sees_but_cannot_delete(page, server, sbx, artifacts):
    ro = server.create_key(read_only=True, name="console-watcher")
    sign_in(page, server, ro)
    page.wait_for_selector(f'#sandbox-rows tr[data-id="{sbx.id}"]')
    page.goto(server.url + f"/console#/sandbox/{sbx.id}")
    page.wait_for_selector("#sandbox-title")
    page.click('button[data-action="delete"]')
    page.click('button[data-action="delete"]')
    error = page.wait_for_selector("#action-error .error")
    assert "read-only" in error.inner_text() and "forbidden" in error.inner_text()
    # The page shows the API's refusals inside the sandbox too.
    page.wait_for_selector("#processes .error")
    page.click("#terminal-open")
    assert "read-only" in page.wait_for_selector("#terminal-error .error").inner_text()
    shot(page, artifacts, "read-only")
    assert http(server, "GET", f"/v1/sandboxes/{sbx.id}").status == 200
    # Making a key is refused with the API's message.
    page.click('nav a[data-view="keys"]')
    page.click("#create-key")
    assert "read-only" in page.wait_for_selector("#key-error .error").inner_text()


def test_usage_shows_rows_by_day_key_and_sandbox(page, server, sbx, artifacts):
    # Charges settle each second; a running sandbox has some by now.
    deadline = time.monotonic() + 60
    while not http(server, "GET", "/v1/usage/daily?days=2").json()["days"]:
        assert time.monotonic() < deadline, "no spending recorded"
        time.sleep(1)
    sign_in(page, server, server.admin_key())
    page.click('nav a[data-view="usage"]')
    page.wait_for_selector("#usage-days tbody tr")
    assert page.query_selector_all("#usage-keys tbody tr")
    assert page.query_selector(f'#usage-sandboxes a[href="#/sandbox/{sbx.id}"]')
    assert page.inner_text("#spent").startswith("$")
    shot(page, artifacts, "usage")


def test_signing_in_by_an_admins_approval(browser, page, server, artifacts):
    page.goto(server.url + "/console")
    page.click("#ask-approval")
    code = page.wait_for_selector("#approval-code").inner_text().strip()
    link = page.get_attribute("#approval-link", "href")
    assert link.startswith(server.url + "/login/")
    approver = browser.new_page()
    try:
        approver.goto(link)
        assert approver.inner_text("#code").strip() == code
        approver.fill("#adminKey", server.admin_key())
        approver.fill("#name", "console-approved")
        approver.click("#approve")
        approver.wait_for_selector("#result")
    finally:
        approver.close()
    page.wait_for_selector("#sandboxes")
    assert "console-approved" in page.inner_text("#who")
    local, sess = storage(page)
    assert local == {} and len(sess) == 1
    key = list(sess.values())[0]
    server.keys.append(key)
    assert KEY_SHAPE.fullmatch(key) and key not in page.content()
