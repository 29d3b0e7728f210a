"""How long `snapctl create` takes as a command, against what no command can beat.

On a fresh store mounted in a temporary directory, in one run: the interpreter alone
(`python -c pass`), the interpreter importing click (the CLI library every command loads),
and `snapctl create` itself, N times each, interleaved; medians and p90 in ms, and the ratio
of `snapctl create` to the interpreter floor. The import tree of the create path is printed
too (the modules over 1 ms), so a regression names its module.

    .venv/bin/python scripts/bench_snapctl.py [--runs 40] [--bin .venv/bin]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def timed(args: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(args, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return (time.perf_counter() - started) * 1000


def summary(times: list[float]) -> str:
    ordered = sorted(times)
    return (f"median {statistics.median(ordered):7.1f}  p90 "
            f"{ordered[int(len(ordered) * 0.9)]:7.1f}  min {ordered[0]:7.1f}")


def import_tree(python: str) -> list[str]:
    """The create path's imports that cost over 1 ms (cumulative), as importtime lists them."""
    code = ("try:\n    from cmdline.snapctl import main\n"
            "except ImportError:\n    from mountfs.snapctl import main   # before the split\n"
            "main.get_command(None, 'create')")
    res = subprocess.run([python, "-X", "importtime", "-c", code], capture_output=True,
                         text=True, check=True, cwd="/")      # not the checkout's sources
    rows = []
    for line in res.stderr.splitlines():
        if not line.startswith("import time:") or "cumulative" in line:
            continue
        _, cumulative, name = line.removeprefix("import time:").split("|")
        depth = (len(name) - len(name.lstrip()) - 1) // 2
        if int(cumulative) > 1000 and depth <= 2:
            rows.append(f"{int(cumulative) / 1000:8.1f} ms  {name.rstrip()}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--bin", default=str(Path(sys.executable).parent),
                        help="Where mountfs, snapctl and python are (default: this venv).")
    args = parser.parse_args()
    bindir = Path(args.bin)
    python, snapctl, mountfs = (str(bindir / n) for n in ("python", "snapctl", "mountfs"))
    with tempfile.TemporaryDirectory(prefix="bench-snapctl-") as work:
        store, mnt = os.path.join(work, "store"), os.path.join(work, "mnt")
        os.mkdir(mnt)
        subprocess.run([mountfs, "mkfs", store], check=True, stdout=subprocess.DEVNULL)
        subprocess.run([mountfs, "mount", store, mnt], check=True, stdout=subprocess.DEVNULL)
        try:
            cases = {"python -c pass": [python, "-c", "pass"],
                     "python -c 'import click'": [python, "-c", "import click"],
                     "snapctl create": None}
            times: dict[str, list[float]] = {name: [] for name in cases}
            for i in range(args.runs + 3):
                for name, cmd in cases.items():
                    cmd = cmd or [snapctl, "-m", mnt, "create", f"s{i}"]
                    t = timed(cmd)
                    if i >= 3:                               # three warm-up rounds
                        times[name].append(t)
        finally:
            subprocess.run([mountfs, "umount", mnt], check=True)
    print(f"load average {os.getloadavg()[0]:.2f}, {args.runs} runs each, ms")
    for name, ts in times.items():
        print(f"{name:<26} {summary(ts)}")
    floor = statistics.median(times["python -c pass"])
    print(f"snapctl create / interpreter floor: "
          f"{statistics.median(times['snapctl create']) / floor:.1f}x")
    print("create path imports over 1 ms (cumulative, python -X importtime):")
    print("\n".join(import_tree(python)))


if __name__ == "__main__":
    main()
