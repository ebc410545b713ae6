"""deploy/: the Kubernetes manifests, the systemd unit and its environment
file, and the container image, checked against the repository and the
built binary.

- Every YAML document parses and names itself; the kustomization lists
  exactly the manifests there are (the `*.example.yaml` aside).
- Every `--flag` the DaemonSet's containers, the unit's ExecStart (with its
  SERVE_FLAGS) and the image's CMD pass is one the binary's `--help` of that
  command lists; every RUNTIME_ variable they set is one `runtime serve
  --help` names. These need the binary: RUNTIME_BIN, else
  target/release/runtime; without it they are skipped.
- The probes ask for paths the server answers without a key. `runtime serve`
  builds the guest kernel and image before it listens, so the test reads the
  route code instead of starting one.
- Ports, the data and cache directories, the Service, the Ingress's hosts
  (the API's and the wildcard of --preview-domain) agree with each other;
  the image builds with rust-toolchain.toml's toolchain.

Run from the repository's root: .venv/bin/python -m pytest tests/deploy
"""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
UNIT = ROOT / "deploy" / "systemd" / "runtime.service"
ENV_EXAMPLE = ROOT / "deploy" / "systemd" / "runtime.env.example"
DOCKERFILE = ROOT / "deploy" / "container" / "Dockerfile"
HTTP_SRC = ROOT / "crates" / "server" / "src" / "http"

# Where `runtime serve` keeps the cache when it runs as root (no flag moves
# it; crates/cli/src/main.rs, cache_dir).
ROOT_CACHE_DIR = "/var/cache/runtime"


# --- reading the files ---------------------------------------------------------


def manifest_files() -> list[Path]:
    return sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


@functools.cache
def documents() -> list[tuple[str, dict]]:
    """Every document of every manifest, with its file's name."""
    out = []
    for path in manifest_files():
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                out.append((path.name, doc))
    return out


def the(kind: str) -> dict:
    found = [d for _, d in documents() if d.get("kind") == kind]
    assert len(found) == 1, f"expected one {kind} in {K8S}, found {len(found)}"
    return found[0]


def pod_spec() -> dict:
    return the("DaemonSet")["spec"]["template"]["spec"]


def serve_container() -> dict:
    found = [
        c for c in pod_spec()["containers"] if "command" not in c and c.get("args", [])[:1] == ["serve"]
    ]
    assert len(found) == 1, "the DaemonSet has no container running `runtime serve`"
    return found[0]


def flag_value(args: list[str], flag: str) -> str:
    for i, a in enumerate(args):
        if a == flag:
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    raise AssertionError(f"{flag} is not among the arguments {args}")


def unit_settings() -> dict[str, list[str]]:
    """The unit's Key=value lines, by key (continuation lines joined)."""
    settings: dict[str, list[str]] = {}
    text = UNIT.read_text().replace("\\\n", " ")
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";", "[")):
            continue
        key, _, value = line.partition("=")
        settings.setdefault(key.strip(), []).append(value.strip())
    return settings


def env_example() -> dict[str, str]:
    """The assignments of runtime.env.example (comments aside)."""
    out = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, value = line.partition("=")
        assert sep and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name), f"not an assignment: {line!r}"
        out[name] = value
    return out


def exec_start() -> list[str]:
    """The unit's ExecStart as the server receives it: $SERVE_FLAGS split
    into words with the example's value."""
    (line,) = unit_settings()["ExecStart"]
    words = []
    for w in shlex.split(line):
        if w == "$SERVE_FLAGS":
            words += env_example().get("SERVE_FLAGS", "").split()
        else:
            assert "$" not in w, f"ExecStart uses {w}, which the test does not expand"
            words.append(w)
    return words


def dockerfile_cmd() -> list[str]:
    lines = [line for line in DOCKERFILE.read_text().splitlines() if line.startswith("CMD ")]
    assert len(lines) == 1, "the Dockerfile has no CMD (or more than one)"
    return json.loads(lines[0][4:])


# --- the binary -------------------------------------------------------------------


