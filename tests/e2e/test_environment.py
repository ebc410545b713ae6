"""The default image's environment (docs/environment.md) through the official
client: the tools and their versions, who commands run as (`runtime`, uid
1000, HOME and cwd /workspace, passwordless sudo, PATH starting with
/workspace/.local/bin), `pip install` outside a venv (into /workspace/.local,
under sudo into /usr/local, in a venv into the venv) and `npm install -g` /
`bun add -g` onto PATH, all offline: the packages are made in the test. One
sandbox shared by the module."""
from __future__ import annotations

import re
from pathlib import Path

import pytest


def run(sbx, command: str, *, user: str = "sandbox", timeout_ms: int = 120_000) -> str:
    result = sbx.exec(command, user=user, timeout_ms=timeout_ms)
    assert result.exit_code == 0, (command, result.exit_code, result.stdout, result.stderr)
    return result.stdout


def version(text: str) -> tuple[int, ...]:
    found = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
    assert found, text
    return tuple(int(g) for g in found.groups() if g is not None)


def test_python_and_its_tools(sbx):
    assert version(run(sbx, "python --version")) >= (3, 12)
    assert run(sbx, "cat /etc/debian_version").startswith("13."), "not Debian trixie"
    assert run(sbx, "python --version") == run(sbx, "python3 --version")
    assert version(run(sbx, "pip --version")) >= (23,)
    assert version(run(sbx, "pip3 --version")) >= (23,)
    assert re.fullmatch(r"uv \d+\.\d+\.\d+.*\n", run(sbx, "uv --version"))
    assert re.fullmatch(r"uvx \d+\.\d+\.\d+.*\n", run(sbx, "uvx --version"))
    libs = run(sbx, "OPENBLAS_CORETYPE=Prescott python -c 'import numpy, pandas, matplotlib; "
                    "print(numpy.__version__, pandas.__version__, matplotlib.__version__)'")
    assert len(libs.split()) == 3, libs


@pytest.mark.timeout(600)
def test_javascript_runtimes_and_package_managers(sbx):
    # One command: each of these starts a JavaScript runtime, slow under TCG.
    out = run(sbx, "node --version; npm --version; npx --version; corepack --version; "
                   # Corepack's pnpm and yarn are in the image: no download on first use.
                   "COREPACK_ENABLE_NETWORK=0 pnpm --version; COREPACK_ENABLE_NETWORK=0 yarn --version; "
                   "bun --version; bun -e 'console.log(6 * 7)'; tsc --version; "
                   # node-gyp builds native addons against the image's node headers.
                   "npm config get nodedir; test -f /usr/local/include/node/node_api.h && echo headers; "
                   "echo $NODE_USE_ENV_PROXY", timeout_ms=540_000).splitlines()
    node, npm, npx, corepack, pnpm, yarn, bun, bun_run, tsc, nodedir, headers, env_proxy = out
    assert re.fullmatch(r"v24\.\d+\.\d+", node), out
    assert version(npm) >= (10,) and npx == npm, out
    for v in (corepack, pnpm, yarn, bun):
        assert re.fullmatch(r"\d+\.\d+\.\d+", v), out
    assert bun_run == "42", out
    assert version(tsc) >= (5,), out
    assert (nodedir, headers) == ("/usr/local", "headers"), out
    # Node's own fetch follows the proxy variables.
    assert env_proxy == "1", out


