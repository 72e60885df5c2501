"""``deploy/prometheus/``: the alert rules name only metrics a real server exports, and no
metric carries a per-session label.

The names come from the rules' expressions; the page they are checked against is what
``GET /metrics`` of a real server answers (the scripted engine stands in for the model: the
metrics are the server's, whatever engine decodes) after sessions, refusals and errors have
touched every labelled series.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from bench.http_probe import http_get
from server.config import ServerConfig
from server.serve.app import WhisperwireServer
from tests.helpers import Float32Array, ScriptedEngine, pcm_frames, stream_frames
from tests.instances import HAPROXY_CFG

REPO = Path(__file__).resolve().parents[1]
PROMETHEUS = REPO / "deploy" / "prometheus"
PROTOCOL = REPO / "docs" / "protocol.md"
# Labels a series may have: why a session was refused, an error's code, a histogram bucket.
# Each has a handful of values, whatever the number of sessions.
ALLOWED_LABELS = {"reason", "code", "le"}
BUILTIN_SERIES = {"up"}  # made by Prometheus itself for every target
PROMQL_WORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "and", "or",
    "unless", "bool", "offset",
}  # fmt: skip
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})? \S+$")


def rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def series_in(expr: str) -> set[str]:
    """The series names an expression reads (functions, keywords and labels left out)."""
    text = re.sub(r'"[^"]*"', "", expr)  # label values, humanize templates
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # range selectors
    text = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", "", text)  # grouping labels
    names = set()
    for match in re.finditer(r"[a-zA-Z_:][a-zA-Z0-9_:]*", text):
        follows = text[match.end() :].lstrip()[:1]
        if follows == "(" or match.group() in PROMQL_WORDS:
            continue  # a function or an operator
        names.add(match.group())
    return names


def matchers_in(expr: str) -> list[tuple[str, str, str]]:
    """(series, label, value pattern) of every label matcher in an expression."""
    found = []
    for series, body in re.findall(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{([^}]*)\}", expr):
        for label, value in re.findall(r'(\w+)\s*=~?\s*"([^"]*)"', body):
            found.append((series, label, value))
    return found


def parse_page(page: str) -> tuple[dict[str, str], dict[str, str], set[tuple[str, str]]]:
    """(family -> type, family -> help, {(series name, label names)}) of an exposition."""
    types, helps, series = {}, {}, set()
    for line in page.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            types[name] = kind
        elif line.startswith("# HELP "):
            _, _, name, text = line.split(" ", 3)
            helps[name] = text
        elif line:
            match = _SAMPLE.match(line)
            assert match, line
            labels = re.findall(r'(\w+)="', match.group(3) or "")
            series.add((match.group(1), ",".join(sorted(labels))))
    return types, helps, series


def exported_names(types: dict[str, str]) -> set[str]:
    """Every series name a family makes: a histogram's _bucket, _sum and _count."""
    names = set()
    for family, kind in types.items():
        if kind == "histogram":
            names |= {f"{family}_bucket", f"{family}_sum", f"{family}_count"}
        else:
            names.add(family)
    return names


async def real_page(open_sessions: int) -> tuple[str, list[str]]:
    """A server's /metrics with ``open_sessions`` sessions open, after one finished
    session, an unauthorized handshake, a session told its message was bad and a
    refused-for-full handshake: (page, session ids)."""
    config = ServerConfig(
        host="127.0.0.1",
        port=0,
        warmup=False,
        max_sessions=open_sessions,
        capacity_limit=False,  # refused at max_sessions, whatever the estimate says
        api_key="k",
    )
    bearer = {"Authorization": "Bearer k"}
    async with WhisperwireServer(ScriptedEngine, server=config) as server:
        url = server.url + "/v1/stream"
        done = await stream_frames(url, pcm_frames(_tone(2.0)), additional_headers=bearer)
        ids = [done.messages[0]["session_id"]]
        with pytest.raises(InvalidStatus):
            async with connect(url):
                pass
        async with connect(url, additional_headers=bearer) as ws:  # a bad message: an error
            await ws.recv()
            await ws.send("{")
            assert json.loads(await ws.recv())["type"] == "error"
        held = [await connect(url, additional_headers=bearer) for _ in range(open_sessions)]
        try:
            for ws in held:
                ids.append(json.loads(await ws.recv())["session_id"])
                await ws.send(pcm_frames(_tone(1.0))[0])
            with pytest.raises(InvalidStatus) as full:  # refused before the handshake
                async with connect(url, additional_headers=bearer):
                    pass
            assert full.value.response.status_code == 503
            _, _, body = await http_get(server.http_url + "/metrics")
        finally:
            await asyncio.gather(*(ws.close() for ws in held))
    return body.decode(), ids


