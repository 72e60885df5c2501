"""One PNG per metric of the latency benchmark, ours beside the peer (matplotlib, Agg)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display: the benchmark runs headless
import matplotlib.pyplot as plt  # after use(): the backend must be chosen first

logger = logging.getLogger("bench.latency_plots")

COLORS = {"ours": "tab:blue", "peer": "tab:orange", "offline": "tab:gray"}


def _cdf(ax: Any, samples_s: Sequence[float], label: str, color: str, style: str = "-") -> None:
    if not samples_s:
        return
    xs = sorted(s * 1000.0 for s in samples_s)
    ys = [(k + 1) / len(xs) for k in range(len(xs))]
    ax.step(xs, ys, style, where="post", label=label, color=color)


def _save(fig: Any, folder: Path, name: str) -> Path:
    path = folder / name
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _p50_p95_bars(
    folder: Path, name: str, title: str, series: dict[str, dict[str, Any]], target_ms: float | None
) -> Path:
    fig, ax = plt.subplots(figsize=(6, 4))
    for k, (who, stats) in enumerate(series.items()):
        values = [stats.get("p50_ms") or 0.0, stats.get("p95_ms") or 0.0]
        offset = (k - (len(series) - 1) / 2) * 0.4
        ax.bar([offset, 1 + offset], values, width=0.4, label=who, color=COLORS.get(who))
    ax.set_xticks([0.0, 1.0], ["p50", "p95"])
    if target_ms is not None:
        ax.axhline(target_ms, color="red", linestyle="--", label=f"target p50 {target_ms:g} ms")
    ax.set_ylabel("ms")
    ax.set_title(title)
    ax.legend()
    return _save(fig, folder, name)


def write_plots(
    folder: Path, results: dict[str, Any], samples: dict[str, Any], *, prefix: str = "latency"
) -> list[Path]:
    """Write every plot as ``{prefix}_{metric}.png``; ``samples`` holds the raw per-server
    latency lists in seconds."""
    folder.mkdir(parents=True, exist_ok=True)
    servers = [s for s in ("ours", "peer") if s in results["single_stream"]]
    single = {s: results["single_stream"][s]["pooled"] for s in servers}
    paths = [
        _p50_p95_bars(
            folder,
            f"{prefix}_ttft.png",
            "Time to first token (speech onset -> first word shown)",
            {s: single[s]["ttft"] for s in servers},
            600.0,
        )
    ]

    fig, ax = plt.subplots(figsize=(7, 4))
    for s in servers:
        _cdf(ax, samples[s]["first_seen_s"], f"{s}: first shown", COLORS[s], "--")
        _cdf(ax, samples[s]["finalised_s"], f"{s}: finalised", COLORS[s])
    ax.set_xlabel("word end sent -> word shown / finalised (ms)")
    ax.set_ylabel("fraction of reference words")
    ax.set_title("Word emission latency (single stream)")
    ax.legend()
    paths.append(_save(fig, folder, f"{prefix}_word_emission.png"))

    fig, ax = plt.subplots(figsize=(7, 4))
    for s in servers:
        _cdf(ax, samples[s]["end_of_speech_to_final_s"], s, COLORS[s])
    ax.axvline(800.0, color="red", linestyle="--", label="target p50 800 ms")
    ax.set_xlabel("end of utterance sent -> final holding it (ms)")
    ax.set_ylabel("fraction of utterances")
    ax.set_title("End of speech to final")
    ax.legend()
    paths.append(_save(fig, folder, f"{prefix}_end_of_speech.png"))

    fig, ax = plt.subplots(figsize=(5, 4))
    ax.bar(
        servers, [single[s]["flicker_rate"] for s in servers], color=[COLORS[s] for s in servers]
    )
    ax.set_ylabel("words changed / tentative words shown")
    ax.set_title("Partial flicker")
    paths.append(_save(fig, folder, f"{prefix}_flicker.png"))

    names = list(results["single_stream"][servers[0]]["streams"])
    fig, ax = plt.subplots(figsize=(max(6, 2 * len(names) + 2), 4))
    width = 0.8 / (len(servers) + 1)
    for k, who in enumerate([*servers, "offline"]):
        if who == "offline":
            values = [results["offline_wer"][n] for n in names]
        else:
            values = [results["single_stream"][who]["streams"][n]["wer"] for n in names]
        ax.bar(
            [i + (k - len(servers) / 2) * width for i in range(len(names))],
            [100 * v for v in values],
            width=width,
            label=who,
            color=COLORS[who],
        )
    ax.set_xticks(range(len(names)), names, fontsize=8)
    ax.set_ylabel("WER %")
    ax.set_title("WER of the finals beside offline transcription")
    ax.legend()
    paths.append(_save(fig, folder, f"{prefix}_wer.png"))

    if results.get("capacity"):
        fig, ax = plt.subplots(figsize=(6, 4))
        for s in servers:
            runs = results["capacity"].get(s, {}).get("runs", [])
            xs = [r["clients"] for r in runs]
            ax.plot(xs, [r["final"]["p95_ms"] or float("nan") for r in runs], "o-", color=COLORS[s])
            ax.plot(
                xs, [r["final"]["p50_ms"] or float("nan") for r in runs], "o--", color=COLORS[s]
            )
            ax.plot([], [], "-", color=COLORS[s], label=f"{s} p95 (dashed: p50)")
        counts = sorted({r["clients"] for c in results["capacity"].values() for r in c["runs"]})
        ax.set_xticks(counts)
        ax.axhline(2000.0, color="red", linestyle="--", label="sustained: p95 <= 2 s")
        ax.set_xlabel("concurrent real-time streams")
        ax.set_ylabel("word finalisation latency (ms)")
        ax.set_title("Capacity")
        ax.legend()
        paths.append(_save(fig, folder, f"{prefix}_capacity.png"))

        fig, (cpu_ax, rss_ax) = plt.subplots(1, 2, figsize=(9, 4))
        for s in servers:
            runs = results["capacity"].get(s, {}).get("runs", [])
            xs = [r["clients"] for r in runs]
            cpu_ax.plot(xs, [r["cpu_percent_mean"] for r in runs], "o-", label=s, color=COLORS[s])
            rss_ax.plot(xs, [r["rss_mb_max"] for r in runs], "o-", label=s, color=COLORS[s])
        cpu_ax.set_xlabel("streams")
        cpu_ax.set_ylabel("server CPU % (100 = one core)")
        rss_ax.set_xlabel("streams")
        rss_ax.set_ylabel("server RSS peak (MB)")
        cpu_ax.legend()
        fig.suptitle("Server CPU and memory by stream count")
        paths.append(_save(fig, folder, f"{prefix}_capacity_resources.png"))

    long = results.get("rss_long_session")
    if long and long.get("samples"):
        fig, ax = plt.subplots(figsize=(7, 4))
        xs = [p[0] / 60.0 for p in long["samples"]]
        ax.plot(xs, [p[1] for p in long["samples"]], color=COLORS["ours"])
        ax.set_xlabel("audio sent (minutes)")
        ax.set_ylabel("server RSS (MB)")
        ax.set_title(f"Our server's RSS over one {long['audio_s'] / 60:.0f}-minute session")
        paths.append(_save(fig, folder, f"{prefix}_rss_long.png"))
    logger.info("wrote %d plots to %s", len(paths), folder)
    return paths
