"""`gmlx systemone --batch`: offline and through a server, bad lines, resume, 503 retries."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import httpx
import pytest
from server_harness import gmlx_command, start

from gmlx import bulk

REPO = Path(__file__).resolve().parent.parent

QUESTIONS = {
    "urgent": {"type": "noul", "instructions": "Does the customer need a reply within the hour?"},
    "team": {"type": "choice", "instructions": "Which team should handle the ticket?",
             "criteria": {"billing": "invoices, charges, refunds", "infra": "outages, errors, latency",
                          "product": "features, UI bugs"}},
}
TICKETS = [
    "I was charged twice for my March invoice. Please refund the duplicate charge.",
    "The dashboard returns 500 errors since this morning and nobody can log in.",
    "Please add a dark mode to the settings page.",
    "Our invoices show the wrong VAT number.",
]


def _body(ticket: str, **extra) -> dict:
    return {"state": {"ticket": ticket}, "questions": QUESTIONS, **extra}


def write_requests(path: Path) -> Path:
    """Lines 1-4 good (ids t0, t1, none -> 3, t3), 5 not JSON, 6 a validation error, 7 blank."""
    bad_choice = {"state": "x", "questions": {"q": {"type": "choice", "criteria": {"only": None}}}, "id": "bad"}
    lines = [
        json.dumps(_body(TICKETS[0], id="t0")),
        json.dumps(_body(TICKETS[1], id="t1")),
        json.dumps(_body(TICKETS[2])),
        json.dumps(_body(TICKETS[3], id="t3")),
        '{"state": "broken", ',
        json.dumps(bad_choice),
        "",
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def gmlx(*args: str, cwd: Path = REPO, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(gmlx_command() + list(args), capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env={**os.environ, "GMLX_API_KEY": "k-123"})


def read_out(path: Path) -> dict:
    """id -> record; fails on a broken or duplicate line."""
    text = path.read_text()
    assert text.endswith("\n")
    out = {}
    for raw in text.splitlines():
        rec = json.loads(raw)
        assert rec["id"] not in out, f"duplicate id {rec['id']!r}"
        assert ("response" in rec) != ("error" in rec), rec
        out[rec["id"]] = rec
    return out


@pytest.fixture(scope="module")
def config(tmp_path_factory, gemma_path):
    return {
        "models": {"gemma3-270m": {"path": str(gemma_path), "n_ctx": 4096}},
        "server": {"systemone": {"model": "gemma3-270m"}, "api_key": "k-123"},
    }


@pytest.fixture(scope="module")
def server(tmp_path_factory, config):
    s = start(tmp_path_factory.mktemp("bulk_server"), config)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def requests_file(tmp_path_factory) -> Path:
    return write_requests(tmp_path_factory.mktemp("bulk_in") / "requests.jsonl")


@pytest.fixture(scope="module")
def offline(tmp_path_factory, requests_file, server):
    d = tmp_path_factory.mktemp("bulk_offline")
    out, summary = d / "answers.jsonl", d / "summary.json"
    r = gmlx("systemone", "--batch", str(requests_file), "--out", str(out), "--model", "gemma3-270m",
             "--config", str(server.config_path), "--summary-json", str(summary))
    return r, read_out(out), json.loads(summary.read_text())


def _usage(record: dict) -> dict:
    return {k: v for k, v in record["response"]["usage"].items() if k != "cached_tokens"}


def _check_errors(records: dict) -> None:
    assert records[5]["error"]["type"] == "invalid_request_error" and records[5]["error"]["code"] == 400
    assert records[5]["line"] == 5
    assert records["bad"]["error"]["type"] == "validation_error" and records["bad"]["error"]["code"] == 422
    assert set(records["bad"]["error"]) == {"message", "type", "param", "code"}


def test_offline_bulk_answers_every_good_line_and_reports_bad_ones(offline):
    r, records, summary = offline
    assert r.returncode == 1, r.stderr  # two lines failed
    assert set(records) == {"t0", "t1", 3, "t3", 5, "bad"}
    assert records[3]["line"] == 3
    for rid in ("t0", "t1", 3, "t3"):
        resp = records[rid]["response"]
        assert list(resp["answers"]) == ["urgent", "team"]
        assert resp["answers"]["team"]["choice"] in {"billing", "infra", "product"}
    _check_errors(records)
    assert "line 5 (id 5): 400 invalid_request_error" in r.stderr
    assert "line 6 (id 'bad'): 422 validation_error" in r.stderr
    assert summary["lines"] == 6 and summary["answered"] == 4 and summary["failed"] == 2
    assert summary["input_tokens"] == sum(records[i]["response"]["usage"]["input_tokens"] for i in ("t0", "t1", 3, "t3"))
    assert summary["decisions_per_s"] > 0
    assert "6 lines, 4 answered, 2 failed" in r.stderr


def test_server_bulk_gives_the_offline_numbers(offline, server, requests_file, tmp_path):
    _, off, _ = offline
    out = tmp_path / "answers.jsonl"
    r = gmlx("systemone", "--batch", str(requests_file), "--out", str(out), "--url", server.url,
             "--concurrency", "3")
    assert r.returncode == 1, r.stderr
    srv = read_out(out)
    assert set(srv) == set(off)
    for rid in ("t0", "t1", 3, "t3"):
        assert srv[rid]["response"]["answers"] == off[rid]["response"]["answers"], rid
        # cached_tokens (server prefix-cache reuse) depends on what the server answered before.
        assert _usage(srv[rid]) == _usage(off[rid]), rid
        assert srv[rid]["line"] == off[rid]["line"]
    _check_errors(srv)


def test_resume_skips_answered_ids_and_leaves_whole_lines(server, requests_file, tmp_path):
    out = tmp_path / "answers.jsonl"
    first = tmp_path / "first.jsonl"
    first.write_text("".join(requests_file.read_text().splitlines(keepends=True)[:2]))  # t0, t1
    r = gmlx("systemone", "--batch", str(first), "--out", str(out), "--url", server.url)
    assert r.returncode == 0, r.stderr
    before = read_out(out)
    assert set(before) == {"t0", "t1"}
    # An interrupted run's broken last line, and a transient failure for t3.
    with open(out, "a") as f:
        f.write(json.dumps({"id": "t3", "line": 4, "error": {"message": "x", "type": "overloaded", "param": None,
                                                            "code": 503}}) + "\n")
        f.write('{"id": 3, "line": 3, "resp')
    summary = tmp_path / "summary.json"
    r = gmlx("systemone", "--batch", str(requests_file), "--out", str(out), "--url", server.url,
             "--summary-json", str(summary))
    assert r.returncode == 1, r.stderr
    after = read_out(out)  # no duplicate, no broken line
    assert set(after) == {"t0", "t1", 3, "t3", 5, "bad"}
    for rid in ("t0", "t1"):  # not answered again: the same decision ids
        assert after[rid] == before[rid]
    assert "response" in after["t3"] and "response" in after[3]
    s = json.loads(summary.read_text())
    assert (s["already_answered"], s["answered"], s["failed"]) == (2, 2, 2)
    # A third run has nothing left but the bad lines.
    r = gmlx("systemone", "--batch", str(requests_file), "--out", str(out), "--url", server.url,
             "--summary-json", str(summary))
    assert r.returncode == 1
    s = json.loads(summary.read_text())
    assert (s["already_answered"], s["answered"], s["failed"]) == (4, 0, 2)
    assert set(read_out(out)) == set(after)


def test_a_full_queue_503_is_retried_until_answered(tmp_path, config, offline):
    _, off, _ = offline
    cfg = {**config, "server": {**config["server"], "max_queue": 1}}
    s = start(tmp_path / "srv", cfg)
    try:
        req = tmp_path / "req.jsonl"
        req.write_text("".join(json.dumps(_body(t, id=f"r{i}")) + "\n" for i, t in enumerate(TICKETS)))
        out, summary = tmp_path / "answers.jsonl", tmp_path / "summary.json"
        r = gmlx("systemone", "--batch", str(req), "--out", str(out), "--url", s.url, "--concurrency", "4",
                 "--retries", "30", "--summary-json", str(summary))
        assert r.returncode == 0, r.stderr
        got = read_out(out)
        sm = json.loads(summary.read_text())
        assert sm["answered"] == 4 and sm["failed"] == 0
        assert sm["retries"] >= 1  # 4 in flight, one running and one queued: the others got 503
        assert got["r0"]["response"]["answers"] == off["t0"]["response"]["answers"]
        assert got["r1"]["response"]["answers"] == off["t1"]["response"]["answers"]
        assert got["r3"]["response"]["answers"] == off["t3"]["response"]["answers"]
    finally:
        s.stop()


# -- no model: the engine's retry policy, the files -----------------------------------


def _engine(responses: list, retries: int = 3):
    calls, sleeps = [], []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(json.loads(request.content))
        item = responses[min(len(calls) - 1, len(responses) - 1)]
        if isinstance(item, Exception):
            raise item
        return item

    eng = bulk.ServerEngine("http://test", "k", retries=retries, sleep=sleeps.append,
                            transport=httpx.MockTransport(handler))
    return eng, calls, sleeps


def test_retry_after_is_honoured_and_bounded():
    busy = httpx.Response(503, headers={"Retry-After": "2"},
                          json={"error": {"message": "full", "type": "overloaded", "param": None, "code": 503}})
    ok = httpx.Response(200, json={"answers": {}, "usage": {"input_tokens": 3, "output_tokens": 1}})
    eng, calls, sleeps = _engine([busy, busy, ok])
    assert eng({"state": "s"}) == {"response": {"answers": {}, "usage": {"input_tokens": 3, "output_tokens": 1}}}
    assert len(calls) == 3 and sleeps == [2.0, 2.0] and eng.retried == 2
    eng, calls, sleeps = _engine([busy], retries=3)
    result = eng({"state": "s"})
    assert result["error"]["type"] == "overloaded" and result["error"]["code"] == 503
    assert len(calls) == 4 and sleeps == [2.0, 2.0, 2.0]
    # A huge or missing Retry-After is capped / backs off.
    huge = httpx.Response(503, headers={"Retry-After": "3600"}, json={"error": {"message": "", "type": "overloaded",
                                                                              "param": None, "code": 503}})
    eng, calls, sleeps = _engine([huge, ok])
    assert "response" in eng({}) and sleeps == [bulk.MAX_RETRY_AFTER_S]


def test_other_errors_are_not_retried_and_connection_errors_are():
    bad = httpx.Response(422, json={"error": {"message": "no", "type": "validation_error", "param": "q", "code": 422}})
    eng, calls, sleeps = _engine([bad])
    assert eng({}) == {"error": {"message": "no", "type": "validation_error", "param": "q", "code": 422}}
    assert len(calls) == 1 and sleeps == []
    ok = httpx.Response(200, json={"answers": {}})
    eng, calls, sleeps = _engine([httpx.ConnectError("refused"), ok], retries=2)
    assert "response" in eng({}) and len(calls) == 2 and len(sleeps) == 1
    eng, calls, sleeps = _engine([httpx.ConnectError("refused")], retries=2)
    res = eng({})
    assert res["error"]["type"] == "connection_error" and len(calls) == 3


def test_read_lines_ids(tmp_path):
    p = tmp_path / "r.jsonl"
    p.write_text('{"id": "a", "state": 1}\n\n[1]\n{"id": 7, "state": 2}\n{"id": "7", "state": 3}\n'
                 '{"id": "a", "state": 4}\n{"id": 1.5}\n{"state": 5}\n')
    lines = list(bulk.read_lines(str(p), seed=9))
    assert [(ln.number, ln.id, ln.body is not None) for ln in lines] == [
        (1, "a", True), (3, 3, False), (4, 7, True), (5, "7", True), (6, "a", False), (7, 7, False), (8, 8, True)]
    assert lines[0].body == {"state": 1, "seed": 9}  # the id is not sent
    assert "repeats" in lines[4].error["message"] and lines[4].error["param"] == "id"


def test_answered_ids_drops_failed_and_broken_lines(tmp_path):
    out = tmp_path / "a.jsonl"
    out.write_text('{"id": "a", "line": 1, "response": {}}\n{"id": 2, "line": 2, "error": {}}\n'
                   '{"id": "b", "line": 3, "response": {}}\n{"id": "c", "li')
    assert bulk.answered_ids(out) == {'"a"', '"b"'}
    assert out.read_text() == '{"id": "a", "line": 1, "response": {}}\n{"id": "b", "line": 3, "response": {}}\n'


def test_batch_needs_out_and_no_request_file(tmp_path):
    req = write_requests(tmp_path / "r.jsonl")
    r = gmlx("systemone", "--batch", str(req), timeout=60)
    assert r.returncode == 2 and "--out" in r.stderr
    r = gmlx("systemone", str(req), "--batch", str(req), "--out", str(tmp_path / "o.jsonl"), timeout=60)
    assert r.returncode == 2


def test_progress_bar_on_a_terminal_and_plain_lines_otherwise():
    import io

    tty = io.StringIO()
    bar = bulk.Progress(3, stream=tty, tty=True)
    assert bar.bar is not None  # rich, not hand-drawn
    for failed in (False, True, False):
        bar.advance(failed)
    bar.stop()
    assert "3/3" in tty.getvalue() and "1 failed" in tty.getvalue()
    plain = io.StringIO()
    p = bulk.Progress(4, stream=plain, every=0.0, tty=False)
    assert p.bar is None
    for failed in (False, False, True, False):
        p.advance(failed)
    lines = plain.getvalue().splitlines()
    assert lines[0].startswith("gmlx: 1/4 lines, 0 failed, ") and "decisions/s, ETA" in lines[0]
    assert lines[-1].startswith("gmlx: 3/4 lines, 1 failed")  # the summary replaces a 4/4 line
