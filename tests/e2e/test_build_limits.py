"""A build's machine and limits, `build` on `images.build`: vCPUs and memory
of the build machine, the build's time limit and the image's size limit,
each applied by the real build (QEMU guest) and refused when out of range."""
from __future__ import annotations

import json
import time

import pytest
from withruntime import InvalidRequestError
from withruntime import RuntimeError as ClientError

from conftest import assert_error_body, http


def test_a_build_runs_on_the_machine_it_asks_for(runtime):
    recipe = {"commands": [
        "nproc > /workspace/nproc.txt",
        "awk '/MemTotal/ {print $2}' /proc/meminfo > /workspace/mem.txt",
    ]}
    image = runtime.images.build(name="e2e-small-builder", recipe=recipe,
                                 build={"vcpu": 1, "memory_mib": 1024}, poll_seconds=0.5)
    assert image["state"] == "ready", image
    assert image["build"] == {"vcpu": 1, "memoryMiB": 1024, "timeoutSeconds": 1800,
                              "maxImageMiB": 8192, "diskMiB": 3072}
    with runtime.sandboxes.create(image=image["id"]) as sbx:
        # The files were written on the build machine, not the sandbox.
        assert sbx.exec("cat /workspace/nproc.txt").stdout == "1\n"
        mem_kib = int(sbx.exec("cat /workspace/mem.txt").stdout)
        assert 700_000 < mem_kib <= 1_048_576, mem_kib
        # The sandbox itself has its own shape (2 vCPUs by default).
        assert sbx.exec("nproc").stdout == "2\n"


def test_a_build_disk_makes_an_image_that_big_and_its_sandboxes_at_least_as_big(runtime):
    # Harbor's and inspect_ai's tasks pass build={"disk_mib": ...}: the
    # image's file system is the build disk, so it holds more than the
    # smallest sandbox disk (3072 MiB) would.
    recipe = {"commands": [
        "df -Pm / | awk 'NR==2 {print $2}' > /workspace/build-disk.txt",
        # More than a 3072 MiB disk has left beside the base image.
        "fallocate -l 1500M /var/tmp/big.bin && rm /var/tmp/big.bin",
    ]}
    image = runtime.images.build(name="e2e-big-disk", recipe=recipe,
                                 build={"vcpu": 1, "memory_mib": 1024, "disk_mib": 5120},
                                 poll_seconds=0.5)
    assert image["state"] == "ready", image
    assert image["build"]["diskMiB"] == 5120, image
    # A disk smaller than the image's is refused, naming the field.
    with pytest.raises(InvalidRequestError) as caught:
        runtime.sandboxes.create(image=image["id"], disk_mib=4096)
    assert "diskMiB" in str(caught.value.details), caught.value.details
    assert "at least 5120" in str(caught.value.details), caught.value.details
    # Left out, the disk is the image's.
    with runtime.sandboxes.create(image=image["id"]) as sbx:
        assert sbx.info["diskMiB"] == 5120, sbx.info
        assert int(sbx.exec("cat /workspace/build-disk.txt").stdout) > 4900
        assert int(sbx.exec("df -Pm / | awk 'NR==2 {print $2}'").stdout) > 4900
    # A sandbox on a smaller disk cannot switch to it until it grows.
    with runtime.sandboxes.create(disk_mib=4096) as small:
        with pytest.raises(InvalidRequestError) as caught:
            small.switch_image(image["id"], keep="workspace")
        assert "at least 5120 MiB" in str(caught.value.details), caught.value.details
        assert small.exec("cat /etc/hostname").exit_code == 0


def test_a_step_that_fills_the_image_past_its_limit_fails_the_build(runtime):
    with runtime.sandboxes.create() as sbx:
        line = sbx.exec("df -Pk / | tail -1").stdout.split()
        base_mib = int(line[2]) // 1024
    limit = max(512, base_mib + 64)
    write_mib = limit - base_mib + 64
    recipe = {"commands": ["echo small > /workspace/small.txt",
                           f"head -c {write_mib}M /dev/zero > /workspace/big.bin"]}
    with pytest.raises(ClientError) as caught:
        runtime.images.build(name="e2e-too-big", recipe=recipe,
                             build={"max_image_mib": limit}, poll_seconds=0.5)
    assert caught.value.code == "image_build_failed"
    failed = runtime.images.list(name="e2e-too-big").data[0]
    assert failed["state"] == "failed"
    assert f"maxImageMiB {limit}" in failed["error"], failed["error"]
    assert "step 2" in failed["error"], failed["error"]
    assert [s["state"] for s in failed["steps"]] == ["done", "failed"]


def test_a_build_past_its_time_limit_fails_saying_so(runtime):
    began = time.monotonic()
    with pytest.raises(ClientError) as caught:
        runtime.images.build(name="e2e-too-slow", recipe={"commands": ["sleep 600"]},
                             build={"timeout_seconds": 60}, poll_seconds=1)
    took = time.monotonic() - began
    assert caught.value.code == "image_build_failed"
    failed = runtime.images.list(name="e2e-too-slow").data[0]
    assert failed["state"] == "failed"
    assert "timeoutSeconds 60" in failed["error"], failed["error"]
    # Ended at its limit, not the step's own 30 minutes.
    assert took < 240, took


def test_limits_out_of_range_are_refused_each_named(server, runtime):
    before = len(runtime.images.list().data)
    answer = http(server, "POST", "/v1/images", {
        "recipe": {"commands": ["true"]},
        "build": {"vcpu": 9, "memoryMiB": "lots", "timeoutSeconds": 10, "maxImageMiB": 100,
                  "diskMiB": 65536, "cacheMiB": 5},
    })
    error = assert_error_body(answer, 400)
    details = json.dumps(error.get("details"))
    for field in ("build.vcpu", "build.memoryMiB", "build.timeoutSeconds", "build.maxImageMiB",
                  "build.diskMiB", "build.cacheMiB"):
        assert field in details, f"{field} not named in {error}"
    assert_error_body(http(server, "POST", "/v1/images",
                           {"recipe": {"commands": ["true"]}, "build": 4}), 400)
    with pytest.raises(InvalidRequestError):
        runtime.images.create(recipe={"commands": ["true"]}, build={"vcpu": 0})
    assert len(runtime.images.list().data) == before
