"""Copy-truncate rotation of the local stack's logs (devstack.logs): sizes, backups, appending writers."""

from __future__ import annotations

import os
from pathlib import Path

from devstack.logs import backup_path, rotate, rotate_all


def _write(path: Path, data: bytes) -> None:
    with open(path, "ab") as fh:
        fh.write(data)


def test_a_log_at_or_under_the_cap_is_left_alone(tmp_path: Path) -> None:
    log = tmp_path / "trainer.log"
    _write(log, b"x" * 100)
    assert rotate(log, max_bytes=100, backups=3) is False
    assert log.read_bytes() == b"x" * 100 and not backup_path(log, 1).exists()
    assert rotate(tmp_path / "missing.log", max_bytes=1) is False


def test_over_the_cap_it_is_copied_to_dot_1_and_truncated_in_place(tmp_path: Path) -> None:
    log = tmp_path / "trainer.log"
    _write(log, b'{"event": "fragment_trained"}\n' * 10)
    inode = log.stat().st_ino
    assert rotate(log, max_bytes=100, backups=3) is True
    assert log.stat().st_size == 0 and log.stat().st_ino == inode  # same file: writers keep their descriptor
    assert backup_path(log, 1).read_bytes() == b'{"event": "fragment_trained"}\n' * 10


def test_backups_shift_and_the_oldest_is_dropped(tmp_path: Path) -> None:
    log = tmp_path / "s3.log"
    for generation in range(5):
        _write(log, f"generation {generation}\n".encode() * 20)
        assert rotate(log, max_bytes=10, backups=3)
    kept = [backup_path(log, i).read_text().splitlines()[0] for i in (1, 2, 3)]
    assert kept == ["generation 4", "generation 3", "generation 2"]
    assert not backup_path(log, 4).exists()


def test_zero_backups_only_truncates(tmp_path: Path) -> None:
    log = tmp_path / "kafka.log"
    _write(log, b"y" * 50)
    assert rotate(log, max_bytes=10, backups=0)
    assert log.stat().st_size == 0 and not backup_path(log, 1).exists()


def test_an_appending_writer_continues_at_the_start_after_truncation(tmp_path: Path) -> None:
    """What every child of the stack relies on: O_APPEND writes land at the end of the truncated file."""
    log = tmp_path / "sampler-0.log"
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, b"a" * 1000)
        assert rotate(log, max_bytes=100, backups=1)
        os.write(fd, b"after\n")
    finally:
        os.close(fd)
    assert log.read_bytes() == b"after\n"  # no hole of 1000 NUL bytes before it


def test_rotate_all_takes_only_logs_over_the_cap(tmp_path: Path) -> None:
    _write(tmp_path / "big.log", b"z" * 200)
    _write(tmp_path / "small.log", b"z" * 10)
    _write(tmp_path / "notes.txt", b"z" * 200)
    assert rotate_all(tmp_path, max_bytes=100, backups=2) == [tmp_path / "big.log"]
    assert (tmp_path / "notes.txt").stat().st_size == 200
    assert rotate_all(tmp_path / "nowhere") == []
