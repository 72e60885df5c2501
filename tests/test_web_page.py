"""The browser page in real headless Chromium, driven by Playwright, against a real server.

Chromium's fake microphone plays a clip from ``shared/speech`` in a loop, in real time; the
page captures it through its AudioWorklet, streams it to the ``server_url`` fixture's server
(tiny.en, in this process) and shows what comes back. Waits are on page conditions
(``wait_for_function``) with bounds, never fixed sleeps. Facts about Chromium's fake devices:
``shared/docs/BROWSER-TESTING.md``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from playwright.async_api import Browser, Page, Playwright, async_playwright
from playwright.async_api import TimeoutError as PlaywrightTimeoutError

pytestmark = [
    pytest.mark.asyncio(loop_scope="session"),
    pytest.mark.browser,
    pytest.mark.skipif(
        not Path("/usr/bin/chromium").is_file(),
        reason="Debian's Chromium is not at /usr/bin/chromium (`make browser` installs it)",
    ),
]

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
CLIP = "misc_en/jfk.wav"  # 11 s, 16 kHz mono 16-bit: a format the fake device plays
PHRASE = "ask not what your country can do for you"
WORDS_WAIT_MS = 120_000  # real-time audio, then the real model on a busy 2-core machine
STATE_WAIT_MS = 30_000  # page state changes: permission answers, stopping

# Flags measured to work as root in headless mode (shared/docs/BROWSER-TESTING.md).
BASE_ARGS = (
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--use-fake-device-for-media-stream",
    "--autoplay-policy=no-user-gesture-required",
)

# The finals on the page, lower-cased with punctuation dropped, as one line.
FINAL_TEXT_JS = """() => [...document.querySelectorAll('#transcript .final')]
    .map((e) => e.textContent).join(' ').toLowerCase()
    .replace(/[^a-z' ]+/g, ' ').replace(/\\s+/g, ' ').trim()"""

# Records every distinct text the partial span showed: it is replaced in place and removed
# when its final lands, so a check at the end could not see it.
RECORD_PARTIALS_JS = """() => {
  window.seenPartials = [];
  const transcript = document.getElementById('transcript');
  new MutationObserver(() => {
    for (const el of transcript.querySelectorAll('.partial')) {
      const text = el.textContent.trim();
      if (text && window.seenPartials[window.seenPartials.length - 1] !== text) {
        window.seenPartials.push(text);
      }
    }
  }).observe(transcript, { childList: true, subtree: true, characterData: true });
}"""


def page_url(server_url: str) -> str:
    """The page's address: the server's HTTP side on the same host and port."""
    return "http" + server_url.removeprefix("ws") + "/"


async def launch(pw: Playwright, *extra_args: str) -> Browser:
    return await pw.chromium.launch(
        executable_path=CHROMIUM, headless=True, args=[*BASE_ARGS, *extra_args]
    )


async def page_state(page: Page) -> dict[str, Any]:
    """What the page shows and counts, for failure messages."""
    state: dict[str, Any] = await page.evaluate(
        """() => ({
          state: document.body.dataset.state,
          status: document.getElementById('status').textContent,
          transcript: document.getElementById('transcript').textContent,
          ttft: document.getElementById('ttft').textContent,
          whisperwire: window.whisperwire,
        })"""
    )
    return state


async def wait_until(page: Page, expression: str, timeout_ms: float, arg: Any = None) -> None:
    """Wait for ``expression`` to hold on the page; on timeout, fail with what the page shows."""
    try:
        await page.wait_for_function(expression, arg=arg, timeout=timeout_ms)
    except PlaywrightTimeoutError:
        pytest.fail(
            f"timed out after {timeout_ms / 1000:g} s waiting for {expression!r}; "
            f"page: {await page_state(page)}"
        )


async def test_microphone_to_captions(server_url: str, speech_dir: Path) -> None:
    wav = speech_dir / CLIP
    errors: list[str] = []
    async with async_playwright() as pw:
        browser = await launch(
            pw, "--use-fake-ui-for-media-stream", f"--use-file-for-fake-audio-capture={wav}"
        )
        try:
            page = await browser.new_page(viewport={"width": 1000, "height": 560})
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            await page.goto(page_url(server_url))
            await wait_until(page, "document.body.dataset.state === 'idle'", STATE_WAIT_MS)
            await page.evaluate(RECORD_PARTIALS_JS)

            await page.click("#start")
            await wait_until(page, "document.body.dataset.state === 'running'", STATE_WAIT_MS)
            await wait_until(
                page, f"(phrase) => ({FINAL_TEXT_JS})().includes(phrase)", WORDS_WAIT_MS, PHRASE
            )
            ARTIFACTS.mkdir(exist_ok=True)
            await page.screenshot(path=str(ARTIFACTS / "web_page.png"), full_page=True)

            shown = await page_state(page)
            exposed = shown["whisperwire"]
            assert exposed["maxRms"] > 0.01, shown  # real signal, not a silent fake device
            assert exposed["chunksSent"] > 0 and exposed["reconnects"] == 0, shown
            assert exposed["ttftS"] > 0, shown
            ttft = re.fullmatch(r"(\d+\.\d\d) s", shown["ttft"])
            assert ttft and float(ttft[1]) == pytest.approx(exposed["ttftS"], abs=0.006), shown
            latency = await page.text_content("#latency")
            assert latency is not None and latency.endswith(")") and " s (median " in latency
            assert await page.evaluate("window.seenPartials.length") > 0, shown
            assert shown["status"].startswith("Listening (model tiny.en)"), shown
            assert await page.text_content("#start") == "Stop"

            await page.click("#start")
            await wait_until(page, "document.body.dataset.state === 'idle'", STATE_WAIT_MS)
            stopped = await page_state(page)
            # "Stopped." only after the server's "done"; a close without it says so.
            assert stopped["status"] == "Stopped.", stopped
            assert stopped["whisperwire"]["lastClose"]["code"] == 1000, stopped
            assert await page.text_content("#start") == "Start"
            assert not await page.is_disabled("#start")
            assert await page.locator("#transcript .partial").count() == 0
            assert PHRASE in await page.evaluate(FINAL_TEXT_JS)
        finally:
            await browser.close()
    assert not errors, errors


async def test_refused_microphone_permission_is_explained(server_url: str) -> None:
    async with async_playwright() as pw:
        # No --use-fake-ui-for-media-stream: the permission is asked for, and refused.
        browser = await launch(pw, "--deny-permission-prompts")
        try:
            context = await browser.new_context(permissions=[])  # nothing granted
            page = await context.new_page()
            await page.goto(page_url(server_url))
            await page.click("#start")
            await wait_until(
                page,
                "document.body.dataset.state === 'idle' && "
                "document.getElementById('status').classList.contains('error')",
                STATE_WAIT_MS,
            )
            status = await page.text_content("#status")
            assert status is not None and status.startswith("Microphone permission was refused"), (
                status
            )
            assert await page.evaluate("window.whisperwire.chunksSent") == 0
            assert await page.text_content("#start") == "Start"
            assert not await page.is_disabled("#start")
        finally:
            await browser.close()
