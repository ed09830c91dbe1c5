"""Tiny random-weight GGUFs of the architectures issue 18 serves: qwen35 (hybrid
gated-delta-net / full attention), gemma4 (Winnow reads) and lfm2 (Liquid d1).

Same conventions as tests/tiny_gguf.py (whose vocabulary and writer this
reuses): f32 weights, deterministic bytes per (arch, seed, overrides), the tiny
SentencePiece-style vocabulary plus the architecture's chat tokens.

The tensor lists and metadata keys are the ones the llama.cpp bundled with
llama-cpp-python 0.3.36 demands (found by loading: each missing key or tensor,
and each wrong shape, is named by llama.cpp's loader; shapes below are numpy
order, the reverse of ggml's):

qwen35 (`{a}` = qwen35), 4 layers, full attention every 4th layer:
  keys: {a}.rope.dimension_sections [4,4,0,0] (IMROPE), {a}.ssm.conv_kernel 4,
  {a}.ssm.inner_size 64, {a}.ssm.state_size 16, {a}.ssm.time_step_rank 4,
  {a}.ssm.group_count 2, {a}.full_attention_interval 4.
  linear-attention layers (0..2): attn_norm, post_attention_norm, attn_qkv
  (128,64), attn_gate (64,64), ssm_conv1d (128,4), ssm_dt.bias (4,), ssm_a (4,),
  ssm_beta (4,64), ssm_alpha (4,64), ssm_norm (16,), ssm_out (64,64), ffn_*.
  full-attention layer 3: attn_q (128,64: query and its gate), attn_k/attn_v (32,64),
  attn_output (64,64), attn_q_norm/attn_k_norm (16,), ffn_*.
gemma4: keys {a}.attention.sliding_window_pattern [true, false],
  {a}.attention.sliding_window, {a}.embedding_length_per_layer_input 0,
  {a}.attention.shared_kv_layers 0, {a}.final_logit_softcapping, *_swa lengths;
  tensors: rope_freqs (8,), per layer attn_norm, attn_q, attn_k, attn_v,
  attn_output, attn_q_norm, attn_k_norm, post_attention_norm, ffn_norm,
  ffn_gate/up/down, post_ffw_norm.
lfm2: keys {a}.attention.head_count_kv per layer [0, 2] (0 = short-conv layer),
  {a}.shortconv.l_cache 3; tensors: token_embd_norm (64,) (lfm2's final norm),
  conv layer: attn_norm, shortconv.conv (64,3), shortconv.in_proj (192,64),
  shortconv.out_proj (64,64); attention layer: attn_norm, attn_q, attn_k, attn_v,
  attn_output, attn_q_norm, attn_k_norm; every layer ffn_norm, ffn_gate/up/down.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGUFValueType

from tiny_gguf import QWEN3_CHAT_TEMPLATE, TokenType, Vocab, _add_kv, _target, _Writer, _write_and_move, tiny_vocab

# Chat tokens per architecture (appended to the tiny vocabulary when missing).
CHATML_TOKENS = [
    ("<|endoftext|>", TokenType.CONTROL),
    ("<|im_start|>", TokenType.CONTROL),
    ("<|im_end|>", TokenType.CONTROL),
    ("<think>", TokenType.USER_DEFINED),
    ("</think>", TokenType.USER_DEFINED),
]
LFM2_TOKENS = [
    ("<|startoftext|>", TokenType.CONTROL),
    ("<|im_start|>", TokenType.CONTROL),
    ("<|im_end|>", TokenType.CONTROL),
    ("<image>", TokenType.CONTROL),
]
GEMMA4_TOKENS = [
    ("<bos>", TokenType.CONTROL),
    ("<eos>", TokenType.CONTROL),
    ("<|turn>", TokenType.CONTROL),
    ("<turn|>", TokenType.CONTROL),
]

# Qwen3.5's template, reduced to what gmlx's reads use (same shape as Qwen3's:
# an empty thinking block when enable_thinking is false).
QWEN35_CHAT_TEMPLATE = QWEN3_CHAT_TEMPLATE

# LFM2's ChatML-style template (the real one starts with <|startoftext|>).
LFM2_CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)

# Gemma 4's turn format.
GEMMA4_CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{- '<|turn>' + role + '\n' + message['content'] | trim + '<turn|>\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|turn>model\n' -}}{%- endif -%}"
)


def _vocab(arch: str) -> tuple[Vocab, dict[str, int], dict[str, bool]]:
    base = tiny_vocab()
    if arch == "qwen35":
        v = base.with_tokens(CHATML_TOKENS)
        eos = v.token_id("<|im_end|>")
        return v, {"bos": v.token_id("<|endoftext|>"), "eos": eos, "eot": eos,
                   "pad": v.token_id("<|endoftext|>"), "unk": 0}, {"add_bos_token": False}
    if arch == "lfm2":
        v = base.with_tokens(LFM2_TOKENS)
        eos = v.token_id("<|im_end|>")
        return v, {"bos": v.token_id("<|startoftext|>"), "eos": eos, "eot": eos, "pad": 3, "unk": 0}, {
            "add_bos_token": False}
    if arch == "gemma4":
        v = base.with_tokens(GEMMA4_TOKENS)
        return v, {"bos": v.token_id("<bos>"), "eos": v.token_id("<turn|>"), "eot": v.token_id("<turn|>"),
                   "pad": 3, "unk": 0}, {"add_bos_token": True}
    raise ValueError(arch)


def build_more(path: str | os.PathLike[str], arch: str, seed: int = 0, chat_template: str | None = "default",
               n_embd: int = 64, embd_scale: float = 0.15, extra_kv: dict[str, Any] | None = None) -> Path:
    """Write a tiny f32 GGUF of `arch` ("qwen35", "gemma4", "lfm2") to `path`."""
    voc, ids, flags = _vocab(arch)
    n_vocab = len(voc)
    E, hd, H, Hkv, F = n_embd, 16, n_embd // 16, 2, 128
    rng = np.random.default_rng(seed)

    def normal(shape, std):
        a = rng.standard_normal(shape, dtype=np.float32)
        a *= np.float32(std)
        return a

    def norm_w(n):
        return (1.0 + normal((n,), 0.1)).astype(np.float32)

    kv: dict[str, Any] = {
        "context_length": 4096, "embedding_length": E, "feed_forward_length": F,
        "attention.head_count": H, "attention.layer_norm_rms_epsilon": 1e-6,
        "attention.key_length": hd, "attention.value_length": hd, "rope.dimension_count": hd,
        "rope.freq_base": 1e6, "vocab_size": n_vocab,
    }
    tensors: list[tuple[str, np.ndarray]] = [("token_embd.weight", normal((n_vocab, E), embd_scale))]

    def attn(b: str, q_rows: int) -> None:
        tensors.extend([
            (b + "attn_q.weight", normal((q_rows, E), E ** -0.5)),
            (b + "attn_k.weight", normal((Hkv * hd, E), E ** -0.5)),
            (b + "attn_v.weight", normal((Hkv * hd, E), E ** -0.5)),
            (b + "attn_output.weight", normal((E, H * hd), (H * hd) ** -0.5)),
            (b + "attn_q_norm.weight", norm_w(hd)),
            (b + "attn_k_norm.weight", norm_w(hd)),
        ])

    def ffn(b: str) -> None:
        tensors.extend([
            (b + "ffn_gate.weight", normal((F, E), E ** -0.5)),
            (b + "ffn_up.weight", normal((F, E), E ** -0.5)),
            (b + "ffn_down.weight", normal((E, F), F ** -0.5)),
        ])

    if arch == "qwen35":
        n_layer = 4
        inner, state, v_heads, groups, conv = 4 * hd, hd, 4, 2, 4
        conv_ch = 2 * groups * state + inner
        kv.update({"block_count": n_layer, "attention.head_count_kv": Hkv, "ssm.conv_kernel": conv,
                   "ssm.inner_size": inner, "ssm.state_size": state, "ssm.time_step_rank": v_heads,
                   "ssm.group_count": groups, "full_attention_interval": 4,
                   "rope.dimension_sections": [4, 4, 0, 0]})
        tensors.append(("output_norm.weight", norm_w(E)))
        for i in range(n_layer):
            b = f"blk.{i}."
            tensors.append((b + "attn_norm.weight", norm_w(E)))
            if (i + 1) % 4 == 0:
                attn(b, 2 * H * hd)  # query and its output gate
            else:
                tensors.extend([
                    (b + "attn_qkv.weight", normal((conv_ch, E), E ** -0.5)),
                    (b + "attn_gate.weight", normal((inner, E), E ** -0.5)),
                    (b + "ssm_conv1d.weight", normal((conv_ch, conv), 0.5)),
                    (b + "ssm_dt.bias", normal((v_heads,), 0.5)),
                    (b + "ssm_a", -np.abs(normal((v_heads,), 1.0)) - 0.1),
                    (b + "ssm_beta.weight", normal((v_heads, E), E ** -0.5)),
                    (b + "ssm_alpha.weight", normal((v_heads, E), E ** -0.5)),
                    (b + "ssm_norm.weight", norm_w(state)),
                    (b + "ssm_out.weight", normal((E, inner), inner ** -0.5)),
                ])
            tensors.append((b + "post_attention_norm.weight", norm_w(E)))
            ffn(b)
        template = QWEN35_CHAT_TEMPLATE
    elif arch == "gemma4":
        n_layer = 2
        kv.update({"block_count": n_layer, "attention.head_count_kv": Hkv,
                   "attention.sliding_window_pattern": [True, False], "attention.sliding_window": 512,
                   "embedding_length_per_layer_input": 0, "attention.shared_kv_layers": 0,
                   "final_logit_softcapping": 30.0, "attention.key_length_swa": hd,
                   "attention.value_length_swa": hd, "rope.freq_base_swa": 1e4, "rope.dimension_count_swa": hd})
        tensors.append(("output_norm.weight", norm_w(E)))
        tensors.append(("rope_freqs.weight", np.ones((hd // 2,), dtype=np.float32)))
        for i in range(n_layer):
            b = f"blk.{i}."
            tensors.append((b + "attn_norm.weight", norm_w(E)))
            attn(b, H * hd)
            tensors.append((b + "post_attention_norm.weight", norm_w(E)))
            tensors.append((b + "ffn_norm.weight", norm_w(E)))
            ffn(b)
            tensors.append((b + "post_ffw_norm.weight", norm_w(E)))
        template = GEMMA4_CHAT_TEMPLATE
    elif arch == "lfm2":
        n_layer = 2
        kv.update({"block_count": n_layer, "attention.head_count_kv": [0, Hkv], "shortconv.l_cache": 3})
        tensors.append(("token_embd_norm.weight", norm_w(E)))
        for i in range(n_layer):
            b = f"blk.{i}."
            tensors.append((b + "attn_norm.weight", norm_w(E)))
            if i == 0:
                tensors.extend([
                    (b + "shortconv.conv.weight", normal((E, 3), 0.5)),
                    (b + "shortconv.in_proj.weight", normal((3 * E, E), E ** -0.5)),
                    (b + "shortconv.out_proj.weight", normal((E, E), E ** -0.5)),
                ])
            else:
                attn(b, H * hd)
            tensors.append((b + "ffn_norm.weight", norm_w(E)))
            ffn(b)
        template = LFM2_CHAT_TEMPLATE
    else:
        raise ValueError(f"no tiny builder for {arch!r}")

    path, tmp = _target(path)
    w = _Writer(str(tmp), arch)
    w.add_name(f"tiny-{arch}-s{seed}")
    w.add_file_type(int(gguf.LlamaFileType.ALL_F32))
    for k, v in kv.items():
        key = f"{arch}.{k}"
        if isinstance(v, list) and v and isinstance(v[0], bool):
            w.add_array(key, v)
        elif isinstance(v, list):
            w.add_key_value(key, v, GGUFValueType.ARRAY, sub_type=GGUFValueType.INT32)
        elif isinstance(v, float):
            w.add_float32(key, v)
        else:
            w.add_uint32(key, int(v))
    for k, v in (extra_kv or {}).items():
        _add_kv(w, k, v)
    w.add_tokenizer_model(voc.model)
    w.add_key_value(gguf.Keys.Tokenizer.LIST, list(voc.tokens), GGUFValueType.ARRAY, sub_type=GGUFValueType.STRING)
    w.add_key_value(gguf.Keys.Tokenizer.SCORES, list(voc.scores), GGUFValueType.ARRAY, sub_type=GGUFValueType.FLOAT32)
    w.add_key_value(gguf.Keys.Tokenizer.TOKEN_TYPE, list(voc.types), GGUFValueType.ARRAY, sub_type=GGUFValueType.INT32)
    setters = {"bos": w.add_bos_token_id, "eos": w.add_eos_token_id, "unk": w.add_unk_token_id,
               "pad": w.add_pad_token_id, "eot": w.add_eot_token_id}
    for k, fn in setters.items():
        if k in ids:
            fn(int(ids[k]))
    flags = {"add_eos_token": False, "add_space_prefix": False, **flags}
    for k, v in flags.items():
        w.add_bool(f"tokenizer.ggml.{k}", bool(v))
    tmpl = template if chat_template == "default" else chat_template
    if tmpl:
        w.add_chat_template(tmpl)
    for name, arr in tensors:
        w.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
    return _write_and_move(w, tmp, path)


def build_qwen35(path, seed: int = 0, **kw) -> Path:
    return build_more(path, "qwen35", seed, **kw)


def build_gemma4(path, seed: int = 0, **kw) -> Path:
    return build_more(path, "gemma4", seed, **kw)


def build_lfm2(path, seed: int = 0, **kw) -> Path:
    return build_more(path, "lfm2", seed, **kw)


def build_mmproj(path: str | os.PathLike[str], n_embd_text: int = 64, seed: int = 0, image_size: int = 32,
                 patch_size: int = 8, kind: str = "mlp") -> Path:
    """A tiny projector that llama.cpp's bundled clip loader accepts.

    kind "mlp" (llava-style): a one-block ViT (width 32, 2 heads) over 8x8
    patches of a 32x32 image, then mm.0 (32 -> out) GELU mm.2 (out -> out), out =
    the text model's n_embd. Tensors (ggml order): v.patch_embd [P,P,3,E],
    v.position_embd [E,16], v.blk.0.{attn_q,attn_k,attn_v,attn_out} [E,E] +
    biases, ln1/ln2 weight+bias, ffn_up [E,F] + bias, ffn_down [F,E] + bias,
    v.post_ln, mm.0, mm.2 (+ biases). One image is (32/8)^2 = 16 embedding tokens.

    kind "qwen2vl" (`qwen2vl_merger`, Qwen2-VL's): the same block without
    position embeddings (the ViT uses 2-D M-RoPE), a second patch embedding
    (v.patch_embd.weight.1, the temporal half), and the 2x2 patch merger: mm.0
    [4E,4E], mm.2 [4E,out]. An image is resized to a multiple of 16 pixels a side
    (at least its minimum pixel count); w x h pixels give (w/16)(h/16) tokens,
    wrapped by libmtmd in <|vision_start|> ... <|vision_end|> text, and take
    max(w/16, h/16) positions under M-RoPE: a 64x32 image is 8 tokens, 4 positions."""
    E, F, OUT = 32, 64, n_embd_text
    npos = (image_size // patch_size) ** 2
    rng = np.random.default_rng(seed)
    shapes = {"v.patch_embd.weight": [patch_size, patch_size, 3, E]}
    if kind == "mlp":
        shapes["v.position_embd.weight"] = [E, npos]
        merged = E
    elif kind == "qwen2vl":
        shapes["v.patch_embd.weight.1"] = [patch_size, patch_size, 3, E]
        merged = 4 * E
        image_size = max(image_size, 64)
    else:
        raise ValueError(f"no tiny projector of kind {kind!r}")
    shapes.update({
        "v.blk.0.attn_q.weight": [E, E], "v.blk.0.attn_q.bias": [E], "v.blk.0.attn_k.weight": [E, E],
        "v.blk.0.attn_k.bias": [E], "v.blk.0.attn_v.weight": [E, E], "v.blk.0.attn_v.bias": [E],
        "v.blk.0.attn_out.weight": [E, E], "v.blk.0.attn_out.bias": [E],
        "v.blk.0.ln1.weight": [E], "v.blk.0.ln1.bias": [E], "v.blk.0.ln2.weight": [E], "v.blk.0.ln2.bias": [E],
        "v.blk.0.ffn_up.weight": [E, F], "v.blk.0.ffn_up.bias": [F], "v.blk.0.ffn_down.weight": [F, E],
        "v.blk.0.ffn_down.bias": [E], "v.post_ln.weight": [E], "v.post_ln.bias": [E],
    })
    if kind == "mlp":
        shapes.update({"mm.0.weight": [E, OUT], "mm.0.bias": [OUT], "mm.2.weight": [OUT, OUT], "mm.2.bias": [OUT]})
    else:
        shapes.update({"mm.0.weight": [merged, merged], "mm.0.bias": [merged], "mm.2.weight": [merged, OUT],
                       "mm.2.bias": [OUT]})
    path, tmp = _target(path)
    w = gguf.GGUFWriter(str(tmp), "clip")
    w.add_string("clip.projector_type", "mlp" if kind == "mlp" else "qwen2vl_merger")
    w.add_bool("clip.has_vision_encoder", True)
    w.add_bool("clip.use_gelu", True)
    w.add_uint32("general.file_type", 0)
    for k, v in {"image_size": image_size, "patch_size": patch_size, "embedding_length": E,
                 "feed_forward_length": F, "block_count": 1, "attention.head_count": 2,
                 "projection_dim": OUT}.items():
        w.add_uint32(f"clip.vision.{k}", v)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    w.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    w.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    for name, shape in shapes.items():
        numpy_shape = tuple(reversed(shape))
        if name.endswith(("ln1.weight", "ln2.weight", "post_ln.weight")):
            arr = np.ones(numpy_shape, dtype=np.float32)
        else:
            arr = (rng.standard_normal(numpy_shape) * (0.3 if name.startswith("mm.") else 0.05)).astype(np.float32)
        w.add_tensor(name, arr)
    return _write_and_move(w, tmp, path)
