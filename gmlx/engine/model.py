"""Loading a GGUF through llama.cpp's low-level API, and what a loaded model
exposes: tokenizer, special ids, architecture, strategy, chat template."""

from __future__ import annotations

import ctypes
import logging
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import llama_cpp

from ..decisions.literal import segments as literal_segments
from ..config import with_load_defaults
from ..errors import ModelFileMissing, ModelLoadError
from .chat import ChatTemplate, choose_template
from .gguf_info import CHILD_LOAD, DIFFUSION_ARCHS, llama_supports_arch, read_info, strategy_problem, unsupported_note

log = logging.getLogger("gmlx.engine")

_backend_lock = threading.Lock()
_backend_ready = False


@llama_cpp.llama_log_callback
def _llama_log(level, text, user_data):  # noqa: ARG001
    # llama.cpp logs through here; keep its chatter at debug level so a served
    # decision prints one line, not hundreds.
    if log.isEnabledFor(logging.DEBUG) and text:
        log.debug("llama.cpp: %s", text.decode("utf-8", "replace").rstrip())


def init_backend() -> None:
    global _backend_ready
    with _backend_lock:
        if not _backend_ready:
            llama_cpp.llama_log_set(_llama_log, ctypes.c_void_p(0))
            llama_cpp.llama_backend_init()
            _backend_ready = True


