"""The error table of SPEC section 5, as exceptions.

Every failure a request can meet is one of these; the server turns it into
`{"error": {"message", "type", "param", "code"}}` with the status below.
Pure Python: the decision core raises these too.
"""

from __future__ import annotations


class GmlxError(Exception):
    status = 500
    type = "server_error"

    def __init__(self, message: str, param: str | None = None, *, retry_after: int | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.retry_after = retry_after

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}


class InvalidRequest(GmlxError):
    """Body not a JSON object, images present, prompt larger than the context."""

    status = 400
    type = "invalid_request_error"


class ClientClosed(GmlxError):
    """The client went away before its decision was answered (nginx's 499).
    Nobody may read it, but a proxy or a log does: it keeps the envelope."""

    status = 499
    type = "client_closed_request"


class UnknownProfile(GmlxError):
    status = 400
    type = "unknown_profile"


class NoModelSpecified(GmlxError):
    status = 400
    type = "no_model_specified"


class AuthenticationError(GmlxError):
    status = 401
    type = "authentication_error"


class ModelNotFound(GmlxError):
    status = 404
    type = "model_not_found"


class ModelFileMissing(GmlxError):
    status = 404
    type = "model_file_missing"


class RequestTooLarge(GmlxError):
    status = 413
    type = "request_too_large"


class UnsupportedMediaType(GmlxError):
    status = 415
    type = "unsupported_media_type"


class ValidationError(GmlxError):
    """A field fails validation, a label is not one token, a template is too long."""

    status = 422
    type = "validation_error"


class NotImplementedStrategy(GmlxError):
    status = 501
    type = "not_implemented"


class Overloaded(GmlxError):
    status = 503
    type = "overloaded"


class ModelLoading(GmlxError):
    status = 503
    type = "model_loading"


class Timeout(GmlxError):
    status = 504
    type = "timeout"


class ServerError(GmlxError):
    status = 500
    type = "server_error"


class Cancelled(Exception):
    """The client went away; the decision stops at its next read. Never sent to anyone."""


class ModelLoadError(Exception):
    """A model could not be loaded (unsupported architecture, corrupt file).

    Not a request error by itself: the server maps it to 500 `server_error`
    naming the model, and keeps serving the others.
    """
