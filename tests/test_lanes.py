"""Decode lanes: a thread of this process, and child processes with their own engine.

The process lanes here run the real spawn machinery: a fresh interpreter that unpickles the
engine factory, loads it, and answers calls over a pipe. ``GatedEngine`` (tests/helpers.py)
holds a call inside the engine with ``multiprocessing`` primitives, so a test knows a call is
running in the child before it kills the child.
"""

from __future__ import annotations

import asyncio
import functools
import multiprocessing
import operator
import os
import signal
from collections.abc import AsyncIterator

import numpy as np
import pytest
import pytest_asyncio

from server.core.engine_api import DecodeInterrupted, DecodeRequest, DecodeResult, Window
from server.decode.lanes import LaneLost, ProcessLane, ThreadLane
from server.protocol.errors import ModelError
from tests.helpers import GatedEngine, ScriptedEngine, scripted_engine

pytestmark = pytest.mark.asyncio(loop_scope="session")

WAIT_S = 60.0  # a child loads an interpreter and its imports; only a bug waits this long


def windows(*seconds: float) -> list[Window]:
    return [
        Window(np.full(round(s * 100), 0.1, dtype=np.float32), DecodeRequest(s)) for s in seconds
    ]


def failing_engine() -> ScriptedEngine:
    raise ModelError("no model at /nowhere")


@pytest_asyncio.fixture(loop_scope="session")
async def process_lane() -> AsyncIterator[ProcessLane]:
    lane = ProcessLane("test-lane")
    await asyncio.wait_for(lane.load(scripted_engine), WAIT_S)
    try:
        yield lane
    finally:
        await lane.stop()


async def test_a_thread_lane_runs_each_call_on_its_engine() -> None:
    lane = ThreadLane("test-thread-lane")
    engine = await lane.load(scripted_engine)
    try:
        results = await lane.call(operator.methodcaller("decode_windows", windows(1.0, 2.0)))
        assert [r.text for r in results] == [" w0 w1", " w0 w1 w2 w3"]
        assert await lane.call(operator.methodcaller("warmup")) == 0.0
        assert isinstance(engine, ScriptedEngine) and engine.warmups == 1
        with pytest.raises(ValueError):
            await lane.call(operator.methodcaller("features", "not audio"))
    finally:
        await lane.stop()


async def test_a_process_lane_decodes_what_this_process_would(process_lane: ProcessLane) -> None:
    batch = windows(0.5, 1.5, 3.0)
    results = await process_lane.call(operator.methodcaller("decode_windows", batch))
    assert results == ScriptedEngine().decode_windows(batch)
    assert process_lane.alive and process_lane.pid is not None


async def test_an_error_in_the_child_reaches_the_caller_and_the_lane_goes_on(
    process_lane: ProcessLane,
) -> None:
    with pytest.raises(ValueError, match=r"could not convert"):
        await process_lane.call(operator.methodcaller("features", "not audio"))
    results = await process_lane.call(operator.methodcaller("decode_windows", windows(1.0)))
    assert results[0].text == " w0 w1"


async def test_an_engine_the_child_cannot_load_raises_its_error() -> None:
    lane = ProcessLane("test-lane-no-model")
    try:
        with pytest.raises(ModelError, match="no model at /nowhere"):
            await asyncio.wait_for(lane.load(failing_engine), WAIT_S)
    finally:
        await lane.stop()
    assert not lane.alive


async def test_a_load_engine_that_does_not_pickle_is_refused_before_spawning() -> None:
    lane = ProcessLane("test-lane-lambda")
    with pytest.raises(ValueError, match="pickles"):
        await lane.load(lambda: ScriptedEngine())
    assert lane.pid is None


async def test_a_child_killed_mid_call_fails_that_call_and_every_later_one() -> None:
    context = multiprocessing.get_context("spawn")
    gate, entered = context.Semaphore(0), context.Semaphore(0)
    lane = ProcessLane("test-lane-killed")
    await asyncio.wait_for(lane.load(functools.partial(GatedEngine, gate, entered)), WAIT_S)
    try:
        call = asyncio.ensure_future(
            lane.call(operator.methodcaller("decode_windows", windows(1.0)))
        )
        assert await asyncio.to_thread(entered.acquire, True, WAIT_S), "the call never entered"
        lane.kill()
        with pytest.raises(LaneLost, match="died"):
            await asyncio.wait_for(call, WAIT_S)
        assert not lane.alive
        with pytest.raises(LaneLost):
            await lane.call(operator.methodcaller("warmup"))
    finally:
        gate.release()
        await lane.stop()


async def test_stop_lets_the_child_exit_cleanly(process_lane: ProcessLane) -> None:
    await process_lane.stop()
    assert not process_lane.alive
    assert process_lane.exitcode == 0


async def test_a_signal_to_the_whole_process_group_leaves_the_child_to_the_parent(
    process_lane: ProcessLane,
) -> None:
    # systemd's SIGTERM reaches every process of the service; Ctrl-C the whole group.
    assert process_lane.pid is not None
    for sig in (signal.SIGTERM, signal.SIGINT):
        os.kill(process_lane.pid, sig)
    results = await process_lane.call(operator.methodcaller("decode_windows", windows(1.0)))
    assert results[0].text == " w0 w1" and process_lane.alive
    await process_lane.stop()
    assert process_lane.exitcode == 0


@pytest.mark.parametrize("kind", ["thread", "process"])
async def test_interrupt_stops_the_call_running_and_never_a_later_one(kind: str) -> None:
    """Calls held in a ``GatedEngine``, which checks for an interruption while it waits as the
    real engine does between token steps. An interruption asked while the lane is idle
    stops nothing; one asked during a call stops that call, and the next runs to its end."""
    context = multiprocessing.get_context("spawn")
    gate, entered = context.Semaphore(0), context.Semaphore(0)
    load = functools.partial(GatedEngine, gate, entered)
    lane: ThreadLane | ProcessLane = (
        ThreadLane("test-lane") if kind == "thread" else ProcessLane("test-lane")
    )
    await asyncio.wait_for(lane.load(load), WAIT_S)

    def decode(seconds: float) -> asyncio.Future[list[DecodeResult]]:
        return asyncio.ensure_future(
            lane.call(operator.methodcaller("decode_windows", windows(seconds)))
        )

    async def enters() -> None:
        assert await asyncio.to_thread(entered.acquire, True, WAIT_S), "no call entered"

    try:
        gate.release()
        assert (await decode(1.0))[0].text == " w0 w1"
        lane.interrupt()  # idle
        held = decode(2.0)
        await enters()
        await enters()  # the first call's entry, then this one's
        await asyncio.sleep(0.2)
        assert not held.done(), "an interruption asked while idle stopped a later call"
        lane.interrupt()
        with pytest.raises(DecodeInterrupted):
            await asyncio.wait_for(held, WAIT_S)
        gate.release()
        assert (await asyncio.wait_for(decode(1.5), WAIT_S))[0].text == " w0 w1 w2"
    finally:
        gate.release()
        await lane.stop()
