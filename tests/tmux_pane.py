"""A real terminal for tests: one tmux pane on a private tmux server, its screen read back
with ``capture-pane`` (Debian's ``tmux``; ``make tmux`` installs it)."""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

TMUX = shutil.which("tmux")
_SGR = re.compile(r"\x1b\[[0-9;]*m")
DEAD_ROW = re.compile(r"Pane is dead \(")  # the row remain-on-exit may add at the bottom


class TmuxPane:
    """A detached tmux session of one pane running ``command`` in a ``width`` x ``height``
    window; ``close`` ends the tmux server it started."""

    def __init__(
        self,
        socket: Path,
        command: Sequence[str],
        *,
        width: int,
        height: int,
        env: dict[str, str] | None = None,
        prompt: str | None = None,
    ) -> None:
        if TMUX is None:
            raise RuntimeError("tmux is not installed (make tmux)")
        config = socket.with_suffix(".conf")
        # Keep the pane, and its last screen, after the command exits; no status line.
        config.write_text("set -g remain-on-exit on\nset -g status off\n")
        self._base = [TMUX, "-S", str(socket), "-f", str(config)]
        self._status_file = socket.with_suffix(".status")
        env = {**(env or {}), "STATUS_FILE": str(self._status_file), "PROMPT": prompt or ""}
        args = [f"-e{k}={v}" for k, v in env.items()]
        # A shell's prompt line first, as a user would see it; the exit status to a file
        # (tmux 3.3's #{pane_dead_status} and "Pane is dead" row do not always show).
        script = (
            '[ -n "$PROMPT" ] && printf "%s\\n" "$ $PROMPT"; "$0" "$@"; echo $? > "$STATUS_FILE"'
        )
        wrapped = ["sh", "-c", script, *command]
        self._run("new-session", "-d", "-x", str(width), "-y", str(height), *args, "--", *wrapped)

    def _run(self, *args: str) -> str:
        done = subprocess.run(
            [*self._base, *args], capture_output=True, text=True, timeout=10, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"tmux {' '.join(args)}: {done.stderr.strip()}")
        return done.stdout

    @property
    def tty(self) -> str:
        """The pane's terminal device, for a test that writes to it as a program would."""
        return self._run("display-message", "-p", "#{pane_tty}").strip()

    def screen(self, *, escapes: bool = False, scrollback: bool = False) -> list[str]:
        """The visible rows, trailing blanks removed; ``escapes`` keeps colours and
        attributes as escape sequences (``\\x1b[2m`` for dim); ``scrollback`` starts with
        the rows scrolled off the top (a "Pane is dead" row scrolls the screen by one).

        When a shrinking window reflows the cursor's row on the screen's top row, tmux moves
        the part that no longer fits into the scrollback, where no program can erase it.
        """
        history = ["-S", "-"] if scrollback else []
        rows = self._run("capture-pane", "-p", *history, *(["-e"] if escapes else [])).split("\n")
        rows = rows[:-1]
        while rows and not rows[-1].strip():
            rows.pop()
        return [r.rstrip() for r in rows]

    def text_rows(self, *, scrollback: bool = False) -> list[str]:
        """``screen`` without escape sequences."""
        return [_SGR.sub("", r) for r in self.screen(escapes=True, scrollback=scrollback)]

    def exit_status(self) -> int | None:
        """The pane's command's exit status; None while it runs."""
        try:
            return int(self._status_file.read_text())
        except (FileNotFoundError, ValueError):  # not yet, or being written
            return None

    def resize(self, width: int, height: int) -> None:
        """Resize the window; returns once the pane's terminal has the new size."""
        self._run("resize-window", "-x", str(width), "-y", str(height))
        deadline = time.monotonic() + 5
        while self._run("display-message", "-p", "#{pane_width}").strip() != str(width):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the pane did not become {width} columns wide")
            time.sleep(0.01)

    async def wait_for(self, condition: Callable[[list[str]], bool], timeout_s: float) -> list[str]:
        """The screen once ``condition(screen)`` holds; the last screen when it times out.

        tmux draws what a program writes asynchronously, so a test polls for the screen it
        expects rather than reading it at once (without blocking the event loop a server in
        the test may be running on).
        """
        deadline = time.monotonic() + timeout_s
        while True:
            rows = self.screen()
            if condition(rows) or time.monotonic() > deadline:
                return rows
            await asyncio.sleep(0.02)

    def close(self) -> None:
        subprocess.run([*self._base, "kill-server"], capture_output=True, timeout=10, check=False)


def render_png(rows: Sequence[str], path: Path, *, columns: int) -> None:
    """Draw captured rows (with escape sequences) as a terminal screenshot: light text on
    dark, dim text grey. Uses Pillow and matplotlib's bundled DejaVu Sans Mono (dev extras)."""
    from matplotlib import font_manager
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.truetype(font_manager.findfont("DejaVu Sans Mono"), 16)
    cell_w = round(font.getlength("M"))
    cell_h = 22
    pad = 12
    image = Image.new("RGB", (columns * cell_w + 2 * pad, max(len(rows), 1) * cell_h + 2 * pad))
    draw = ImageDraw.Draw(image)
    draw.rectangle([(0, 0), image.size], fill=(24, 24, 28))
    for y, row in enumerate(rows):
        x = 0
        dim = False
        for part in re.split(r"(\x1b\[[0-9;]*m)", row):
            if part.startswith("\x1b["):
                codes = part[2:-1].split(";")
                dim = "2" in codes or (dim and not {"0", "22", ""} & set(codes))
                continue
            colour = (140, 140, 150) if dim else (235, 235, 235)
            for char in part:  # on the character grid, as a terminal draws
                draw.text((pad + x * cell_w, pad + y * cell_h), char, font=font, fill=colour)
                x += 1
    image.save(path)
