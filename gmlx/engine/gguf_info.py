"""What a GGUF is, read from its header alone (no weights loaded), and which
architectures the linked llama.cpp can load."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

# SPEC 3: these read on the diffusion canvas; everything else with a chat
# template reads next-token.
DIFFUSION_ARCHS = frozenset({"diffusion-gemma", "llada", "llada-moe", "dream", "rnd1"})


@dataclass(frozen=True)
class GGUFInfo:
    path: Path
    size: int
    architecture: str
    has_chat_template: bool
    canvas_length: int | None
    context_length: int | None


def _field_value(reader, key: str):
    field = reader.fields.get(key)
    if field is None:
        return None
    try:
        return field.contents()
    except Exception:  # older gguf packages
        part = field.parts[field.data[0]]
        return bytes(part).decode("utf-8", "replace") if part.dtype.kind == "u" and part.itemsize == 1 else part[0]


def read_info(path: str | Path) -> GGUFInfo:
    """Header facts; raises ValueError for a file that is not a readable GGUF."""
    from gguf import GGUFReader  # numpy memmap: weights are never read

    p = Path(path)
    try:
        reader = GGUFReader(str(p), "r")
    except Exception as err:  # truncated, wrong magic, bad header
        raise ValueError(f"{p}: not a readable GGUF file ({err})") from None
    arch = _field_value(reader, "general.architecture") or "unknown"
    canvas = _field_value(reader, "diffusion.canvas_length")
    ctx = _field_value(reader, f"{arch}.context_length")
    return GGUFInfo(
        path=p,
        size=p.stat().st_size,
        architecture=str(arch),
        has_chat_template=_field_value(reader, "tokenizer.chat_template") is not None,
        canvas_length=int(canvas) if canvas is not None else None,
        context_length=int(ctx) if ctx is not None else None,
    )


@lru_cache(maxsize=1)
def _libllama_bytes() -> bytes:
    import llama_cpp

    lib_dir = Path(llama_cpp.__file__).parent / "lib"
    chunks = []
    for lib in sorted(lib_dir.glob("libllama*")):
        if lib.is_file():
            chunks.append(lib.read_bytes())
    return b"".join(chunks)


def llama_supports_arch(arch: str) -> bool:
    """Whether the linked llama.cpp registers `arch`.

    llama.cpp keeps its architecture names as C strings in libllama; a build
    that predates an architecture (diffusion-gemma in llama-cpp-python 0.3.36)
    does not contain the name, so looking for it tells us before a load fails.
    """
    data = _libllama_bytes()
    if not data:  # cannot tell: let the load decide
        return True
    return b"\x00" + arch.encode() + b"\x00" in data
