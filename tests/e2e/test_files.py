"""Files: write and read (text, bytes, large), list, stat, mkdir, remove,
rename and their errors, on one sandbox shared by the module."""
from __future__ import annotations

import hashlib
import os

import pytest
from withruntime import ConflictError, InvalidRequestError, NotFoundError, RuntimeAPIError


def test_write_and_read_text(sbx):
    sbx.files.write("/workspace/t.txt", "héllo\nworld\n")
    assert sbx.files.read("/workspace/t.txt") == "héllo\nworld\n".encode()
    assert sbx.files.read_text("/workspace/t.txt") == "héllo\nworld\n"
    # The guest sees the same bytes, owned by the sandbox user, mode 644.
    assert sbx.exec("cat /workspace/t.txt").stdout == "héllo\nworld\n"
    assert sbx.exec("stat -c '%u %a' /workspace/t.txt").stdout == "1000 644\n"
    # Overwrite replaces the whole file.
    sbx.files.write("/workspace/t.txt", "short")
    assert sbx.files.read("/workspace/t.txt") == b"short"


def test_write_and_read_bytes(sbx):
    data = bytes(range(256)) * 4
    sbx.files.write("/workspace/bin.dat", data)
    assert sbx.files.read("/workspace/bin.dat") == data
    assert sbx.exec("sha256sum /workspace/bin.dat").stdout.split()[0] == hashlib.sha256(data).hexdigest()


def test_empty_file(sbx):
    sbx.files.write("/workspace/empty", b"")
    assert sbx.files.read("/workspace/empty") == b""
    assert sbx.files.stat("/workspace/empty")["size"] == 0


def test_read_what_a_command_wrote(sbx):
    sbx.exec("printf 'from exec' > /workspace/from-exec.txt")
    assert sbx.files.read("/workspace/from-exec.txt") == b"from exec"


def test_write_makes_parents(sbx):
    sbx.files.write("/workspace/p1/p2/p3/f.txt", "deep")
    assert sbx.exec("cat /workspace/p1/p2/p3/f.txt").stdout == "deep"
    assert sbx.files.stat("/workspace/p1/p2")["type"] == "directory"


def test_mode(sbx):
    sbx.files.write("/workspace/run.sh", "#!/bin/sh\necho ran\n", mode=0o755)
    assert sbx.exec("stat -c %a /workspace/run.sh").stdout == "755\n"
    assert sbx.exec("/workspace/run.sh").stdout == "ran\n"


def test_large_file_uses_chunked_upload(sbx):
    data = os.urandom(3 * 1024 * 1024 + 17)
    digest = hashlib.sha256(data).hexdigest()
    sbx.files.write("/workspace/big/blob.bin", data)
    back = sbx.files.read("/workspace/big/blob.bin")
    assert len(back) == len(data)
    assert hashlib.sha256(back).hexdigest() == digest
    assert sbx.exec("sha256sum /workspace/big/blob.bin").stdout.split()[0] == digest
    assert sbx.files.stat("/workspace/big/blob.bin")["size"] == len(data)


def test_large_file_with_mode(sbx):
    data = b"#!/bin/sh\necho big\n" + b"#" * (1024 * 1024 + 100) + b"\n"
    sbx.files.write("/workspace/big/run-big.sh", data, mode=0o755)
    assert sbx.exec("stat -c %a /workspace/big/run-big.sh").stdout == "755\n"
    assert sbx.exec("/workspace/big/run-big.sh").stdout == "big\n"


def test_list(sbx):
    sbx.files.mkdir("/workspace/lst/sub")
    sbx.files.write("/workspace/lst/one.txt", "1")
    sbx.files.write("/workspace/lst/two.txt", "22")
    sbx.files.write("/workspace/lst/sub/three.txt", "333")
    entries = {e["name"]: e for e in sbx.files.list("/workspace/lst")}
    assert set(entries) == {"one.txt", "two.txt", "sub"}
    assert entries["one.txt"]["type"] == "file" and entries["one.txt"]["size"] == 1
    assert entries["two.txt"]["size"] == 2
    assert entries["two.txt"]["path"] == "/workspace/lst/two.txt"
    assert entries["sub"]["type"] == "directory"
    deep = {e["path"] for e in sbx.files.list("/workspace/lst", depth=2)}
    assert "/workspace/lst/sub/three.txt" in deep


def test_list_defaults_to_workspace(sbx):
    sbx.files.write("/workspace/at-root.txt", "r")
    assert "/workspace/at-root.txt" in {e["path"] for e in sbx.files.list()}


