"""What a GGUF is, read from its header alone (no weights loaded), and which
architectures the linked llama.cpp can load."""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

# SPEC 3: these read on the diffusion canvas; everything else with a chat
# template reads next-token.
DIFFUSION_ARCHS = frozenset({"diffusion-gemma", "llada", "llada-moe", "dream", "rnd1"})
# Architectures each explicit `read_strategy` can serve (docs/reads.md).
WINNOW_ARCHS = frozenset({"gemma4"})
LIQUID_ARCHS = frozenset({"lfm2", "lfm2moe"})
# Hybrid / recurrent architectures: their memory cannot drop part of a sequence,
# so shared-prefix reads copy whole sequences instead (engine/hybrid.py).
RECURRENT_ARCHS = frozenset({"qwen35", "qwen35moe", "qwen3next", "lfm2", "lfm2moe"})


def strategy_problem(requested: str | None, arch: str, is_diffusion: bool, has_template: bool) -> str | None:
    """Why an explicit `read_strategy` cannot serve a model of `arch` (None: it can)."""
    if requested in (None, "auto"):
        return None
    diffusion = is_diffusion or arch in DIFFUSION_ARCHS
    ok = {
        "canvas": diffusion,
        "next-token": not diffusion and has_template,
        "winnow": arch in WINNOW_ARCHS,
        "liquid": arch in LIQUID_ARCHS,
    }.get(requested)
    if ok:
        return None
    need = {
        "canvas": f"a diffusion architecture ({', '.join(sorted(DIFFUSION_ARCHS))})",
        "next-token": "an autoregressive model with a chat template",
        "winnow": f"architecture {' or '.join(sorted(WINNOW_ARCHS))}",
        "liquid": f"architecture {' or '.join(sorted(LIQUID_ARCHS))}",
    }.get(requested, "auto, next-token, canvas, winnow or liquid")
    return f"read_strategy {requested!r} cannot serve architecture {arch!r} (it needs {need})"


@dataclass(frozen=True)
class GGUFInfo:
    path: Path
    size: int
    architecture: str
    has_chat_template: bool
    canvas_length: int | None
    context_length: int | None


# GGUF value types (gguf spec): sizes of the fixed-width scalars.
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def _header_values(path: Path, wanted: frozenset[str]) -> dict[str, object]:
    """The values of `wanted` keys from a GGUF header, by a plain scan.

    gguf's GGUFReader builds an object per array item: on a 262k-token
    vocabulary that takes tens of seconds. This skips arrays by their sizes
    (string arrays item by item, without decoding) and keeps only what is asked.
    """
    out: dict[str, object] = {}
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        size = len(mm)

        def need(o: int, n: int) -> None:
            if o + n > size:
                raise ValueError("header runs past the end of the file")

        def read_str(o: int) -> tuple[bytes, int]:
            need(o, 8)
            (n,) = struct.unpack_from("<Q", mm, o)
            need(o + 8, n)
            return mm[o + 8 : o + 8 + n], o + 8 + n

        def skip_str(o: int) -> int:
            need(o, 8)
            (n,) = struct.unpack_from("<Q", mm, o)
            need(o + 8, n)
            return o + 8 + n

        def read_val(vt: int, o: int, keep: bool) -> tuple[object, int]:
            if vt == _STRING:
                if not keep:
                    return None, skip_str(o)
                raw, o = read_str(o)
                return raw.decode("utf-8", "replace"), o
            if vt == _ARRAY:
                need(o, 12)
                et, n = struct.unpack_from("<IQ", mm, o)
                o += 12
                if et in _SCALAR:
                    width = struct.calcsize(_SCALAR[et])
                    need(o, n * width)
                    return None, o + n * width
                for _ in range(n):
                    _, o = read_val(et, o, False)
                return None, o
            fmt = _SCALAR.get(vt)
            if fmt is None:
                raise ValueError(f"unknown value type {vt}")
            width = struct.calcsize(fmt)
            need(o, width)
            return struct.unpack_from(fmt, mm, o)[0], o + width

        need(0, 24)
        if mm[:4] != b"GGUF":
            raise ValueError("bad magic (not a GGUF file)")
        (version,) = struct.unpack_from("<I", mm, 4)
        if version < 2:
            raise ValueError(f"GGUF version {version} is not supported")
        n_tensors, n_kv = struct.unpack_from("<QQ", mm, 8)
        off = 24
        for _ in range(n_kv):
            key, off = read_str(off)
            need(off, 4)
            (vt,) = struct.unpack_from("<I", mm, off)
            off += 4
            name = key.decode("utf-8", "replace")
            keep = name in wanted or name.endswith(".context_length") or name == "general.alignment"
            val, off = read_val(vt, off, keep)
            if keep:
                out[name] = val
        # Tensor infos: the file must hold every tensor's bytes. A file cut short
        # after the header would load (mmap) and then kill the process with
        # SIGBUS on the first read of a missing page.
        end = 0
        for _ in range(n_tensors):
            tname, off = read_str(off)
            need(off, 4)
            (n_dims,) = struct.unpack_from("<I", mm, off)
            need(off + 4, 8 * n_dims + 12)
            dims = struct.unpack_from(f"<{n_dims}Q", mm, off + 4)
            ttype, toff = struct.unpack_from("<IQ", mm, off + 4 + 8 * n_dims)
            off += 4 + 8 * n_dims + 12
            end = max(end, toff + _tensor_bytes(ttype, dims, tname))
        align = int(out.get("general.alignment") or 32)
        data_start = (off + align - 1) // align * align
        if n_tensors and data_start + end > size:
            raise ValueError(
                f"truncated: the header promises tensor data up to byte {data_start + end:,} "
                f"but the file holds {size:,} bytes"
            )
    return out


