"""The decision routes: what `/v1/systemone` (and `/systemone`) and
`POST /v1/decisions` (OpenAI's Decisions API, SPEC 8) do differently.

Both run the same handler (`app.serve_decision`): auth,
body reading (size limit, gzip/zstd), model resolution, lazy load, admission,
the model's queue with back-pressure and timeouts, cancellation, the error
mapping. What differs is at its two ends, which this adapter supplies:

- `parse`: the OpenAI body -> its /v1/systemone equivalent -> Decision
  (gmlx.decisions.openai; 400 in OpenAI's envelope for the route's own rules);
- `respond`: the SPEC 4.8 response -> OpenAI's Decision object;
- `error`: admission errors about a generated question id (`q3`) name the
  request's own field (`questions[3]`).

One adapter per request: it keeps the mapping between the two shapes.
"""

from __future__ import annotations

import logging

from ..decisions.openai import OpenAIDecision, parse_openai
from ..decisions.parse import parse_decision
from ..decisions.types import Decision, DecisionSettings
from ..errors import GmlxError

log = logging.getLogger("gmlx.server")


class SystemOneRoute:
    """/v1/systemone: the body is the decision, the response is SPEC 4.8's."""

    name = "systemone"

    def parse(self, payload: dict, settings: DecisionSettings) -> Decision:
        return parse_decision(payload, settings)

    def respond(self, result: dict) -> dict:
        return result

    def error(self, err: GmlxError) -> GmlxError:
        return err

    def note(self) -> str:
        return ""


class OpenAIDecisionsRoute:
    """/v1/decisions: OpenAI's request and answer shapes around the same decision."""

    name = "openai"

    def __init__(self) -> None:
        self.request: OpenAIDecision | None = None

    def parse(self, payload: dict, settings: DecisionSettings) -> Decision:
        self.request = parse_openai(payload, settings)
        if self.request.no_effect:
            log.info("accepted with no effect: %s", ", ".join(self.request.no_effect))
        return self.request.decision(settings)

    def respond(self, result: dict) -> dict:
        assert self.request is not None
        return self.request.response(result)

    def error(self, err: GmlxError) -> GmlxError:
        return self.request.error(err) if self.request is not None else err

    def note(self) -> str:
        """Extra words for the decision's log line: the caller's safety_identifier
        (logged only; it authenticates nothing)."""
        if self.request is None or self.request.safety_identifier is None:
            return "route=decisions"
        return f"route=decisions safety_identifier={self.request.safety_identifier!r}"
