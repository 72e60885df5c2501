"""A server under test as a subprocess, with its CPU and RSS sampled by psutil.

Each server runs in its own process so that its CPU time and memory are its own and the two
servers are measured the same way; only one runs at a time, so they never share the 2 cores.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import psutil

from bench.http_probe import http_get

logger = logging.getLogger("bench.server_process")


@dataclass(frozen=True)
class Sample:
    wall_s: float  # perf_counter
    rss_bytes: int  # the server and its children
    cpu_percent: float  # since the previous sample; 100 = one core


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class ResourceSampler:
    """Samples a process tree's RSS and CPU every ``interval_s`` on a thread.

    A thread, not a task: the event loop is busy pacing audio and reading messages, and a
    sample must not wait for it.
    """

    def __init__(self, pid: int, interval_s: float = 0.5) -> None:
        self._process = psutil.Process(pid)
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._samples: list[Sample] = []
        self._thread = threading.Thread(target=self._run, name="resource-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def samples(self, since_s: float = 0.0, until_s: float = float("inf")) -> list[Sample]:
        with self._lock:
            return [s for s in self._samples if since_s <= s.wall_s <= until_s]

    def _cpu_seconds(self, procs: list[psutil.Process]) -> float:
        total = 0.0
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                t = p.cpu_times()
                total += t.user + t.system
        return total

    def _tree(self) -> list[psutil.Process]:
        with contextlib.suppress(psutil.NoSuchProcess):
            return [self._process, *self._process.children(recursive=True)]
        return []

    def _run(self) -> None:
        last_wall = time.perf_counter()
        last_cpu = self._cpu_seconds(self._tree())
        # Event.wait doubles as the sampling clock and the stop signal.
        while not self._stop.wait(self._interval_s):
            procs = self._tree()
            if not procs:
                return
            rss = 0
            for p in procs:
                with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                    rss += p.memory_info().rss
            wall, cpu = time.perf_counter(), self._cpu_seconds(procs)
            sample = Sample(wall, rss, 100.0 * (cpu - last_cpu) / max(wall - last_wall, 1e-9))
            last_wall, last_cpu = wall, cpu
            with self._lock:
                self._samples.append(sample)


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent() -> None:
    """Run in the child between fork and exec (Linux): SIGTERM to the child when the process
    that started it dies. A benchmark stopped by SIGTERM or SIGKILL runs none of its cleanup,
    and its server would go on holding a core and a port under the next run's figures."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class ServerProcess:
    """Start a server command, wait until ``ready`` says so, sample it, stop it."""

    def __init__(
        self,
        name: str,
        cmd: list[str],
        *,
        ready: Callable[[], Awaitable[bool]],
        env: dict[str, str] | None = None,
        log_path: Path,
        ready_timeout_s: float = 300.0,
    ) -> None:
        self.name = name
        self._cmd = cmd
        self._ready = ready
        self._env = env
        self._log_path = log_path
        self._ready_timeout_s = ready_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None
        self.sampler: ResourceSampler | None = None
        self.startup_s = 0.0

    async def __aenter__(self) -> ServerProcess:
        self._log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self._log_path.open("wb")
        started = time.perf_counter()
        self._proc = subprocess.Popen(
            self._cmd, env=self._env, stdout=log, stderr=log, preexec_fn=die_with_parent
        )
        log.close()
        logger.info("started %s (pid %d): %s", self.name, self._proc.pid, " ".join(self._cmd))
        try:
            await self._wait_ready()
        except BaseException:
            self._terminate()
            raise
        self.startup_s = time.perf_counter() - started
        self.sampler = ResourceSampler(self._proc.pid)
        self.sampler.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.sampler is not None:
            self.sampler.stop()
        self._terminate()

    async def _wait_ready(self) -> None:
        assert self._proc is not None
        deadline = time.perf_counter() + self._ready_timeout_s
        delay = 0.05
        # A subprocess has no readiness event to await: ask, backing off, until it answers,
        # exits or the deadline passes.
        while not await self._ready():
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self._proc.returncode}; see {self._log_path}"
                )
            if time.perf_counter() > deadline:
                raise TimeoutError(f"{self.name} not ready after {self._ready_timeout_s} s")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    def _terminate(self) -> None:
        if self._proc is None or self._proc.poll() is not None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            logger.warning("%s did not stop on SIGTERM; killing it", self.name)
            self._proc.kill()
            self._proc.wait()


async def http_ok(url: str) -> bool:
    """True when GET ``url`` (http://127.0.0.1:PORT/path) answers 200."""
    try:
        status, _, _ = await http_get(url)
    except OSError:
        return False
    return status == 200


async def port_open(host: str, port: int) -> bool:
    """True when a TCP connection to ``host:port`` succeeds."""
    try:
        _, writer = await asyncio.open_connection(host, port)
    except OSError:
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True