def runtime_bin() -> Path | None:
    p = Path(os.environ.get("RUNTIME_BIN") or ROOT / "target" / "release" / "runtime")
    return p if p.is_file() and os.access(p, os.X_OK) else None


@pytest.fixture(scope="module")
def binary() -> Path:
    p = runtime_bin()
    if p is None:
        pytest.skip("no runtime binary: build it (scripts/build.sh) or set RUNTIME_BIN")
    return p


@functools.cache
def help_of(binary: Path, command: tuple[str, ...]) -> str:
    out = subprocess.run(
        [str(binary), *command, "--help"], capture_output=True, text=True, timeout=60, check=True
    )
    return out.stdout


def help_flags(text: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])(--[a-z0-9][a-z0-9-]*)", text))


def split_command(args: list[str]) -> tuple[tuple[str, ...], list[str]]:
    """`serve --listen X` -> (("serve",), ["--listen"]): the subcommand's
    words before the first flag, and every flag after."""
    command = []
    for a in args:
        if a.startswith("-"):
            break
        command.append(a)
    flags = [a.split("=", 1)[0] for a in args[len(command) :] if a.startswith("--")]
    return tuple(command), flags


def runtime_invocations() -> list[tuple[str, list[str]]]:
    """Every `runtime ...` the deployment runs: where, and its arguments
    after the binary's name."""
    out = []
    spec = pod_spec()
    for c in spec.get("initContainers", []) + spec["containers"]:
        if "command" in c:  # not the image's entrypoint (runtime): a shell
            assert "runtime" not in " ".join(c["command"][:1]), c["name"]
            continue
        out.append((f"DaemonSet container {c['name']}", c.get("args", [])))
    words = exec_start()
    assert Path(words[0]).name == "runtime", f"ExecStart runs {words[0]}"
    out.append(("runtime.service ExecStart", words[1:]))
    out.append(("Dockerfile CMD", dockerfile_cmd()))
    return out


# --- the tests ------------------------------------------------------------------


def test_every_document_parses_and_names_itself():
    files = manifest_files()
    assert files, f"no manifests in {K8S}"
    seen = set()
    for name, doc in documents():
        assert isinstance(doc, dict), f"{name}: a document that is not a mapping"
        for field in ("apiVersion", "kind"):
            assert isinstance(doc.get(field), str) and doc[field], f"{name}: no {field}"
        meta = doc.get("metadata") or {}
        assert isinstance(meta.get("name"), str) and meta["name"], f"{name}: no metadata.name"
        seen.add(name)
    assert seen == {p.name for p in files}, "a manifest without a document"
    namespace = the("Namespace")["metadata"]["name"]
    for name, doc in documents():
        if doc["kind"] != "Namespace":
            assert doc["metadata"].get("namespace") == namespace, f"{name}: {doc['kind']} is not in {namespace}"


def test_the_kustomization_lists_exactly_the_manifests():
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert kust["kind"] == "Kustomization"
    listed = kust.get("resources", [])
    assert len(listed) == len(set(listed)), "a resource listed twice"
    examples = {p.name for p in manifest_files() if p.name.endswith(".example.yaml")}
    assert examples, "the store Secret's example is missing"
    present = {p.name for p in manifest_files()} - examples
    assert not set(listed) - present, f"listed but not there: {sorted(set(listed) - present)}"
    assert not present - set(listed), f"there but not listed: {sorted(present - set(listed))}"
    assert kust.get("namespace") == the("Namespace")["metadata"]["name"]
    for image in kust.get("images", []):
        used = {c["image"] for c in pod_spec().get("initContainers", []) + pod_spec()["containers"]}
        assert image["name"] in used, f"the kustomization sets an image no container uses: {image['name']}"


def test_every_flag_is_one_the_binary_has(binary):
    checked = 0
    for where, args in runtime_invocations():
        command, flags = split_command(args)
        assert command, f"{where}: no subcommand in {args}"
        known = help_flags(help_of(binary, command))
        for flag in flags:
            assert flag in known, f"{where}: `runtime {' '.join(command)}` has no {flag}"
            checked += 1
    assert checked >= 5, "too few flags found: is the parsing of the files still right?"


