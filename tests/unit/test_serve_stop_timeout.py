"""A service whose run failed and whose stop hangs exits anyway (status 1), after STOP_AFTER_FAILURE_S."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CHILD = """
import asyncio, threading
import shared.service as service
from shared.settings import Settings

service.STOP_AFTER_FAILURE_S = 1.0

class Stuck:
    async def start(self): pass
    async def run(self, stop_event): raise RuntimeError("collective failed")
    async def stop(self): await asyncio.to_thread(threading.Event().wait)  # never returns
    def health(self): return {}
    def metrics(self): return b""

async def app(scope, receive, send):  # a bare ASGI app: lifespan only
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return

settings = Settings.model_validate({"http": {"host": "127.0.0.1", "port": 0}})
asyncio.run(service.serve(Stuck(), settings, app=app))
"""


def test_a_failed_service_whose_stop_hangs_exits_with_status_1() -> None:
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "stop_timed_out" in proc.stdout + proc.stderr
    assert time.monotonic() - started < 50
