"""Folders in and out as tar archives (`files.upload`/`download` of a
folder, `archive`, `unarchive`), packed and unpacked by the sandbox's own
tar, on one sandbox shared by the module."""
from __future__ import annotations

import io
import os
import tarfile

import pytest
from withruntime import NotFoundError
from withruntime import RuntimeError as ClientError


def _tar(members: dict[str, bytes], gz: bool = True) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz" if gz else "w") as t:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o644
            t.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_a_folder_goes_in_and_comes_back_the_same(sbx, tmp_path):
    src = tmp_path / "src"
    (src / "pkg" / "deep").mkdir(parents=True)
    (src / "top.txt").write_text("top\n")
    (src / "pkg" / "deep" / "data.bin").write_bytes(os.urandom(200_000))
    run = src / "run.sh"
    run.write_text("#!/bin/sh\necho ran\n")
    run.chmod(0o755)
    sbx.files.upload(str(src), "/workspace/arch/in")
    # The guest sees what was sent, as its own user, modes kept.
    assert sbx.exec("cd /workspace/arch/in && ./run.sh && cat top.txt && stat -c %U pkg/deep/data.bin").stdout \
        == "ran\ntop\nruntime\n"
    back = tmp_path / "back"
    sbx.files.download("/workspace/arch/in", str(back))
    assert (back / "top.txt").read_text() == "top\n"
    assert (back / "pkg" / "deep" / "data.bin").read_bytes() == (src / "pkg" / "deep" / "data.bin").read_bytes()
    assert os.access(back / "run.sh", os.X_OK)


def test_archive_leaves_out_what_is_excluded_and_can_be_plain_tar(sbx):
    sbx.exec("mkdir -p /workspace/arch/ex/node_modules/x /workspace/arch/ex/src"
             " && echo a > /workspace/arch/ex/src/a.js && echo dep > /workspace/arch/ex/node_modules/x/i.js")
    packed = sbx.files.archive("/workspace/arch/ex", exclude=["node_modules"])
    assert packed[:2] == b"\x1f\x8b"
    with tarfile.open(fileobj=io.BytesIO(packed)) as t:
        names = sorted(n.lstrip("./") for n in t.getnames() if n not in (".", "./"))
    assert names == ["src", "src/a.js"]
    plain = sbx.files.archive("/workspace/arch/ex", gzip=False)
    with tarfile.open(fileobj=io.BytesIO(plain), mode="r:") as t:
        assert any(n.endswith("node_modules/x/i.js") for n in t.getnames())


def test_unarchive_keeps_every_member_inside_its_target(sbx):
    sbx.files.unarchive("/workspace/arch/target", _tar({"ok.txt": b"inside\n", "/abs.txt": b"abs\n"}))
    assert sbx.exec("cd /workspace/arch/target && find . -type f | sort").stdout == "./abs.txt\n./ok.txt\n"
    assert sbx.files.read("/workspace/arch/target/ok.txt") == b"inside\n"
    # Plain tar too, merged with what is there.
    sbx.files.unarchive("/workspace/arch/target", _tar({"more.txt": b"more\n"}, gz=False))
    assert sbx.exec("ls /workspace/arch/target").stdout.split() == ["abs.txt", "more.txt", "ok.txt"]
    # A member naming a parent refuses the whole archive: nothing of it lands.
    with pytest.raises(ClientError) as outside:
        sbx.files.unarchive("/workspace/arch/target", _tar({"new.txt": b"n\n", "../escape.txt": b"x\n"}))
    assert (outside.value.status, outside.value.code) == (400, "invalid_request")
    assert outside.value.details["issues"][0]["field"] == "body"
    assert "../escape.txt" in str(outside.value)
    assert "new.txt" not in sbx.exec("ls /workspace/arch/target").stdout
    assert "escape.txt" not in sbx.exec("ls /workspace/arch /workspace").stdout


def test_bad_folders_and_archives_are_clear_errors(sbx):
    with pytest.raises(NotFoundError) as missing:
        sbx.files.archive("/workspace/arch/none-such")
    assert missing.value.code == "file_not_found"
    sbx.files.write("/workspace/arch/a-file", "x")
    with pytest.raises(ClientError) as not_dir:
        sbx.files.archive("/workspace/arch/a-file")
    assert (not_dir.value.status, not_dir.value.code) == (409, "not_a_directory")
    with pytest.raises(ClientError) as garbage:
        sbx.files.unarchive("/workspace/arch/t2", b"this is not a tar archive at all" * 40)
    assert (garbage.value.status, garbage.value.code) == (400, "invalid_request")
    assert garbage.value.details["issues"][0]["field"] == "body"
    # Root's folders need user="root".
    with pytest.raises(ClientError) as denied:
        sbx.files.archive("/root")
    assert denied.value.code == "permission_denied"
    assert sbx.files.archive("/root", user="root")[:2] == b"\x1f\x8b"