def test_every_runtime_variable_is_one_serve_reads(binary):
    mentioned = set(re.findall(r"\bRUNTIME_[A-Z0-9_]+", help_of(binary, ("serve",))))
    assert {"RUNTIME_STORE", "RUNTIME_NODE_URL"} <= mentioned
    names = {}
    for c in pod_spec().get("initContainers", []) + pod_spec()["containers"]:
        for e in c.get("env", []):
            names[e["name"]] = f"DaemonSet container {c['name']}"
    for n in env_example():
        names[n] = ENV_EXAMPLE.name
    for line in unit_settings().get("Environment", []):
        for assignment in shlex.split(line):
            names[assignment.split("=", 1)[0]] = UNIT.name
    set_here = {n: w for n, w in names.items() if n.startswith("RUNTIME_")}
    assert set_here, "no RUNTIME_ variable found: is the parsing of the files still right?"
    for name, where in set_here.items():
        assert name in mentioned, f"{where} sets {name}, which `runtime serve --help` does not name"


def test_the_store_comes_from_the_example_secrets_key():
    (store,) = [e for e in serve_container()["env"] if e["name"] == "RUNTIME_STORE"]
    ref = store["valueFrom"]["secretKeyRef"]
    secrets = [d for _, d in documents() if d["kind"] == "Secret" and d["metadata"]["name"] == ref["name"]]
    assert len(secrets) == 1, f"no example of the Secret {ref['name']}"
    value = secrets[0].get("stringData", {}).get(ref["key"])
    assert value and value.startswith("postgres://"), f"the example has no postgres:// {ref['key']}"
    assert "CHANGE-ME" in value, "the example's store URL must be a marked placeholder"


def unauthenticated_paths() -> set[str]:
    """The paths answered 200 without a key: the console's files. They are
    handled in http/mod.rs before `serve`, which authenticates."""
    mod = (HTTP_SRC / "mod.rs").read_text()
    console_at = mod.find("console::is_console_path(")
    serve_at = mod.find("serve(&st, req")
    assert 0 <= console_at < serve_at, "http/mod.rs no longer answers the console before authenticating"
    console = (HTTP_SRC / "console" / "mod.rs").read_text()
    return set(re.findall(r'path:\s*"(/[^"]*)"', console))


def test_the_probes_ask_for_paths_the_server_answers_without_a_key():
    served = unauthenticated_paths()
    assert "/console/" in served, served
    container = serve_container()
    port_names = {p.get("name"): p["containerPort"] for p in container["ports"]}
    probes = [k for k in ("startupProbe", "readinessProbe", "livenessProbe") if k in container]
    assert {"readinessProbe", "livenessProbe"} <= set(probes)
    listen_port = int(flag_value(container["args"], "--listen").rsplit(":", 1)[1])
    for k in probes:
        get = container[k]["httpGet"]
        assert get["path"] in served, f"{k} asks for {get['path']}, which is not answered without a key"
        port = port_names.get(get["port"], get["port"])
        assert port == listen_port, f"{k} asks port {get['port']}, the server listens on {listen_port}"


def test_ports_agree():
    container = serve_container()
    listen_port = int(flag_value(container["args"], "--listen").rsplit(":", 1)[1])
    ports = {p.get("name"): p["containerPort"] for p in container["ports"]}
    assert listen_port in ports.values()
    (node_url,) = [e["value"] for e in container["env"] if e["name"] == "RUNTIME_NODE_URL"]
    assert re.fullmatch(rf"http://\$\(POD_IP\):{listen_port}", node_url), node_url
    (pod_ip,) = [e for e in container["env"] if e["name"] == "POD_IP"]
    assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    names = [e["name"] for e in container["env"]]
    assert names.index("POD_IP") < names.index("RUNTIME_NODE_URL"), "$(POD_IP) must be defined first"
    service = the("Service")
    labels = the("DaemonSet")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items(), "the Service selects no node"
    for p in service["spec"]["ports"]:
        target = p.get("targetPort", p["port"])
        assert ports.get(target, target) == listen_port, f"the Service's {target} is not the server's port"


