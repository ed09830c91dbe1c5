"""llama.cpp RPC: `rpc_servers` on a model, `gmlx rpc-worker`.

With ../shared/llama-dg/lib (a llama.cpp build with the RPC backend; CI has it
at the same place), two `gmlx rpc-worker` processes on loopback hold the layers
of a tiny model and of the embedded Gemma served by `gmlx serve`, and the
answers equal those of a local load with the same library, bitwise
(docs/reads.md). Without an RPC build (the bundled llama-cpp-python), a model
with `rpc_servers` fails to load with a configuration error that says how to
get one, and `gmlx rpc-worker` refuses to start with the same advice.
"""

from __future__ import annotations

import copy
import os
import socket
import subprocess
import time
from pathlib import Path

import llama_cpp
import pytest
import tiny_gguf
import yaml
from fake_reader import ticket_body
from server_harness import free_port, gmlx_command, start

REPO = Path(__file__).resolve().parent.parent


def _ticket() -> dict:
    """The tests' support ticket (fake_reader.ticket_body) without its second stage, two samples."""
    body = ticket_body(samples=2)
    del body["questions"]["refund"]
    return body


TICKET = _ticket()

BUNDLED_HAS_RPC = bool(llama_cpp.llama_supports_rpc())


def _wait_port(port: int, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"rpc worker exited with {proc.returncode}: {proc.stderr.read() if proc.stderr else ''}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"rpc worker on {port} did not listen in {timeout} s")


@pytest.fixture(scope="module")
def dg_env():
    lib = tiny_gguf.dg_lib_dir()
    if lib is None:
        pytest.skip("no ../shared/llama-dg/lib (llama.cpp with the RPC backend)")
    return tiny_gguf.dg_env(lib)


@pytest.fixture(scope="module")
def workers(dg_env, tmp_path_factory):
    d = tmp_path_factory.mktemp("rpc_workers")
    procs, endpoints = [], []
    try:
        for i in range(2):
            port = free_port()
            log = open(d / f"worker{i}.log", "wb")
            p = subprocess.Popen(gmlx_command() + ["rpc-worker", "--port", str(port), "--threads", "1"],
                                 stdout=log, stderr=subprocess.STDOUT, env=dg_env)
            procs.append(p)
            _wait_port(port, p)
            endpoints.append(f"127.0.0.1:{port}")
        time.sleep(0.5)
        yield endpoints, d, procs, [_rss_mb(p.pid) for p in procs]
    finally:
        for p in procs:
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


@pytest.fixture(scope="module")
def server(workers, dg_env, gemma_path, tiny_qwen3, tmp_path_factory):
    endpoints = workers[0]
    models = {}
    for name, path in (("gemma", gemma_path), ("tiny", tiny_qwen3)):
        base = {"path": str(path), "n_ctx": 4096, "n_threads": 1}
        models[f"{name}-local"] = {**base, "extra_buffers": "off"}
        models[f"{name}-rpc"] = {**base, "rpc_servers": endpoints}
    cfg = {"models": models, "server": {"systemone": {"model": "gemma-local"}}}
    s = start(tmp_path_factory.mktemp("rpc_server"), cfg, env={"LLAMA_CPP_LIB_PATH": dg_env["LLAMA_CPP_LIB_PATH"]})
    yield s
    s.stop()


def _ask(server, model: str) -> dict:
    body = copy.deepcopy(TICKET)
    body["model"] = model
    r = server.post(body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("name", ["tiny", "gemma"])
def test_rpc_answers_equal_the_local_load(server, workers, name):
    local = _ask(server, f"{name}-local")
    remote = _ask(server, f"{name}-rpc")
    assert remote["model"] == f"{name}-rpc"
    # Bitwise: the workers run the same CPU kernels on the same plain (not
    # repacked) weight layout as the local load with extra_buffers off.
    assert remote["answers"] == local["answers"]
    assert {k: v for k, v in remote["usage"].items() if k != "cached_tokens"} == \
        {k: v for k, v in local["usage"].items() if k != "cached_tokens"}
    assert remote["diagnostics"]["samples"]["tops"] == local["diagnostics"]["samples"]["tops"]
    # /health reports where the model runs.
    assert "rpc:" + ",".join(workers[0]) in repr(server.health())
    if name == "gemma":
        # The weights (253 MB) really live in the workers: each holds part of them.
        _, _, procs, before = workers
        grown = [_rss_mb(p.pid) - b for p, b in zip(procs, before)]
        assert all(g > 40 for g in grown), grown
        assert sum(grown) > 200, grown


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def test_rpc_worker_binds_to_loopback_by_default(dg_env, tmp_path):
    port = free_port()
    p = subprocess.Popen(gmlx_command() + ["rpc-worker", "--port", str(port), "--threads", "1"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dg_env, text=True)
    try:
        _wait_port(port, p)
        out = subprocess.run(["ss", "-ltn"], capture_output=True, text=True).stdout if _has("ss") else ""
        if out:
            lines = [ln for ln in out.splitlines() if f":{port} " in ln]
            assert lines and all("127.0.0.1:" in ln for ln in lines), out
    finally:
        p.terminate()
        p.wait(10)
    assert "127.0.0.1" in p.stderr.read()


def test_a_worker_that_does_not_answer_fails_the_load(dg_env, tiny_qwen3, tmp_path):
    cfg = {"models": {"tiny": {"path": str(tiny_qwen3), "rpc_servers": f"127.0.0.1:{free_port()}"}}}
    (tmp_path / "decisions.yaml").write_text(yaml.safe_dump(cfg))
    req = tmp_path / "r.json"
    req.write_text('{"state": "x", "questions": {"q": {"type": "noul"}}}')
    r = subprocess.run(gmlx_command() + ["systemone", str(req), "--model", "tiny", "--config",
                                         str(tmp_path / "decisions.yaml")],
                       capture_output=True, text=True, env=dg_env, timeout=120)
    assert r.returncode == 1
    assert "does not answer" in r.stderr and "gmlx rpc-worker" in r.stderr


def _has(cmd: str) -> bool:
    from shutil import which

    return which(cmd) is not None


@pytest.mark.skipif(BUNDLED_HAS_RPC, reason="the installed llama-cpp-python has the RPC backend")
def test_without_an_rpc_build_the_load_says_how_to_get_one(tiny_qwen3, tmp_path):
    cfg = {"models": {"tiny": {"path": str(tiny_qwen3), "rpc_servers": ["127.0.0.1:50052"]}}}
    (tmp_path / "decisions.yaml").write_text(yaml.safe_dump(cfg))
    req = tmp_path / "r.json"
    req.write_text('{"state": "x", "questions": {"q": {"type": "noul"}}}')
    env = {k: v for k, v in os.environ.items() if k != "LLAMA_CPP_LIB_PATH"}
    r = subprocess.run(gmlx_command() + ["systemone", str(req), "--model", "tiny", "--config",
                                         str(tmp_path / "decisions.yaml")],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 1
    assert "configuration error: rpc_servers" in r.stderr
    assert 'CMAKE_ARGS="-DGGML_RPC=on" pip install --force-reinstall --no-cache-dir llama-cpp-python' in r.stderr
    w = subprocess.run(gmlx_command() + ["rpc-worker", "--port", "1"], capture_output=True, text=True, env=env,
                       timeout=60)
    assert w.returncode == 2 and "-DGGML_RPC=on" in w.stderr
