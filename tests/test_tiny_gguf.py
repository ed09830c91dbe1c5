"""The tiny random GGUFs of tests/tiny_gguf.py load and run in the real llama.cpp."""

from __future__ import annotations

import contextlib
import ctypes
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import pytest

import tiny_gguf
from tiny_gguf import TINY_IDS

L = pytest.importorskip("llama_cpp")

# llama.cpp logs through this callback; keep a reference for the life of the process.
_QUIET = L.llama_log_callback(lambda level, text, user_data: None)


@pytest.fixture(scope="module", autouse=True)
def _llama_quiet() -> None:
    L.llama_log_set(_QUIET, ctypes.c_void_p())
    L.llama_backend_init()


# --- low-level helpers ------------------------------------------------------------------


@contextlib.contextmanager
def load(path: str | Path, vocab_only: bool = False) -> Iterator[ctypes.c_void_p]:
    p = L.llama_model_default_params()
    p.n_gpu_layers = 0
    p.vocab_only = vocab_only
    model = L.llama_model_load_from_file(str(path).encode(), p)
    assert model, f"llama.cpp could not load {path}"
    try:
        yield model
    finally:
        L.llama_model_free(model)


@contextlib.contextmanager
def context(model, n: int) -> Iterator[ctypes.c_void_p]:
    cp = L.llama_context_default_params()
    cp.n_ctx = n
    cp.n_batch = n
    cp.n_ubatch = n  # diffusion: the whole forward must fit one ubatch
    cp.n_seq_max = 1
    cp.n_threads = cp.n_threads_batch = 2
    ctx = L.llama_init_from_model(model, cp)
    assert ctx, "llama_init_from_model failed"
    try:
        yield ctx
    finally:
        L.llama_free(ctx)


def meta(model, key: str) -> str | None:
    buf = ctypes.create_string_buffer(512)
    n = L.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
    return buf.value.decode() if n >= 0 else None


def tokenize(vocab, text: str, add_special: bool = False, parse_special: bool = True) -> list[int]:
    data = text.encode()
    n_max = len(data) + 8
    out = (L.llama_token * n_max)()
    n = L.llama_tokenize(vocab, data, len(data), out, n_max, add_special, parse_special)
    assert n >= 0, n
    return list(out[:n])


def piece(vocab, token: int) -> str:
    buf = ctypes.create_string_buffer(128)
    n = L.llama_token_to_piece(vocab, token, buf, len(buf), 0, True)
    return buf.raw[:n].decode("utf-8", errors="replace")


def forward(ctx, model, tokens: Sequence[int], rows: Sequence[int]) -> np.ndarray:
    """One llama_decode of `tokens` (positions 0.., seq 0); the logits rows asked for."""
    n_ctx = L.llama_n_ubatch(ctx)
    assert 0 < len(tokens) <= n_ctx, "a batch over n_ubatch aborts the process"
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    batch = L.llama_batch_init(len(tokens), 0, 1)
    try:
        want = set(rows)
        for i, t in enumerate(tokens):
            batch.token[i] = t
            batch.pos[i] = i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = i in want
        batch.n_tokens = len(tokens)
        assert L.llama_decode(ctx, batch) == 0
        out = np.empty((len(rows), n_vocab), dtype=np.float32)
        for k, i in enumerate(rows):
            ptr = L.llama_get_logits_ith(ctx, i)
            assert ptr, f"no logits for row {i}"
            out[k] = np.ctypeslib.as_array(ptr, shape=(n_vocab,))
        return out
    finally:
        L.llama_batch_free(batch)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


TINY_N = len(tiny_gguf.tiny_vocab())
GEMMA_N = 262144

MODELS = [
    # fixture, architecture, diffusion, vocabulary size
    ("tiny_llada", "llada", True, TINY_N),
    ("tiny_dream", "dream", True, TINY_N),
    ("tiny_qwen3", "qwen3", False, TINY_N),
    ("tiny_llada_gemma_vocab", "llada", True, GEMMA_N),
    ("tiny_dream_gemma_vocab", "dream", True, GEMMA_N),
]


# --- loading and metadata -------------------------------------------------------------------


@pytest.mark.parametrize("fixture,arch,diffusion,n_vocab", MODELS)
def test_loads_with_expected_metadata(request, fixture, arch, diffusion, n_vocab):
    path = request.getfixturevalue(fixture)
    with load(path) as model:
        assert meta(model, "general.architecture") == arch
        assert bool(L.llama_model_is_diffusion(model)) is diffusion
        vocab = L.llama_model_get_vocab(model)
        assert L.llama_vocab_n_tokens(vocab) == n_vocab
        assert L.llama_model_n_embd(model) == 64
        assert L.llama_model_n_layer(model) == 2
        assert L.llama_model_n_head(model) == 4
        assert L.llama_model_n_ctx_train(model) >= 2048
        template = L.llama_model_chat_template(model, None)
        if diffusion:
            assert L.llama_vocab_mask(vocab) == 4  # <mask> in both vocabularies
            assert piece(vocab, 4) == "<mask>"
            assert meta(model, "diffusion.shift_logits") == ("true" if arch == "dream" else "false")
            assert meta(model, f"{arch}.attention.causal") == "false"
            assert template is None
        else:
            assert L.llama_vocab_mask(vocab) == -1
            assert template is not None and template.decode() == tiny_gguf.QWEN3_CHAT_TEMPLATE


