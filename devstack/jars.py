"""Fetching Apache Kafka's jars from Maven Central into a cache outside the repository."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from devstack.config import KAFKA_POM, StackError, cache_root, kafka_version
from devstack.procs import file_lock, tail

MIN_JAVA = 17
MAVEN_TIMEOUT_S = 900.0
_MARKER = ".complete"

Progress = Callable[[str], None]


def find_java() -> str:
    """Path of a `java` (JAVA_HOME first, then PATH) that is at least Java 17, else StackError."""
    java_home = os.environ.get("JAVA_HOME")
    java = str(Path(java_home) / "bin" / "java") if java_home else shutil.which("java")
    if not java or not Path(java).exists():
        where = f"JAVA_HOME={java_home} has no bin/java" if java_home else "no `java` on PATH"
        raise StackError(
            f"Java not found ({where}); the local Kafka needs Java >= {MIN_JAVA}, "
            "e.g. `apt-get install openjdk-17-jre-headless`"
        )
    try:
        out = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise StackError(f"`{java} -version` failed: {exc}") from exc
    match = re.search(r'version "(\d+)(?:\.(\d+))?', out.stderr + out.stdout)
    if not match:
        raise StackError(f"cannot parse the Java version from `{java} -version`: {out.stderr.strip()!r}")
    major = int(match.group(1))
    if major == 1 and match.group(2):  # "1.8.0_392" style
        major = int(match.group(2))
    if major < MIN_JAVA:
        raise StackError(f"{java} is Java {major}; Kafka {kafka_version()} needs Java >= {MIN_JAVA}")
    return java


def kafka_libs_dir() -> Path:
    return cache_root() / f"kafka-{kafka_version()}" / "libs"


def _complete(libs: Path) -> bool:
    marker = libs / _MARKER
    if not marker.is_file():
        return False
    names = [n for n in marker.read_text().splitlines() if n]
    return bool(names) and all((libs / n).is_file() for n in names)


def ensure_kafka_jars(progress: Progress) -> Path:
    """Return the directory holding Kafka's jars, downloading them with Maven on first use.

    The download goes to a scratch directory that is renamed into place and then marked complete
    (the marker lists every jar), so an interrupted download is simply redone next time.
    """
    libs = kafka_libs_dir()
    if _complete(libs):
        return libs
    version = kafka_version()
    mvn = shutil.which("mvn")
    if mvn is None:
        raise StackError(
            f"Kafka {version}'s jars are not cached in {libs} and `mvn` is not on PATH to fetch them; "
            "install Maven (`apt-get install maven`) or point FLYWHEEL_CACHE at a filled cache"
        )
    libs.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(libs.parent / ".lock"):
        if _complete(libs):  # another process finished it while we waited for the lock
            return libs
        scratch = libs.parent / "libs.partial"
        shutil.rmtree(scratch, ignore_errors=True)
        shutil.rmtree(libs, ignore_errors=True)
        mvn_log = libs.parent / "mvn.log"
        cmd = [
            mvn,
            "-q",
            "-B",
            "-f",
            str(KAFKA_POM),
            "dependency:copy-dependencies",
            f"-DoutputDirectory={scratch}",
            "-DincludeScope=runtime",
        ]
        progress(f"fetching Kafka {version} from Maven Central into {libs.parent} (first run only) ...")
        started = time.monotonic()
        next_report = started + 10.0
        with open(mvn_log, "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            while proc.poll() is None:
                now = time.monotonic()
                if now - started > MAVEN_TIMEOUT_S:
                    proc.kill()
                    proc.wait()
                    raise StackError(f"Maven did not finish within {MAVEN_TIMEOUT_S:.0f} s; see {mvn_log}")
                if now >= next_report:
                    progress(f"  ... still fetching Kafka jars ({now - started:.0f} s)")
                    next_report += 10.0
                time.sleep(0.5)
        jars = sorted(p.name for p in scratch.glob("*.jar")) if scratch.is_dir() else []
        if proc.returncode != 0 or not any(n.startswith(f"kafka_2.13-{version}") for n in jars):
            raise StackError(
                f"fetching Kafka {version} with Maven failed (exit {proc.returncode}): {' '.join(cmd)}\n"
                f"last lines of {mvn_log}:\n{tail(mvn_log)}"
            )
        scratch.rename(libs)
        (libs / _MARKER).write_text("\n".join(jars) + "\n")
        progress(f"fetched {len(jars)} jars in {time.monotonic() - started:.0f} s")
    return libs
