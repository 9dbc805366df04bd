"""The OpenAI error of a refused request, pure: :class:`ApiError` (an HTTP status and OpenAI's error body
``{"error": {"message", "type", "param", "code"}}``) and :func:`invalid`, the 400 that names the field.
Re-exported by :mod:`pipeline.serving.endpoints.openai_api`, where requests are validated."""

from __future__ import annotations

from typing import Optional


class ApiError(Exception):
    """A request refused with an HTTP status and OpenAI's error body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def __reduce__(self):  # picklable with all its fields (Ray ships exceptions and captured globals)
        return (type(self), (self.status, self.message, self.type, self.param, self.code))

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def __repr__(self) -> str:
        return f"ApiError({self.status}, {self.message!r}, param={self.param!r}, code={self.code!r})"


def invalid(message: str, param: Optional[str] = None, code: Optional[str] = None) -> ApiError:
    """A 400 invalid_request_error."""
    return ApiError(400, message, "invalid_request_error", param, code)
