"""The operator's status page at ``/`` and an offline Swagger UI at ``/docs``: every asset is served from here.

The page (``static/index.html``, ``app.js``, ``app.css``) polls ``GET /status`` and draws it with uPlot;
``/docs`` is FastAPI's Swagger UI page pointed at the vendored ``swagger-ui-dist`` instead of a CDN, so both
work on a machine without internet. Vendored packages live in ``static/vendor/<name>-<version>/`` with
their licenses (see ``static/vendor/README.md``).
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse
from fastapi.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).resolve().with_name("static")
SWAGGER_UI = "vendor/swagger-ui-dist-5.35.0"

# The page only talks to its own origin: the token typed into it cannot be sent anywhere else,
# and no other site may frame it (its buttons pause samplers and roll policies back).
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; connect-src 'self'; "
                               "frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "Cache-Control": "no-cache",
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
}
# Swagger UI's page starts itself with an inline script and styles elements inline.
DOCS_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self' 'unsafe-inline'; "
                               "style-src 'self' 'unsafe-inline'; img-src 'self' data:; connect-src 'self'; "
                               "frame-ancestors 'none'; base-uri 'none'",
    "Referrer-Policy": "no-referrer",
}


def mount_pages(app: FastAPI) -> None:
    """Serve ``/static``, the status page at ``/`` and Swagger UI at ``/docs``.

    Create the app with ``docs_url=None``, else FastAPI's own ``/docs`` (assets from a CDN) answers first.
    """
    if not (STATIC_DIR / "index.html").is_file():
        raise RuntimeError(f"admin static files are missing: {STATIC_DIR} (was the package installed without them?)")
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

    @app.get("/", include_in_schema=False)
    def status_page() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html", headers=PAGE_HEADERS)

    @app.get("/docs", include_in_schema=False)
    def swagger_ui(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "").rstrip("/")
        page = get_swagger_ui_html(
            openapi_url=f"{root}{app.openapi_url or '/openapi.json'}",
            title=f"{app.title} - API",
            swagger_js_url=f"{root}/static/{SWAGGER_UI}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}/static/{SWAGGER_UI}/swagger-ui.css",
            swagger_favicon_url=f"{root}/static/{SWAGGER_UI}/favicon-32x32.png",
            # validatorUrl None: no call to swagger.io's online validator
            swagger_ui_parameters={"validatorUrl": None, **(app.swagger_ui_parameters or {})},
        )
        page.headers.update(DOCS_HEADERS)
        return page
