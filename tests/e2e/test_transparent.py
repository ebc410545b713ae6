"""Programs that ignore the proxy variables, through the official client:
names resolve inside the sandbox to reserved addresses, any TCP
connection is carried to the host's egress proxy as a CONNECT and any UDP
flow as a connect-udp, under the same rules (docs/network.md, "Transparent
egress"). Root cannot go around it: without the redirect, traffic dies on
the agent's interface; DNS to any resolver is answered inside.

`example.net` is the suite's plain HTTP server; `ssh.example.com` a raw TCP
server that speaks first like sshd, then echoes lines upper-cased
(egress_servers.py).
"""
from __future__ import annotations

import json

from withruntime import Sandbox

from egress_servers import BANNER_NAME, UDP_NAME

# Every proxy variable gone: the program connects by itself.
BARE = "env -u HTTP_PROXY -u HTTPS_PROXY -u ALL_PROXY -u http_proxy -u https_proxy -u all_proxy"

# A raw HTTP request over a plain socket; prints the status line and body.
RAW_HTTP = """
import socket, sys
host, port = sys.argv[1], int(sys.argv[2])
try:
    c = socket.create_connection((host, port), timeout=15)
    c.sendall(b'GET /echo/raw HTTP/1.0\\r\\nHost: ' + host.encode() + b'\\r\\n\\r\\n')
    d = b''
    while True:
        b = c.recv(65536)
        if not b:
            break
        d += b
except OSError as e:
    print('failed', type(e).__name__, e)
    sys.exit(1)
if not d:
    print('failed closed')
    sys.exit(1)
print(d.decode(errors='replace'))
"""

# Reads the banner, sends a line, reads its echo.
BANNER_CLIENT = """
import socket, sys
try:
    c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=15)
    f = c.makefile('rwb')
    banner = f.readline()
    f.write(b'hello over tcp\\n'); f.flush()
    echo = f.readline()
except OSError as e:
    print('failed', type(e).__name__, e)
    sys.exit(1)
if not banner:
    print('failed closed')
    sys.exit(1)
print(banner.decode().strip(), '|', echo.decode().strip())
"""


# An A query over TCP to the sandbox's resolver; prints the id and the address.
DNS_OVER_TCP = r"""
import socket, sys
q = bytes.fromhex('123401000001000000000000')
for label in sys.argv[1].split('.'):
    q += bytes([len(label)]) + label.encode()
q += b'\0\0\1\0\1'
c = socket.create_connection(('127.0.0.53', 53), timeout=10)
c.sendall(len(q).to_bytes(2, 'big') + q)
n = int.from_bytes(c.recv(2), 'big')
a = b''
while len(a) < n:
    a += c.recv(n - len(a))
print(a[:2].hex(), socket.inet_ntoa(a[-4:]))
"""


# Sends datagrams on one connected socket, prints each answer (or why not).
UDP_CLIENT = """
import socket, sys
host, port, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.settimeout(15)
try:
    s.connect((host, port))
    for i in range(count):
        s.send(b'hello over udp ' + str(i).encode())
        print(s.recv(65536).decode().rsplit(' #', 1)[0])
except OSError as e:
    print('failed', e)
    sys.exit(1)
"""


def run(sbx, command: str, timeout_ms: int = 120_000) -> tuple[int, str, str]:
    r = sbx.exec(command, timeout_ms=timeout_ms)
    return r.exit_code, r.stdout, r.stderr


def py(sbx, script: str, *args: str) -> tuple[int, str]:
    sbx.files.write("/tmp/probe.py", script)
    code, out, err = run(sbx, f"{BARE} python3 /tmp/probe.py {' '.join(args)}")
    return code, (out + err).strip()


