"""The issue-18 strategies behind a real `gmlx serve`: Winnow (tiny gemma4),
Liquid d1 (tiny lfm2) and Qwen3.5 next-token (tiny qwen35). One ticket per
strategy on both routes, /v1/decisions, the Winnow 400s, and a strategy the
architecture cannot serve."""

from __future__ import annotations

import httpx
import pytest
from server_harness import assert_error, start
from tiny_gguf_more import build_gemma4, build_lfm2, build_qwen35

from fake_reader import ticket_body

STRATEGY = {"winnow": "winnow", "liquid": "liquid", "qwen35": "next-token"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("server_strategies")
    g4, lf, q35 = build_gemma4(d / "g4.gguf"), build_lfm2(d / "lfm2.gguf"), build_qwen35(d / "q35.gguf")
    cfg = {
        "models": {
            "winnow": {"path": str(g4), "n_ctx": 2048, "n_threads": 1, "read_strategy": "winnow",
                       "decision_temperature": 1.5},
            "winnow-json": {"path": str(g4), "n_ctx": 2048, "n_threads": 1, "read_strategy": "winnow",
                            "decision_state_format": "json"},
            "liquid": {"path": str(lf), "n_ctx": 2048, "n_threads": 1, "read_strategy": "liquid"},
            "qwen35": {"path": str(q35), "n_ctx": 2048, "n_threads": 1},
        },
        "server": {"systemone": {"model": "qwen35"}},
    }
    s = start(d, cfg)
    yield s
    s.stop()



@pytest.mark.parametrize("model", ["winnow", "liquid", "qwen35"])
def test_ticket_on_both_routes(server, model):
    a = server.ok(ticket_body(model=model))
    b = server.ok(ticket_body(model=model), "/systemone")
    assert a["model"] == b["model"] == model
    assert a["answers"] == b["answers"]
    assert a["diagnostics"]["strategy"] == STRATEGY[model]
    assert list(a["answers"]) == ["urgent", "team", "severity", "refund"]
    for ans in a["answers"].values():
        if ans is not None:
            assert abs(sum(ans["probabilities"].values()) - 1) < 1e-6
    assert isinstance(a["usage"]["input_tokens"], int) and a["usage"]["input_tokens"] > 20


@pytest.mark.parametrize("model", ["winnow", "liquid", "qwen35"])
def test_openai_decisions_route(server, model):
    body = {"model": model, "input": "The package arrived with a broken screen.",
            "questions": [{"type": "predicate", "name": "damaged", "instructions": "Is the item damaged?"},
                          {"type": "choice", "instructions": "Which department?",
                           "choices": [{"value": "returns"}, {"value": "billing"}]}]}
    r = httpx.post(server.url + "/v1/decisions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["model"] == model
    assert [a["type"] for a in out["answers"]] == ["predicate", "choice"]
    assert 0.0 <= out["answers"][0]["probability"] <= 1.0


def test_winnow_temperature_and_full_probabilities(server):
    a = server.ok(ticket_body(model="winnow"))
    w = a["diagnostics"]["winnow"]
    assert w["decision_temperature"] == 1.5 and w["state_format"] == "text"
    team = w["full_probabilities"]["team"]
    assert set(team) == {"billing", "infra", "product"}
    assert sum(team.values()) == pytest.approx(a["diagnostics"]["questions"]["team"]["label_mass"], rel=1e-6)


def test_winnow_json_state_and_its_400(server):
    a = server.ok(ticket_body(model="winnow-json"))
    b = server.ok(ticket_body(model="winnow-json", state='{ "ticket" : "I was charged twice for my March '
                                  'invoice. Please refund the duplicate charge." }'))
    assert a["answers"] == b["answers"]  # one canonical serialization
    r = server.post(ticket_body(model="winnow-json", state="not { json"))
    err = assert_error(r, 400, "invalid_request_error", "state")
    assert "not valid JSON" in err["message"]


@pytest.mark.parametrize("field,value", [("chat_template_kwargs", {"enable_thinking": True}),
                                         ("instructions", "Be brief.")])
def test_winnow_refuses_chat_overrides(server, field, value):
    r = server.post(ticket_body(model="winnow", **{field: value}))
    err = assert_error(r, 400, "invalid_request_error", field)
    assert field in err["message"]


def test_strategy_the_architecture_cannot_serve_is_a_config_error(tmp_path):
    import subprocess

    import yaml
    from server_harness import gmlx_command

    q35 = build_qwen35(tmp_path / "q35.gguf")
    cfg = tmp_path / "decisions.yaml"
    cfg.write_text(yaml.safe_dump({"models": {"bad": {"path": str(q35), "read_strategy": "winnow"}}}))
    r = subprocess.run(gmlx_command() + ["serve", "--config", str(cfg), "--port", "0"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "models.bad.read_strategy" in r.stderr and "'winnow'" in r.stderr and "'qwen35'" in r.stderr
    assert "Traceback" not in r.stderr
