"""The backend and devices gmlx reports come from llama.cpp's device registry
(engine/devices.py), not from llama_supports_gpu_offload(), which is also true
for a CPU build that carries the RPC backend."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import tiny_gguf

from gmlx.engine.devices import backend_name, devices

PROBE = """
import json, sys
import llama_cpp
from gmlx.config import LOAD_DEFAULTS
from gmlx.engine.devices import backend_name, devices
from gmlx.engine.model import load_model
lm = load_model("m", sys.argv[1], dict(LOAD_DEFAULTS, n_ctx=512))
print(json.dumps({"offload": bool(llama_cpp.llama_supports_gpu_offload()), "backend": lm.backend,
                  "gpu_layers": lm.gpu_layers, "devices": [d.name for d in devices()], "name": backend_name()}))
"""


def test_this_cpu_build_reports_the_cpu():
    devs = devices()
    assert devs and devs[0].name == "CPU" and devs[0].kind == "cpu" and devs[0].backend == "CPU"
    assert devs[0].description  # the processor's name
    assert backend_name() == "cpu"


def test_an_rpc_capable_cpu_build_is_not_reported_as_a_gpu(tiny_qwen3):
    lib = tiny_gguf.dg_lib_dir()
    if lib is None:
        pytest.skip("no ../shared/llama-dg/lib (a CPU build with the RPC backend)")
    out = subprocess.run([sys.executable, "-c", PROBE, str(tiny_qwen3)], env=tiny_gguf.dg_env(lib),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["offload"] is True  # what the old check went by
    assert got["backend"] == got["name"] == "cpu"
    assert got["gpu_layers"] == 0 and got["devices"] == ["CPU"]