def test_stat_and_exists(sbx):
    sbx.files.write("/workspace/st.txt", "12345")
    st = sbx.files.stat("/workspace/st.txt")
    assert st["exists"] is True
    assert st["type"] == "file"
    assert st["size"] == 5
    assert st["path"] == "/workspace/st.txt"
    assert sbx.files.stat("/workspace/no-such-file")["exists"] is False
    assert sbx.files.exists("/workspace/st.txt") is True
    assert sbx.files.exists("/workspace/no-such-file") is False
    assert sbx.files.stat("/workspace")["type"] == "directory"


def test_mkdir(sbx):
    sbx.files.mkdir("/workspace/mk/a/b")
    assert sbx.files.stat("/workspace/mk/a/b")["type"] == "directory"
    assert sbx.exec("test -d /workspace/mk/a/b && stat -c %u /workspace/mk/a/b").stdout == "1000\n"
    # Making an existing directory again is fine with parents=True.
    sbx.files.mkdir("/workspace/mk/a/b")


def test_remove(sbx):
    sbx.files.write("/workspace/rm/file.txt", "x")
    sbx.files.write("/workspace/rm/dir/inner.txt", "y")
    assert sbx.files.remove("/workspace/rm/file.txt") is True
    assert sbx.files.exists("/workspace/rm/file.txt") is False
    with pytest.raises((ConflictError, InvalidRequestError)):
        sbx.files.remove("/workspace/rm/dir")  # not empty, not recursive
    assert sbx.files.exists("/workspace/rm/dir/inner.txt") is True
    assert sbx.files.remove("/workspace/rm/dir", recursive=True) is True
    assert sbx.files.exists("/workspace/rm/dir") is False


def test_rename(sbx):
    sbx.files.write("/workspace/mv/a.txt", "A")
    sbx.files.rename("/workspace/mv/a.txt", "/workspace/mv/b.txt")
    assert sbx.files.exists("/workspace/mv/a.txt") is False
    assert sbx.files.read("/workspace/mv/b.txt") == b"A"
    sbx.files.write("/workspace/mv/c.txt", "C")
    with pytest.raises((ConflictError, InvalidRequestError)):
        sbx.files.rename("/workspace/mv/c.txt", "/workspace/mv/b.txt")
    assert sbx.files.read("/workspace/mv/b.txt") == b"A"
    sbx.files.rename("/workspace/mv/c.txt", "/workspace/mv/b.txt", overwrite=True)
    assert sbx.files.read("/workspace/mv/b.txt") == b"C"
    assert sbx.files.exists("/workspace/mv/c.txt") is False


def test_errors(sbx):
    with pytest.raises(NotFoundError) as missing:
        sbx.files.read("/workspace/definitely-missing.txt")
    assert missing.value.code == "file_not_found"
    assert missing.value.status == 404

    sbx.files.mkdir("/workspace/a-dir")
    with pytest.raises(ConflictError) as is_dir:
        sbx.files.read("/workspace/a-dir")
    assert is_dir.value.code == "is_a_directory"
    assert is_dir.value.status == 409

    with pytest.raises(NotFoundError):
        sbx.files.list("/workspace/no-such-dir")
    with pytest.raises(NotFoundError):
        sbx.files.rename("/workspace/no-such-src", "/workspace/dst")


def test_reads_that_never_end_or_do_not_fit_are_refused_at_once(sbx, server):
    # A device never ends; a sparse file is larger than a read takes. Each is
    # refused before a byte is held, and the server's memory stays put.
    rss_before = server.rss_kib()
    for path in ("/dev/zero", "/dev/urandom"):
        with pytest.raises(InvalidRequestError) as device:
            sbx.files.read(path)
        assert device.value.code == "invalid_request" and "not a regular file" in device.value.message
    sbx.exec("truncate -s 300M /workspace/e2e-sparse", check=True)
    with pytest.raises(RuntimeAPIError) as big:
        sbx.files.read("/workspace/e2e-sparse")
    assert (big.value.status, big.value.code) == (413, "file_too_large"), big.value
    assert "256 MiB" in big.value.message
    sbx.exec("rm /workspace/e2e-sparse", check=True)
    assert server.rss_kib() - rss_before < 100 * 1024
    # What fits is still read whole.
    sbx.exec("head -c 3000000 /dev/urandom > /workspace/e2e-3m", check=True)
    assert len(sbx.files.read("/workspace/e2e-3m")) == 3_000_000


def test_write_outside_workspace_as_the_sandbox_user(sbx):
    sbx.files.write("/tmp/e2e-outside.txt", "tmp ok")
    assert sbx.exec("cat /tmp/e2e-outside.txt").stdout == "tmp ok"
    # /etc belongs to root: the files API acts as the sandbox user.
    with pytest.raises(RuntimeAPIError) as denied:
        sbx.files.write("/etc/e2e-denied.txt", "no")
    assert denied.value.code == "permission_denied", denied.value
    assert sbx.exec("test -e /etc/e2e-denied.txt || echo absent").stdout == "absent\n"
