"""``whisperwire models``: the models this machine holds, and what each registry name would
fetch; ``whisperwire models pull NAME`` fetches one ahead of a server's start.

    whisperwire models                  cached models (size, layout, source) and the registry
    whisperwire models pull NAME        fetch NAME (a registry name or owner/name) now

The hub is reached the ecosystem's way (``HF_ENDPOINT``, ``HF_TOKEN``, ``HF_HUB_OFFLINE``,
the shared cache in ``~/.cache/huggingface/hub``); see ``server.engine.store``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import TextIO

from server.protocol.errors import ModelError

EXIT_OK = 0
EXIT_FAILED = 1


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The ``models`` subcommand and its ``pull``, on the ``whisperwire`` parser."""
    models = commands.add_parser(
        "models",
        help="list cached models and what each registry name fetches; 'pull NAME' fetches one",
        description="List the models this machine holds and what each registry name would "
        "fetch, or fetch one with 'pull NAME'.",
    )
    models.add_argument("-v", "--verbose", action="store_true", help="log debug detail")
    actions = models.add_subparsers(dest="models_command", metavar="ACTION")
    pull = actions.add_parser(
        "pull",
        help="fetch a model into the cache now (registry name or owner/name)",
        description="Fetch a model from the Hugging Face hub into its shared cache (asking the "
        "hub for a newer revision even when one is cached) and convert a CTranslate2 one, so "
        "a server starts on it with no network.",
    )
    pull.add_argument("name", metavar="NAME")
    models.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if getattr(args, "models_command", None) == "pull":
        return pull(args.name)
    show(sys.stdout)
    return EXIT_OK


def pull(name: str) -> int:
    from server.engine import store

    # Progress: a bar on a terminal (the hub library's), else a log line per 10%.
    logging.getLogger("server.engine.store").setLevel(logging.INFO)
    try:
        folder = store.pull_model(name)
    except ModelError as exc:
        sys.stderr.write(f"whisperwire: error: {exc}\n")
        return EXIT_FAILED
    sys.stdout.write(f"{folder}\n")
    return EXIT_OK


def _size(n: int) -> str:
    for unit in ("B", "kB", "MB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n = n / 1000  # type: ignore[assignment]  # float from here on, for the display only
    return f"{n:.1f} GB"


def show(out: TextIO) -> None:
    from server.engine import store

    cached = store.cached_models()
    out.write(
        f"Cached models (hub cache {store.hub_cache_dir()}, "
        f"conversions {store.cache_root() / 'converted'}):\n"
    )
    if not cached:
        out.write("  none\n")
    else:
        width = max(len(m.name) for m in cached)
        for m in cached:
            out.write(
                f"  {m.name:<{width}}  {m.layout:<11}  {_size(m.size_bytes):>9}  "
                f"{m.source:<9}  {m.path}\n"
            )
    out.write(f"\nRegistry names (--model NAME; hub {store.hub_endpoint()}):\n")
    entries = store.registry()
    width = max(len(e.name) for e in entries)
    fetch_width = max(len(e.fetches) for e in entries)
    for e in entries:
        state = "cached" if e.cached else "to fetch"
        then = f"  (else {', '.join(e.alternatives)})" if e.alternatives and not e.cached else ""
        out.write(f"  {e.name:<{width}}  {e.fetches:<{fetch_width}}  {state}{then}\n")
