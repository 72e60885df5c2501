"""What each side imports, recorded in a fresh interpreter: the client and the protocol
modules it shares with the server stay free of MLX, webrtcvad and the websockets server.

Each check runs ``python -X importtime`` in a subprocess (an import already made by pytest
would hide it) and rebuilds the import tree from its report, so a failure names the chain
that pulled a module in. ``python -m tests.test_imports`` prints what ``server.serve.app`` imports
and how MLX gets there. One check reads source instead: no benchmark imports ``tests``, even
lazily inside a function (what both need lives in ``bench/``).
"""

from __future__ import annotations

import ast
import subprocess
import sys
import wave
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("mlx", "webrtcvad", "websockets.asyncio.server", "websockets.server")
# What the client may use of the server package: the protocol and audio file reading.
SHARED = (
    "server.protocol.messages",
    "server.protocol.errors",
    "server.protocol.formats",
    "server.protocol.audio",
    "server.protocol.g711",  # audio.py's G.711 tables (numpy)
)
# Makes MLX unimportable, as on a machine that has only the client installed.
BLOCK_MLX = "import sys; sys.modules['mlx'] = None; "


@dataclass(frozen=True)
class ImportTree:
    """The modules one program imported, each with the module whose import pulled it in."""

    parents: dict[str, str | None]  # None: imported by the program itself

    def chain(self, module: str) -> list[str]:
        """The importers of ``module``, outermost first, ending with ``module``."""
        chain = [module]
        while (parent := self.parents.get(chain[-1])) is not None:
            chain.append(parent)
        return chain[::-1]

    def heavy(self) -> list[list[str]]:
        """The chain to every heavy module, outermost first."""
        return [self.chain(m) for m in self.parents if _is_heavy(m)]


def _is_heavy(module: str) -> bool:
    return any(module == h or module.startswith(h + ".") for h in HEAVY)


def record_imports(code: str) -> tuple[ImportTree, subprocess.CompletedProcess[str]]:
    """Run ``code`` in a fresh interpreter and return its import tree and the process."""
    process = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return parse_importtime(process.stderr), process


def parse_importtime(report: str) -> ImportTree:
    """The tree of ``-X importtime`` lines: a module comes after the ones it imported, which
    are indented two more spaces."""
    parents: dict[str, str | None] = {}
    waiting: list[tuple[int, str]] = []  # imported modules whose importer has not shown yet
    for line in report.splitlines():
        if not line.startswith("import time:") or line.rstrip().endswith("imported package"):
            continue
        field = line.split("|")[-1]
        name = field.strip()
        depth = len(field) - len(field.lstrip()) - 1
        while waiting and waiting[-1][0] > depth:
            parents[waiting.pop()[1]] = name
        waiting.append((depth, name))
    for _, name in waiting:
        parents[name] = None
    return ImportTree(parents)


def imported_modules(source: str) -> set[str]:
    """The absolute modules that ``source``'s import statements name, at any depth (imports
    inside functions too); ``from a import b`` names ``a``."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
    return found


def wav_file(path: Path) -> Path:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16_000)
        w.writeframes(bytes(3200))
    return path


def test_parse_importtime_rebuilds_the_tree() -> None:
    report = "\n".join(
        [
            "import time: self [us] | cumulative | imported package",
            "import time:        1 |          1 |     c",
            "import time:        1 |          2 |   b",
            "import time:        1 |          1 |   d",
            "import time:        1 |          4 | a",
            "import time:        1 |          1 | e",
        ]
    )
    tree = parse_importtime(report)
    assert tree.parents == {"c": "b", "b": "a", "d": "a", "a": None, "e": None}
    assert tree.chain("c") == ["a", "b", "c"]


def test_imported_modules_finds_lazy_and_from_imports() -> None:
    source = "import os, tests.helpers\nfrom . import x\ndef f():\n    from tests import helpers\n"
    assert imported_modules(source) == {"os", "tests.helpers", "tests"}


def test_no_benchmark_imports_the_tests() -> None:
    """Tests may use the benchmarks' modules (``bench/corpus.py``, ``bench/http_probe.py``),
    never the reverse: a benchmark must run without the test suite's code and its doubles."""
    bench_files = sorted((REPO / "bench").rglob("*.py"))
    assert bench_files
    offenders = {
        str(path.relative_to(REPO)): sorted(
            m
            for m in imported_modules(path.read_text(encoding="utf-8"))
            if m.split(".")[0] == "tests"
        )
        for path in bench_files
    }
    assert {path: found for path, found in offenders.items() if found} == {}


# The server's layers, each importing only those below it (and config and metrics, which every
# layer configures or counts with): a layer's name is its folder under server/.
LAYERS_BELOW: dict[str, set[str]] = {
    "protocol": set(),
    "core": {"protocol"},
    "engine": {"protocol", "core"},
    "decode": {"protocol", "core"},
    # The speaker encoder (numpy); the core plans its windows through core.speakers' Protocol.
    "speakers": {"protocol", "core"},
    # The turn models on onnxruntime; Smart Turn's log-mel is the engine's frontend. The core
    # asks for scores through core.turns' Protocol.
    "turns": {"protocol", "core", "engine"},
    "apis": {"protocol", "core", "decode"},
    "serve": {"protocol", "core", "decode", "apis", "engine", "speakers", "turns"},
    # Every layer's frozen options; CommitConfig is the commit policy's own.
    "config": {"protocol", "core"},
    "metrics": set(),
}


