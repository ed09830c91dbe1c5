"""`gmlx systemone`: answer a request file through a server, or offline.

Both paths end in the same response body, printed one line per question:

    team:     billing (0.99)
    urgent:   0.022
    severity: 0.96 (0.95)
    refund:   skipped
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import GmlxError


class RequestFileError(Exception):
    """The request file cannot be read or is not a JSON object."""


def read_request(path: str) -> dict[str, Any]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as err:
        raise RequestFileError(f"{path}: cannot read ({err.strerror or err})") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as err:
        raise RequestFileError(f"{path}: not valid JSON ({err.msg} at line {err.lineno} column {err.colno})") from None
    if not isinstance(body, dict):
        raise RequestFileError(f"{path}: the request must be a JSON object")
    return body


def format_answers(request: dict[str, Any], response: dict[str, Any]) -> list[str]:
    """One line per asked question, ids aligned, in request order."""
    answers = response.get("answers") or {}
    skipped = (response.get("diagnostics") or {}).get("skipped") or {}
    questions = request.get("questions") if isinstance(request.get("questions"), dict) else {}
    ids = [q for q in questions if q in answers or q in skipped] or list(answers)
    width = max((len(q) for q in ids), default=0) + 1
    lines = []
    for qid in ids:
        lines.append(f"{(qid + ':').ljust(width)} {_answer_text(answers.get(qid))}")
    return lines


def _answer_text(answer: dict[str, Any] | None) -> str:
    if answer is None:
        return "skipped"
    kind = answer.get("type")
    if kind == "noul":
        return f"{answer['noul']:.3f}"
    if kind == "choice":
        return f"{answer['choice']} ({answer['confidence']:.2f})"
    if kind == "score":
        return f"{answer['score']:.2f} ({answer['confidence']:.2f})"
    return json.dumps(answer)


def post(url: str, body: dict[str, Any], api_key: str | None, timeout: float = 600.0) -> dict[str, Any]:
    """POST to a server; raises ConnectionError or HTTPFailure."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.post(url.rstrip("/") + "/v1/systemone", json=body, headers=headers, timeout=timeout)
    except httpx.TransportError as err:
        raise ConnectionError(str(err)) from None
    if r.status_code != 200:
        try:
            err = r.json()["error"]
            message = f"{err.get('type')}: {err.get('message')}"
        except Exception:
            message = r.text.strip()[:300] or r.reason_phrase
        raise HTTPFailure(r.status_code, message)
    return r.json()


class HTTPFailure(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


def run_offline(body: dict[str, Any], model: str, config_path: str | None) -> dict[str, Any]:
    """Load the model in this process and run the same decision code as the server."""
    from .decisions.parse import parse_decision
    from .decisions.decide import admit, decide

    model_id, reader, ds = open_offline(model, config_path, profile=body.get("profile") if isinstance(body, dict) else None)
    decision = parse_decision(body, ds)
    admit(decision, reader, ds)
    return decide(decision, reader, ds, model_id)


def open_offline(model: str, config_path: str | None, profile: str | None = None):
    """Load `model` (a configured id or alias, or a GGUF path) and open its
    reader: (model_id, reader, decision settings), as the server would serve it:
    the request's profile (or server.defaults.profile) resolved as the server
    resolves it, and the server.systemone defaults.
    `gmlx systemone --batch` keeps them for every line."""
    from .config import Config, load_config, parse_config
    from .engine import open_reader
    from .engine.model import load_model

    cfg: Config
    if config_path:
        cfg = load_config(config_path)
    elif Path("decisions.yaml").is_file():
        cfg = load_config("decisions.yaml")
    else:
        cfg = parse_config({})
    model_id = cfg.resolve_id(model)
    if model_id is not None:
        path = cfg.model_path(model_id)
        chosen = cfg.profile_for(model_id, profile if isinstance(profile, str) else None)
        settings = cfg.models[model_id].settings(cfg.profiles[chosen] if chosen else None)
    else:
        path = Path(model).expanduser()
        if not path.is_file():
            raise GmlxError(f"{model!r} is neither a configured model nor a GGUF file")
        model_id = path.stem
        settings = parse_config({"models": {model_id: {"path": str(path)}}}).models[model_id].settings()
    ds = cfg.server.systemone.decision_settings()
    lm = load_model(model_id, path, settings)
    reader = open_reader(lm, settings, canvas=ds.canvas)
    return model_id, reader, ds
