"""Amazon ECR through the official client (docs/images.md, "ECR"): an
access key stored with `runtime.images.registries.set(..., access_key_id=,
secret_access_key=)` is exchanged for a registry password (kept while it lasts) with
`ecr:GetAuthorizationToken`, signed with AWS Signature Version 4.

The stand-ins: `123456789012.dkr.ecr.us-east-1.amazonaws.com` is a real
registry (Debian's docker-registry, registry.py) whose only login is `AWS`
and a password; `api.ecr.us-east-1.amazonaws.com` is an HTTPS server here
that checks the request's signature (computed again in Python, independently
of the server's Rust) and answers that password as ECR does, base64 of
`AWS:<password>`."""
from __future__ import annotations

import base64
import calendar
import hashlib
import hmac
import json
import os
import shutil
import ssl
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from conftest import Server
from egress_servers import make_leaf
from registry import Registry, publish

REGION = "us-east-1"
ECR = f"123456789012.dkr.ecr.{REGION}.amazonaws.com"
API = f"api.ecr.{REGION}.amazonaws.com"
KEY_ID = "AKIAIOSFODNN7EXAMPLE"
SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
TARGET = "AmazonEC2ContainerRegistry_V20150921.GetAuthorizationToken"


def _hmac(key: bytes, data: str) -> bytes:
    return hmac.new(key, data.encode(), hashlib.sha256).digest()


def expected_authorization(headers: dict[str, str], body: bytes, secret: str) -> str:
    """SigV4 of a POST / with the headers the request signed."""
    signed = sorted(["content-type", "host", "x-amz-date", "x-amz-target"])
    canonical = "\n".join([
        "POST", "/", "",
        *[f"{h}:{headers[h].strip()}" for h in signed], "",
        ";".join(signed), hashlib.sha256(body).hexdigest()])
    date = headers["x-amz-date"]
    scope = f"{date[:8]}/{REGION}/ecr/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", date, scope, hashlib.sha256(canonical.encode()).hexdigest()])
    k = _hmac(f"AWS4{secret}".encode(), date[:8])
    for part in (REGION, "ecr", "aws4_request"):
        k = _hmac(k, part)
    signature = hmac.new(k, to_sign.encode(), hashlib.sha256).hexdigest()
    return f"AWS4-HMAC-SHA256 Credential={KEY_ID}/{scope}, SignedHeaders={';'.join(signed)}, Signature={signature}"


class FakeEcr:
    """`GetAuthorizationToken` over HTTPS: 200 with the registry password
    when the signature and the call are right, else ECR's 400 errors."""

    def __init__(self, cert: Path, key: Path, password: str) -> None:
        self.calls: list[str] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_args) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                h = {k.lower(): v for k, v in self.headers.items()}
                problem = None
                if h.get("x-amz-target") != TARGET or h.get("content-type") != "application/x-amz-json-1.1":
                    problem = ("UnknownOperationException", "unknown operation")
                elif abs(time.time() - calendar.timegm(time.strptime(h.get("x-amz-date", ""),
                                                                      "%Y%m%dT%H%M%SZ"))) > 300:
                    problem = ("InvalidSignatureException", "Signature expired")
                elif h.get("authorization") != expected_authorization(h, body, SECRET):
                    problem = ("InvalidSignatureException", "The request signature we calculated does not match")
                outer.calls.append(problem[0] if problem else "ok")
                if problem:
                    answer, status = {"__type": problem[0], "message": problem[1]}, 400
                else:
                    token = base64.b64encode(f"AWS:{password}".encode()).decode()
                    answer, status = {"authorizationData": [{
                        "authorizationToken": token, "expiresAt": time.time() + 43200,
                        "proxyEndpoint": f"https://{ECR}"}]}, 200
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("content-type", "application/x-amz-json-1.1")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(str(cert), str(key))
        self.httpd.socket = ctx.wrap_socket(self.httpd.socket, server_side=True)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.mark.timeout(900)
def test_an_ecr_access_key_is_exchanged_for_a_token_kept_between_pulls():
    from withruntime import Runtime
    root = Path(tempfile.mkdtemp(prefix="runtime-e2e-ecr-"))
    os.chmod(root, 0o711)
    srv = Server(root)
    password = "ecr-password-" + os.urandom(8).hex()
    cert, key = make_leaf(root, srv.egress.ca_pem, srv.egress.ca_key, "ecr", [ECR, API], ips=("127.0.0.1",))
    reg = Registry(root / "ecr", ECR, cert, key, srv.egress.ca_pem, auth=("AWS", password))
    api = FakeEcr(cert, key, password)
    try:
        publish(reg, "team/app", "1")
        srv.extra_args += ["--egress-test-map", f"{ECR}=127.0.0.1:{reg.port}",
                           "--egress-test-map", f"{API}=127.0.0.1:{api.port}"]
        srv.start()
        ref = f"{ECR}/team/app:1"
        with Runtime(api_key=srv.admin_key(), base_url=srv.url) as rt:
            # A wrong secret: ECR refuses the signature, the build says so.
            rt.images.registries.set(ECR, access_key_id=KEY_ID, secret_access_key="not-the-secret")
            image = rt.images.create(image=ref)
            while image["state"] in ("queued", "building"):
                time.sleep(0.5)
                image = rt.images.get(image["id"])
            assert image["state"] == "failed", image
            assert "GetAuthorizationToken answered 400" in image["error"], image["error"]
            assert api.calls == ["InvalidSignatureException"], api.calls

            rt.images.registries.set(ECR, access_key_id=KEY_ID, secret_access_key=SECRET)
            image = rt.images.build(name="from-ecr", image=ref, poll_seconds=0.5)
            assert image["state"] == "ready", image["error"]
            assert api.calls[-1] == "ok", api.calls
            assert f"signed in with access key {KEY_ID}" in image["log"], image["log"]
            assert SECRET not in image["log"] and password not in image["log"]
            with rt.sandboxes.create(image="from-ecr") as sbx:
                assert sbx.exec("/srv/app/hello.sh").stdout == "hello from the image\n"
            # Another pull of the registry within the token's 12 hours asks
            # ECR nothing: the token is kept (the registry still checks it).
            asked = len(api.calls)
            again = rt.images.build(name="from-ecr-again", image=ref, poll_seconds=0.5)
            assert again["state"] == "ready", again["error"]
            assert len(api.calls) == asked, api.calls
            assert "ECR token kept from an earlier pull" in again["log"], again["log"]
        log = srv.log_path.read_bytes()
        assert SECRET.encode() not in log and password.encode() not in log
    finally:
        srv.shut_down()
        api.close()
        reg.close()
        shutil.rmtree(root, ignore_errors=True)