def layer_of(module: str) -> str | None:
    """``server.core.session`` -> ``core``; None outside the server package."""
    parts = module.split(".")
    if parts[0] != "server" or len(parts) < 2:
        return None
    return parts[1]


def test_layer_of_names_the_folder() -> None:
    assert layer_of("server.core.session") == "core"
    assert layer_of("server.config") == "config"
    assert layer_of("server") is None and layer_of("client.cli") is None


def test_each_server_layer_imports_only_the_layers_below_it() -> None:
    """Read from source, so an import inside a function counts too. The layers are folders
    (``server/protocol``, ``core``, ``engine``, ``decode``, ``apis``, ``serve``) and two
    modules every layer may use (``server/config.py``, ``server/metrics.py``)."""
    files = sorted((REPO / "server").rglob("*.py"))
    assert files
    crossings: dict[str, list[str]] = {}
    for path in files:
        module = ".".join(path.relative_to(REPO).with_suffix("").parts)
        layer = layer_of(module.removesuffix(".__init__"))
        if layer is None:
            continue
        assert layer in LAYERS_BELOW, f"{module}: no layer {layer!r}; add it to LAYERS_BELOW"
        allowed = LAYERS_BELOW[layer] | {layer, "config", "metrics"}
        if layer in ("config", "metrics"):
            allowed = LAYERS_BELOW[layer]
        bad = sorted(
            m
            for m in imported_modules(path.read_text(encoding="utf-8"))
            if (used := layer_of(m)) is not None and used not in allowed
        )
        if bad:
            crossings[module] = bad
    assert crossings == {}


@pytest.mark.parametrize("module", SHARED)
def test_the_modules_both_sides_share_import_nothing_heavy(module: str) -> None:
    tree, process = record_imports(f"import {module}")
    assert process.returncode == 0, process.stderr[-2000:]
    assert tree.heavy() == []
    assert "server.config" not in tree.parents, tree.chain("server.config")


def test_the_client_help_imports_no_mlx_and_only_the_shared_server_modules() -> None:
    code = BLOCK_MLX + "from client.cli import main; main(['stream', '--help'])"
    tree, process = record_imports(code)
    assert process.returncode == 0, process.stderr[-2000:]
    assert "usage: whisperwire stream" in process.stdout
    assert tree.heavy() == []
    server_side = {m for m in tree.parents if m.split(".")[0] == "server"}
    assert server_side <= {"server", "server.protocol", *SHARED}, sorted(server_side)


def test_streaming_a_file_runs_without_mlx(tmp_path: Path) -> None:
    clip = wav_file(tmp_path / "silence.wav")
    # Port 9 (discard) has no server: the command gets as far as connecting, then exits 1.
    argv = ["stream", str(clip), "--url", "ws://127.0.0.1:9/v1/stream", "--pace", "0"]
    code = BLOCK_MLX + f"import sys; from client.cli import main; sys.exit(main({argv!r}))"
    tree, process = record_imports(code)
    assert process.returncode == 1, process.stderr[-2000:]
    assert "Traceback" not in process.stderr
    assert tree.heavy() == []


def test_the_server_app_imports_no_client_code_and_no_engine() -> None:
    tree, process = record_imports("import server.serve.app")
    assert process.returncode == 0, process.stderr[-2000:]
    assert not [m for m in tree.parents if m.split(".")[0] == "client"]
    # The engine is loaded by the CLI that starts the server, not by the server itself.
    assert not [m for m in tree.parents if m.startswith("server.engine.")], sorted(tree.parents)
    assert not [c for c in tree.heavy() if c[-1].startswith("mlx")]


@pytest.mark.parametrize(
    "module", ["server.serve.app", "server.decode.pipeline", "server.core.session"]
)
def test_the_server_core_imports_without_mlx(module: str) -> None:
    """The streaming core and its test double need no MLX (``ScriptedEngine`` stands in)."""
    code = BLOCK_MLX + f"import {module}; import tests.helpers; tests.helpers.ScriptedEngine()"
    tree, process = record_imports(code)
    assert process.returncode == 0, process.stderr[-2000:]
    assert not [m for m in tree.parents if m.startswith("mlx")]


def main() -> None:
    """Print what ``import server.serve.app`` pulls in, and the chain to each heavy module."""
    tree, process = record_imports("import server.serve.app")
    if process.returncode != 0:
        sys.stderr.write(process.stderr)
        raise SystemExit(process.returncode)
    ours = sorted(m for m in tree.parents if m.split(".")[0] in ("server", "client"))
    sys.stdout.write("server.serve.app imports: " + " ".join(ours) + "\n")
    for chain in tree.heavy():
        if len(chain) == 1 or not _is_heavy(chain[-2]):  # where the chain enters the package
            sys.stdout.write(" -> ".join(chain) + "\n")


if __name__ == "__main__":
    main()
