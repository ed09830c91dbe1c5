"""Model resolution (SPEC 6.2) and the per-(model, profile) load state.

Each (model id, profile) pair is a slot: unloaded -> loading -> ready, or
failed. The first decision for an unloaded slot starts its worker (which loads
the GGUF on its own thread) and waits for the load; decisions arriving while
it loads get 503 `model_loading` with Retry-After. The model file is checked
at every request, so a file deleted after start gives 404 `model_file_missing`
for that model while the others keep serving. A failed load stays failed
(its error is the answer) until the file changes on disk.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import Config
from ..decisions.types import DecisionSettings
from ..errors import (
    GmlxError,
    ModelFileMissing,
    ModelLoadError,
    ModelLoading,
    ModelNotFound,
    NoModelSpecified,
    ServerError,
)
from .shared import SharedModels, weights_key
from .worker import Worker

log = logging.getLogger("gmlx.server")

LOADING_RETRY_AFTER_S = 2


def _stamp(path: Path | None) -> tuple[int, int] | None:
    try:
        st = path.stat() if path is not None else None
    except OSError:
        return None
    return (st.st_size, st.st_mtime_ns) if st else None


def default_parallel(cores: int | None = None) -> int:
    """Contexts per model when `parallel` is not set: one per two cores, 1..4.
    (A 2-core machine gets 1: set `parallel: 2` there for two 1-thread contexts.)"""
    cores = cores or os.cpu_count() or 1
    return max(1, min(4, cores // 2))


def context_settings(settings: dict[str, Any], parallel: int) -> dict[str, Any]:
    """Each of `parallel` contexts gets its share of the threads."""
    if parallel <= 1:
        return settings
    total = settings.get("n_threads") or os.cpu_count() or 1
    return {**settings, "n_threads": max(1, total // parallel)}


def slot_name(model_id: str, profile: str | None) -> str:
    return model_id if profile is None else f"{model_id}@{profile}"


@dataclass
class Slot:
    model_id: str
    profile: str | None
    state: str = "unloaded"  # unloaded | loading | ready | failed
    worker: Worker | None = None
    error: GmlxError | None = None
    failed_stamp: tuple[int, int] | None = None
    info: dict[str, Any] = field(default_factory=dict)
    loaded: asyncio.Event | None = None
    load_started: float | None = None

    @property
    def name(self) -> str:
        return slot_name(self.model_id, self.profile)

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"state": self.state, "profile": self.profile}
        if self.info:
            for key in ("architecture", "strategy", "backend", "gpu_layers", "load_ms", "chat_template", "parallel"):
                out[key] = self.info.get(key)
        if self.error is not None:
            out["error"] = self.error.body()["error"]
        if self.worker is not None and self.state == "ready":
            out["queue"] = self.worker.snapshot()
        return out


class ModelManager:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.settings: DecisionSettings = cfg.server.systemone.decision_settings()
        self.slots: dict[tuple[str, str | None], Slot] = {}
        self._paths: dict[str, Path] = {}  # resolved package paths (assembling is slow)
        self.stopping = False
        self.draining = False
        self.preloading = False
        self.metrics = None  # gmlx.server.metrics.Metrics, set by the app
        # Loaded models, shared by the profiles that load the same weights (shared.py).
        self.models = SharedModels()

    # -- SPEC 6.2 --------------------------------------------------------------
    def resolve(self, name: str | None) -> str:
        """A request's `model` -> a configured model id (never a path)."""
        if name is not None:
            mid = self.cfg.resolve_id(name)
            if mid is not None:
                return mid
        fallback = self.cfg.fallback_id()
        if fallback is not None:
            if name is not None:
                log.debug("model %r is not configured: answering with fallback %r", name, fallback)
            return fallback
        known = ", ".join(sorted(set(self.cfg.models) | set(self.cfg.aliases)))
        if name is None:
            raise NoModelSpecified(
                f"no model was named and the server has no fallback model (configured: {known})", param="model"
            )
        raise ModelNotFound(f"model {name!r} is not configured (configured: {known})", param="model")

    def profile_for(self, model_id: str, requested: str | None) -> str | None:
        return self.cfg.profile_for(model_id, requested)

    # -- files -------------------------------------------------------------------
    def known_path(self, model_id: str) -> Path | None:
        """The model's path if it can be told without assembling a package."""
        m = self.cfg.models[model_id]
        if m.package:
            return self._paths.get(model_id)
        return self.cfg.model_path(model_id)

    async def check_file(self, model_id: str) -> Path:
        """The model's GGUF path, or 404 `model_file_missing` (checked every request)."""
        m = self.cfg.models[model_id]
        path = self._paths.get(model_id) if m.package else None
        if path is None:
            try:
                if m.package:
                    path = await asyncio.to_thread(self.cfg.model_path, model_id)
                    self._paths[model_id] = path
                else:
                    path = self.cfg.model_path(model_id)
            except FileNotFoundError as err:
                raise ModelFileMissing(f"model {model_id!r}: {err}", param="model") from None
            except Exception as err:  # noqa: BLE001 - a broken package must not become a bare 500
                raise ModelFileMissing(f"model {model_id!r}: its file cannot be found ({err})", param="model") from None
        if not path.is_file():
            raise ModelFileMissing(f"model {model_id!r}: file {path} is missing", param="model")
        return path

    # -- slots -------------------------------------------------------------------
    def slot(self, model_id: str, profile: str | None) -> Slot:
        key = (model_id, profile)
        if key not in self.slots:
            self.slots[key] = Slot(model_id, profile)
        return self.slots[key]

    async def ready(self, model_id: str, profile: str | None) -> Slot:
        """A slot ready to take decisions; loads it when this request is the first."""
        path = await self.check_file(model_id)
        slot = self.slot(model_id, profile)
        if slot.state == "failed" and slot.failed_stamp != _stamp(path):
            log.info("model file of %s changed since its failed load: loading again", slot.name)
            slot.state, slot.error, slot.info = "unloaded", None, {}
        if slot.state == "ready" and (self.stopping or self.draining):
            from ..errors import Overloaded

            raise Overloaded("the server is shutting down", retry_after=1)
        if slot.state == "ready":
            return slot
        if slot.state == "failed":
            raise slot.error  # type: ignore[misc]
        if slot.state == "loading":
            raise ModelLoading(
                f"model {slot.name!r} is loading; retry shortly", param="model", retry_after=LOADING_RETRY_AFTER_S
            )
        if self.stopping or self.draining:
            from ..errors import Overloaded

            raise Overloaded("the server is shutting down", retry_after=1)
        self._start_load(slot, path)
        assert slot.loaded is not None
        await slot.loaded.wait()
        if slot.state == "ready":
            return slot
        if slot.error is not None:
            raise slot.error
        raise ModelFileMissing(f"model {model_id!r}: file {path} is missing", param="model")

    def _start_load(self, slot: Slot, path: Path) -> None:
        m = self.cfg.models[slot.model_id]
        profile = self.cfg.profiles.get(slot.profile) if slot.profile else None
        load_settings = m.settings(profile)
        model_id = slot.model_id
        parallel = m.parallel or default_parallel()
        read_settings = context_settings(load_settings, parallel)
        canvas = self.settings.canvas

        def open_more(lm):
            from ..engine import open_reader

            return open_reader(lm, read_settings, canvas=canvas)

        def load():
            from ..engine import open_reader
            from ..engine.model import load_model

            lm = self.models.acquire(weights_key(model_id, path, load_settings),
                                     lambda: load_model(model_id, path, load_settings, isolate_vocab=True))
            try:
                reader = open_reader(lm, read_settings, canvas=canvas)
            except GmlxError as err:  # 501 not_implemented: no read strategy
                err.info = lm.describe()  # type: ignore[attr-defined]
                lm.close()
                raise
            except BaseException:
                lm.close()
                raise
            return lm, reader

        worker = Worker(
            slot.name,
            model_id,
            load,
            self.settings,
            max_queue=self.cfg.server.max_queue,
            timeout_s=self.cfg.server.token_queue_timeout_s,
            parallel=parallel,
            open_more=open_more,
        )
        if self.metrics is not None:
            worker.on_done = self.metrics.job_hook(model_id)
        loop = asyncio.get_running_loop()
        slot.state, slot.error, slot.info, slot.worker = "loading", None, {}, None
        slot.loaded = asyncio.Event()
        slot.load_started = time.monotonic()
        log.info("loading %s from %s", slot.name, path)
        fut = worker.start()
        # Settled on the event loop whatever happens to the request that started it.
        fut.add_done_callback(lambda f: loop.call_soon_threadsafe(self._loaded, slot, worker, f, path))

    def _loaded(self, slot: Slot, worker: Worker, fut, path: Path) -> None:
        err = fut.exception()
        if err is None:
            lm = fut.result()
            slot.state, slot.worker, slot.info = "ready", worker, lm.describe()
            slot.info["parallel"] = worker.contexts
            if self.metrics is not None:
                self.metrics.model_loaded(slot.model_id, slot.profile, lm.load_ms / 1000.0)
            if self.stopping:
                worker.stop()
            elif self.draining:
                worker.drain()
        elif isinstance(err, ModelFileMissing):
            slot.state = "unloaded"  # the file went away between the check and the load
            slot.error = None
        else:
            if isinstance(err, GmlxError):
                error = err
                slot.info = getattr(err, "info", {}) or {}
            elif isinstance(err, ModelLoadError):
                error = ServerError(str(err), param="model")
            else:
                error = ServerError(f"model {slot.model_id!r} failed to load: {type(err).__name__}: {err}", param="model")
            slot.state, slot.error, slot.failed_stamp = "failed", error, _stamp(path)
            log.error("loading %s failed: %s", slot.name, error.message)
        if slot.loaded is not None:
            slot.loaded.set()

    # -- whole server --------------------------------------------------------------
    async def preload(self) -> None:
        """`gmlx serve --preload`: load every configured model (default profile)."""
        for mid in self.cfg.models:
            try:
                await self.ready(mid, self.profile_for(mid, None))
            except GmlxError as err:
                log.warning("preload of %s: %s", mid, err.message)

    async def preload_ids(self, names: list[str]) -> None:
        """`server.preload`: load these models (default profile) in the background."""
        self.preloading = True
        try:
            for name in names:
                mid = self.cfg.resolve_id(name) or name
                try:
                    await self.ready(mid, self.profile_for(mid, None))
                except GmlxError as err:
                    log.warning("preload of %s: %s", mid, err.message)
        finally:
            self.preloading = False

    def is_ready(self, names: list[str]) -> tuple[bool, str]:
        """Readiness for a balancer: not draining, not preloading, every preload model ready."""
        if self.stopping or self.draining:
            return False, "draining"
        if self.preloading:
            return False, "loading"
        for name in names:
            mid = self.cfg.resolve_id(name) or name
            slot = self.slots.get((mid, self.profile_for(mid, None)))
            if slot is None or slot.state != "ready":
                return False, f"model {mid!r} is {slot.state if slot else 'unloaded'}"
        return True, "ready"

    def begin_drain(self) -> None:
        """SIGTERM: refuse new decisions (503), let queued and running ones finish."""
        if self.draining or self.stopping:
            return
        self.draining = True
        for slot in self.slots.values():
            if slot.worker is not None:
                slot.worker.drain()

    def idle(self) -> bool:
        return all(s.worker is None or s.worker.idle() for s in self.slots.values())

    def begin_shutdown(self) -> None:
        """SIGTERM: new decisions and queued ones get 503; running ones finish."""
        if self.stopping:
            return
        self.stopping = True
        for slot in self.slots.values():
            if slot.worker is not None:
                slot.worker.stop()

    async def close(self, grace_s: float = 5.0) -> None:
        self.begin_shutdown()
        workers = [s.worker for s in self.slots.values() if s.worker is not None]
        for w in workers:
            w.cancel_running()
        deadline = time.monotonic() + grace_s
        for w in workers:
            await asyncio.to_thread(w.join, max(0.0, deadline - time.monotonic()))

    def health(self) -> dict[str, Any]:
        rank = {"ready": 3, "loading": 2, "failed": 1, "unloaded": 0}
        models: dict[str, Any] = {}
        for mid in self.cfg.models:
            slots = [s for (m, _), s in self.slots.items() if m == mid]
            state = max((s.state for s in slots), key=rank.__getitem__, default="unloaded")
            path = self.known_path(mid)
            models[mid] = {
                "state": state,
                "aliases": sorted(a for a, t in self.cfg.aliases.items() if t == mid),
                "file_present": path.is_file() if path is not None else None,
                "slots": {s.profile or "default": s.describe() for s in slots},
            }
        return models
