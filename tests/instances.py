"""Real processes for the deploy tests: ``whisperwire-server`` instances and HAProxy.

A subprocess has no readiness event to await. A server's log says ``listening on`` once its
model is warm, and its log is read line by line as it comes; HAProxy's view of its servers is
asked on its stats page, in a bounded poll that backs off.

``haproxy_config`` turns the shipped ``deploy/haproxy/haproxy.cfg`` into one for loopback
ports by replacing only its addresses, so what the tests run is the file as shipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import os
import shutil
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from bench.http_probe import http_get
from tests.helpers import REPO

HAPROXY_CFG = REPO / "deploy" / "haproxy" / "haproxy.cfg"
FRONTEND = "whisperwire"  # the shipped config's frontend and backend
STATS_FRONTEND = "stats"
START_S = 300.0  # bound on a server's start with the real model on a busy 2-core machine


def free_port() -> int:
    """A loopback port nobody listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def haproxy_binary() -> str:
    """The ``haproxy`` executable. Missing: the test fails under CI (``make test`` installs
    it), and is skipped elsewhere with the way to get it."""
    found = shutil.which("haproxy")
    if found is None:
        if os.environ.get("CI") == "true":
            pytest.fail("haproxy is not installed; `make haproxy` installs Debian's package")
        pytest.skip("haproxy is not installed: make haproxy (apt-get install haproxy)")
    return found


def haproxy_config(shipped: str, *, frontend_port: int, stats_port: int, servers: list[int]) -> str:
    """``shipped`` with its listening addresses on loopback ports and one ``server`` line
    per port in ``servers`` (named ww1, ww2, ...); every other line is kept as it is."""
    out: list[str] = []
    section = ""
    for line in shipped.splitlines():
        words = line.split()
        if line and not line[0].isspace():
            section = " ".join(words[:2])
        elif words and words[0] == "bind" and section == f"frontend {FRONTEND}":
            line = f"    bind 127.0.0.1:{frontend_port}"
        elif words and words[0] == "bind" and section == f"frontend {STATS_FRONTEND}":
            line = f"    bind 127.0.0.1:{stats_port}"
        elif words and words[0] == "server" and section == f"backend {FRONTEND}":
            if words[1] != "ww1":
                continue  # the first server line stands for all of them
            out.extend(f"    server ww{i} 127.0.0.1:{p}" for i, p in enumerate(servers, 1))
            continue
        out.append(line)
    return "\n".join(out) + "\n"


async def wait_until(
    what: str, check: Callable[[], Awaitable[bool]], *, timeout_s: float = 30.0
) -> None:
    """Ask ``check`` until it says True, backing off from 50 ms to 0.5 s; fail after
    ``timeout_s`` naming ``what`` was awaited."""
    deadline = time.monotonic() + timeout_s
    delay_s = 0.05
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up after {timeout_s:g} s waiting for: {what}")
        await asyncio.sleep(delay_s)
        delay_s = min(2 * delay_s, 0.5)