def test_names_resolve_inside_the_sandbox_to_reserved_addresses(server):
    with Sandbox.create() as s:
        code, out, err = run(s, "cat /etc/resolv.conf; getent ahostsv4 example.net | head -1;"
                                " getent ahostsv4 EXAMPLE.net | head -1; getent ahostsv4 a.example.org | head -1")
        assert code == 0, err
        assert "nameserver 127.0.0.53" in out, out
        first, again, other = [l.split()[0] for l in out.splitlines() if l and l[0].isdigit()]
        assert first.startswith(("198.18.", "198.19.")), out
        assert again == first, "the same name (in any case) keeps its address"
        assert other != first and other.startswith(("198.18.", "198.19.")), out
        # Over TCP too, with the same mapping.
        s.files.write("/tmp/dns_tcp.py", DNS_OVER_TCP)
        code, out, err = run(s, "python3 /tmp/dns_tcp.py example.net")
        assert code == 0 and out.split() == ["1234", first], (out, err)
        # No AAAA answers: programs use IPv4.
        code, out, _ = run(s, "python3 -c \"import socket; print(socket.getaddrinfo('example.net', 80, socket.AF_INET6))\"")
        assert code != 0, out


def test_raw_tcp_reaches_allowed_hosts_by_name_under_the_rules(server):
    with Sandbox.create() as s:
        code, out = py(s, RAW_HTTP, "example.net", "80")
        assert code == 0 and out.startswith("HTTP/1."), out
        body = out.split("\r\n\r\n", 1)[1] if "\r\n\r\n" in out else out.split("\n\n", 1)[1]
        assert json.loads(body)["path"] == "/echo/raw", out

        # Port 22 is not open by default: the proxy refuses, the program's
        # connection is reset.
        code, out = py(s, BANNER_CLIENT, BANNER_NAME, "22")
        assert code != 0 and "SSH-2.0" not in out, out

        answer = s.network.set(internet=True, connect=[f"{BANNER_NAME}:22"])
        assert 22 in answer["ports"]
        code, out = py(s, BANNER_CLIENT, BANNER_NAME, "22")
        assert code == 0, out
        assert out == "SSH-2.0-RuntimeTest | HELLO OVER TCP", out

        # ssh itself, which knows nothing of proxies: it reads the server's
        # version before the key exchange fails on the echo server.
        code, out, err = run(s, f"{BARE} timeout 30 ssh -v -o BatchMode=yes -o StrictHostKeyChecking=no"
                                f" -o ConnectTimeout=30 -p 22 {BANNER_NAME} true", timeout_ms=90_000)
        assert "remote software version RuntimeTest" in err, err[-2000:]

        # A change of the rules cuts a connection already open.
        script = (
            "import socket, os, time\n"
            f"c = socket.create_connection(('{BANNER_NAME}', 22), timeout=30)\n"
            "f = c.makefile('rwb')\n"
            "print('banner', f.readline().decode().strip(), flush=True)\n"
            "while not os.path.exists('/tmp/go'): time.sleep(0.05)\n"
            "try:\n"
            "    f.write(b'again\\n'); f.flush(); line = f.readline()\n"
            "    print('second', line.decode().strip() or 'closed')\n"
            "except OSError as e:\n"
            "    print('second closed', e)\n"
        )
        s.files.write("/tmp/keep.py", script)
        proc = s.spawn(f"{BARE} python3 /tmp/keep.py")
        events = proc.output(timeout_seconds=60)
        first = next(e for e in events if e["type"] in ("stdout", "exit"))
        events.close()
        assert first.get("data", "").startswith("banner SSH-2.0-RuntimeTest"), first
        s.network.set(internet=True)
        s.files.write("/tmp/go", "")
        result = proc.wait()
        assert "second closed" in result.stdout, result.stdout + result.stderr

        # Internet off: names still resolve, nothing connects.
        s.network.off()
        code, out = py(s, RAW_HTTP, "example.net", "80")
        assert code != 0 and "echo/raw" not in out, out


def test_udp_reaches_allowed_hosts_under_the_rules_and_a_refusal_is_heard_at_once(server):
    with Sandbox.create() as s:
        # Port 7777 is not open by default (UDP has TCP's ports): the proxy
        # refuses and the program hears it at once, not after its timeout.
        code, out = py(s, UDP_CLIENT, UDP_NAME, "7777", "1")
        assert code != 0 and "No route to host" in out, out

        s.network.set(internet=True, connect=[f"{UDP_NAME}:7777"])
        code, out = py(s, UDP_CLIENT, UDP_NAME, "7777", "3")
        assert code == 0, out
        assert out.splitlines() == [f"HELLO OVER UDP {i}" for i in range(3)], out

        # The rules change: a new flow is refused again.
        s.network.set(internet=True)
        code, out = py(s, UDP_CLIENT, UDP_NAME, "7777", "1")
        assert code != 0 and "No route to host" in out, out

        # Private addresses stay refused, on an open port too (QUIC's 443).
        code, out = py(s, UDP_CLIENT, "10.0.0.1", "443", "1")
        assert code != 0 and "No route to host" in out, out


