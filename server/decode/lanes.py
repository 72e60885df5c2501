"""Decode lanes: where engine calls run. One lane runs one call at a time.

``ThreadLane`` is a thread of this process that owns an engine (MLX is not thread-safe, so
an engine lives on one thread only). ``ProcessLane`` is a child process with its own engine,
driven over a pipe by a thread of this process. On a CPU one engine call keeps one core busy
(one BLAS thread: more spin and starve the other stages), so each further core is a further
process lane: two lanes on two cores decode two batches at once, each as fast as one alone
(a 7 s window: 552 ms alone, 570 ms each with both lanes busy).

An engine call is a function of the engine, ``fn(engine) -> T``. For a process lane it is
pickled to the child, and so is its result: module-level functions, ``functools.partial``
of them and ``operator.methodcaller`` qualify. A lane whose child died raises ``LaneLost``
for the call it was running and every later one; the pipeline decides what to do about it.

``interrupt`` stops the call a lane is running at the engine's next step (the engine raises
``DecodeInterrupted``, ``server.core.engine_api.interruptible``), and never a later call:
calls are numbered, and the lane asks the engine to stop every call up to the number of the
one it runs now. A dropped decode or a stale search then frees its lane within a token step
rather than at its end.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import logging
import multiprocessing
import multiprocessing.connection
import pickle
import queue
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from server.core.engine_api import SpeechEngine, interruptible
from server.protocol.errors import DecodeError

logger = logging.getLogger("server.decode.lanes")

T = TypeVar("T")
EngineCall = Callable[[SpeechEngine], T]
LoadEngine = Callable[[], SpeechEngine]

# A child's engine load can take a minute on a cold disk; after that a missing answer to
# the stop request means the child hangs, and it is killed.
_CHILD_EXIT_TIMEOUT_S = 10.0


class LaneLost(DecodeError):
    """The lane's process died (killed, out of memory, crashed): the call did not finish."""


@dataclass(eq=False)
class _Call(Generic[T]):
    fn: Callable[[], T]
    future: asyncio.Future[T]


def settle_future(future: asyncio.Future[Any], value: Any, error: BaseException | None) -> None:
    """Resolve ``future`` unless it is done; runs on the loop."""
    # The awaiting coroutine may have been cancelled meanwhile.
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


class _Worker:
    """A thread that runs zero-argument functions one at a time; ``call`` awaits each.

    The thread blocks on its inbox between calls (no polling) and posts each outcome back to
    the event loop with ``call_soon_threadsafe``.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._inbox: queue.SimpleQueue[_Call[Any] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped: asyncio.Future[None] | None = None

    def start(self) -> None:
        """Start the thread; call from the event loop that will await ``call``."""
        if self._loop is not None:
            raise RuntimeError(f"lane {self.name} was already started")
        self._loop = asyncio.get_running_loop()
        self._stopped = self._loop.create_future()
        self._thread.start()

    async def call(self, fn: Callable[[], T]) -> T:
        if self._loop is None or self._stopped is None or self._stopped.done():
            raise RuntimeError(f"lane {self.name} is not running")
        future: asyncio.Future[T] = self._loop.create_future()
        self._inbox.put(_Call(fn, future))
        return await future

    async def stop(self) -> None:
        """Let the thread finish its current call, then end it; awaits the thread's exit."""
        if self._loop is None or self._stopped is None:
            return
        self._inbox.put(None)
        await asyncio.shield(self._stopped)
        self._thread.join()  # the thread has posted its last callback; this returns at once

    def _post(self, future: asyncio.Future[Any], value: Any, error: BaseException | None) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(settle_future, future, value, error)
        except RuntimeError:
            # The loop is closed: nobody is left to hear about this call.
            logger.debug("lane %s result dropped: event loop closed", self.name)

    def _run(self) -> None:
        assert self._stopped is not None
        try:
            while (call := self._inbox.get()) is not None:
                try:
                    value = call.fn()
                except Exception as exc:  # handed to the awaiting coroutine, which decides
                    self._post(call.future, None, exc)
                else:
                    self._post(call.future, value, None)
                del call  # drop references to windows and results before sleeping
        finally:
            self._post(self._stopped, None, None)


