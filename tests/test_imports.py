"""Imports run one way (mountfs at the bottom, replicator above it, daemon above that, the
command lines composed on top), and a command loads only what it uses: checked in fresh
interpreters, from sys.modules, not from timings."""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("mountfs", "replicator", "daemon", "cmdline")
HEAVY = ("replicator", "daemon", "pyspark", "py4j", "trio", "pyfuse3", "httpx", "lmdb",
         "blake3", "tqdm", "prometheus_client")


def loaded_after(code: str) -> set[str]:
    """Top-level packages in sys.modules after running ``code`` in a fresh interpreter."""
    res = subprocess.run([sys.executable, "-c", code + "\nimport sys\n"
                          "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    return set(res.stdout.split())


def test_the_create_command_loads_neither_replicator_daemon_spark_trio_nor_fuse():
    loaded = loaded_after("from cmdline.snapctl import main\n"
                          "main.get_command(None, 'create')")
    assert loaded.isdisjoint(HEAVY), sorted(loaded & set(HEAVY))


def test_a_snapshot_taken_by_snapctl_create_loads_no_store_code(mounted):
    """Running, not only loading: the client checks the name and asks the mount, so LMDB,
    the hashes and the rest of the store (snapshots, namespace) stay unloaded; they were
    two thirds of its imports while it read the daemon's name form from them."""
    code = (f"import sys\nsys.argv = ['snapctl', '-m', {str(mounted.mnt)!r}, 'create', 's1']\n"
            "from cmdline.snapctl import main\n"
            "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n")
    res = subprocess.run([sys.executable, "-c", code + "print(' '.join(sorted(sys.modules)))"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert res.returncode == 0 and res.stdout.startswith("created snapshot s1"), res
    modules = set(res.stdout.splitlines()[-1].split())
    assert {m.split(".")[0] for m in modules}.isdisjoint(HEAVY), sorted(modules)
    assert {"mountfs.snapshots", "mountfs.namespace", "mountfs.store"}.isdisjoint(modules)
    # Nor the mount process's code: finding the mount is mountinfo's, the control socket's
    # server side controlserver's (with them came subprocess and logging: 10 ms of 110).
    assert {"mountfs.mount", "mountfs.controlserver", "subprocess", "logging"}.isdisjoint(
        modules), sorted({"mountfs.mount", "mountfs.controlserver", "subprocess",
                          "logging"} & modules)


@pytest.mark.parametrize("command, allowed", [
    ("replicate", {"replicator", "lmdb", "blake3"}),        # the machinery loads when it runs
    ("status", {"daemon", "lmdb", "blake3"}),
])
def test_other_commands_load_only_their_own_package(command, allowed):
    loaded = loaded_after(f"from cmdline.snapctl import main\n"
                          f"main.get_command(None, {command!r})")
    assert loaded.isdisjoint(set(HEAVY) - allowed), sorted(loaded & (set(HEAVY) - allowed))


def imported_packages(package: str) -> dict[str, set[str]]:
    """For each module of ``package``, the top-level packages it imports (anywhere in it,
    also inside functions)."""
    out = {}
    for path in (ROOT / package).glob("*.py"):
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
        out[path.name] = found
    return out


@pytest.mark.parametrize("package, above", [
    ("mountfs", {"replicator", "daemon", "cmdline"}),
    ("replicator", {"daemon", "cmdline"}),
    ("daemon", {"cmdline"}),
])
def test_no_package_imports_one_above_it(package, above):
    wrong = {name: sorted(found & above)
             for name, found in imported_packages(package).items() if found & above}
    assert not wrong, f"{package} imports upwards: {wrong}"


def test_the_modules_snapctl_create_loads_start_from_current_bytecode():
    """scripts/setup.sh compiles the packages: where writing bytecode is off
    (PYTHONDONTWRITEBYTECODE), an editable install would otherwise compile every module
    again at each start of a command that has 100 ms for all it does."""
    res = subprocess.run([sys.executable, "-c", "from cmdline.snapctl import main\n"
                          "main.get_command(None, 'create')\nimport sys\n"
                          "print('\\n'.join(m.__file__ for m in list(sys.modules.values())\n"
                          "    if getattr(m, '__file__', None)))"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT,
                         env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    assert res.returncode == 0, res.stderr
    ours = [Path(f) for f in res.stdout.split("\n") if f.endswith(".py")
            and Path(f).is_relative_to(ROOT) and Path(f).relative_to(ROOT).parts[0] in PACKAGES]
    assert ours
    stale = [str(f.relative_to(ROOT)) for f in ours if not current_bytecode(f)]
    assert not stale, f"no current bytecode for {stale}: run scripts/setup.sh"


def current_bytecode(source: Path) -> bool:
    """Whether ``source`` has a .pyc that its import takes as it is (the header's magic,
    and the source's mtime and size, as a timestamp-checked pyc records them)."""
    cached = Path(importlib.util.cache_from_source(str(source)))
    try:
        head = cached.read_bytes()[:16]
    except FileNotFoundError:
        return False
    st = source.stat()
    return (head[:4] == importlib.util.MAGIC_NUMBER and head[4:8] == bytes(4)
            and int.from_bytes(head[8:12], "little") == int(st.st_mtime) & 0xFFFFFFFF
            and int.from_bytes(head[12:16], "little") == st.st_size & 0xFFFFFFFF)