def test_qwen3_special_tokens(tiny_qwen3):
    with load(tiny_qwen3, vocab_only=True) as model:
        vocab = L.llama_model_get_vocab(model)
        im_end = TINY_IDS["im_end"]
        assert L.llama_vocab_eos(vocab) == im_end
        assert L.llama_vocab_eot(vocab) == im_end
        assert L.llama_vocab_is_eog(vocab, im_end)
        assert L.llama_vocab_bos(vocab) == TINY_IDS["endoftext"]
        assert not L.llama_vocab_get_add_bos(vocab)
        for text, tid in [("<|im_start|>", 6), ("<|im_end|>", 7), ("<think>", 8), ("</think>", 9)]:
            assert tokenize(vocab, text) == [tid]
            assert piece(vocab, tid) == text
        assert L.llama_vocab_is_control(vocab, 6) and L.llama_vocab_is_control(vocab, 7)
        nl = TINY_IDS["byte0"] + 0x0A
        tail = tokenize(vocab, "<|im_start|>assistant\n<think>\n\n</think>\n\n")
        assert tail == [6, tokenize(vocab, "assistant")[0], nl, 8, nl, nl, 9, nl, nl]


def test_tiny_vocab_labels_are_single_tokens(tiny_llada):
    labels = [chr(c) for c in range(ord("A"), ord("Z") + 1)] + [str(d) for d in range(10)]
    labels += ["yes", "no", "Yes", "No", ":", "assistant", "user", "model"]
    with load(tiny_llada, vocab_only=True) as model:
        vocab = L.llama_model_get_vocab(model)
        for label in labels:
            for text in (label, " " + label):
                ids = tokenize(vocab, text, parse_special=False)
                assert len(ids) == 1, (text, ids)
                assert piece(vocab, ids[0]) == text
        # BOS is added for the diffusion models; newline goes through the byte tokens
        assert tokenize(vocab, "yes", add_special=True)[0] == TINY_IDS["bos"]
        assert tokenize(vocab, "\n") == [TINY_IDS["byte0"] + 0x0A]
        assert tokenize(vocab, "Answer with yes or no only.") == [
            vocab_id for w in ("Answer", " with", " yes", " or", " no", " only", ".") for vocab_id in tokenize(vocab, w)
        ]


def test_gemma_vocab_tokenizes_like_gemma(tiny_dream_gemma_vocab, gemma_path):
    text = "<start_of_turn>user\nIs the sky blue? Answer with yes or no.<end_of_turn>\n<start_of_turn>model\n"
    with load(gemma_path, vocab_only=True) as real, load(tiny_dream_gemma_vocab, vocab_only=True) as tiny:
        rv, tv = L.llama_model_get_vocab(real), L.llama_model_get_vocab(tiny)
        assert tokenize(tv, text, add_special=True) == tokenize(rv, text, add_special=True)
        for f in ("llama_vocab_bos", "llama_vocab_eos", "llama_vocab_eot", "llama_vocab_pad"):
            assert getattr(L, f)(tv) == getattr(L, f)(rv)
        assert L.llama_vocab_mask(tv) == 4 and L.llama_vocab_mask(rv) == -1


# --- forwards --------------------------------------------------------------------------------


def _diffusion_tokens(vocab, prompt: str, n_total: int = 40) -> list[int]:
    toks = tokenize(vocab, prompt, add_special=True)
    assert len(toks) < n_total
    return toks + [L.llama_vocab_mask(vocab)] * (n_total - len(toks))


@pytest.mark.parametrize("fixture", ["tiny_llada", "tiny_dream", "tiny_llada_gemma_vocab", "tiny_dream_gemma_vocab"])
def test_diffusion_forward_is_non_causal(request, fixture):
    path = request.getfixturevalue(fixture)
    with load(path) as model, context(model, 64) as ctx:
        assert not L.llama_get_memory(ctx)  # no KV cache for diffusion models
        vocab = L.llama_model_get_vocab(model)
        toks = _diffusion_tokens(vocab, "Question: is the sky blue?\nAnswer with yes or no only.\n")
        n = len(toks)
        assert n == 40
        rows = list(range(n))
        a = forward(ctx, model, toks, rows)
        assert np.isfinite(a).all()
        assert a.std(axis=-1).min() > 0.3  # logits are spread, not near-uniform
        # non-causal: changing the last token changes the first row
        changed = toks[:-1] + [tokenize(vocab, "yes")[0]]
        b = forward(ctx, model, changed, rows)
        assert np.abs(a[0] - b[0]).max() > 1e-3
        # the canvas rows depend on the prompt: label distribution moves with the input
        other = _diffusion_tokens(vocab, "Question: is water dry?\nAnswer with yes or no only.\n")
        c = forward(ctx, model, other, rows)
        labels = [tokenize(vocab, t)[0] for t in ("yes", "no")]
        row = n - 5
        pa = np.exp(log_softmax(a[row, labels]))
        pc = np.exp(log_softmax(c[row, labels]))
        assert abs(pa[0] - pc[0]) > 1e-3
        # same input, same logits
        again = forward(ctx, model, toks, rows)
        np.testing.assert_array_equal(again, a)


