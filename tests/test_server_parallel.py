"""Parallel reads (issue 15.1) through a real `gmlx serve`: `parallel: 2`
contexts share one loaded Gemma; a decision's numbers do not depend on what
else is in flight (bitwise), and back-pressure counts every context."""

from __future__ import annotations

import concurrent.futures
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fake_reader import ticket_body  # noqa: E402
from server_harness import assert_error, long_body, start  # noqa: E402


@pytest.fixture(scope="module")
def server(tmp_path_factory, gemma_path):
    d = tmp_path_factory.mktemp("server_parallel")
    config = {
        "models": {"gemma": {"path": str(gemma_path), "n_ctx": 1024, "parallel": 2}},
        "server": {"max_queue": 16},
    }
    s = start(d, config, preload=True)
    yield s
    s.stop()


def numbers(body: dict) -> dict:
    """Everything a decision says in numbers: answers and per-question diagnostics
    (not the work accounting: timing, and the tokens evaluated, which the
    cross-request prefix cache lowers when another decision shared a prefix)."""
    diag = dict(body["diagnostics"])
    diag.pop("timing", None)
    diag.pop("evaluated_tokens", None)
    return {"answers": body["answers"], "diagnostics": diag}


def other_body(i: int) -> dict:
    b = ticket_body()
    b["state"] = {"ticket": f"Ticket {i}: my order {1000 + i} arrived broken, item {i} of {i + 2}. Please help."}
    return b


def test_two_contexts_share_the_model(server):
    slot = server.health()["models"]["gemma"]["slots"]["default"]
    assert slot["state"] == "ready"
    assert slot["parallel"] == 2
    assert slot["queue"]["parallel"] == 2


def test_a_decision_alone_and_among_8_concurrent_others_is_bitwise_equal(server):
    alone = server.post(ticket_body())
    assert alone.status_code == 200, alone.text
    ref = numbers(alone.json())
    saw_two = threading.Event()
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            if server.health()["models"]["gemma"]["slots"]["default"]["queue"]["in_flight"] >= 2:
                saw_two.set()
                return
            time.sleep(0.01)

    w = threading.Thread(target=watch)
    w.start()
    with concurrent.futures.ThreadPoolExecutor(9) as ex:
        others = [ex.submit(server.post, other_body(i)) for i in range(8)]
        # The same decision three times among the others, at different moments.
        mine = []
        for _ in range(3):
            mine.append(ex.submit(server.post, ticket_body()))
            time.sleep(0.3)
        results = [f.result() for f in others + mine]
    stop.set()
    w.join()
    for r in results:
        assert r.status_code == 200, r.text
    for r in results[8:]:
        assert numbers(r.json()) == ref  # dict equality of floats: bitwise
    assert saw_two.is_set(), "two decisions never ran at once with parallel: 2"


def test_back_pressure_counts_every_context(tmp_path, gemma_path):
    s = start(tmp_path, {"models": {"gemma": {"path": str(gemma_path), "n_ctx": 1024, "parallel": 2}},
                         "server": {"max_queue": 1}}, preload=True)
    try:
        out: dict[int, object] = {}

        def go(i):
            out[i] = s.post(long_body(n=4, samples=3))

        threads = [threading.Thread(target=go, args=(i,)) for i in range(3)]
        deadline = time.monotonic() + 30
        for k, t in enumerate(threads):  # one at a time: each taken up before the next arrives
            t.start()
            while True:
                q = s.health()["models"]["gemma"]["slots"]["default"]["queue"]
                if q["in_flight"] + q["waiting"] >= k + 1:
                    break
                assert time.monotonic() < deadline, q
                time.sleep(0.01)
        while True:
            q = s.health()["models"]["gemma"]["slots"]["default"]["queue"]
            if q["in_flight"] == 2 and q["waiting"] == 1:
                break
            assert time.monotonic() < deadline, q
            time.sleep(0.02)
        # Two running, one waiting (max_queue 1): the next one is refused at once.
        r = s.post(long_body(n=1, samples=1))
        assert_error(r, 503, "overloaded")
        assert 1 <= int(r.headers["Retry-After"]) <= 5
        for t in threads:
            t.join(120)
        assert all(out[i].status_code == 200 for i in range(3)), [out[i].text for i in range(3)]
        q = s.health()["models"]["gemma"]["slots"]["default"]["queue"]
        assert q["in_flight"] == 0 and q["waiting"] == 0 and q["overloaded"] == 1
    finally:
        s.stop()