def test_allow_lists_apply_to_names_and_literal_addresses(server):
    with Sandbox.create(network={"internet": True, "allow": ["*.example.org"]}) as s:
        # Names the rules could never allow still get an address; the host
        # refuses them at connect time.
        code, out = py(s, RAW_HTTP, "example.net", "80")
        assert code != 0 and "echo/raw" not in out, out
        # Private and reserved addresses, and a reserved address no name
        # maps to, are refused as through the proxy.
        for target in ("10.0.0.1", "169.254.169.254", "198.19.250.1", "192.168.1.1"):
            code, out = py(s, RAW_HTTP, target, "80")
            assert code != 0 and "HTTP/1." not in out, f"{target}: {out}"


# Deletes the agent's nftables table over netlink, as `nft delete table inet
# runtime` would; prints the kernel's answer (0: deleted).
DELETE_TABLE = r"""
import socket, struct
def msg(ty, flags, seq, family, attrs=b''):
    res = socket.htons(10) if ty in (0x10, 0x11) else 0
    body = struct.pack('=BBH', family, 0, res) + attrs
    return struct.pack('=IHHII', 16 + len(body), ty, flags, seq, 0) + body
name = b'runtime\0'
attr = struct.pack('=HH', 4 + len(name), 1) + name
s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 12)
s.sendto(msg(0x10, 1, 1, 0) + msg((10 << 8) | 2, 1 | 4, 2, 1, attr) + msg(0x11, 1, 3, 0), (0, 0))
r = s.recv(4096)
print('deleted', struct.unpack('=i', r[16:20])[0])
"""

# An ICMP echo over a raw socket; succeeds only if a reply comes back.
RAW_ICMP = r"""
import socket, sys
r = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
r.settimeout(3)
try:
    r.sendto(b'\x08\x00\xf7\xff\x00\x00\x00\x00', (sys.argv[1], 0))
    while True:
        data, src = r.recvfrom(2048)
        if src[0] == sys.argv[1]:
            print('reply from', src[0])
            sys.exit(0)
except OSError as e:
    print('no reply', e)
    sys.exit(1)
"""


def test_root_cannot_go_around_the_redirect(server):
    with Sandbox.create(user="root") as s:
        # A raw socket: its packets go to the agent's interface, no answer comes.
        code, out = py(s, RAW_ICMP, "93.184.215.14")
        assert code != 0, out
        # Another resolver: its queries over UDP are answered inside, with a
        # reserved address as ours are (nothing leaves as DNS); DNS over TCP
        # to it is a connection the rules refuse (port 53).
        s.files.write("/etc/resolv.conf", "nameserver 8.8.8.8\noptions timeout:1 attempts:1\n")
        code, out, _ = run(s, "getent ahostsv4 example.net")
        assert code == 0 and out.split()[0].startswith(("198.18.", "198.19.")), out
        code, out = py(s, RAW_HTTP, "8.8.8.8", "53")
        assert code != 0 and "HTTP/1." not in out, out
        s.files.write("/etc/resolv.conf", "nameserver 127.0.0.53\n")
        code, out = py(s, RAW_HTTP, "example.net", "80")
        assert code == 0, out
        # Rules deleted: connections go to the agent's interface and die.
        code, out = py(s, DELETE_TABLE)
        assert code == 0 and out == "deleted 0", out
        for host in ("example.net", "93.184.215.14"):
            code, out = py(s, RAW_HTTP, host, "80")
            assert code != 0 and "HTTP/1." not in out, f"{host}: {out}"
        # The proxy variables still work.
        code, out, err = run(s, "curl -sSf --max-time 30 http://example.net/echo/proxied")
        assert code == 0 and json.loads(out)["path"] == "/echo/proxied", err
