"""OpenAI-style API errors: an HTTP status and a body `{"error": {message, type, param, code}}`."""
from __future__ import annotations


class ApiError(Exception):
    """An error answered to the client; `message` says what was wrong and what to do."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ("server_error" if status >= 500 else "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    """A 400 for a request field the client must change."""
    return ApiError(400, message, param=param, code=code or "invalid_value")


def missing(param: str, what: str) -> ApiError:
    """A 400 for a required field left out; `what` says what it should hold."""
    return ApiError(400, f"'{param}' is required: {what}.", param=param,
                    code="missing_required_parameter")