class _Progress:
    """A terminal progress bar for model loads (only when stderr is a TTY)."""

    def __init__(self, label: str):
        self.label = label
        self.last = -1
        self.enabled = sys.stderr.isatty()

        @llama_cpp.llama_progress_callback
        def cb(progress, user_data):  # noqa: ARG001
            self.update(progress)
            return True

        self.callback = cb

    def update(self, fraction: float) -> None:
        pct = int(fraction * 100)
        if not self.enabled or pct == self.last:
            return
        self.last = pct
        bar = "#" * (pct // 4)
        sys.stderr.write(f"\rloading {self.label} [{bar:<25}] {pct:3d}%")
        if pct >= 100:
            sys.stderr.write("\n")
        sys.stderr.flush()


@dataclass
class SpecialTokens:
    bos: int | None
    eos: int | None
    eot: int | None
    pad: int | None
    mask: int | None


def _tok(value: int) -> int | None:
    return None if value is None or value < 0 else int(value)


@dataclass
class LoadedModel:
    model_id: str
    path: Path
    settings: dict[str, Any]
    model: Any  # llama_model_p
    vocab: Any  # llama_vocab_p
    architecture: str
    strategy: str | None  # "canvas" | "next-token" | None
    n_ctx_train: int
    n_layer: int
    n_vocab: int
    special: SpecialTokens
    chat_template: ChatTemplate | None
    canvas_length: int | None
    shift_logits: bool
    add_bos: bool
    gpu_layers: int
    backend: str
    load_ms: float
    _meta_cache: dict[str, str | None] = field(default_factory=dict)

    # -- tokenizer ---------------------------------------------------------
    def tokenize(self, text: str, add_special: bool = False, parse_special: bool = False) -> list[int]:
        data = text.encode("utf-8")
        n_max = len(data) + 16
        buf = (llama_cpp.llama_token * n_max)()
        n = llama_cpp.llama_tokenize(self.vocab, data, len(data), buf, n_max, add_special, parse_special)
        if n < 0:  # buffer too small: -n is the size needed
            n_max = -n
            buf = (llama_cpp.llama_token * n_max)()
            n = llama_cpp.llama_tokenize(self.vocab, data, len(data), buf, n_max, add_special, parse_special)
        return list(buf[:n])

    def encode(self, text: str) -> list[int]:
        """Plain text -> tokens, without special tokens (no BOS, specials as text)."""
        return self.tokenize(text, add_special=False, parse_special=False)

    def encode_prompt(self, text: str, bos: bool = True) -> list[int]:
        """A rendered chat prompt -> tokens: the template's markers parsed as
        special tokens, caller text (marked by decisions/literal.py) tokenized
        as plain text, BOS added when the model wants one and the template did
        not write it (`bos=False`: a prompt's continuation, never)."""
        toks: list[int] = []
        for is_literal, part in literal_segments(text):
            toks += self.tokenize(part, add_special=False, parse_special=not is_literal)
        if not bos:
            return toks
        bos_id = self.special.bos
        if self.add_bos and bos_id is not None and (not toks or toks[0] != bos_id):
            toks.insert(0, bos_id)
        return toks

    def max_prompt_tokens(self, text: str) -> int:
        """An upper bound of len(encode_prompt(text)) without tokenizing: every
        token llama.cpp's tokenizers emit stands for at least one byte of the
        text it was given, except the one leading space a SentencePiece
        tokenizer may add per call (one call per segment) and the BOS."""
        return 1 + sum(len(part.encode("utf-8")) + 1 for _, part in literal_segments(text))

    def piece(self, token: int, special: bool = True) -> str:
        buf = ctypes.create_string_buffer(64)
        n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        return buf.raw[:n].decode("utf-8", "replace")

    def decode(self, tokens: list[int], special: bool = False) -> str:
        raw = b""
        for t in tokens:
            buf = ctypes.create_string_buffer(64)
            n = llama_cpp.llama_token_to_piece(self.vocab, t, buf, len(buf), 0, special)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = llama_cpp.llama_token_to_piece(self.vocab, t, buf, len(buf), 0, special)
            raw += buf.raw[:n]
        return raw.decode("utf-8", "replace")

    def token_id(self, text: str) -> int | None:
        """The id of `text` when it is exactly one token (specials parsed), else None."""
        toks = self.tokenize(text, add_special=False, parse_special=True)
        return toks[0] if len(toks) == 1 else None

    def meta(self, key: str) -> str | None:
        if key not in self._meta_cache:
            self._meta_cache[key] = model_meta(self.model, key)
        return self._meta_cache[key]

    def describe(self) -> dict[str, Any]:
        return {
            "id": self.model_id,
            "path": str(self.path),
            "architecture": self.architecture,
            "strategy": self.strategy,
            "n_ctx_train": self.n_ctx_train,
            "n_vocab": self.n_vocab,
            "chat_template": self.chat_template.origin if self.chat_template else None,
            "canvas_length": self.canvas_length,
            "gpu_layers": self.gpu_layers,
            "backend": self.backend,
            "load_ms": round(self.load_ms, 1),
        }

    def close(self) -> None:
        if self.model is not None:
            llama_cpp.llama_model_free(self.model)
            self.model = None


def model_meta(model, key: str) -> str | None:
    buf = ctypes.create_string_buffer(4096)
    n = llama_cpp.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
    if n < 0:
        return None
    if n >= len(buf):
        buf = ctypes.create_string_buffer(n + 1)
        llama_cpp.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
    return buf.value.decode("utf-8", "replace")


def backend_name() -> str:
    """The offload backend and devices llama.cpp has (engine/devices.py), or "cpu"."""
    from .devices import backend_name as name

    return name()


def has_accelerator() -> bool:
    from .devices import accelerators

    return llama_cpp.llama_supports_gpu_offload() and bool(accelerators())


_SPLIT = {"none": 0, "layer": 1, "row": 2}


def _set_load_mode(mp, use_mmap: bool, use_mlock: bool) -> None:
    """use_mmap / use_mlock on either llama.cpp API.

    Newer llama.cpp (the one bundled with llama-cpp-python 0.3.36) replaced the
    two booleans with one `load_mode` enum; setting `mp.use_mmap` on that
    ctypes struct is silently a plain Python attribute, so both settings had
    no effect (the file stayed mapped with use_mmap: false, and a file truncated
    under the server then killed it with SIGBUS)."""
    fields = {name for name, *_ in type(mp)._fields_}
    if "load_mode" not in fields:
        mp.use_mmap = use_mmap
        mp.use_mlock = use_mlock
        return
    if not use_mmap:
        mp.load_mode = llama_cpp.LLAMA_LOAD_MODE_MLOCK if use_mlock else llama_cpp.LLAMA_LOAD_MODE_NONE
    elif use_mlock:
        mp.load_mode = llama_cpp.LLAMA_LOAD_MODE_MMAP_MLOCK
    # else: llama.cpp's default (AUTO), which maps the file where the device allows it


def _model_params(settings: dict[str, Any], progress: _Progress):
    mp = llama_cpp.llama_model_default_params()
    # Layers go to a local GPU or to RPC workers' devices; a CPU build has neither.
    offload = has_accelerator() or bool(settings.get("rpc_servers"))
    n_gpu = settings["n_gpu_layers"]
    mp.n_gpu_layers = (0x7FFFFFFF if n_gpu < 0 else n_gpu) if offload else 0
    mp.split_mode = _SPLIT[settings["split_mode"]]
    mp.main_gpu = settings["main_gpu"]
    _set_load_mode(mp, bool(settings["use_mmap"]), bool(settings["use_mlock"]))
    if settings["tensor_split"]:
        n = llama_cpp.llama_max_devices()
        arr = (ctypes.c_float * n)(*settings["tensor_split"][:n])
        mp.tensor_split = arr
        progress._tensor_split = arr  # keep alive while loading
    mp.progress_callback = progress.callback
    if hasattr(mp, "use_extra_bufts"):
        mp.use_extra_bufts = _extra_buffers(settings["extra_buffers"])
    return mp


def _extra_buffers(mode: str) -> bool:
    """Whether llama.cpp may move weights into its extra CPU layouts. On CPUs
    with AMX_INT8 llama.cpp puts Q4_K weights in its AMX buffer, whose matmul
    segfaults (llama.cpp issue 20824; seen on this project's CI machines), so
    "auto" keeps the plain layout there."""
    if mode != "auto":
        return mode == "on"
    return "AMX_INT8 = 1" not in system_info()


def system_info() -> str:
    raw = llama_cpp.llama_print_system_info()
    return raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)


