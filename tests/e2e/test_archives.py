"""Folders in and out as tar archives (`files.upload`/`download` of a
folder, `archive`, `unarchive`), packed and unpacked by the sandbox's own
tar, on one sandbox shared by the module."""
from __future__ import annotations

import hashlib
import io
import os
import tarfile

import pytest
from withruntime import NotFoundError
from withruntime import RuntimeError as ClientError

from conftest import assert_error_body, http


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


# -- large folders: chunked archive uploads ------------------------------------

def _local_sums(root) -> dict[str, str]:
    out = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            full = os.path.join(dirpath, name)
            with open(full, "rb") as f:
                out["./" + os.path.relpath(full, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


def _guest_sums(sbx, folder: str) -> dict[str, str]:
    listing = sbx.exec(f"cd {folder} && find . -type f -print0 | sort -z | xargs -0 -r sha256sum").stdout
    sums = {}
    for line in listing.splitlines():
        digest, name = line.split(maxsplit=1)
        sums[name] = digest
    return sums


def _random_tree(root, sizes: dict[str, int]) -> None:
    for name, size in sizes.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(size))


def test_a_folder_of_several_mib_goes_in_by_chunks(sbx, tmp_path):
    src = tmp_path / "big"
    _random_tree(src, {"a.bin": 2_500_000, "deep/er/b.bin": 1_700_000, "c.bin": 900_000, "tiny.txt": 3})
    sbx.files.upload(str(src), "/workspace/arch/big")
    sums = _local_sums(src)
    assert len(sums) == 4
    assert _guest_sums(sbx, "/workspace/arch/big") == sums
    # Unpacked as the sandbox's user, and nothing left staged in the guest.
    assert sbx.exec("stat -c %U /workspace/arch/big/deep/er/b.bin").stdout == "runtime\n"
    assert sbx.exec("find /var/tmp /tmp -maxdepth 1 -name 'tmp.*' | wc -l").stdout == "0\n"


def test_unarchive_takes_large_gzipped_and_plain_archives(sbx):
    # More than the 8 MiB the server sends ahead of the guest's tar: the
    # commit goes on only as the guest says it took the bytes.
    members = {f"f{i}.bin": os.urandom(2_500_000) for i in range(5)}
    packed = _tar(members)
    assert len(packed) > 10 * 1_048_576
    sbx.files.unarchive("/workspace/arch/un-gz", packed)
    want = {f"./{n}": hashlib.sha256(d).hexdigest() for n, d in members.items()}
    assert _guest_sums(sbx, "/workspace/arch/un-gz") == want
    plain = _tar(members, gz=False)
    sbx.files.unarchive("/workspace/arch/un-tar", plain, gzip=False, user="root")
    assert _guest_sums(sbx, "/workspace/arch/un-tar") == want
    assert sbx.exec("stat -c %U /workspace/arch/un-tar/f0.bin").stdout == "root\n"


def test_a_large_archive_naming_a_parent_unpacks_nothing(sbx):
    members = {"first.bin": os.urandom(1_500_000), "../escape-big.txt": b"x\n", "last.bin": b"l\n"}
    with pytest.raises(ClientError) as outside:
        sbx.files.unarchive("/workspace/arch/big-bad", _tar(members))
    assert (outside.value.status, outside.value.code) == (400, "invalid_request")
    assert outside.value.details["issues"][0]["field"] == "body"
    assert sbx.exec("ls /workspace/arch/big-bad 2>&1; ls /workspace/arch").stdout.count("escape-big") == 0
    assert "No such file" in sbx.exec("ls /workspace/arch/big-bad 2>&1").stdout


def test_morph_uploads_a_folder_over_a_mib(sbx, runtime, tmp_path):
    from withruntime.morph import MorphCloudClient
    src = tmp_path / "morph"
    _random_tree(src, {"model.bin": 1_600_000, "cfg/settings.json": 40})
    instance = MorphCloudClient(runtime=runtime).instances.get(sbx.id)
    instance.upload(str(src), "/workspace/arch/morph", recursive=True)
    assert _guest_sums(sbx, "/workspace/arch/morph") == _local_sums(src)


def _begin(server, sid, path, *, gzip=True, key="admin"):
    return http(server, "POST", f"/v1/sandboxes/{sid}/files/archive/uploads",
                {"path": path, "gzip": gzip}, key=key)


def _chunk(server, sid, upload, offset, data, key="admin"):
    return http(server, "PUT", f"/v1/sandboxes/{sid}/files/archive/uploads/{upload}?offset={offset}",
                raw=data, key=key, headers={"Content-Type": "application/octet-stream"})


def _act(server, sid, upload, verb, key="admin"):
    return http(server, "POST", f"/v1/sandboxes/{sid}/files/archive/uploads/{upload}:{verb}", {}, key=key)


def test_archive_upload_bad_input_is_the_one_error_shape(server, sbx):
    sid = sbx.id
    packed = _tar({"one.txt": b"1\n", "two.bin": os.urandom(300_000)})
    begun = _begin(server, sid, "/workspace/arch/raw")
    assert begun.status == 201, begun
    answer = begun.json()
    upload, step = answer["uploadId"], answer["chunkBytes"]
    assert step == 1_048_576
    # Offsets go in order: a gap names `offset`, and so do bytes that
    # differ from those already there.
    assert _chunk(server, sid, upload, 0, packed[:100_000]).status == 200
    gap = assert_error_body(_chunk(server, sid, upload, 200_000, packed[200_000:]), 400, "invalid_request")
    assert gap["details"]["issues"][0]["field"] == "offset"
    assert "100000" in gap["message"] or "100000" in gap["details"]["issues"][0]["message"]
    changed = assert_error_body(_chunk(server, sid, upload, 0, b"\0" * 10), 400, "invalid_request")
    assert changed["details"]["issues"][0]["field"] == "offset"
    # The same bytes again (a resend) are taken.
    resent = _chunk(server, sid, upload, 0, packed[:100_000])
    assert resent.status == 200 and resent.json()["received"] == 100_000, resent
    done = _chunk(server, sid, upload, 100_000, packed[100_000:])
    assert done.status == 200 and done.json()["received"] == len(packed), done
    # Another key's sandbox and its uploads are not found.
    other = server.create_key()
    assert_error_body(_begin(server, sid, "/workspace/x", key=other), 404, "sandbox_not_found")
    assert_error_body(_chunk(server, sid, upload, len(packed), b"x", key=other), 404, "sandbox_not_found")
    assert_error_body(_act(server, sid, upload, "commit", key=other), 404, "sandbox_not_found")
    # Unknown ids, and the file upload routes do not know an archive's.
    assert_error_body(_chunk(server, sid, "upa_nonesuch", 0, b"x"), 404, "upload_not_found")
    assert_error_body(_act(server, sid, "upa_nonesuch", "commit"), 404, "upload_not_found")
    assert_error_body(http(server, "POST", f"/v1/sandboxes/{sid}/uploads/{upload}:commit", {}),
                      404, "upload_not_found")
    committed = _act(server, sid, upload, "commit")
    assert committed.status == 200, committed
    assert committed.json() == {"path": "/workspace/arch/raw", "size": len(packed), "committed": True}
    assert sbx.files.read("/workspace/arch/raw/one.txt") == b"1\n"
    # Once committed it is gone: a second commit, a late chunk.
    assert_error_body(_act(server, sid, upload, "commit"), 404, "upload_not_found")
    assert_error_body(_chunk(server, sid, upload, len(packed), b"x"), 404, "upload_not_found")
    # Aborted, it cannot be committed; nothing lands.
    second = _begin(server, sid, "/workspace/arch/aborted").json()["uploadId"]
    assert _chunk(server, sid, second, 0, packed).status == 200
    aborted = _act(server, sid, second, "abort")
    assert aborted.status == 200 and aborted.json() == {"uploadId": second, "aborted": True}
    assert_error_body(_act(server, sid, second, "commit"), 404, "upload_not_found")
    assert_error_body(_act(server, sid, second, "abort"), 404, "upload_not_found")
    assert "No such file" in sbx.exec("ls /workspace/arch/aborted 2>&1").stdout
    # Nothing to commit, a `gzip` that the bytes contradict, bad fields.
    empty = _begin(server, sid, "/workspace/arch/empty").json()["uploadId"]
    assert_error_body(_act(server, sid, empty, "commit"), 409, "upload_incomplete")
    assert _chunk(server, sid, empty, 0, _tar({"p.txt": b"p\n"}, gz=False)).status == 200
    wrong = assert_error_body(_act(server, sid, empty, "commit"), 400, "invalid_request")
    assert wrong["details"]["issues"][0]["field"] == "gzip"
    assert "No such file" in sbx.exec("ls /workspace/arch/empty 2>&1").stdout
    bad = assert_error_body(http(server, "POST", f"/v1/sandboxes/{sid}/files/archive/uploads",
                                 {"path": "relative", "gzip": "yes", "user": "nobody"}), 400, "invalid_request")
    assert sorted(i["field"] for i in bad["details"]["issues"]) == ["gzip", "path", "user"]
    missing = assert_error_body(http(server, "PUT", f"/v1/sandboxes/{sid}/files/archive/uploads/{upload}",
                                     raw=b"x"), 400, "invalid_request")
    assert missing["details"]["issues"][0]["field"] == "offset"


# -- streamed reads -------------------------------------------------------------

def test_read_stream_takes_a_large_file_in_pieces(server, sbx):
    made = sbx.exec("head -c 67108864 /dev/urandom > /workspace/arch/big.bin"
                    " && sha256sum /workspace/arch/big.bin", timeout_ms=600_000)
    assert made.exit_code == 0, made.stderr
    want = made.stdout.split()[0]
    digest, size, pieces = hashlib.sha256(), 0, 0
    for piece in sbx.files.read_stream("/workspace/arch/big.bin"):
        digest.update(piece)
        size += len(piece)
        pieces += 1
    assert (size, digest.hexdigest()) == (64 << 20, want)
    assert pieces > 1
    # On the wire: the length first, the body as it comes (no SHA-256,
    # which would need the whole file first); a small file has both.
    sbx.exec("head -c 3000000 /dev/urandom > /workspace/arch/mid.bin")
    wire = http(server, "GET", f"/v1/sandboxes/{sbx.id}/files/content?path=/workspace/arch/mid.bin")
    assert wire.status == 200 and len(wire.body) == 3_000_000
    assert wire.headers["x-content-length"] == "3000000"
    assert "x-content-sha256" not in wire.headers
    assert wire.headers.get("transfer-encoding") == "chunked"
    sbx.files.write("/workspace/arch/small.txt", "small\n")
    small = http(server, "GET", f"/v1/sandboxes/{sbx.id}/files/content?path=/workspace/arch/small.txt")
    assert small.body == b"small\n"
    assert small.headers["x-content-sha256"] == hashlib.sha256(b"small\n").hexdigest()


def test_the_async_client_sends_and_streams_large_ones_too(sbx, tmp_path):
    import asyncio

    from withruntime import AsyncRuntime
    src = tmp_path / "async"
    _random_tree(src, {"x.bin": 1_800_000, "y/z.bin": 600_000})
    members = {"solo.bin": os.urandom(1_300_000)}

    async def scenario():
        async with AsyncRuntime() as rt:
            asbx = await rt.sandboxes.get(sbx.id)
            await asbx.files.upload(str(src), "/workspace/arch/async-up")
            await asbx.files.unarchive("/workspace/arch/async-un", _tar(members))
            digest = hashlib.sha256()
            async for piece in asbx.files.read_stream("/workspace/arch/async-un/solo.bin"):
                digest.update(piece)
            return digest.hexdigest()

    streamed = asyncio.run(scenario())
    assert _guest_sums(sbx, "/workspace/arch/async-up") == _local_sums(src)
    want = hashlib.sha256(members["solo.bin"]).hexdigest()
    assert _guest_sums(sbx, "/workspace/arch/async-un") == {"./solo.bin": want}
    assert streamed == want
