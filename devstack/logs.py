"""Size-capped logs: copy-truncate rotation of ``<home>/logs/*.log``, safe for writers that append.

Every process of a stack writes its log through a descriptor opened with O_APPEND, so after the
file is truncated in place its next write lands at the new end (offset 0), not at the old offset
leaving a hole. The copy-truncate leaves one window open: bytes written between the copy and the
truncation are lost; the copy of a 20 MiB file takes milliseconds.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

LOG_MAX_BYTES = 20 * 1024 * 1024
LOG_BACKUPS = 3


def backup_path(path: Path, index: int) -> Path:
    """``trainer.log`` -> ``trainer.log.<index>`` (1 is the newest backup)."""
    return path.with_name(f"{path.name}.{index}")


def rotate(path: Path, max_bytes: int = LOG_MAX_BYTES, backups: int = LOG_BACKUPS) -> bool:
    """Rotate ``path`` if it is larger than ``max_bytes``; return whether it did.

    ``.{backups-1}`` -> ``.{backups}`` ... ``.1`` -> ``.2`` (the oldest is overwritten), then a copy
    of the log to ``.1``, then the log is truncated in place (its inode, and the writers'
    descriptors, stay). ``backups=0`` only truncates.
    """
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return False
    if size <= max_bytes:
        return False
    for index in range(backups - 1, 0, -1):
        older = backup_path(path, index)
        if older.exists():
            older.replace(backup_path(path, index + 1))
    if backups > 0:
        shutil.copyfile(path, backup_path(path, 1))
    os.truncate(path, 0)
    return True


def rotate_all(logs_dir: Path, max_bytes: int = LOG_MAX_BYTES, backups: int = LOG_BACKUPS) -> list[Path]:
    """Rotate every ``*.log`` and ``*.out`` in ``logs_dir`` that is over the cap; return those rotated.

    The services rotate their own ``*.log`` (between lines, at the same cap: ``log.file``), so in
    practice this acts on the infrastructure's logs and on standard-output files."""
    if not logs_dir.is_dir():
        return []
    paths = sorted([*logs_dir.glob("*.log"), *logs_dir.glob("*.out")])
    return [path for path in paths if rotate(path, max_bytes, backups)]
