"""Services rotate their own log file by size, between lines: nothing lost, nothing cut, capped."""

from __future__ import annotations

import json
from pathlib import Path

from shared.logging import RotatingFile, configure_logging, get_logger


def test_rotation_keeps_every_line_whole_and_files_under_the_cap(tmp_path: Path) -> None:
    path = tmp_path / "logs" / "trainer.log"
    stream = RotatingFile(path, max_bytes=64 * 1024, backups=50)
    configure_logging("trainer", "r", stream=stream)
    log = get_logger()
    for i in range(5000):
        log.info("fragment_trained", n=i, sample_id=f"{i:032x}")
    files = [path] + sorted(tmp_path.glob("logs/trainer.log.*"))
    assert len(files) > 5, "expected several rotations"
    assert all(f.stat().st_size <= 64 * 1024 for f in files)
    numbers = sorted(json.loads(line)["n"] for f in files for line in f.read_text().splitlines())
    assert numbers == list(range(5000))  # every line, once, parseable


def test_oldest_backups_are_deleted(tmp_path: Path) -> None:
    path = tmp_path / "x.log"
    stream = RotatingFile(path, max_bytes=1000, backups=2)
    for i in range(200):
        stream.write(f"line {i:04d} " + "x" * 40 + "\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.log", "x.log.1", "x.log.2"]
    assert (tmp_path / "x.log").read_text().splitlines()[-1].startswith("line 0199")