def test_qwen3_forward(tiny_qwen3):
    import jinja2.sandbox

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    tmpl = env.from_string(tiny_gguf.QWEN3_CHAT_TEMPLATE)

    def render(content: str) -> str:
        msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": content}]
        return tmpl.render(messages=msgs, add_generation_prompt=True, enable_thinking=False)

    text = render("Is the sky blue? Answer with yes or no only.")
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")
    thinking = tmpl.render(messages=[{"role": "user", "content": "x"}], add_generation_prompt=True)
    assert thinking.endswith("<|im_start|>assistant\n")

    with load(tiny_qwen3) as model, context(model, 256) as ctx:
        assert L.llama_get_memory(ctx)
        vocab = L.llama_model_get_vocab(model)
        labels = [tokenize(vocab, t)[0] for t in ("yes", "no")]
        probs = []
        for content in ("Is the sky blue? Answer with yes or no only.", "Is water dry? Answer with yes or no only."):
            toks = tokenize(vocab, render(content), add_special=True)
            assert toks[0] == TINY_IDS["im_start"]  # no BOS for qwen3
            L.llama_memory_clear(L.llama_get_memory(ctx), True)
            logits = forward(ctx, model, toks, [len(toks) - 1])[0]
            assert np.isfinite(logits).all()
            assert logits.std() > 0.3
            probs.append(np.exp(log_softmax(logits[labels])))
        assert abs(probs[0][0] - probs[1][0]) > 1e-3

        # causal: the first row does not depend on later tokens
        toks = tokenize(vocab, render("Is the sky blue?"), add_special=True)
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
        a = forward(ctx, model, toks, [0])[0]
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
        b = forward(ctx, model, toks[:-1] + [labels[0]], [0])[0]
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_gemma3_forward(tiny_gemma3, gemma_path):
    text = "<start_of_turn>user\nIs the sky blue? Answer with yes or no.<end_of_turn>\n<start_of_turn>model\n"
    with load(tiny_gemma3) as model, context(model, 128) as ctx:
        assert meta(model, "general.architecture") == "gemma3"
        assert not L.llama_model_is_diffusion(model)
        vocab = L.llama_model_get_vocab(model)
        assert L.llama_vocab_n_tokens(vocab) == GEMMA_N
        toks = tokenize(vocab, text, add_special=True)
        assert toks[0] == 2  # <bos>
        logits = forward(ctx, model, toks, [len(toks) - 1])[0]
        assert np.isfinite(logits).all() and logits.std() > 0.3


# --- building ---------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llada", "dream", "qwen3"])
def test_same_seed_same_bytes(tmp_path, arch):
    a = tiny_gguf.build_gguf(tmp_path / "a.gguf", arch, seed=3)
    b = tiny_gguf.build_gguf(tmp_path / "b.gguf", arch, seed=3)
    c = tiny_gguf.build_gguf(tmp_path / "c.gguf", arch, seed=4)
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()


def test_gemma_vocab_build_is_deterministic(tmp_path, tiny_llada_gemma_vocab, gemma_path):
    again = tiny_gguf.build_llada(tmp_path / "again.gguf", vocab=gemma_path)
    assert again.read_bytes() == Path(tiny_llada_gemma_vocab).read_bytes()


def test_llama_supports_arch(tmp_path):
    for arch in ("llada", "dream", "qwen3", "gemma3"):
        assert tiny_gguf.llama_supports_arch(arch)
    assert not tiny_gguf.llama_supports_arch("no-such-arch-xyz")
    # diffusion-gemma has its own builder (tests/test_engine_dg.py loads it through
    # ../shared/llama-dg/lib); build_gguf refuses the name.
    with pytest.raises(tiny_gguf.UnsupportedArchError):
        tiny_gguf.build_gguf(tmp_path / "dg.gguf", "diffusion-gemma")
    assert not (tmp_path / "dg.gguf").exists()


def test_arch_probe_subprocess():
    # the slow path of llama_supports_arch, on a known and an unknown architecture
    from gmlx.engine.gguf_info import probe_arch

    assert probe_arch("llada")
    assert not probe_arch("diffusion-gemma-not-real")