def strategy_for(arch: str, is_diffusion: bool, has_template: bool) -> str | None:
    if is_diffusion or arch in DIFFUSION_ARCHS:
        return "canvas"
    if has_template:
        return "next-token"
    return None


STRATEGIES = ("auto", "next-token", "canvas", "winnow", "liquid")


def resolve_strategy(requested: str | None, arch: str, is_diffusion: bool, has_template: bool) -> str | None:
    """The config's `read_strategy` for a model of `arch`: `auto` is SPEC 3's
    choice by architecture; an explicit strategy the architecture cannot serve
    raises ValueError naming both."""
    problem = strategy_problem(requested, arch, is_diffusion, has_template)
    if problem:
        raise ValueError(problem)
    if requested in (None, "auto"):
        return strategy_for(arch, is_diffusion, has_template)
    return requested


def configured_strategy(requested: str | None, arch: str, has_template: bool) -> str | None:
    """What `gmlx models` shows for a model from its header: the configured
    `read_strategy` when the architecture can serve it, else the automatic
    choice (a mismatch is a config error at start-up, gmlx.config)."""
    try:
        return resolve_strategy(requested, arch, arch in DIFFUSION_ARCHS, has_template)
    except ValueError:
        return strategy_for(arch, False, has_template)


def load_model(model_id: str, path: Path, settings: dict[str, Any], isolate_vocab: bool = False) -> LoadedModel:
    """Load a GGUF. Raises ModelFileMissing (404 later) or ModelLoadError.

    `isolate_vocab` (the server) first reads the file's vocabulary in a child
    process (probe_vocab): llama.cpp aborts the whole process on some corrupted
    vocabularies, and a server must survive a bad file."""
    init_backend()
    settings = with_load_defaults(settings)
    path = Path(path)
    if not path.is_file():
        raise ModelFileMissing(f"model {model_id!r}: file {path} is missing", param="model")
    try:
        info = read_info(path)
    except ValueError as err:
        raise ModelLoadError(f"model {model_id!r}: {err}") from None
    if isolate_vocab:
        problem = probe_vocab(path)
        if problem is not None:
            raise ModelLoadError(f"model {model_id!r}: {path} is corrupted: {problem}")
    rpc_devices = _rpc_devices(model_id, settings["rpc_servers"]) if settings.get("rpc_servers") else None
    progress = _Progress(model_id)
    t0 = time.perf_counter()
    mp = _model_params(settings, progress)
    if rpc_devices is not None:
        # NULL-terminated ggml_backend_dev_t array: the RPC workers' devices, then local GPUs.
        mp.devices = ctypes.cast(rpc_devices, ctypes.c_void_p)
        progress._devices = rpc_devices  # keep alive while loading
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), mp)
    if not model:
        if not llama_supports_arch(info.architecture):
            raise ModelLoadError(
                f"model {model_id!r} (llama-cpp-python {llama_cpp.__version__}): {unsupported_note(info.architecture)}"
            )
        raise ModelLoadError(
            f"model {model_id!r}: llama.cpp could not load {path} (architecture {info.architecture!r}; "
            "a truncated or corrupted file, or not enough memory)"
        )
    progress.update(1.0)
    load_ms = (time.perf_counter() - t0) * 1000
    vocab = llama_cpp.llama_model_get_vocab(model)
    arch = model_meta(model, "general.architecture") or info.architecture
    special = SpecialTokens(
        bos=_tok(llama_cpp.llama_vocab_bos(vocab)),
        eos=_tok(llama_cpp.llama_vocab_eos(vocab)),
        eot=_tok(llama_cpp.llama_vocab_eot(vocab)),
        pad=_tok(llama_cpp.llama_vocab_pad(vocab)),
        mask=_tok(llama_cpp.llama_vocab_mask(vocab)) if hasattr(llama_cpp, "llama_vocab_mask") else None,
    )
    is_diffusion = bool(llama_cpp.llama_model_is_diffusion(model)) if hasattr(llama_cpp, "llama_model_is_diffusion") else False
    raw_template = llama_cpp.llama_model_chat_template(model, None)
    gguf_template = raw_template.decode("utf-8", "replace") if raw_template else None
    n_layer = llama_cpp.llama_model_n_layer(model)
    m = LoadedModel(
        model_id=model_id,
        path=path,
        settings=settings,
        model=model,
        vocab=vocab,
        architecture=arch,
        strategy=None,
        n_ctx_train=llama_cpp.llama_model_n_ctx_train(model),
        n_layer=n_layer,
        n_vocab=llama_cpp.llama_vocab_n_tokens(vocab),
        special=special,
        chat_template=None,
        canvas_length=None,
        shift_logits=False,
        add_bos=bool(llama_cpp.llama_vocab_get_add_bos(vocab)),
        gpu_layers=0,
        backend=backend_name() if rpc_devices is None else "rpc:" + ",".join(settings["rpc_servers"]),
        load_ms=load_ms,
    )
    bos_text = m.piece(special.bos) if special.bos is not None else ""
    eos_text = m.piece(special.eos) if special.eos is not None else ""
    try:
        m.chat_template = choose_template(settings.get("chat_template"), gguf_template, arch, bos_text, eos_text)
    except Exception as err:  # a template that does not compile
        llama_cpp.llama_model_free(model)
        raise ModelLoadError(f"model {model_id!r}: chat template does not compile ({err})") from None
    if m.chat_template is not None:
        # A template that compiles but cannot render a plain conversation (a
        # corrupted file, a broken config) fails the load with its reason
        # instead of every decision with a 500.
        try:
            m.chat_template.render([{"role": "user", "content": "ping"}], True, {})
        except Exception as err:  # noqa: BLE001 - Jinja raises anything
            llama_cpp.llama_model_free(model)
            raise ModelLoadError(
                f"model {model_id!r}: chat template ({m.chat_template.origin}) does not render: "
                f"{type(err).__name__}: {err}"
            ) from None
    try:
        m.strategy = resolve_strategy(settings.get("read_strategy"), arch, is_diffusion, m.chat_template is not None)
    except ValueError as err:
        llama_cpp.llama_model_free(model)
        raise ModelLoadError(f"model {model_id!r}: {err}") from None
    canvas = m.meta("diffusion.canvas_length")
    m.canvas_length = int(canvas) if canvas and canvas.isdigit() else None
    m.shift_logits = (m.meta("diffusion.shift_logits") or "").lower() == "true"
    requested = settings["n_gpu_layers"]
    if has_accelerator() or rpc_devices is not None:
        # llama.cpp offloads the repeating layers plus the output layer.
        m.gpu_layers = n_layer + 1 if requested < 0 else min(requested, n_layer + 1)
    log.info(
        "loaded %s (%s, %s) from %s in %.0f ms: backend %s, %d/%d layers offloaded",
        model_id, arch, m.strategy or "no read strategy", path, load_ms, m.backend, m.gpu_layers, n_layer + 1,
    )
    return m


