"""Requests the admin API refused for their token (401: none, 403: one no operator has).

Every refusal is counted (``flywheel_admin_requests_refused_total{reason, access}``) and logged (``request_refused``,
with the client, method and path; never the token). The audit trail gets the first refusal of each client and
reason in every ``window_s`` (default a minute), as ``request_refused`` by ``anonymous@<client>``, with how many
were held back since that pair's last entry: a client without a token can make the admin write at most one audit
object a minute per reason, not one per request. At most ``max_clients`` pairs are remembered (the oldest go first:
a forgotten pair's held-back count is in the metric and the log lines only).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter

from shared.logging import get_logger

REFUSED = Counter("flywheel_admin_requests_refused_total",
                  "Admin API requests refused for their bearer token (no_token: 401, wrong_token: 403)",
                  ["reason", "access"])
WINDOW_S = 60.0
MAX_CLIENTS = 1024
REASONS = {401: "no_token", 403: "wrong_token"}


@dataclass
class _Pair:
    audited_at: float
    held: int = 0


class RequestRefusals:
    """Which refusals the audit gets (:meth:`note`); the counting and the log line happen for every one."""

    def __init__(self, log: Any = None, window_s: float = WINDOW_S, max_clients: int = MAX_CLIENTS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.log = log if log is not None else get_logger()
        self.window_s = window_s
        self.max_clients = max_clients
        self.clock = clock
        self._pairs: OrderedDict[tuple[str, str], _Pair] = OrderedDict()

    def note(self, client: str, status: int, access: str, method: str, path: str) -> dict[str, Any] | None:
        """Count and log one refusal; the audit entry's params when this one is to be audited, else None."""
        reason = REASONS[status]
        REFUSED.labels(reason, access).inc()
        self.log.warning("request_refused", client=client, status=status, reason=reason, access=access,
                         method=method, path=path)
        key, now = (client, reason), self.clock()
        pair = self._pairs.get(key)
        if pair is not None and now - pair.audited_at < self.window_s:
            pair.held += 1
            return None
        held = pair.held if pair is not None else 0
        self._pairs[key] = _Pair(now)
        self._pairs.move_to_end(key)
        while len(self._pairs) > self.max_clients:
            self._pairs.popitem(last=False)
        return {"method": method, "path": path, "status": status, "reason": reason, "access": access,
                "held_back_since_last": held, "window_s": self.window_s}
