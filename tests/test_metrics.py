"""/metrics (Prometheus text through prometheus-client) and /health/ready on a
real `gmlx serve`, and the SIGTERM drain with `server.drain_grace_s`."""

from __future__ import annotations

import signal
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent))

import tiny_gguf  # noqa: E402
from server_harness import assert_error, long_body, noul_body, start  # noqa: E402

KEY = "sekrit"
AUTH = {"Authorization": f"Bearer {KEY}"}


def samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(m, name, **labels) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture(scope="module")
def server(tmp_path_factory, gemma_path):
    d = tmp_path_factory.mktemp("metrics")
    config = {
        "models": {"gemma": {"path": str(gemma_path), "n_ctx": 1024, "parallel": 1}},
        "server": {"api_key": KEY, "max_queue": 0, "preload": ["gemma"]},
    }
    s = start(d, config)
    yield s
    s.stop()


def wait_ready(s, timeout=60.0) -> list[int]:
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = httpx.get(s.url + "/health/ready", timeout=5)
        seen.append(r.status_code)
        if r.status_code == 200:
            return seen
        assert r.status_code == 503 and r.headers.get("Retry-After"), (r.status_code, r.text)
        time.sleep(0.05)
    raise AssertionError(f"never ready: {seen[-5:]}")


def test_ready_after_the_preload_models_are_loaded(server):
    seen = wait_ready(server)
    assert seen[-1] == 200
    # Ready means loaded: the model answers at once, no 503 model_loading.
    assert server.health()["models"]["gemma"]["state"] == "ready"
    assert httpx.get(server.url + "/health/ready").json() == {"status": "ready"}


def test_metrics_need_the_api_key(server):
    r = httpx.get(server.url + "/metrics")
    assert_error(r, 401, "authentication_error")
    r = httpx.get(server.url + "/metrics", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401


def test_metrics_count_requests_tokens_latency_and_503(server):
    wait_ready(server)
    before = samples(httpx.get(server.url + "/metrics", headers=AUTH).text)
    r = server.post(noul_body(), headers=AUTH)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    # One long decision running, max_queue 0: the next one gets 503.
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", server.post(long_body(n=4, samples=3), headers=AUTH)))
    t.start()
    deadline = time.monotonic() + 30
    while not server.health()["models"]["gemma"]["slots"]["default"]["queue"]["running"]:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    mid = samples(httpx.get(server.url + "/metrics", headers=AUTH).text)
    assert value(mid, "gmlx_decisions_in_flight", model="gemma") == 1
    assert value(mid, "gmlx_decisions_queued", model="gemma") == 0
    refused = server.post(noul_body(), headers=AUTH)
    assert_error(refused, 503, "overloaded")
    t.join(120)
    assert out["r"].status_code == 200
    r = httpx.get(server.url + "/metrics", headers=AUTH)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    after = samples(r.text)
    d = lambda name, **lb: value(after, name, **lb) - value(before, name, **lb)  # noqa: E731
    assert d("gmlx_requests_total", route="/v1/systemone", status="200") == 2
    assert d("gmlx_requests_total", route="/v1/systemone", status="503") == 1
    assert d("gmlx_rejected_total", model="gemma", code="503") == 1
    assert d("gmlx_decision_seconds_count", model="gemma", outcome="served") == 2
    assert d("gmlx_queue_wait_seconds_count", model="gemma") == 2
    assert d("gmlx_decision_request_seconds_count", model="gemma") == 2
    assert d("gmlx_tokens_evaluated_total", model="gemma", kind="input") >= usage["input_tokens"] > 0
    assert value(after, "gmlx_cached_tokens_total", model="gemma") >= 0
    assert ("gmlx_cached_tokens_total", (("model", "gemma"),)) in after
    assert 0 < value(after, "gmlx_model_load_seconds", model="gemma", profile="") < 60
    assert value(after, "gmlx_model_contexts", model="gemma") == 1
    assert value(after, "gmlx_decisions_in_flight", model="gemma") == 0
    assert value(after, "gmlx_requests_total", route="/health/ready", status="200") >= 1


def test_metrics_open_when_metrics_auth_is_false(tmp_path):
    tiny = tiny_gguf.build_qwen3(tmp_path / "tiny.gguf")
    s = start(tmp_path, {"models": {"tiny": {"path": str(tiny), "n_ctx": 512}},
                         "server": {"api_key": KEY, "metrics_auth": False}})
    try:
        r = httpx.get(s.url + "/metrics")
        assert r.status_code == 200 and "gmlx_requests_total" in r.text
        # Decisions still need the key.
        assert s.post(noul_body()).status_code == 401
        # No preload configured: ready at once.
        assert httpx.get(s.url + "/health/ready").status_code == 200
    finally:
        s.stop()


def test_sigterm_drains_queued_decisions_within_the_grace_period_then_exits_0(tmp_path, gemma_path):
    s = start(tmp_path, {"models": {"tiny": {"path": str(gemma_path), "n_ctx": 1024, "parallel": 1}},
                         "server": {"max_queue": 4, "drain_grace_s": 60}}, preload=True)
    try:
        long = long_body(n=8, samples=4)  # several seconds on two cores
        results: dict[str, object] = {}

        def go(name, body):
            try:
                results[name] = httpx.post(s.url + "/v1/systemone", json=body, timeout=60)
            except BaseException as err:  # noqa: BLE001
                results[name] = err

        running = threading.Thread(target=go, args=("running", long))
        running.start()
        deadline = time.monotonic() + 20
        while not s.health()["models"]["tiny"]["slots"]["default"]["queue"]["running"]:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        queued = threading.Thread(target=go, args=("queued", noul_body()))
        queued.start()
        while s.health()["models"]["tiny"]["slots"]["default"]["queue"]["waiting"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        s.proc.send_signal(signal.SIGTERM)
        # Draining: not ready, new decisions refused with Retry-After...
        while (r := httpx.get(s.url + "/health/ready", timeout=5)).status_code == 200:
            assert time.monotonic() < deadline + 10
            time.sleep(0.01)
        assert r.status_code == 503 and r.json()["status"] == "draining"
        assert results.get("running") is None  # still running
        new = httpx.post(s.url + "/v1/systemone", json=noul_body(), timeout=10)
        err = assert_error(new, 503, "overloaded")
        assert "shutting down" in err["message"] and 1 <= int(new.headers["Retry-After"]) <= 5
        running.join(60)
        queued.join(60)
        # ...and both the running and the queued one answered in full.
        for name in ("running", "queued"):
            assert isinstance(results[name], httpx.Response), results[name]
            assert results[name].status_code == 200, results[name].text
        assert len(results["running"].json()["answers"]) == 8
        assert s.proc.wait(30) == 0, s.log()[-3000:]
    finally:
        s.stop()
