"""A fork server for the mutants' test runs (``tools/mutation/run.py``): cosmic-ray starts its test command once per
mutant, and a fresh ``python -m pytest`` spends most of its time importing pytest, numpy, pydantic, boto3 and the
tree's own modules. So the server runs the unmutated tests once (in a child), imports what they imported, except
the mutated module, every module of the tree that imports it (directly or through others: an import statement
anywhere in a module counts) and the tests, and then forks a child per request that runs ``pytest.main``
in-process: the mutated module and everything that binds its objects are imported fresh in every child, from
disk, exactly as in a new process.

    python tools/mutation/forkserver.py serve SOCKET MODULE_PATH PYTEST_ARGS...  # in the copy's root
    python -S tools/mutation/forkserver.py client SOCKET              # the test command: the child's exit status

No bytecode is written by the children (``sys.dont_write_bytecode``), so a mutant never leaves a ``.pyc`` a later
mutant of the same size and second could be taken for. A client that goes away (cosmic-ray's timeout kills it)
takes its child with it.
"""

from __future__ import annotations

import ast
import os
import resource
import select
import signal
import socket
import sys
import time

ERROR = "FORKSERVER-ERROR:"
"""Printed by a client that got no answer: ``run.py`` counts such a mutant as an error, never as killed."""


def _run_pytest(args: list[str], quiet: bool) -> int:
    import pytest

    if quiet:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
    return int(pytest.main(args))


MEMORY_HEADROOM = 3 << 30
"""Address space a child may add to the server's: a mutant such as ``x ** MASK`` in place of ``x & MASK`` fails
with a MemoryError at once instead of taking the machine's memory (or the whole timeout)."""


def _limit_memory() -> None:
    with open("/proc/self/status") as f:
        vm = next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:")), 0)
    if vm:
        resource.setrlimit(resource.RLIMIT_AS, (vm + MEMORY_HEADROOM, vm + MEMORY_HEADROOM))


def _imported(root: str) -> list[str]:
    """``name<TAB>path`` of every imported module, in import order (path empty for built-in ones)."""
    out = []
    for name, mod in list(sys.modules.items()):
        path = getattr(mod, "__file__", None) or ""
        out.append(f"{name}\t{os.path.abspath(path) if path else ''}")
    return out


def _imports_of(name: str, path: str, is_package: bool) -> set[str]:
    """Every module ``path`` names in an import statement anywhere in it (conservative: function-level imports
    too), plus its parent packages."""
    with open(path, "rb") as f:
        tree = ast.parse(f.read())
    package = name if is_package else name.rpartition(".")[0]
    out = {name.rsplit(".", k)[0] for k in range(1, name.count(".") + 1)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parent = ".".join(parts[: len(parts) - node.level + 1])
                base = f"{parent}.{base}" if base else parent
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


def preloadable(modules: list[tuple[str, str]], root: str, target: str) -> list[str]:
    """The modules the server may import once: not from ``tests/``, and neither the mutated module ``target``
    (a path under ``root``) nor any module of the tree that imports it, directly or through others (those must
    bind the mutated module's objects, so each child imports them afresh)."""
    tree = {n: p for n, p in modules if p.startswith(root) and os.path.isfile(p)}
    target_path = os.path.abspath(os.path.join(root, target))
    tainted = {n for n, p in tree.items() if p == target_path}
    deps = {n: _imports_of(n, p, os.path.basename(p) == "__init__.py") & tree.keys() for n, p in tree.items()
            if p.endswith(".py")}
    changed = True
    while changed:
        changed = False
        for n, d in deps.items():
            if n not in tainted and d & tainted:
                tainted.add(n)
                changed = True
    tests = os.path.join(root, "tests") + os.sep
    return [n for n, p in modules if n != "__main__" and not n.startswith("conftest") and n not in tainted
            and not p.startswith(tests) and (not p.startswith(root) or n in deps)]


def serve(sock_path: str, target: str, args: list[str]) -> int:
    root = os.path.abspath(os.getcwd()) + os.sep
    sys.path.insert(0, os.getcwd())
    # The unmutated run, in a child: it must pass, and it tells which modules to import here. It may write
    # bytecode (the tree is unmutated), so the children start from compiled test modules.
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        rc = _run_pytest(args, quiet=False)
        with os.fdopen(w, "w") as f:
            f.write("\n".join(_imported(root)))
        os._exit(rc)
    os.close(w)
    with os.fdopen(r) as f:
        modules = [(ln.split("\t")[0], ln.split("\t")[1]) for ln in f.read().splitlines() if "\t" in ln]
    _, status = os.waitpid(pid, 0)
    rc = os.waitstatus_to_exitcode(status)
    if rc != 0:
        print(f"forkserver: the unmutated tests fail (exit {rc})", file=sys.stderr, flush=True)  # noqa: T201
        return rc
    names = preloadable(modules, root, target)
    print(f"forkserver: {len(names)} of {len(modules)} modules imported once; the children import the rest",  # noqa: T201
          flush=True)
    for name in names:
        try:
            __import__(name)
        except BaseException:  # noqa: BLE001 - a module that cannot be imported on its own is imported by the child
            pass
    import pytest  # noqa: F401

    sys.dont_write_bytecode = True
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(sock_path + ".tmp")
    server.listen(4)
    os.rename(sock_path + ".tmp", sock_path)  # ready
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        conn, _ = server.accept()
        with conn:
            pid = os.fork()
            if pid == 0:
                server.close()
                conn.close()
                os.setsid()
                _limit_memory()
                os._exit(_run_pytest(args, quiet=True))
            while True:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    rc = os.waitstatus_to_exitcode(status)
                    try:
                        conn.sendall(f"{rc}\n".encode())
                    except OSError:
                        pass
                    break
                readable, _, _ = select.select([conn], [], [], 0.02)
                if readable and not conn.recv(1):  # the client went away (timed out): stop the child
                    try:
                        os.killpg(pid, signal.SIGKILL)
                    except OSError:
                        os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    break


def client(sock_path: str) -> int:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    for _ in range(100):
        try:
            conn.connect(sock_path)
            break
        except OSError:
            time.sleep(0.1)
    else:
        print(f"{ERROR} no server at {sock_path}", flush=True)  # noqa: T201
        return 3
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(64)
        if not chunk:
            print(f"{ERROR} the server closed the connection", flush=True)  # noqa: T201
            return 3
        data += chunk
    return int(data)


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        sys.exit(serve(sys.argv[2], sys.argv[3], sys.argv[4:]))
    sys.exit(client(sys.argv[2]))
