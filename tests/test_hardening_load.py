"""Back-pressure under a burst: the test-sized version of bench/load.py.

A real `gmlx serve` with the embedded Gemma 3 270M and `max_queue: 4` gets 32
decisions released at the same instant. Every one must be answered 200 or 503
`overloaded` with Retry-After 1..5; the accepted ones all give the same
answers (one decision, deterministic); afterwards the server is alive, the
worker idle, and its resident memory within 10% of what it was after a
warm-up decision.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("gmlx_bench_load", ROOT / "bench" / "load.py")
load = importlib.util.module_from_spec(_spec)
sys.modules["gmlx_bench_load"] = load
_spec.loader.exec_module(load)

CONCURRENCY = 32
MAX_QUEUE = 4


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = load.embedded_gemma_server(tmp_path_factory.mktemp("load"), max_queue=MAX_QUEUE, n_ctx=1024).start()
    yield s
    s.stop()


def test_burst_gets_200_or_503_and_the_server_recovers(server):
    results: list = []
    report = load.measure(server.url, server.proc.pid, "gemma", CONCURRENCY, results=results)
    assert len(results) == CONCURRENCY
    statuses = report["statuses"]
    assert set(statuses) <= {"200", "503"}, report
    assert not report["failures"], report["failures"]  # no reset connection, no timeout
    ok = [r for r in results if r.status == 200]
    busy = [r for r in results if r.status == 503]
    # At most one running plus max_queue waiting can be accepted at a time;
    # with every request released at once most are refused.
    assert 1 <= len(ok) and len(busy) >= CONCURRENCY - 2 * (MAX_QUEUE + 1), statuses
    for r in busy:
        assert r.error_type == "overloaded", r
        assert r.retry_after is not None and 1 <= int(r.retry_after) <= 5, r
    assert report["missing_retry_after"] == 0
    # Every accepted decision ran, and they agree (same request, same seed).
    assert report["worker"]["served"] == len(ok), report["worker"]
    assert report["worker"]["overloaded"] == len(busy), report["worker"]
    assert report["worker"]["failed"] == 0 and report["worker"]["timeouts"] == 0
    assert report["distinct_answers"] == 1
    assert ok[0].answers and set(ok[0].answers) == {"refund", "team", "severity"}
    # The refusals are quick compared with the answered decisions at the back of the queue.
    assert max(r.seconds for r in busy) < max(r.seconds for r in ok), report["latency_ms"]
    # Afterwards: alive, idle, memory back.
    assert report["server_alive"] and server.proc.poll() is None
    assert report["worker_after"] == {"waiting": 0, "running": False}
    before, after = report["rss_kb"]["before"], report["rss_kb"]["after"]
    assert before > 100_000, report["rss_kb"]  # the model is in memory
    assert abs(after - before) <= 0.10 * before, report["rss_kb"]


def test_percentile_and_report_helpers():
    assert load.percentile([], 50) is None
    assert load.percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert load.percentile(list(range(1, 101)), 95) == 95
    assert load.percentile([5.0], 95) == 5.0
    assert load.rss_kb(load.os.getpid()) > 0
    report = {"concurrency": 4, "max_queue": 1, "statuses": {"200": 2, "503": 2},
              "latency_ms": {"all": {"p50": 1.0, "p95": 2.0}, "200": {"p95": 2.0}, "503": {"p95": 1.0}},
              "retry_after": {"1": 2}, "worker": {"served": 2, "overloaded": 2},
              "rss_kb": {"before": 1024, "after": 2048}, "rss_change_pct": 100.0}
    text = load.markdown([report], {"args": "", "machine": "x", "cpus": 1, "python": "3", "n_ctx": 1})
    assert "| 1 | 4 | 1 | 2 | 2 | 0 |" in text and "1 s x2" in text and "1.0 -> 2.0" in text
