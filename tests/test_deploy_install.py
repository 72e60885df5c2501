"""``deploy/Dockerfile`` installs exactly as ``make install``: both run ``deploy/install.sh``.

The image cannot be built here (no image registry is reachable), so what is checked is what
can be read: that the Makefile and the Dockerfile hand the install to the one script and do
none of its steps themselves, that the script is valid shell, and that what the image runs
is a command line the server accepts, on the port it exposes.
"""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import yaml

from server.serve.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
INSTALL = REPO / "deploy" / "install.sh"
DOCKERFILE = REPO / "deploy" / "Dockerfile"
# What installing is made of: none of it may happen outside the script.
INSTALL_STEPS = ("pip install", "-m venv", "apt-get", "lightning-whisper-mlx", "libgfortran")


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(instruction, arguments) of the Dockerfile, continuation lines joined."""
    joined = DOCKERFILE.read_text().replace("\\\n", " ")
    found = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            instruction, _, arguments = line.partition(" ")
            found.append((instruction.upper(), arguments.strip()))
    return found


def make_install_recipe() -> list[str]:
    """The commands ``make install`` would run on a machine without the virtualenv."""
    dry_run = subprocess.run(
        ["make", "-n", "-B", "--no-print-directory", "PYTHON=python3", ".venv/.installed"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return [line for line in dry_run.stdout.splitlines() if line.strip()]


def test_make_install_runs_the_install_script_and_nothing_else() -> None:
    recipe = make_install_recipe()
    assert recipe == [
        "PYTHON=python3 VENV=.venv bash deploy/install.sh dev,base",
        "touch .venv/.installed",
    ]


def test_the_dockerfile_runs_the_same_script_and_no_install_step_of_its_own() -> None:
    instructions = dockerfile_instructions()
    runs = [args for kind, args in instructions if kind == "RUN"]
    uses = [r for r in runs if "deploy/install.sh" in r]
    assert len(uses) == 1 and uses[0].startswith("bash deploy/install.sh")
    assert shlex.split(uses[0])[2:3] in ([], ["&&"])  # no extras: the server and client only
    for run in runs:
        for step in INSTALL_STEPS:
            assert step not in run, (step, run)
    copied = [args.split()[0] for kind, args in instructions if kind == "COPY"]
    assert "deploy/install.sh" in copied
    for needed in ("pyproject.toml", "server", "client"):
        assert needed in copied, needed


def test_the_install_script_holds_every_install_step() -> None:
    script = INSTALL.read_text()
    for step in INSTALL_STEPS:
        assert step in script, step
    check = subprocess.run(["bash", "-n", str(INSTALL)], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr


def test_what_the_image_runs_is_a_command_line_the_server_takes() -> None:
    instructions = dict(dockerfile_instructions())
    entrypoint = yaml.safe_load(instructions["ENTRYPOINT"])  # JSON arrays are YAML too
    command = yaml.safe_load(instructions["CMD"])
    assert entrypoint[0] == ".venv/bin/whisperwire-server"
    args = build_parser().parse_args([*entrypoint[1:], *command])
    assert args.host == "0.0.0.0"  # reachable from outside the container
    assert instructions["EXPOSE"] == str(args.port)
    assert instructions["STOPSIGNAL"] == "SIGTERM"  # the signal that drains