class ThreadLane:
    """A lane in this process: the engine lives on the lane's thread."""

    def __init__(self, name: str = "whisperwire-decode") -> None:
        self.name = name
        self._worker = _Worker(name)
        self._engine: SpeechEngine | None = None
        self._calls = 0  # calls made, numbered from 1
        self._interrupted_through = 0  # calls up to this number are asked to stop

    @property
    def alive(self) -> bool:
        return True

    async def load(self, load_engine: LoadEngine) -> SpeechEngine:
        """Start the thread and load the engine on it; raises what ``load_engine`` raises."""
        self._worker.start()
        self._engine = await self._worker.call(load_engine)
        return self._engine

    async def call(self, fn: EngineCall[T]) -> T:
        engine = self._engine
        if engine is None:
            raise RuntimeError(f"lane {self.name} has no engine; await load() first")
        self._calls += 1
        number = self._calls

        def run() -> T:
            with interruptible(lambda: self._interrupted_through >= number):
                return fn(engine)

        return await self._worker.call(run)

    def interrupt(self) -> None:
        """Ask the call running now, if any, to stop (see the module docstring)."""
        self._interrupted_through = self._calls

    async def stop(self) -> None:
        await self._worker.stop()


class ProcessLane:
    """A lane in a child process (spawned, so it shares no MLX or BLAS state with us).

    A thread of this process sends each call down a pipe and waits for the answer, so the
    event loop never blocks on the pipe. ``load_engine`` must pickle.
    """

    def __init__(self, name: str, on_lost: Callable[[ProcessLane], None] | None = None) -> None:
        self.name = name
        # Called on the loop when the child ends on its own (killed while idle, say), not
        # only when a call finds it gone.
        self._on_lost = on_lost
        self._watched: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self._worker = _Worker(f"{name}-pipe")
        self._process: multiprocessing.process.BaseProcess | None = None
        self._conn: multiprocessing.connection.Connection | None = None
        self._ready = False  # the child answered that its engine is loaded
        self._lost = False
        self._calls = 0  # calls sent, numbered from 1, as the child counts them
        # Shared with the child: calls up to this number are asked to stop.
        self._interrupted_through: Any = None

    @property
    def alive(self) -> bool:
        """Loaded and still running."""
        return (
            self._ready
            and not self._lost
            and self._process is not None
            and self._process.is_alive()
        )

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    @property
    def exitcode(self) -> int | None:
        """The child's exit status once it ended (negative: killed by that signal)."""
        return None if self._process is None else self._process.exitcode

    async def load(self, load_engine: LoadEngine) -> None:
        """Spawn the child and wait until it loaded its engine; raises what loading raised
        there (``LaneLost`` if the child died before answering)."""
        context = multiprocessing.get_context("spawn")
        ours, theirs = context.Pipe()
        self._conn = ours
        self._interrupted_through = context.RawValue(ctypes.c_int64, 0)
        self._process = context.Process(
            target=_serve,
            args=(
                theirs,
                load_engine,
                logging.getLogger().getEffectiveLevel(),
                self._interrupted_through,
            ),
            name=self.name,
            daemon=True,
        )
        try:
            self._process.start()  # pickles load_engine, here, before the child exists
        except (pickle.PicklingError, AttributeError, TypeError) as exc:
            ours.close()
            theirs.close()
            self._process = None
            raise ValueError(
                "a process lane needs a load_engine that pickles (a module-level function, "
                f"or functools.partial of one): {exc}"
            ) from exc
        theirs.close()  # the child holds its end: our copy would hide the child's exit as EOF
        self._watched = asyncio.get_running_loop()
        self._watched.add_reader(self._process.sentinel, self._exited)
        self._worker.start()
        await self._worker.call(self._answer)
        self._ready = True
        logger.info("lane %s ready (pid %s)", self.name, self._process.pid)

    async def call(self, fn: EngineCall[T]) -> T:
        if self._lost:
            raise LaneLost(f"lane {self.name} is gone")
        self._calls += 1
        result: T = await self._worker.call(lambda: self._exchange(fn))
        return result

    def interrupt(self) -> None:
        """Ask the call running now, if any, to stop (see the module docstring)."""
        if self._interrupted_through is not None:
            self._interrupted_through.value = self._calls

    async def stop(self) -> None:
        """Ask the child to exit after its current call, wait for it (kill it if it hangs)."""
        if self._process is None:
            return
        self._stopping = True
        self._unwatch()
        await self._worker.stop()
        if self._conn is not None and not self._lost:
            with contextlib.suppress(OSError, ValueError):  # the child is gone already
                self._conn.send(None)
        process = self._process
        await asyncio.to_thread(process.join, _CHILD_EXIT_TIMEOUT_S)
        if process.is_alive():
            logger.warning("lane %s did not exit; killing it", self.name)
            process.kill()
            await asyncio.to_thread(process.join)
        if self._conn is not None:
            self._conn.close()

    def _exited(self) -> None:
        self._unwatch()
        if self._stopping:
            return
        self._lost = True
        logger.error("lane %s ended (exit code %s)", self.name, self.exitcode)
        if self._on_lost is not None:
            self._on_lost(self)

    def _unwatch(self) -> None:
        if self._watched is not None and self._process is not None:
            self._watched.remove_reader(self._process.sentinel)
            self._watched = None

    def kill(self) -> None:
        """Kill the child now (tests: a lane that dies mid-call)."""
        if self._process is not None:
            self._process.kill()

    # -- on the pipe thread ------------------------------------------------------------
    def _exchange(self, fn: EngineCall[T]) -> T:
        assert self._conn is not None
        try:
            self._conn.send(fn)
        except (OSError, ValueError) as exc:
            self._lost = True
            raise LaneLost(f"lane {self.name} is gone: {exc}") from exc
        value: T = self._answer()
        return value

    def _answer(self) -> Any:
        assert self._conn is not None and self._process is not None
        try:
            ok, value = self._conn.recv()
        except (EOFError, OSError) as exc:
            self._lost = True
            self._process.join(_CHILD_EXIT_TIMEOUT_S)
            raise LaneLost(f"lane {self.name} died (exit code {self._process.exitcode})") from exc
        if not ok:
            raise value
        return value


