"""llama.cpp side of gmlx: loading GGUFs and the two read strategies."""

from __future__ import annotations

from typing import Any

from ..config import with_load_defaults
from ..errors import NotImplementedStrategy


def _with_defaults(reader, lm, settings: dict[str, Any]):
    """Per-model decision defaults every reader carries (decisions/read.py)."""
    reader.calibrate = settings["calibrate"]
    # Calibration priors are shared only by readers of the same file and settings.
    reader.model_key = (str(getattr(lm, "path", "")), tuple(sorted((k, repr(v)) for k, v in settings.items())))
    return reader


def _refuse_images(reader, lm):
    """A reader that cannot read images refuses a decision that has some
    (400 at admission) instead of answering without them."""
    if getattr(reader, "reads_images", False):
        return reader
    check = reader.check

    def guarded(decision):
        if getattr(decision, "images", None):
            from .media import no_projector

            raise no_projector(lm.model_id, lm.strategy)
        return check(decision)

    reader.check = guarded
    return reader


def open_reader(lm, settings: dict[str, Any], canvas: int = 64):
    return _refuse_images(_open_reader(lm, with_load_defaults(settings), canvas), lm)


def _open_reader(lm, settings: dict[str, Any], canvas: int = 64):
    """The Reader for a loaded model, by its strategy (SPEC 3). It owns a
    llama.cpp context: create it on the thread that will use it. `canvas` is
    the served canvas width (`server.systemone.canvas`) for canvas reads."""
    if lm.strategy == "next-token":
        from .gguf_info import RECURRENT_ARCHS

        if lm.architecture in RECURRENT_ARCHS:
            from .hybrid import HybridNextTokenReader

            return _with_defaults(HybridNextTokenReader(lm, settings), lm, settings)
        from .nexttoken import NextTokenReader

        return _with_defaults(NextTokenReader(lm, settings), lm, settings)
    if lm.strategy == "winnow":
        from .winnow import WinnowReader

        return _with_defaults(WinnowReader(lm, settings), lm, settings)
    if lm.strategy == "liquid":
        from .liquid import LiquidReader

        return _with_defaults(LiquidReader(lm, settings), lm, settings)
    if lm.strategy == "canvas":
        from .canvas import CanvasReader

        return _with_defaults(CanvasReader(lm, settings, canvas=canvas), lm, settings)
    raise NotImplementedStrategy(
        f"model {lm.model_id!r} ({lm.architecture}) has no read strategy: it is neither a diffusion model "
        "nor a chat model with a chat template",
        param="model",
    )
