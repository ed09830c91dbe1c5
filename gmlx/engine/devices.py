"""The compute devices of the loaded llama.cpp (CPU, CUDA, Metal, Vulkan, RPC...).

llama-cpp-python 0.3.36 does not wrap ggml's device registry, so the few
functions needed are declared through ctypes on the libggml next to the
libllama the binding loaded. `llama_supports_gpu_offload()` alone cannot name
the backend, and it is also true for a CPU build that carries the RPC backend.
"""

from __future__ import annotations

import ctypes
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import llama_cpp


def _lib_names(stem: str) -> list[str]:
    if sys.platform == "darwin":
        return [f"lib{stem}.dylib"]
    if sys.platform == "win32":
        return [f"{stem}.dll", f"lib{stem}.dll"]
    return [f"lib{stem}.so", f"lib{stem}.so.0"]


def library_dir() -> Path:
    """The folder of the libllama the binding loaded (LLAMA_CPP_LIB_PATH or the bundled one)."""
    return Path(llama_cpp.llama_cpp._lib._name).resolve().parent


def _open(stem: str) -> ctypes.CDLL | None:
    for name in _lib_names(stem):
        # Next to libllama as named (LLAMA_CPP_LIB_PATH may be a folder of links).
        for folder in (Path(llama_cpp.llama_cpp._lib._name).parent, library_dir()):
            path = folder / name
            if path.is_file():
                try:
                    return ctypes.CDLL(str(path))
                except OSError:
                    continue
    return None

# ggml_backend_dev_type
DEV_CPU, DEV_GPU, DEV_IGPU, DEV_ACCEL = 0, 1, 2, 3
_KIND = {DEV_CPU: "cpu", DEV_GPU: "gpu", DEV_IGPU: "igpu", DEV_ACCEL: "accel"}

_lock = threading.Lock()
_ggml: ctypes.CDLL | None = None
_tried = False


def ggml() -> ctypes.CDLL | None:
    """libggml with the device functions declared, or None when it cannot be found."""
    global _ggml, _tried
    with _lock:
        if not _tried:
            _tried = True
            lib = _open("ggml")
            if lib is not None:
                try:
                    declare(lib)
                    _ggml = lib
                except AttributeError:
                    _ggml = None
        return _ggml


def declare(lib: ctypes.CDLL) -> None:
    """Declare ggml's device-registry functions on `lib` (shared with rpc.py)."""
    vp, sz, cp = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p
    for name, args, res in (
        ("ggml_backend_reg_by_name", [cp], vp),
        ("ggml_backend_reg_get_proc_address", [vp, cp], vp),
        ("ggml_backend_reg_dev_count", [vp], sz),
        ("ggml_backend_reg_dev_get", [vp, sz], vp),
        ("ggml_backend_dev_count", [], sz),
        ("ggml_backend_dev_get", [sz], vp),
        ("ggml_backend_dev_by_type", [ctypes.c_int], vp),
        ("ggml_backend_dev_by_name", [cp], vp),
        ("ggml_backend_dev_name", [vp], cp),
        ("ggml_backend_dev_description", [vp], cp),
        ("ggml_backend_dev_type", [vp], ctypes.c_int),
        ("ggml_backend_dev_backend_reg", [vp], vp),
        ("ggml_backend_reg_name", [vp], cp),
    ):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res


@dataclass(frozen=True)
class Device:
    name: str  # "CPU", "CUDA0", "Metal", "Vulkan0", "RPC[127.0.0.1:50052]"...
    description: str
    kind: str  # cpu, gpu, igpu, accel
    backend: str  # the registry: CPU, CUDA, Metal, Vulkan, RPC...


def devices() -> list[Device]:
    lib = ggml()
    if lib is None:
        return []
    out = []
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        reg = lib.ggml_backend_dev_backend_reg(dev)
        out.append(Device(
            name=(lib.ggml_backend_dev_name(dev) or b"").decode("utf-8", "replace"),
            description=(lib.ggml_backend_dev_description(dev) or b"").decode("utf-8", "replace"),
            kind=_KIND.get(lib.ggml_backend_dev_type(dev), "other"),
            backend=(lib.ggml_backend_reg_name(reg) or b"").decode("utf-8", "replace") if reg else "",
        ))
    return out


def accelerators() -> list[Device]:
    """The devices llama.cpp can offload layers to (GPUs and the like)."""
    return [d for d in devices() if d.kind in ("gpu", "igpu", "accel")]


def backend_name() -> str:
    """"cpu", or the offload backend and its devices, e.g. "CUDA (CUDA0: NVIDIA H200)"."""
    acc = accelerators()
    if not acc:
        return "cpu"
    by_backend: dict[str, list[str]] = {}
    for d in acc:
        by_backend.setdefault(d.backend or d.name, []).append(f"{d.name}: {d.description}" if d.description else d.name)
    return ", ".join(f"{b} ({'; '.join(names)})" for b, names in by_backend.items())
