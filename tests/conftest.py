"""Shared pytest fixtures: the embedded Gemma GGUF and tiny random GGUFs (tests/tiny_gguf.py).

Every model fixture is session-scoped and built once into one tmp directory
(f32, deterministic, seed 0). Tiny-vocab files are ~0.5 MB and build in a few
ms; Gemma-vocab files are ~74 MB and build in under a second each.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import tiny_gguf  # noqa: E402


@pytest.fixture(scope="session")
def gemma_path() -> str:
    """The embedded Gemma 3 270M Q4_K_M GGUF (assembled and hash-checked once)."""
    return tiny_gguf.embedded_gemma_path()


@pytest.fixture(scope="session")
def tiny_gguf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny_gguf")


@pytest.fixture(scope="session")
def tiny_llada(tiny_gguf_dir: Path) -> Path:
    return tiny_gguf.build_llada(tiny_gguf_dir / "llada-tiny.gguf")


@pytest.fixture(scope="session")
def tiny_dream(tiny_gguf_dir: Path) -> Path:
    return tiny_gguf.build_dream(tiny_gguf_dir / "dream-tiny.gguf")


@pytest.fixture(scope="session")
def tiny_qwen3(tiny_gguf_dir: Path) -> Path:
    return tiny_gguf.build_qwen3(tiny_gguf_dir / "qwen3-tiny.gguf")


@pytest.fixture(scope="session")
def tiny_llada_gemma_vocab(tiny_gguf_dir: Path, gemma_path: str) -> Path:
    return tiny_gguf.build_llada(tiny_gguf_dir / "llada-gemma.gguf", vocab=gemma_path)


@pytest.fixture(scope="session")
def tiny_dream_gemma_vocab(tiny_gguf_dir: Path, gemma_path: str) -> Path:
    return tiny_gguf.build_dream(tiny_gguf_dir / "dream-gemma.gguf", vocab=gemma_path)


@pytest.fixture(scope="session")
def tiny_gemma3(tiny_gguf_dir: Path, gemma_path: str) -> Path:
    """Autoregressive gemma3 block with the real Gemma vocabulary (no chat template)."""
    return tiny_gguf.build_gemma3(tiny_gguf_dir / "gemma3-gemma.gguf", vocab=gemma_path)
