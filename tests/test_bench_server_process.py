"""bench.server_process: a server the benchmark started does not outlive the benchmark."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.helpers import REPO

# A benchmark stand-in: it starts a long-running child the way ServerProcess does, says the
# child's pid, and waits to be killed.
PARENT = """
import subprocess, sys, time
from bench.server_process import die_with_parent
child = subprocess.Popen(["sleep", "600"], preexec_fn=die_with_parent)
print(child.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")
@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL])
def test_the_server_ends_when_the_benchmark_is_killed(how: signal.Signals) -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    assert parent.stdout is not None
    child = psutil.Process(int(parent.stdout.readline()))
    assert child.is_running() and child.status() != psutil.STATUS_ZOMBIE
    os.kill(parent.pid, how)
    parent.wait(timeout=10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        time.sleep(0.05)
    else:
        child.kill()
        pytest.fail("the child outlived the process that started it")