# --------------------------------------------------------------------------- the child


def _serve(
    conn: multiprocessing.connection.Connection,
    load_engine: LoadEngine,
    log_level: int,
    interrupted_through: Any,
) -> None:
    """The child's main: load the engine, then answer calls until told to stop or orphaned."""
    # Ctrl-C reaches the whole process group, and systemd sends SIGTERM to the whole cgroup:
    # the parent's shutdown (draining its sessions first) stops us in order, and the pipe's
    # EOF ends us if the parent is gone.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(
        level=log_level,
        # The server's line shape; the brackets hold the lane where its lines hold a session.
        format="%(asctime)s %(levelname)s %(name)s [%(processName)s] %(message)s",
    )
    try:
        engine = load_engine()
    except Exception as exc:
        conn.send((False, _portable(exc)))
        return
    conn.send((True, engine.name))
    number = 0
    while True:
        try:
            fn = conn.recv()
        except (EOFError, OSError):
            return  # the parent is gone
        if fn is None:
            return
        number += 1
        try:
            with interruptible(functools.partial(_reached, interrupted_through, number)):
                answer = (True, fn(engine))
        except Exception as exc:
            answer = (False, _portable(exc))
        del fn  # drop the windows before waiting for the next call
        try:
            conn.send(answer)
        except (pickle.PicklingError, AttributeError, TypeError) as exc:
            conn.send((False, DecodeError(f"the lane's answer does not pickle: {exc}")))


def _reached(interrupted_through: Any, number: int) -> bool:
    return bool(interrupted_through.value >= number)


def _portable(exc: Exception) -> Exception:
    """``exc`` if it survives pickling, else a ``DecodeError`` that says what it was."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return DecodeError(f"{type(exc).__name__}: {exc}")
    return exc
