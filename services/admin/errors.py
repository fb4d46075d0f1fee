"""The admin API's one error model, declared in the OpenAPI schema on every response that can carry it.

Every 4xx/5xx body is ``{"detail": ...}``: a sentence (``HTTPException`` in a route: 401, 404, 405,
409 (e.g. runtime settings that match their schema but not the other settings), 503, and 422 naming
the key of a ``PATCH /config`` body that does not match its schema), or FastAPI's list of
``{"loc", "msg", "type"}`` issues when the request does not match the schema (422). A request the
schema allows is never a 422. :func:`declare_errors` writes that model into the schema, adds 422 to
every operation with parameters or a body and 400 (a body that is not JSON) to every operation with
a body, so the schema and the bodies agree; :func:`allow_all_methods` makes a 405's ``Allow`` list
the path's methods (checked by tests/integration/test_api_schema.py with schemathesis, every check).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.routing import Match, Route, compile_path

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


def allow_all_methods(app: FastAPI) -> None:
    """A 405 names in ``Allow`` every method the path has, as RFC 9110 asks (and the schema lists). Starlette's
    own names only the first route that matched the path: ``OPTIONS /config`` answered ``Allow: GET``
    though the path also has PATCH (found by schemathesis). The methods are the schema's for the path, plus
    those of routes outside it (``/openapi.json``)."""

    async def handler(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if exc.status_code == 405:
            path = request.url.path
            methods = {m.upper() for template, ops in request.app.openapi()["paths"].items()
                       if compile_path(template)[0].match(path) for m in ops}
            methods |= {m for r in request.app.routes if isinstance(r, Route) and r.methods  # e.g. /openapi.json
                        and r.matches(request.scope)[0] is not Match.NONE for m in r.methods}
            allowed = ", ".join(sorted(methods))
            exc = HTTPException(405, detail=f"{request.method} is not allowed on {path}; allowed: "
                                            f"{allowed}", headers={"Allow": allowed})
        return await http_exception_handler(request, exc)

    app.add_exception_handler(HTTPException, handler)
