"""Running `affinity-proxy run` as a real process tree (supervisor + workers) from a test, and finding which
worker process serves a given client connection.

Which worker accepted a connection is the kernel's choice (SO_REUSEPORT hashes the 4-tuple), so the tests
look it up the way `ss -p` does: the connection's socket inode from /proc/net/tcp, then the process holding
that inode among /proc/PID/fd. Linux only, like SO_REUSEPORT balancing itself.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

REPO = Path(__file__).resolve().parents[2]
AFFINITY_PROXY = str(Path(sys.executable).with_name("affinity-proxy"))

# The supervisor's "N workers serving http HOST:PORT[, grpc HOST:PORT]; admin URL" line and the single-process
# "affinity-proxy (all) listening on URL (admin URL)" line: the only way to learn ports chosen as port 0.
_SERVING = re.compile(
    r"workers serving http (?P<host>[^\s:,]+):(?P<port>\d+)(?:, grpc (?P<grpc>[^\s;]+))?.*admin (?P<admin>http://\S+)"
)
_SINGLE = re.compile(r"listening on (?P<http>http://\S+) \(admin (?P<admin>http://[^\s)]+)\)")
START_TIMEOUT_S = 60.0


@dataclass
class ProxyProcess:
    proc: asyncio.subprocess.Process
    http: str = ""
    admin: str = ""
    grpc: str = ""  # host:port of the h2c/gRPC listener, when configured (supervisor mode)
    log: list[str] = field(default_factory=list)
    _pump: asyncio.Task[None] | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def port(self) -> int:
        return int(self.http.rsplit(":", 1)[1])

    def workers(self) -> list[int]:
        """Live worker pids: the supervisor's child processes."""
        children: list[int] = []
        for task in Path(f"/proc/{self.pid}/task").iterdir():
            try:
                children.extend(int(p) for p in (task / "children").read_text().split())
            except OSError:
                continue
        return sorted(children)

    async def terminate(self, timeout: float = 60.0) -> int:
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = await asyncio.wait_for(self.proc.wait(), timeout)
        except asyncio.TimeoutError:
            self.proc.kill()
            code = await self.proc.wait()
        if self._pump is not None:
            await asyncio.wait([self._pump], timeout=5)
        # Shown by pytest only when the test fails: the proxy's own account of what happened.
        print(f"--- affinity-proxy (pid {self.pid}) exited {code}; last log lines:", *self.log[-60:], sep="\n")
        return code


async def start_proxy(args: Sequence[str], env: dict[str, str] | None = None) -> ProxyProcess:
    """Start `args` (an affinity-proxy command line) and wait until it reports its listeners."""
    proc = await asyncio.create_subprocess_exec(
        *args, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE, cwd=REPO,
        env={**os.environ, **(env or {})},
    )
    pp = ProxyProcess(proc)
    ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def pump() -> None:
        assert proc.stderr is not None
        async for raw in proc.stderr:
            line = raw.decode(errors="replace").rstrip()
            pp.log.append(line)
            if line.startswith("{"):  # logging.format json (the default): match on the line's message
                try:
                    line = str(json.loads(line).get("message", line))
                except ValueError:
                    pass
            if not ready.done():
                if m := _SERVING.search(line):
                    pp.http, pp.admin = f"http://{m['host']}:{m['port']}", m["admin"]
                    pp.grpc = m["grpc"] or ""
                    ready.set_result(None)
                elif "(all) listening on" in line and (m := _SINGLE.search(line)):
                    pp.http, pp.admin = m["http"], m["admin"]
                    ready.set_result(None)
        if not ready.done():
            ready.set_exception(RuntimeError("proxy exited before serving:\n" + "\n".join(pp.log[-30:])))

    pp._pump = asyncio.create_task(pump())
    try:
        await asyncio.wait_for(asyncio.shield(ready), START_TIMEOUT_S)
    except BaseException:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        raise
    return pp


def _inode_of(local_port: int, server_port: int) -> str | None:
    """The server side of the connection client:local_port -> server:server_port, from /proc/net/tcp*."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            local, remote, inode = cols[1], cols[2], cols[9]
            # Skip TIME_WAIT leftovers of an earlier connection on the same ports (inode 0): loopback
            # reuses such port pairs at once (net.ipv4.tcp_tw_reuse=2).
            if inode == "0":
                continue
            if int(local.rsplit(":", 1)[1], 16) == server_port and int(remote.rsplit(":", 1)[1], 16) == local_port:
                return inode
    return None


def owner_of_connection(local_port: int, server_port: int, pids: Sequence[int]) -> int | None:
    """Which of `pids` holds the accepted socket of the client connection from `local_port`."""
    inode = _inode_of(local_port, server_port)
    if inode is None:
        return None
    target = f"socket:[{inode}]"
    for pid in pids:
        fd_dir = Path(f"/proc/{pid}/fd")
        try:
            for fd in fd_dir.iterdir():
                try:
                    if os.readlink(fd) == target:
                        return pid
                except OSError:
                    continue
        except OSError:
            continue
    return None


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes
    local_port: int


async def post_json(port: int, path: str, payload: object, inspect: Callable[[Reply], None] | None = None) -> Reply:
    """One HTTP/1.1 keep-alive request on a fresh connection; `inspect` runs while the connection is still
    open (so its server-side socket can still be found in a worker's fd table)."""
    import json

    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        body = json.dumps(payload).encode()
        writer.write(
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n".encode() + body
        )
        status_line = await reader.readline()
        status = int(status_line.split()[1])
        headers: dict[str, str] = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        if "content-length" in headers:
            data = await reader.readexactly(int(headers["content-length"]))
        else:
            chunks = []
            while (size := int((await reader.readline()).split(b";")[0], 16)) > 0:
                chunks.append(await reader.readexactly(size))
                await reader.readline()
            await reader.readline()
            data = b"".join(chunks)
        reply = Reply(status, headers, data, writer.get_extra_info("sockname")[1])
        if inspect is not None:
            inspect(reply)
        return reply
    finally:
        writer.close()