def test_build_and_command_line_tools(sbx):
    assert version(run(sbx, "gcc -dumpfullversion")) >= (14,)
    assert version(run(sbx, "g++ -dumpfullversion")) >= (14,)
    run(sbx, "command -v make git curl wget ssh zip unzip xz ip jq sqlite3 rg fd sudo")
    assert version(run(sbx, "git --version")) >= (2,)
    assert run(sbx, "ssh -V 2>&1").startswith("OpenSSH")
    assert run(sbx, "echo '{\"a\": [1, 2]}' | jq -c '.a | add'") == "3\n"
    assert run(sbx, "sqlite3 :memory: 'select 6 * 7'") == "42\n"
    assert run(sbx, "mkdir -p /tmp/env-rg && echo needle > /tmp/env-rg/hay.txt && rg -l needle /tmp/env-rg") \
        == "/tmp/env-rg/hay.txt\n"
    assert run(sbx, "fd hay /tmp/env-rg") == "/tmp/env-rg/hay.txt\n"
    # The interpreter's other languages, as commands too.
    assert version(run(sbx, "R --version | head -n 1")) >= (4, 5)
    assert version(run(sbx, "java -version 2>&1 | head -n 1")) >= (21,)
    assert version(run(sbx, "jshell --version 2>&1")) >= (21,)
    assert version(run(sbx, "go version")) >= (1, 24)
    # Go's standard packages are compiled in the user's build cache already
    # (with the interpreter's settings): a build compiles only its own main.
    out = run(sbx, "mkdir -p /tmp/env-go && cd /tmp/env-go && "
                   "printf 'package main\\nimport \"fmt\"\\nfunc main() { fmt.Println(\"go built\") }\\n' > main.go && "
                   "CGO_ENABLED=0 GOFLAGS=-mod=mod GOTOOLCHAIN=local GOPROXY=off go build -x -o hello main.go 2>&1 "
                   "| grep -o -- '-p [a-z/]* ' | sort -u; ./hello", timeout_ms=300_000)
    assert out == "-p main \ngo built\n", out
    # pip's setting for installs outside a venv, and no PEP 668 marker.
    assert "break-system-packages = true" in run(sbx, "cat /etc/pip.conf")
    assert run(sbx, "ls /usr/lib/python3*/EXTERNALLY-MANAGED 2>/dev/null | wc -l") == "0\n"
    # A C program builds and runs.
    assert run(sbx, "cd /tmp && printf '#include <stdio.h>\\nint main(void){puts(\"built\");}\\n' > c.c "
                    "&& gcc -o c c.c && ./c") == "built\n"


def test_who_commands_run_as(sbx):
    assert run(sbx, "whoami") == "runtime\n"
    assert run(sbx, "id -un; id -u; id -gn; id -g") == "runtime\n1000\nruntime\n1000\n"
    assert run(sbx, "echo $USER $LOGNAME $HOME; pwd") == "runtime runtime /workspace\n/workspace\n"
    assert run(sbx, "getent passwd runtime | cut -d: -f6,7") == "/workspace:/bin/bash\n"
    assert run(sbx, "echo $PATH").startswith("/workspace/.local/bin:")
    assert run(sbx, "stat -c %U:%G /workspace") == "runtime:runtime\n"
    quiet = sbx.exec("sudo -n true")
    assert quiet.exit_code == 0 and quiet.stderr == "", quiet  # the hostname resolves
    assert run(sbx, "sudo -n whoami") == "root\n"
    # sudo keeps the proxy settings (sudo pip install, sudo apt-get).
    assert run(sbx, "sudo -n sh -c 'echo $HTTPS_PROXY'") == run(sbx, "echo $HTTPS_PROXY")
    # A login shell (an image's start command) puts ~/.local/bin first too.
    assert run(sbx, "bash -lc 'echo $PATH'").startswith("/workspace/.local/bin:")


# A wheel is a zip: made in the sandbox with the standard library, no index.
MAKE_WHEEL = r"""
import sys, zipfile
name, out = sys.argv[1], sys.argv[2]
dist = f"{name}-1.0.dist-info"
files = {
    f"{name}.py": "ANSWER = 42\ndef main():\n    print('hello from', __name__)\n",
    f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n",
    f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: e2e\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    f"{dist}/entry_points.txt": f"[console_scripts]\n{name.replace('_', '-')} = {name}:main\n",
}
with zipfile.ZipFile(f"{out}/{name}-1.0-py3-none-any.whl", "w") as z:
    for path, text in files.items():
        z.writestr(path, text)
    z.writestr(f"{dist}/RECORD", "".join(f"{p},,\n" for p in [*files, f"{dist}/RECORD"]))
"""


