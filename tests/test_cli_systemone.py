"""`gmlx systemone` against a real server and offline with --model: same numbers."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from server_harness import free_port, gmlx_command, start

REPO = Path(__file__).resolve().parent.parent
TICKET = REPO / "examples" / "ticket.json"


def gmlx(*args: str, cwd: Path = REPO, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    return subprocess.run(gmlx_command() + list(args), capture_output=True, text=True, timeout=300, cwd=cwd,
                          env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def server(tmp_path_factory, gemma_path):
    d = tmp_path_factory.mktemp("cli_systemone")
    cfg = {
        "models": {"gemma3-270m": {"path": str(gemma_path), "n_ctx": 8192}},
        "profiles": {"calibrated": {"calibrate": "content_free"}},
        "server": {"systemone": {"model": "gemma3-270m", "auto_max": 6}, "api_key": "k-123"},
    }
    s = start(d, cfg)
    yield s
    s.stop()


LINE = re.compile(r"^(\S+):\s+(.*)$")


def _lines(out: str) -> dict[str, str]:
    return dict(LINE.match(line).groups() for line in out.strip().splitlines())


def test_four_aligned_lines_from_the_server(server):
    r = gmlx("systemone", str(TICKET), "--url", server.url, "--api-key", "k-123")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == ["urgent", "team", "severity", "refund"]
    # Values start in one column.
    assert len({len(line) - len(line.split(":", 1)[1].lstrip()) for line in lines}) == 1
    got = _lines(r.stdout)
    assert re.fullmatch(r"0\.\d{3}|1\.000", got["urgent"])
    assert re.fullmatch(r"(billing|infra|product) \(\d\.\d\d\)", got["team"])
    assert re.fullmatch(r"\d\.\d\d \(\d\.\d\d\)", got["severity"])
    assert got["refund"] == "skipped" or re.fullmatch(r"\d\.\d{3}", got["refund"])


def test_offline_model_prints_the_same_numbers(server):
    body = json.loads(TICKET.read_text())
    online = gmlx("systemone", str(TICKET), "--url", server.url, "--api-key", "k-123", "--json")
    offline = gmlx("systemone", str(TICKET), "--model", "gemma3-270m", "--config", str(server.config_path), "--json")
    assert online.returncode == 0 and offline.returncode == 0, (online.stderr, offline.stderr)
    a, b = json.loads(online.stdout), json.loads(offline.stdout)
    assert a["answers"] == b["answers"]
    # cached_tokens says what an earlier request left in the server's prefix
    # cache (the offline process starts empty): every other number is equal.
    strip = lambda u: {k: v for k, v in u.items() if k != "cached_tokens"}  # noqa: E731
    assert strip(a["usage"]) == strip(b["usage"])
    assert list(a["answers"]) == list(body["questions"])
    # And the printed lines agree too.
    on = gmlx("systemone", str(TICKET), "--url", server.url, "--api-key", "k-123")
    off = gmlx("systemone", str(TICKET), "--model", "gemma3-270m", "--config", str(server.config_path))
    assert on.stdout == off.stdout


def test_offline_with_a_gguf_path_and_seed(gemma_path, tmp_path):
    r1 = gmlx("systemone", str(TICKET), "--model", str(gemma_path), "--json", "--seed", "5", cwd=tmp_path)
    r2 = gmlx("systemone", str(TICKET), "--model", str(gemma_path), "--json", "--seed", "5", cwd=tmp_path)
    assert r1.returncode == 0, r1.stderr
    assert json.loads(r1.stdout)["answers"] == json.loads(r2.stdout)["answers"]


def test_api_key_from_environment(server):
    r = gmlx("systemone", str(TICKET), "--url", server.url, env={"GMLX_API_KEY": "k-123"})
    assert r.returncode == 0, r.stderr
    bad = gmlx("systemone", str(TICKET), "--url", server.url, env={"GMLX_API_KEY": "wrong"})
    assert bad.returncode == 1 and bad.stdout == ""
    assert bad.stderr.strip().startswith("gmlx: HTTP 401: authentication_error")
    assert len(bad.stderr.strip().splitlines()) == 1


def test_http_error_is_one_line_exit_1(server, tmp_path):
    req = tmp_path / "bad.json"
    req.write_text(json.dumps({"state": "x", "questions": {"a:b": {"type": "noul"}}}))
    r = gmlx("systemone", str(req), "--url", server.url, "--api-key", "k-123")
    assert r.returncode == 1
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("gmlx: HTTP 422: validation_error:") and "a:b" in line


def test_unreachable_server_says_how_to_start_one(tmp_path):
    r = gmlx("systemone", str(TICKET), "--host", "127.0.0.1", "--port", str(free_port()), cwd=tmp_path)
    assert r.returncode == 1
    (line,) = r.stderr.strip().splitlines()
    assert "no server at http://127.0.0.1:" in line and "gmlx serve" in line


def test_model_with_url_is_a_usage_error():
    for extra in (["--url", "http://x"], ["--host", "h"], ["--port", "1"]):
        r = gmlx("systemone", str(TICKET), "--model", "gemma3-270m", *extra)
        assert r.returncode == 2 and "cannot be combined" in r.stderr


@pytest.mark.parametrize("content, fragment", [(None, "cannot read"), ("{nope", "not valid JSON"), ("[1, 2]", "JSON object")])
def test_bad_request_file_is_one_line_exit_1(tmp_path, content, fragment):
    req = tmp_path / "req.json"
    if content is not None:
        req.write_text(content)
    r = gmlx("systemone", str(req), "--url", "http://127.0.0.1:9")
    assert r.returncode == 1
    (line,) = r.stderr.strip().splitlines()
    assert fragment in line


def test_every_example_is_a_valid_request():
    from gmlx.decisions.parse import parse_decision
    from gmlx.decisions.types import DecisionSettings

    files = sorted((REPO / "examples").glob("*.json"))
    assert len(files) >= 8
    for f in files:
        d = parse_decision(json.loads(f.read_text()), DecisionSettings())
        assert d.questions, f


def test_module_entry_point_runs():
    r = subprocess.run([sys.executable, "-m", "gmlx", "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "systemone" in r.stdout and "serve" in r.stdout


def test_readme_example_request_runs(server):
    import httpx

    text = (REPO / "README.md").read_text()
    body = json.loads(re.search(r"-d '(\{.*?\})'\n", text, re.S).group(1))
    r = httpx.post(server.url + "/v1/systemone", json=body, headers={"Authorization": "Bearer k-123"}, timeout=120)
    assert r.status_code == 200, r.text
    answers = r.json()["answers"]
    assert list(answers) == ["urgent", "team", "severity", "refund"]
    assert answers["team"]["choice"] in ("billing", "infra", "product")


def test_offline_applies_profiles_and_server_defaults_like_the_server(server, tmp_path):
    """The offline CLI resolves the request's profile and the server.systemone
    defaults (here auto_max 6) as the server does: the same numbers both ways."""
    body = json.loads(TICKET.read_text())
    body["profile"] = "calibrated"
    req = tmp_path / "profiled.json"
    req.write_text(json.dumps(body))
    online = gmlx("systemone", str(req), "--url", server.url, "--api-key", "k-123", "--json")
    offline = gmlx("systemone", str(req), "--model", "gemma3-270m", "--config", str(server.config_path), "--json")
    assert online.returncode == 0 and offline.returncode == 0, (online.stderr, offline.stderr)
    a, b = json.loads(online.stdout), json.loads(offline.stdout)
    assert a["answers"] == b["answers"]
    assert a["diagnostics"]["calibrate"] == b["diagnostics"]["calibrate"] == "content_free"
    assert a["diagnostics"]["samples"] == b["diagnostics"]["samples"]
    plain = json.loads(gmlx("systemone", str(TICKET), "--model", "gemma3-270m", "--config", str(server.config_path),
                            "--json").stdout)
    assert plain["diagnostics"]["calibrate"] == "none" and plain["answers"] != b["answers"]
    body["profile"] = "nonesuch"
    req.write_text(json.dumps(body))
    bad = gmlx("systemone", str(req), "--model", "gemma3-270m", "--config", str(server.config_path))
    assert bad.returncode != 0 and "nonesuch" in bad.stderr