def test_the_data_and_cache_directories_are_the_machines():
    spec = pod_spec()
    container = serve_container()
    data_dir = flag_value(container["args"], "--data-dir")
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    # Disks name their backing files by absolute path: the same path inside
    # the pod as on the machine.
    for path in (data_dir, ROOT_CACHE_DIR, "/dev/kvm"):
        assert path in mounts, f"{path} is not mounted"
        host = volumes[mounts[path]].get("hostPath")
        assert host and host["path"] == path, f"{path} is not the machine's {path}"
    assert volumes[mounts["/dev/kvm"]]["hostPath"].get("type") == "CharDevice"
    assert container["securityContext"]["privileged"] is True
    build = [c for c in spec.get("initContainers", []) if c.get("args", [])[:2] == ["image", "build"]]
    for c in build:
        assert ROOT_CACHE_DIR in {m["mountPath"] for m in c["volumeMounts"]}, "the guest is built elsewhere"
    selector = spec.get("nodeSelector", {})
    assert selector, "the DaemonSet runs on every node, not only those with /dev/kvm"
    # The unit serves the same data directory.
    assert flag_value(exec_start(), "--data-dir") == data_dir


def test_the_ingress_covers_the_api_and_every_preview_host():
    domain = flag_value(serve_container()["args"], "--preview-domain")
    assert domain != "localhost", "set --preview-domain to the domain the wildcard DNS name is under"
    ingress = the("Ingress")
    service = the("Service")
    service_ports = {p.get("name") for p in service["spec"]["ports"]} | {
        p["port"] for p in service["spec"]["ports"]
    }
    hosts = []
    for rule in ingress["spec"]["rules"]:
        hosts.append(rule["host"])
        paths = rule["http"]["paths"]
        assert any(p["path"] == "/" and p.get("pathType") == "Prefix" for p in paths), rule["host"]
        for p in paths:
            backend = p["backend"]["service"]
            assert backend["name"] == service["metadata"]["name"], rule["host"]
            port = backend["port"].get("name", backend["port"].get("number"))
            assert port in service_ports, f"{rule['host']}: the Service has no port {port}"
    assert f"*.{domain}" in hosts, f"no rule for *.{domain}"
    api = [h for h in hosts if not h.startswith("*.") and not h.endswith("." + domain)]
    assert api, "no rule for the API's own host"
    tls_hosts = {h for t in ingress["spec"].get("tls", []) for h in t.get("hosts", [])}
    assert set(hosts) <= tls_hosts, "a host without TLS"
    for h in hosts:
        assert h == "example.com" or h.endswith(".example.com"), f"{h}: use example names only"


def test_the_image_builds_with_the_repositorys_toolchain():
    channel = re.search(r'^channel\s*=\s*"([^"]+)"', (ROOT / "rust-toolchain.toml").read_text(), re.M)
    assert channel, "rust-toolchain.toml names no channel"
    froms = re.findall(r"^FROM\s+rust:(\S+)", DOCKERFILE.read_text(), re.M)
    assert froms, "the Dockerfile builds from no rust image"
    for tag in froms:
        assert tag.split("-")[0] == channel.group(1), f"rust:{tag}, but rust-toolchain.toml has {channel.group(1)}"


def test_the_unit_leaves_machines_running_and_restarts_on_failure():
    s = unit_settings()
    assert s.get("KillMode") == ["process"], "machines are meant to outlive a restart of the server"
    assert s.get("Restart") == ["on-failure"]
    assert "network-online.target" in " ".join(s.get("After", []))
    assert s.get("EnvironmentFile"), "no EnvironmentFile for RUNTIME_STORE and RUNTIME_NODE_URL"
    env = env_example()
    assert env.get("RUNTIME_STORE", "").startswith("postgres://")
    assert env.get("RUNTIME_NODE_URL", "").startswith("http://")
    # An empty value is an error for the server (`--store : give ...`).
    assert all(v for n, v in env.items() if n.startswith("RUNTIME_")), "a RUNTIME_ variable set to nothing"
