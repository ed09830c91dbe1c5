"""Loading GGUFs through the real llama.cpp: strategies, tokenizer, templates, errors."""

from __future__ import annotations

import pytest

import tiny_gguf
from gmlx.config import LOAD_DEFAULTS
from gmlx.engine import open_reader
from gmlx.decisions.literal import strip_marks
from gmlx.engine.chat import GEMMA, ChatTemplate
from gmlx.engine.gguf_info import llama_supports_arch, read_info
from gmlx.engine.model import load_model
from gmlx.errors import ModelFileMissing, ModelLoadError, NotImplementedStrategy

S = dict(LOAD_DEFAULTS, n_gpu_layers=0, n_ctx=1024)


@pytest.fixture(scope="module")
def gemma(gemma_path):
    lm = load_model("gemma3-270m", gemma_path, S)
    yield lm
    lm.close()


def test_embedded_gemma_is_next_token_with_builtin_template(gemma):
    assert gemma.architecture == "gemma3"
    assert gemma.strategy == "next-token"
    assert gemma.chat_template.origin == "builtin:gemma"  # the GGUF carries none
    assert (gemma.special.bos, gemma.special.eos, gemma.special.eot, gemma.special.pad) == (2, 1, 106, 0)
    assert gemma.n_vocab == 262144 and gemma.n_ctx_train == 32768
    assert gemma.canvas_length is None and gemma.shift_logits is False


def test_tokenizer_round_trip(gemma):
    text = "Charged twice for invoice #12 — please refund ü."
    toks = gemma.encode(text)
    assert toks and toks[0] != gemma.special.bos  # no special tokens added
    assert gemma.decode(toks) == text
    assert gemma.token_id("<end_of_turn>") == 106
    assert gemma.token_id("billing and refunds") is None


def test_gemma_template_folds_system_text_into_the_user_turn(gemma):
    text = gemma.chat_template.render(
        [{"role": "system", "content": "Answer as a support lead."}, {"role": "user", "content": "Ticket"}]
    )
    # The caller's text is marked as plain text (decisions/literal.py); unmarked, it reads:
    assert strip_marks(text) == "<bos><start_of_turn>user\nAnswer as a support lead.\n\nTicket<end_of_turn>\n<start_of_turn>model\n"
    toks = gemma.encode_prompt(text)
    assert toks[0] == 2 and toks.count(2) == 1  # BOS parsed once, not doubled
    assert 105 in toks and 106 in toks


def test_template_without_system_role_never_drops_system_text():
    # A template that silently ignores system messages (like llama-cpp-python's gemma format).
    dropping = (
        "{% for m in messages %}{% if m['role'] == 'user' %}<u>{{ m['content'] }}</u>{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<a>{% endif %}"
    )
    t = ChatTemplate(dropping, "config")
    assert not t.has_system_role
    out = t.render([{"role": "system", "content": "SYS"}, {"role": "user", "content": "hello"}])
    assert strip_marks(out) == "<u>SYS\n\nhello</u><a>"
    # One that raises on a system role is folded the same way.
    raising = "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system') }}{% endif %}{{ m['content'] }}{% endfor %}"
    t2 = ChatTemplate(raising, "config")
    assert strip_marks(t2.render([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}])) == "S\n\nU"
    assert ChatTemplate(GEMMA, "builtin:gemma", "<bos>").has_system_role


def test_config_template_wins(gemma_path):
    lm = load_model("g", gemma_path, dict(S, chat_template="chatml"))
    try:
        assert lm.chat_template.origin == "builtin:chatml"
        assert lm.chat_template.render([{"role": "user", "content": "x"}]).endswith("<|im_start|>assistant\n")
    finally:
        lm.close()