@pytest.mark.timeout(600)
def test_pip_install_without_a_venv(sbx):
    sbx.exec("mkdir -p /tmp/wheels")
    for name in ("e2e_envpkg", "e2e_rootpkg", "e2e_venvpkg"):
        run(sbx, f"python - {name} /tmp/wheels <<'EOF'\n{MAKE_WHEEL}\nEOF")
    # As the user: into /workspace/.local, its command on PATH.
    out = run(sbx, "pip install --no-index /tmp/wheels/e2e_envpkg-1.0-py3-none-any.whl 2>&1",
              timeout_ms=240_000)
    assert "Successfully installed e2e-envpkg-1.0" in out, out
    where = run(sbx, "python -c 'import e2e_envpkg; print(e2e_envpkg.__file__, e2e_envpkg.ANSWER)'")
    assert re.fullmatch(r"/workspace/\.local/lib/python3\.\d+/site-packages/e2e_envpkg\.py 42\n", where), where
    assert run(sbx, "command -v e2e-envpkg; e2e-envpkg") == \
        "/workspace/.local/bin/e2e-envpkg\nhello from e2e_envpkg\n"
    assert run(sbx, "stat -c %U /workspace/.local/bin/e2e-envpkg") == "runtime\n"
    # Under sudo: into /usr/local.
    run(sbx, "sudo -n pip install --no-index /tmp/wheels/e2e_rootpkg-1.0-py3-none-any.whl", timeout_ms=240_000)
    where = run(sbx, "python -c 'import e2e_rootpkg; print(e2e_rootpkg.__file__)'")
    assert re.fullmatch(r"/usr/local/lib/python3\.\d+/dist-packages/e2e_rootpkg\.py\n", where), where
    assert run(sbx, "command -v e2e-rootpkg") == "/usr/local/bin/e2e-rootpkg\n"
    # In a venv: into the venv (the image's pip settings do not get in the way).
    # The system's pip installs into it: ensurepip alone takes minutes under TCG.
    run(sbx, "python -m venv --without-pip /tmp/venv && pip --python /tmp/venv/bin/python install "
             "--no-index /tmp/wheels/e2e_venvpkg-1.0-py3-none-any.whl", timeout_ms=240_000)
    where = run(sbx, "/tmp/venv/bin/python -c 'import e2e_venvpkg; print(e2e_venvpkg.__file__)'")
    assert re.fullmatch(r"/tmp/venv/lib/python3\.\d+/site-packages/e2e_venvpkg\.py\n", where), where
    assert sbx.exec("python -c 'import e2e_venvpkg'").exit_code != 0


# Two tiny packages with one command each, packed by one npm pack.
MAKE_NPM_PACKAGES = r"""
set -e
rm -rf /tmp/npm-pkgs && mkdir -p /tmp/npm-pkgs && cd /tmp/npm-pkgs
for name in "$@"; do
  mkdir "$name"
  printf '{"name": "%s", "version": "1.0.0", "bin": {"%s": "cli.js"}}\n' "$name" "$name" > "$name/package.json"
  printf '#!/usr/bin/env node\nconsole.log("hello from %s")\n' "$name" > "$name/cli.js"
done
npm pack --silent "${@/#/./}"
"""


@pytest.mark.timeout(900)
def test_npm_and_bun_global_installs_land_on_path(sbx):
    packed = run(sbx, f"bash -s e2e-npm-cli e2e-bun-cli <<'EOF'\n{MAKE_NPM_PACKAGES}\nEOF", timeout_ms=240_000)
    assert packed.split() == ["e2e-npm-cli-1.0.0.tgz", "e2e-bun-cli-1.0.0.tgz"], packed
    run(sbx, "npm install -g --no-audit --no-fund /tmp/npm-pkgs/e2e-npm-cli-1.0.0.tgz", timeout_ms=240_000)
    assert run(sbx, "command -v e2e-npm-cli; e2e-npm-cli; ls -d /workspace/.local/lib/node_modules/*") == \
        "/workspace/.local/bin/e2e-npm-cli\nhello from e2e-npm-cli\n/workspace/.local/lib/node_modules/e2e-npm-cli\n"
    # The user's prefix is the agent's NPM_CONFIG_PREFIX, which sudo drops:
    # root's npm keeps /usr/local (where a custom image's npm step installs).
    assert run(sbx, "echo $NPM_CONFIG_PREFIX; sudo -n sh -c 'echo ${NPM_CONFIG_PREFIX:-unset}'") == \
        "/workspace/.local\nunset\n"

    run(sbx, "bun add -g /tmp/npm-pkgs/e2e-bun-cli-1.0.0.tgz", timeout_ms=240_000)
    assert run(sbx, "command -v e2e-bun-cli; e2e-bun-cli") == \
        "/workspace/.local/bin/e2e-bun-cli\nhello from e2e-bun-cli\n"


