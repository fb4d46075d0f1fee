"""FastAPI dependencies of the admin API: the state, and the bearer token on mutating calls."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from services.admin.state import AdminState


def get_state(request: Request) -> AdminState:
    state: AdminState = request.app.state.admin
    return state


State = Annotated[AdminState, Depends(get_state)]
bearer = HTTPBearer(auto_error=False)


def require_token(
    request: Request, creds: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]
) -> None:
    token = get_state(request).settings.admin.token
    if token is None:  # only reachable with admin.insecure_dev=true (checked at start-up)
        return
    if creds is None or not hmac.compare_digest(creds.credentials.encode(), token.get_secret_value().encode()):
        raise HTTPException(status_code=401, detail="missing or wrong bearer token",
                            headers={"WWW-Authenticate": "Bearer"})


def actor(request: Request) -> str:
    """Who an audit entry names: the API has one shared token, so the client address."""
    host = request.client.host if request.client else "unknown"
    return f"operator@{host}"