def _tensor_bytes(ttype: int, dims: tuple[int, ...], name: bytes) -> int:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
    except (KeyError, ValueError):
        raise ValueError(f"tensor {name.decode('utf-8', 'replace')!r} has unknown type {ttype}") from None
    n = 1
    for d in dims:
        n *= d
    return n // block * size


def read_info(path: str | Path) -> GGUFInfo:
    """Header facts; raises ValueError for a file that is not a readable GGUF."""
    p = Path(path)
    wanted = frozenset({"general.architecture", "diffusion.canvas_length", "tokenizer.chat_template"})
    try:
        values = _header_values(p, wanted)
    except (OSError, ValueError, struct.error) as err:  # truncated, wrong magic, bad header
        raise ValueError(f"{p}: not a readable GGUF file ({err})") from None
    arch = values.get("general.architecture") or "unknown"
    canvas = values.get("diffusion.canvas_length")
    ctx = values.get(f"{arch}.context_length")
    return GGUFInfo(
        path=p,
        size=p.stat().st_size,
        architecture=str(arch),
        has_chat_template=values.get("tokenizer.chat_template") is not None,
        canvas_length=int(canvas) if canvas is not None else None,
        context_length=int(ctx) if ctx is not None else None,
    )


def loaded_libllama() -> Path | None:
    """The libllama file the binding loaded (LLAMA_CPP_LIB_PATH's when set at
    import, else the bundled one), symbolic links resolved; None if unknown."""
    import llama_cpp

    lib = getattr(getattr(llama_cpp, "llama_cpp", None), "_lib", None)
    name = getattr(lib, "_name", None)
    if name:
        p = Path(name).resolve()
        if p.is_file():
            return p
    return None


@lru_cache(maxsize=1)
def _libllama_bytes() -> bytes:
    import llama_cpp

    loaded = loaded_libllama()
    if loaded is not None:
        return loaded.read_bytes()
    lib_dir = Path(llama_cpp.__file__).parent / "lib"
    chunks = []
    for lib in sorted(lib_dir.glob("libllama*")):
        if lib.is_file() and lib.stat().st_size > 4096:  # not a flattened link
            chunks.append(lib.read_bytes())
    return b"".join(chunks)


# Where to get a llama.cpp that loads an architecture the linked one lacks.
_HOW_TO_GET = {
    "diffusion-gemma": (
        "DiffusionGemma needs a llama.cpp that carries PR #24423 (not merged upstream yet): build "
        "llama-cpp-python against such a llama.cpp, or point LLAMA_CPP_LIB_PATH at a libllama built from "
        "one (docs/reads.md, \"DiffusionGemma\")"
    ),
}


def unsupported_note(arch: str) -> str:
    """Why the linked llama.cpp cannot load `arch`, and what to install."""
    how = _HOW_TO_GET.get(arch, "install a llama-cpp-python whose bundled llama.cpp has it "
                                "(pip install --upgrade llama-cpp-python)")
    return f"the installed llama.cpp does not know the architecture {arch!r}; {how}"


# Loads a GGUF in a child process, so that a failed load (or a GGML_ASSERT,
# which aborts) cannot take the caller with it: `arch` loads a header-only file
# and reports whether llama.cpp knew the architecture; `vocab` reads only the
# vocabulary (model.probe_vocab) and reports whether llama.cpp accepted it.
CHILD_LOAD = r"""
import ctypes, sys
import llama_cpp
msgs = []
@llama_cpp.llama_log_callback
def _cb(level, text, user_data):
    msgs.append(text.decode(errors="replace") if text else "")
llama_cpp.llama_log_set(_cb, ctypes.c_void_p())
llama_cpp.llama_backend_init()
p = llama_cpp.llama_model_default_params()
p.n_gpu_layers = 0
p.vocab_only = sys.argv[2] == "vocab"
m = llama_cpp.llama_model_load_from_file(sys.argv[1].encode(), p)
if m:
    llama_cpp.llama_model_free(m)
if sys.argv[2] == "vocab":
    print("LOADED" if m else "REFUSED")
else:
    print("UNKNOWN" if "unknown model architecture" in "".join(msgs) else "KNOWN")
"""


@lru_cache(maxsize=None)
def llama_supports_arch(arch: str) -> bool:
    """Whether the linked llama.cpp knows the architecture `arch`.

    llama.cpp keeps its architecture names as C string literals in libllama, so
    finding the name is a yes. Not finding it is not proof (the linker may merge
    "gemma" into the tail of "diffusion-gemma"), so a no is confirmed by loading a
    header-only GGUF of that architecture in a child process and looking for
    llama.cpp's "unknown model architecture".
    """
    if b"\x00" + arch.encode() + b"\x00" in _libllama_bytes():
        return True
    return probe_arch(arch)


def probe_arch(arch: str) -> bool:
    """Load a header-only GGUF of `arch` in a child process: False only when
    llama.cpp answers "unknown model architecture"."""
    import subprocess
    import sys
    import tempfile

    import gguf

    with tempfile.TemporaryDirectory() as d:
        probe = Path(d) / "probe.gguf"
        w = gguf.GGUFWriter(str(probe), arch)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        try:
            r = subprocess.run([sys.executable, "-c", CHILD_LOAD, str(probe), "arch"], capture_output=True, text=True,
                               timeout=120)
        except (OSError, subprocess.TimeoutExpired):
            return True  # cannot tell: let a real load decide
        lines = r.stdout.strip().splitlines()
        return not (r.returncode == 0 and lines and lines[-1] == "UNKNOWN")
