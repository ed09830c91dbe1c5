"""Profiles of one model share one loaded llama_model (server/shared.py):
measured in the server's RSS, and the numbers stay those of a separate load."""

from __future__ import annotations

import pytest
from server_harness import start

STATE = "I was charged twice for my March invoice. Please refund the duplicate charge."
BODY = {"state": STATE, "samples": 1,
        "questions": {"refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"}}}


def rss_mib(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def server(tmp_path_factory, gemma_path):
    d = tmp_path_factory.mktemp("server_profiles")
    cfg = {
        "models": {"gemma": {"path": str(gemma_path), "n_ctx": 1024, "profiles": ["short", "long", "apart"]}},
        # short/long change only the context; apart changes how the weights are loaded.
        "profiles": {"short": {"n_ctx": 512}, "long": {"n_ctx": 2048}, "apart": {"use_mmap": False}},
        "server": {"systemone": {"model": "gemma"}},
    }
    s = start(d, cfg)
    yield s
    s.stop()


def post(server, profile=None):
    body = dict(BODY, **({"profile": profile} if profile else {}))
    r = server.post(body)
    assert r.status_code == 200, r.text
    return r.json()


def test_profiles_share_the_weights(server):
    base = post(server)
    before = rss_mib(server.proc.pid)
    short, long_ = post(server, "short"), post(server, "long")
    shared = rss_mib(server.proc.pid) - before
    apart = post(server, "apart")
    separate = rss_mib(server.proc.pid) - before - shared
    # Two more contexts on the same llama_model cost their KV and buffers only;
    # a profile that loads the weights its own way costs a copy of them (~240 MiB).
    print(f"RSS: two context-only profiles +{shared:.0f} MiB, a profile loading its own weights +{separate:.0f} MiB")
    # Measured: +111 MiB for the two shared profiles, +328 MiB for the separate
    # one; without sharing the two cost +662 MiB.
    assert shared < 200, shared
    assert separate > shared + 150, (shared, separate)
    # Same numbers: the context settings do not change this short prompt's read.
    assert base["answers"] == short["answers"] == long_["answers"] == apart["answers"]
