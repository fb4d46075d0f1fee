"""The admin API's one error model, declared in the OpenAPI schema on every response that can carry it.

Every 4xx/5xx body is ``{"detail": ...}``: a sentence (``HTTPException`` in a route: 401, 404, 409,
503, and 422 for a value only the service can judge, e.g. a runtime setting that does not validate),
or FastAPI's list of ``{"loc", "msg", "type"}`` issues when the request does not match the schema
(422). :func:`declare_errors` writes that model into the schema, adds 422 to every operation with
parameters or a body and 400 (a body that is not JSON) to every operation with a body, so the
schema and the bodies agree (checked by tests/integration/test_api_schema.py with schemathesis).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, Field

ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}
NO_ERROR_MODEL = {"/healthz"}
"""Paths whose error statuses have their own body (``/healthz``'s 503 is ``{"ok": false}``)."""


class ValidationIssue(BaseModel):
    loc: list[str | int] = Field(description="Where: body, query, path or header, then the field")
    msg: str
    type: str


class ErrorResponse(BaseModel):
    detail: str | list[ValidationIssue] = Field(
        description="Why: one sentence, or one issue per invalid field when the request does not match the schema")


def declare_errors(app: FastAPI) -> None:
    """Make ``app.openapi()`` declare :class:`ErrorResponse` on every error response (see the module doc)."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = generate()
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        model = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(model.pop("$defs", {}))
        components["ErrorResponse"] = model
        for path, operations in schema.get("paths", {}).items():
            for op in operations.values():
                responses = op.setdefault("responses", {})
                if op.get("parameters") or op.get("requestBody"):
                    responses.setdefault("422", {"description": "Invalid input: detail names each problem"})
                    responses["422"]["description"] = "Invalid input: detail names each problem"
                if op.get("requestBody"):
                    responses.setdefault("400", {"description": "The body is not JSON"})
                if path in NO_ERROR_MODEL:
                    continue
                for code, response in responses.items():
                    if code.startswith(("4", "5")):
                        response["content"] = {"application/json": {"schema": ERROR_REF}}
        text = str(schema["paths"])
        for unused in ("HTTPValidationError", "ValidationError"):
            if f"#/components/schemas/{unused}'" not in text:
                components.pop(unused, None)
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