@pytest.mark.parametrize(
    "fixture, arch, strategy, shift",
    [("tiny_llada", "llada", "canvas", False), ("tiny_dream", "dream", "canvas", True), ("tiny_qwen3", "qwen3", "next-token", False)],
)
def test_tiny_fixtures_load_with_strategy(request, fixture, arch, strategy, shift):
    path = request.getfixturevalue(fixture)
    lm = load_model(arch, path, S)
    try:
        assert lm.architecture == arch
        assert lm.strategy == strategy
        assert lm.shift_logits is shift
        if strategy == "canvas":
            assert lm.special.mask == tiny_gguf.TINY_IDS["mask"]
        else:
            assert lm.chat_template.origin == "gguf" and lm.chat_template.has_thinking
        info = read_info(path)
        assert info.architecture == arch and info.size == path.stat().st_size
    finally:
        lm.close()


def test_arch_builtin_template_when_gguf_has_none(tiny_gguf_dir):
    path = tiny_gguf.build_gguf(tiny_gguf_dir / "qwen3-no-template.gguf", "qwen3", chat_template=None)
    assert not read_info(path).has_chat_template
    lm = load_model("plain-qwen", path, S)
    try:
        # qwen3 has a built-in (chatml): the architecture fallback applies.
        assert lm.strategy == "next-token" and lm.chat_template.origin == "builtin:chatml"
    finally:
        lm.close()


def test_no_template_no_diffusion_is_no_strategy_and_501(tiny_gguf_dir):
    path = tiny_gguf.build_gguf(tiny_gguf_dir / "llama-plain.gguf", "llama")
    lm = load_model("plain", path, S)
    try:
        assert lm.architecture == "llama" and lm.chat_template is None
        assert lm.strategy is None
        with pytest.raises(NotImplementedStrategy) as e:
            open_reader(lm, S)
        assert e.value.status == 501 and "no read strategy" in e.value.message
    finally:
        lm.close()


def test_missing_file_is_a_distinct_error(tmp_path):
    with pytest.raises(ModelFileMissing) as e:
        load_model("gone", tmp_path / "nope.gguf", S)
    assert e.value.status == 404 and e.value.type == "model_file_missing"
    assert "nope.gguf" in e.value.message


def test_truncated_gguf_is_a_clear_error(tmp_path, tiny_llada):
    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(tiny_llada.read_bytes()[: 20000])
    with pytest.raises(ModelLoadError) as e:
        load_model("broken", bad, S)
    assert "broken" in str(e.value)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf at all" * 100)
    with pytest.raises(ModelLoadError):
        load_model("junk", junk, S)


def test_unloadable_architecture_names_it_and_what_to_install(tmp_path):
    # A header that says diffusion-gemma, which llama-cpp-python 0.3.36 does not know.
    import gguf

    path = tmp_path / "dgemma.gguf"
    w = gguf.GGUFWriter(str(path), "diffusion-gemma")
    w.add_uint32("diffusion-gemma.context_length", 128)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if llama_supports_arch("diffusion-gemma"):
        pytest.skip("this llama.cpp build knows diffusion-gemma")
    with pytest.raises(ModelLoadError) as e:
        load_model("dgemma", path, S)
    msg = str(e.value)
    assert "diffusion-gemma" in msg and "llama-cpp-python" in msg and "install" in msg


def test_supported_architectures_detected():
    for arch in ("llada", "dream", "qwen3", "gemma3", "llama"):
        assert llama_supports_arch(arch), arch
    assert not llama_supports_arch("no-such-architecture-xyz")


def test_truncated_file_is_refused_at_load_not_a_sigbus(tmp_path, tiny_qwen3):
    """A GGUF cut short after its header would map fine and kill the process on
    the first read of a missing page; the tensor table is checked first."""
    import os
    import shutil

    from gmlx.config import LOAD_DEFAULTS
    from gmlx.engine.gguf_info import read_info
    from gmlx.engine.model import load_model
    from gmlx.errors import ModelLoadError

    cut = tmp_path / "cut.gguf"
    shutil.copy(tiny_qwen3, cut)
    assert read_info(cut).architecture == "qwen3"  # whole: fine
    os.truncate(cut, os.path.getsize(cut) - 64)
    with pytest.raises(ValueError, match="truncated"):
        read_info(cut)
    with pytest.raises(ModelLoadError, match="truncated"):
        load_model("cut", cut, dict(LOAD_DEFAULTS, n_ctx=256))