# docs/environment.md's table, each version next to the command that prints
# the image's: (what the page says, a command, what its output says).
DOCUMENTED = [
    (r"Python (\S+) \(`python3`", "python --version", r"Python (\S+)"),
    (r"pip (\S+) \(`pip`", "pip --version", r"pip (\S+) "),
    (r"uv (\S+) \(`uv`", "uv --version", r"uv (\S+)"),
    (r"NumPy (\S+),", "python -c 'import numpy; print(numpy.__version__)'", r"(\S+)"),
    (r"pandas (\S+),", "python -c 'import pandas; print(pandas.__version__)'", r"(\S+)"),
    (r"matplotlib (\S+) \(", "python -c 'import matplotlib; print(matplotlib.__version__)'", r"([\d.]+)"),
    (r"Node\.js (\S+) \(`node`", "node --version", r"v(\S+)"),
    (r"npm (\S+) \(`npm`", "npm --version", r"(\S+)"),
    (r"Corepack (\S+) \(`corepack`", "corepack --version", r"(\S+)"),
    (r"pnpm (\S+) and yarn", "COREPACK_ENABLE_NETWORK=0 pnpm --version", r"(\S+)"),
    (r"yarn (\S+) ready offline", "COREPACK_ENABLE_NETWORK=0 yarn --version", r"(\S+)"),
    (r"TypeScript (\S+) \(`tsc`", "tsc --version", r"Version (\S+)"),
    (r"Bun (\S+) \(`bun`", "bun --version", r"(\S+)"),
    (r"gcc and g\+\+ (\S+),", "gcc -dumpfullversion", r"(\S+)"),
    (r"R (\S+) \(`r-base-core`", "R --version", r"R version (\S+)"),
    (r"OpenJDK (\S+) \(", "java -version 2>&1", r'version "([^"]+)"'),
    (r"Go (\S+) \(`golang-go`", "go version", r"go version go(\S+) "),
    (r"git (\S+), `curl`", "git --version", r"git version (\S+)"),
    (r"ripgrep (\S+)\)", "rg --version", r"ripgrep (\S+)"),
    (r"fd-find (\S+)\)", "fd --version", r"fdfind (\S+)"),
    (r"`jq` (\S+) \(", "jq --version", r"jq-(\S+)"),
    (r"`sqlite3` (\S+) \|", "sqlite3 --version", r"(\S+)"),
    (r"Docker Engine (\S+) \(", "docker --version", r"Docker version ([\d.]+)"),
    (r"Docker Compose (\S+) \(", "docker compose version", r"version v?([\d.]+)"),
]


@pytest.mark.timeout(600)
def test_the_documented_versions_are_the_images(sbx):
    page = (Path(__file__).resolve().parents[2] / "docs" / "environment.md").read_text()
    # One command (each JavaScript runtime starts slowly under TCG), a
    # marker line before each output; OpenBLAS as in the test above.
    script = "export OPENBLAS_CORETYPE=Prescott; " + "; ".join(
        f"echo '@@ {i}'; {cmd}" for i, (_, cmd, _) in enumerate(DOCUMENTED))
    out = run(sbx, script, timeout_ms=540_000)
    outputs = re.split(r"^@@ \d+\n", out, flags=re.M)[1:]
    assert len(outputs) == len(DOCUMENTED), out
    wrong = []
    for (doc, cmd, pattern), text in zip(DOCUMENTED, outputs):
        said = re.search(doc, page)
        assert said, f"docs/environment.md no longer says {doc!r}"
        found = re.search(pattern, text)
        assert found, (cmd, text)
        if said.group(1) != found.group(1):
            wrong.append(f"{cmd}: the page says {said.group(1)}, the image has {found.group(1)}")
    assert not wrong, "\n".join(wrong)