_probed: dict[tuple[str, int, int], str | None] = {}
_probe_lock = threading.Lock()


def probe_vocab(path: Path, timeout: float = 300.0) -> str | None:
    """None when llama.cpp reads the vocabulary of `path` without aborting (it
    may still refuse the file: the real load reports that), else what killed
    the child (llama.cpp's GGML_ASSERT line when it printed one).

    Measured on 2 CPUs: 0.3 s for a tiny vocabulary, about 1 s for Gemma's
    262,144 tokens (the child's start and the vocabulary; no weights are read).
    The verdict is kept per (path, size, mtime) for the life of the process."""
    import os
    import re
    import subprocess

    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    with _probe_lock:
        if key in _probed:
            return _probed[key]
    env = {**os.environ, "GGML_NO_BACKTRACE": "1"}
    try:
        # Only the vocabulary, in a child process (gguf_info.CHILD_LOAD): a GGML_ASSERT there
        # aborts the child, not the caller.
        r = subprocess.run([sys.executable, "-c", CHILD_LOAD, str(path), "vocab"], capture_output=True, text=True,
                           timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return f"reading its vocabulary took longer than {timeout:g} s"
    except OSError as err:  # cannot start a child: let the real load decide
        log.warning("could not probe the vocabulary of %s: %s", path, err)
        return None
    verdict: str | None = None
    if r.returncode != 0:
        asserts = re.findall(r"GGML_ASSERT\([^\n]*", r.stderr)
        if asserts:
            verdict = f"llama.cpp aborts reading its vocabulary ({asserts[-1].strip()})"
        elif r.returncode < 0:
            verdict = f"llama.cpp crashes reading its vocabulary (signal {-r.returncode})"
        else:
            tail = (r.stderr.strip().splitlines() or ["no message"])[-1]
            verdict = f"reading its vocabulary failed (exit status {r.returncode}: {tail[:200]})"
    with _probe_lock:
        _probed[key] = verdict
    return verdict


def _rpc_devices(model_id: str, servers: list[str]):
    """The device array for a model with `rpc_servers` (engine/rpc.py), or a
    ModelLoadError that says what to fix: a build without the RPC backend, a
    malformed endpoint, a worker that does not answer."""
    from . import rpc

    try:
        for s in servers:
            rpc.check_endpoint(s)
        return rpc.device_array(rpc.model_devices(list(servers)))
    except rpc.RPCUnavailable as err:
        raise ModelLoadError(f"model {model_id!r}: configuration error: rpc_servers is set but {err}") from None
    except (ValueError, ConnectionError) as err:
        raise ModelLoadError(f"model {model_id!r}: rpc_servers: {err}") from None
