"""The status page and /docs are served by the admin itself: every script and stylesheet is local."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast
from urllib.parse import urljoin, urlsplit

import pytest
from fastapi.testclient import TestClient

from services.admin.app import create_app
from services.admin.pages import STATIC_DIR
from services.admin.state import AdminState
from shared.settings import load_settings

ASSET = re.compile(r"""<(?:script|link|img)\b[^>]*?\b(?:src|href)\s*=\s*["']([^"']+)["']""", re.IGNORECASE)
BASE = "http://admin/"


@pytest.fixture(scope="module")
def client() -> Any:
    settings = load_settings(None, environ={"FLYWHEEL_RUN": "pages", "FLYWHEEL_ADMIN_TOKEN": "t"})
    state = cast(AdminState, SimpleNamespace(settings=settings))  # the pages never touch the state
    with TestClient(create_app(state), base_url=BASE.rstrip("/")) as c:
        yield c


def assets(html: str, page: str) -> list[str]:
    return [urljoin(urljoin(BASE, page), ref) for ref in ASSET.findall(html)]


def test_status_page_is_html_with_a_strict_policy(client: TestClient) -> None:
    r = client.get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "<title>Flywheel</title>" in r.text and 'id="pause-all"' in r.text
    csp = r.headers["content-security-policy"]
    assert "connect-src 'self'" in csp and "frame-ancestors 'none'" in csp


@pytest.mark.parametrize("page", ["/", "/docs"])
def test_every_asset_is_local_and_served(client: TestClient, page: str) -> None:
    html = client.get(page).text
    urls = assets(html, page)
    assert len(urls) >= 3, urls  # a script, a stylesheet, an icon at least
    for url in urls:
        assert urlsplit(url).netloc == "admin", f"{page} loads {url} from another host"
        r = client.get(url)
        assert r.status_code == 200 and r.content, f"{page}: {url} answered {r.status_code}"
    assert "http://" not in html.replace(BASE, "") and "https://" not in html, "a page names an external URL"


def test_docs_is_swagger_ui_on_the_vendored_bundle(client: TestClient) -> None:
    html = client.get("/docs").text
    assert "SwaggerUIBundle" in html and "/openapi.json" in html and "swagger-ui-dist-5.35.0" in html
    assert '"validatorUrl": null' in html


def test_pages_are_not_in_the_api_schema(client: TestClient) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    assert "/status" in paths
    assert not {"/", "/docs"} & set(paths) and not any(p.startswith("/static") for p in paths)


def test_static_files_are_confined_to_the_package(client: TestClient) -> None:
    assert client.get("/static/app.js").status_code == 200
    assert client.get("/static/../pages.py").status_code == 404
    assert client.get("/static/%2e%2e/pages.py").status_code == 404


def test_vendored_packages_keep_their_licenses() -> None:
    vendor = STATIC_DIR / "vendor"
    packages = [p for p in vendor.iterdir() if p.is_dir()]
    assert {p.name for p in packages} >= {"uplot-1.6.32", "swagger-ui-dist-5.35.0"}
    for p in packages:
        assert (p / "LICENSE").is_file(), f"{p} without its LICENSE"


def test_page_script_only_talks_to_its_own_origin() -> None:
    js = (STATIC_DIR / "app.js").read_text()
    targets = re.findall(r"""fetch\(\s*[`"']([^`"']+)""", js)
    assert targets and all(not t.startswith(("/", "http")) and "//" not in t for t in targets), targets
    assert "localStorage" not in js  # the token may outlive the tab nowhere
    assert Path(STATIC_DIR / "index.html").read_text().count("<script") == 2
