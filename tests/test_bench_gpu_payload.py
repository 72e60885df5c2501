"""bench.gpu_payload: its transforms give back every byte, the staged speech holds what
bench-gpu reads, parts fit the calls, and taking them one call at a time notices a machine
that went back between two calls."""

from __future__ import annotations

import hashlib
import shutil
import wave
from pathlib import Path

import numpy as np
import pytest

from bench.gpu import BATCHES, batch_windows
from bench.gpu_payload import (
    EXTRA_CLIPS,
    SUMS,
    join_planes,
    pack_pcm,
    part_names,
    part_sizes,
    rebuild_long,
    split_planes,
    staged_speech,
    take,
    unpack_pcm,
)
from bench.latency_audio import english_clips, long_recordings

CHAPTER = "367-130732"  # test-other's shortest long recording: ten clips, 75 s


def _frames(path: Path) -> bytes:
    with wave.open(str(path)) as w:
        frames: bytes = w.readframes(w.getnframes())
    return frames


@pytest.mark.parametrize("size", [0, 1, 2, 7, 4096 + 3])
def test_byte_planes_give_back_every_byte(size: int) -> None:
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    planes = split_planes(data)
    assert len(planes) == size and join_planes(planes) == data


def test_packed_speech_gives_back_the_samples_and_test_other_s_long_recordings(
    speech_dir: Path, tmp_path: Path
) -> None:
    _, manifest_long, clips = staged_speech(speech_dir)
    chapter = [c for c in clips if f"/{CHAPTER}-" in c]
    assert len(chapter) == 10
    unpack_pcm(pack_pcm(speech_dir, chapter), tmp_path)
    assert all(_frames(tmp_path / c) == _frames(speech_dir / c) for c in chapter)
    long = f"librispeech_test-other/long/{CHAPTER}.concat.wav"
    header, *rows = manifest_long.splitlines()
    row = next(r for r in rows if r.startswith(long))
    (tmp_path / "manifest_long.tsv").write_text(f"{header}\n{row}\n", encoding="utf-8")
    assert long in rebuild_long(tmp_path, tmp_path / "manifest_long.tsv")
    assert _frames(tmp_path / long) == _frames(speech_dir / long)


def test_the_staged_speech_holds_what_bench_gpu_reads(
    speech_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The device's speech folder: test-other and test-clean clips (accuracy, the largest
    batch, the capacity streams), test-other's long recordings, the sonnet and jfk."""
    manifest, manifest_long, clips = staged_speech(speech_dir)
    rows = manifest.splitlines()[1:]
    assert rows and all(
        r.startswith(("librispeech_test-other/", "librispeech_test-clean/")) for r in rows
    )
    assert set(EXTRA_CLIPS) <= set(clips) and len(clips) == len(rows) + len(EXTRA_CLIPS)
    (tmp_path / "manifest.tsv").write_text(manifest, encoding="utf-8")
    (tmp_path / "manifest_long.tsv").write_text(manifest_long, encoding="utf-8")
    for folder in {c.split("/")[0] for c in clips}:
        (tmp_path / folder).symlink_to(speech_dir / folder)
    monkeypatch.setenv("WHISPERWIRE_SPEECH_DIR", str(tmp_path))
    assert len(batch_windows(max(BATCHES))) == max(BATCHES)
    assert len(english_clips()) >= 30
    longs = long_recordings()
    assert len(longs) == 4 and all(r.file.endswith(".concat.wav") for r in longs)


def test_parts_are_as_few_as_the_room_allows_and_even() -> None:
    assert part_sizes(100, 40) == [34, 34, 32]
    assert part_sizes(80, 40) == [40, 40]
    assert sum(part_sizes(271_000_001, 39_000_000)) == 271_000_001
    assert part_names(3) == ["part.aa", "part.ab", "part.ac"]
    with pytest.raises(ValueError, match="no room"):
        part_sizes(100, 0)


def _parts(folder: Path, names: list[str]) -> dict[str, bytes]:
    folder.mkdir()
    data = {n: n.encode() * 1000 for n in names}
    sums = [f"{hashlib.sha256(d).hexdigest()}  {n}" for n, d in data.items()]
    (folder / SUMS).write_text("\n".join(sums) + "\n")
    return data


def test_taking_parts_call_by_call_and_a_machine_that_came_up_fresh(tmp_path: Path) -> None:
    names = ["part.aa", "part.ab", "part.ac"]
    data = _parts(tmp_path / "gpu", names)
    stage = tmp_path / "stage"
    # Call 1 carries aa; call 2 ab, the checkout keeping aa or not.
    (tmp_path / "gpu" / "part.aa").write_bytes(data["part.aa"])
    assert take(tmp_path / "gpu", stage) == (["part.aa"], ["part.ab", "part.ac"])
    (tmp_path / "gpu" / "part.aa").unlink()
    (tmp_path / "gpu" / "part.ab").write_bytes(data["part.ab"][:-1])  # a torn copy
    assert take(tmp_path / "gpu", stage) == (["part.aa"], ["part.ab", "part.ac"])
    (tmp_path / "gpu" / "part.ab").write_bytes(data["part.ab"])
    assert take(tmp_path / "gpu", stage) == (["part.aa", "part.ab"], ["part.ac"])
    # The machine went back before call 3: a fresh one holds only what call 3 carries.
    shutil.rmtree(stage)
    (tmp_path / "gpu" / "part.ab").unlink()
    (tmp_path / "gpu" / "part.ac").write_bytes(data["part.ac"])
    with pytest.raises(RuntimeError, match=r"part\.aa, part\.ab are gone"):
        take(tmp_path / "gpu", stage)