def _tone(seconds: float) -> Float32Array:
    t = np.arange(int(seconds * 16000), dtype=np.float32) / 16000
    return (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)


def test_every_alert_is_complete() -> None:
    for rule in rules():
        assert rule["expr"].strip(), rule
        if "alert" in rule:
            assert rule["labels"]["severity"] in ("info", "warning", "critical"), rule
            assert rule["annotations"]["summary"], rule
            assert re.fullmatch(r"\d+[smh]", rule["for"]), rule
        else:
            assert re.fullmatch(r"whisperwire:[a-z_]+:[a-z_]+", rule["record"]), rule


def test_the_rules_cover_what_users_ask_about() -> None:
    read = set().union(*(series_in(r["expr"]) for r in rules()))
    for name in (
        "whisperwire_stream_lag_seconds",
        "whisperwire_sessions_refused_total",
        "whisperwire_decode_seconds_total",  # decode busy and real-time factor
        "whisperwire_decoded_audio_seconds_total",
        "whisperwire_capacity_headroom_streams",
    ):
        assert name in read, name


def test_the_expression_reader_finds_series_and_nothing_else() -> None:
    expr = (
        'sum by (job, instance) (rate(whisperwire_errors_total{code="internal"}[5m])) > 0 '
        "and on (instance) whisperwire:x:ratio / clamp_min(up, 1)"
    )
    assert series_in(expr) == {"whisperwire_errors_total", "whisperwire:x:ratio", "up"}
    assert matchers_in(expr) == [("whisperwire_errors_total", "code", "internal")]


@pytest.mark.asyncio(loop_scope="session")
async def test_rules_name_only_what_a_real_server_exports() -> None:
    page, _ = await real_page(open_sessions=2)
    types, helps, series = parse_page(page)
    exported = exported_names(types)
    recorded = {r["record"] for r in rules() if "record" in r}
    labels_of = {name: set(labels.split(",")) - {""} for name, labels in series}
    for rule in rules():
        for name in series_in(rule["expr"]):
            assert name in exported | recorded | BUILTIN_SERIES, (name, rule["expr"])
        for name, label, values in matchers_in(rule["expr"]):
            if name in BUILTIN_SERIES:
                continue
            assert label in labels_of.get(name, set()), (name, label)
            # Refusal reasons are listed in the metric's help, error codes in the protocol.
            documented = helps[name] if label == "reason" else PROTOCOL.read_text()
            for value in values.split("|"):
                assert re.search(rf"\b{value}\b", documented), (name, label, value)


@pytest.mark.asyncio(loop_scope="session")
async def test_no_series_has_a_per_session_label() -> None:
    one_page, _ = await real_page(open_sessions=1)
    three_page, ids = await real_page(open_sessions=3)
    _, _, one = parse_page(one_page)
    _, _, three = parse_page(three_page)
    assert one == three  # more sessions open: the same series, no new ones
    for _, labels in three:
        assert set(labels.split(",")) - {""} <= ALLOWED_LABELS, labels
    assert not any(i in three_page for i in ids)


def test_the_scrape_config_points_where_the_deployment_listens() -> None:
    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    for name in config["rule_files"]:
        assert (PROMETHEUS / name).is_file(), name
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    haproxy = HAPROXY_CFG.read_text()
    servers = re.findall(r"(?m)^\s+server \S+ (\S+)$", haproxy)
    (targets,) = [s["targets"] for s in jobs["whisperwire"]["static_configs"]]
    assert targets == servers  # each instance directly, not the balancer
    stats = re.search(r"(?m)^frontend stats\n\s+bind (\S+)$", haproxy)
    assert stats is not None
    assert jobs["haproxy"]["static_configs"][0]["targets"] == [stats.group(1)]
    kubernetes = jobs["whisperwire-kubernetes"]["relabel_configs"]
    assert {"target_label": "job", "replacement": "whisperwire"} in kubernetes