class ServerInstance:
    """One ``whisperwire-server`` process on a loopback port, its log in a file."""

    def __init__(self, name: str, port: int, args: list[str], log_path: Path) -> None:
        self.name = name
        self.port = port
        self.args = args
        self.log_path = log_path
        self.process: asyncio.subprocess.Process | None = None
        self._listening = asyncio.Event()
        self._log_reader: asyncio.Task[None] | None = None
        self.started_at = 0.0
        self.ready_after_s = 0.0  # from start to "listening on" (model loaded and warm)

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def stream_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/stream"

    async def start(self) -> None:
        """Start the process; returns once it runs (its model may still be loading)."""
        script = Path(sys.executable).with_name("whisperwire-server")
        command = [str(script)] if script.is_file() else [sys.executable, "-m", "server.serve.cli"]
        self._listening.clear()
        self.started_at = time.monotonic()
        self.process = await asyncio.create_subprocess_exec(
            *command,
            *("--host", "127.0.0.1", "--port", str(self.port), *self.args),
            cwd=REPO,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        self._log_reader = asyncio.create_task(self._read_log(self.process))

    async def _read_log(self, process: asyncio.subprocess.Process) -> None:
        assert process.stderr is not None
        with self.log_path.open("ab") as log:
            async for line in process.stderr:
                log.write(line)
                log.flush()
                if b"listening on " in line and not self._listening.is_set():
                    self.ready_after_s = time.monotonic() - self.started_at
                    self._listening.set()

    async def wait_ready(self, timeout_s: float = START_S) -> None:
        """Wait until the model is warm and the server listens; fails if it exits first."""
        assert self.process is not None and self._log_reader is not None
        listening = asyncio.ensure_future(self._listening.wait())
        exited = asyncio.ensure_future(self.process.wait())
        try:
            done, _ = await asyncio.wait(
                {listening, exited}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            listening.cancel()
            exited.cancel()
        assert listening in done, f"{self.name} did not become ready:\n{self.log_tail()}"

    def signal(self, sig: signal.Signals) -> None:
        assert self.process is not None
        self.process.send_signal(sig)

    async def wait_exit(self, timeout_s: float = 120.0) -> int:
        """The exit status, once the process has ended and its log is read."""
        assert self.process is not None and self._log_reader is not None
        code = await asyncio.wait_for(self.process.wait(), timeout_s)
        await self._log_reader
        return code

    async def stop(self) -> None:
        """Kill the process if it still runs (a test that failed midway)."""
        if self.process is not None and self.process.returncode is None:
            self.process.kill()
            await self.process.wait()
        if self._log_reader is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._log_reader

    async def get(self, path: str) -> tuple[int, str]:
        status, _, body = await http_get(self.http_url + path)
        return status, body.decode()

    def log_tail(self, lines: int = 30) -> str:
        if not self.log_path.is_file():
            return "(no log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def unchunk(body: bytes) -> bytes:
    """An HTTP/1.1 chunked body (what HAProxy's stats page sends) put back together."""
    out = bytearray()
    while body:
        size_line, _, rest = body.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        out += rest[:size]
        body = rest[size + 2 :]
    return bytes(out)


class Haproxy:
    """A real ``haproxy`` process in the foreground, from a config file."""

    def __init__(self, config_path: Path, log_path: Path, stats_port: int) -> None:
        self.config_path = config_path
        self.log_path = log_path
        self.stats_url = f"http://127.0.0.1:{stats_port}/stats;csv"
        self.process: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        log = self.log_path.open("wb")
        try:
            self.process = await asyncio.create_subprocess_exec(
                haproxy_binary(), "-db", "-f", str(self.config_path), stdout=log, stderr=log
            )
        finally:
            log.close()
        await wait_until("HAProxy to answer on its stats page", self._answers, timeout_s=30.0)

    async def _answers(self) -> bool:
        assert self.process is not None
        if self.process.returncode is not None:
            raise AssertionError(f"haproxy exited:\n{self.log_path.read_text()}")
        try:
            await self.states()
        except OSError:
            return False
        return True

    async def states(self) -> dict[str, str]:
        """Each server's status as HAProxy sees it: ``UP``, ``DOWN``, ``UP 1/2``, ..."""
        status, headers, body = await http_get(self.stats_url)
        assert status == 200, status
        if headers.get("transfer-encoding") == "chunked":
            body = unchunk(body)
        rows = csv.DictReader(body.decode().lstrip("# ").splitlines())
        return {
            row["svname"]: row["status"]
            for row in rows
            if row["pxname"] == FRONTEND and row["svname"] not in ("FRONTEND", "BACKEND")
        }

    async def wait_for(self, server: str, status: str, timeout_s: float = 30.0) -> None:
        """Wait until HAProxy reports ``server`` with exactly ``status``."""

        async def reached() -> bool:
            return (await self.states()).get(server) == status

        await wait_until(f"HAProxy to see {server} {status}", reached, timeout_s=timeout_s)

    async def stop(self) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.process.wait(), 10.0)
            except asyncio.TimeoutError:
                self.process.kill()
                await self.process.wait()
