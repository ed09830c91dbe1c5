"""DiffusionGemma behind a real `gmlx serve` on the tiny diffusion-gemma GGUF, the
server started with LLAMA_CPP_LIB_PATH=../shared/llama-dg/lib (llama.cpp with PR
#24423): the seed ticket on both routes, a staged decision in chunks, samples,
/v1/decisions through the openai SDK, the offline CLI's numbers, `gmlx models`.
Runs, not skips, whenever ../shared/llama-dg/lib exists."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import yaml
from server_harness import gmlx_command, start

import tiny_gguf
from fake_reader import ticket_body

pytestmark = pytest.mark.skipif(tiny_gguf.dg_lib_source() is None, reason="no ../shared/llama-dg/lib")


@pytest.fixture(scope="module")
def dg_model(tmp_path_factory):
    return tiny_gguf.build_diffusion_gemma(tmp_path_factory.mktemp("dg_model") / "dg.gguf", canvas_length=64)


@pytest.fixture(scope="module")
def server(tmp_path_factory, dg_model):
    d = tmp_path_factory.mktemp("server_dg")
    cfg = {
        "models": {"dgemma": {"path": str(dg_model), "n_ctx": 2048, "n_threads": 1}},
        "aliases": {"jev-latest": "dgemma"},
        "server": {"systemone": {"model": "dgemma", "canvas": 64}},
    }
    s = start(d, cfg, env={"LLAMA_CPP_LIB_PATH": str(tiny_gguf.dg_lib_dir())}, request_timeout=300)
    yield s
    s.stop()



def _sums_to_one(answers):
    for ans in answers.values():
        if ans is not None:
            assert abs(sum(ans["probabilities"].values()) - 1) < 1e-6, ans


def test_ticket_on_both_routes(server):
    a = server.ok(ticket_body(model="dgemma"))
    b = server.ok(ticket_body(model="dgemma"), "/systemone")
    assert a["model"] == b["model"] == "dgemma"
    assert a["answers"] == b["answers"]
    assert a["diagnostics"]["strategy"] == "canvas"
    # The engine says self-conditioning was used (the llama-dg library has llama_diffusion_set_sc).
    assert a["diagnostics"]["self_conditioning"] == "on"
    assert list(a["answers"]) == ["urgent", "team", "severity", "refund"]
    team = a["answers"]["team"]["choice"]
    if team == "billing":
        assert a["answers"]["refund"]["type"] == "noul"
    else:
        assert a["answers"]["refund"] is None
        assert a["diagnostics"]["skipped"]["refund"] == {"because": "team", "was": team, "wanted": ["billing"]}
    _sums_to_one(a["answers"])
    # The Jev fallback reaches the DiffusionGemma model too.
    assert server.ok(ticket_body(model="typesafe/jev-1.13"))["model"] == "dgemma"


def test_staged_decision_in_chunks(server):
    body = ticket_body(model="dgemma", chunk_rows=16, samples=1, sequential=True, seed=4)
    out = server.ok(body)
    chunks = out["diagnostics"]["chunks"]
    assert len(chunks[0]) > 1  # the first stage split into several reads
    assert [q for c in chunks[0] for q in c] == ["urgent", "team", "severity"]
    assert out["diagnostics"]["stages"] == [["urgent", "team", "severity"], ["refund"]]
    _sums_to_one(out["answers"])
    assert server.ok(body)["answers"] == out["answers"]


def test_four_samples_are_four_distinct_reads(server):
    body = ticket_body(model="dgemma", samples=4, seed=9)
    one = server.ok(body)
    again = server.ok(body)
    assert one["answers"] == again["answers"]
    _sums_to_one(one["answers"])
    samples = one["diagnostics"]["samples"]
    counts = samples["n"] if isinstance(samples["n"], int) else samples["n"][0]
    assert counts == 4
    assert one["diagnostics"]["timing"]["reads"] >= 4
    single = server.ok(ticket_body(model="dgemma", samples=1, seed=9))
    assert single["answers"] != one["answers"]  # four reads averaged are not the first alone


def test_openai_decisions_through_the_sdk(server):
    openai = pytest.importorskip("openai")
    if not hasattr(openai.OpenAI, "decisions"):
        pytest.skip("openai >= 3.26 (client.decisions) is needed")
    questions = [
        {"type": "predicate", "name": "damaged", "instructions": "Does the customer report a damaged item?"},
        {"type": "score", "name": "severity", "instructions": "How severe is the damage?",
         "levels": [{"label": "cosmetic"}, {"label": "broken"}, {"label": "unusable"}]},
    ]
    state = "The package arrived with a broken screen and I want my money back."
    with openai.OpenAI(base_url=server.url + "/v1", api_key="anything", max_retries=0, timeout=300) as c:
        result = c.decisions.create(model="dgemma", input=state, questions=questions)
        again = c.decisions.create(model="dgemma", input=state, questions=questions)
    assert [a.type for a in result.answers] == ["predicate", "score"]
    assert 0.0 <= result.answers[0].probability <= 1.0
    levels = result.answers[1].probabilities
    assert [p.value for p in levels] == [0, 1, 2]
    assert abs(sum(p.probability for p in levels) - 1) < 1e-6
    assert result.answers[0].probability == again.answers[0].probability
    slot = server.health()["models"]["dgemma"]["slots"]["default"]
    assert slot["strategy"] == "canvas"


def test_offline_cli_gives_the_servers_numbers(server, tmp_path):
    req = tmp_path / "ticket.json"
    req.write_text(json.dumps(ticket_body(model="dgemma", seed=3, steps=2)))
    env = tiny_gguf.dg_env()
    online = subprocess.run(gmlx_command() + ["systemone", str(req), "--url", server.url, "--json"],
                            capture_output=True, text=True, timeout=300)
    offline = subprocess.run(gmlx_command() + ["systemone", str(req), "--model", "dgemma", "--config",
                                               str(server.config_path), "--json"],
                             capture_output=True, text=True, timeout=300, env=env)
    assert online.returncode == 0 and offline.returncode == 0, (online.stderr, offline.stderr[-3000:])
    a, b = json.loads(online.stdout), json.loads(offline.stdout)
    assert a["answers"] == b["answers"] and a["usage"] == b["usage"]


def _models(cfg_path, env):
    r = subprocess.run(gmlx_command() + ["models", "--config", str(cfg_path)], capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    row = next(line for line in r.stdout.splitlines() if line.startswith("dgemma"))
    return row.split(), r.stdout


def test_gmlx_models_with_and_without_the_library(server, tmp_path):
    cfg = yaml.safe_load(server.config_path.read_text())
    path = tmp_path / "decisions.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with_lib, _ = _models(path, tiny_gguf.dg_env())
    assert with_lib[:5] == ["dgemma", "jev-latest", "diffusion-gemma", "canvas", "yes"], with_lib
    env = {k: v for k, v in os.environ.items() if k != "LLAMA_CPP_LIB_PATH"}
    probe = subprocess.run([os.sys.executable, "-c", "from gmlx.engine.gguf_info import llama_supports_arch as s;"
                            "print(s('diffusion-gemma'))"], capture_output=True, text=True, env=env, timeout=300)
    if probe.stdout.strip() == "True":
        pytest.skip("the bundled llama.cpp has diffusion-gemma")
    without, text = _models(path, env)
    assert without[:5] == ["dgemma", "jev-latest", "diffusion-gemma", "canvas", "no"], without
    assert "diffusion-gemma" in text.split("dgemma", 1)[1]  # the note names the architecture
