"""RSS one scrape can cost the relay (not a test; numbers for the README's memory bounds).

    python bench/scrape_memory_bench.py [--mib 8] [--sample-limit 200000 0]

For each body kind (``a 1`` lines: one series repeated; ``distinct``: one new series per 36-byte line)
and each sample limit: a fresh Python process builds the relay's own ``TargetLoop`` (scrape -> parse ->
shape), scrapes the body once from an ``http.server`` in another process, and reports the growth of its
peak RSS (``ru_maxrss``) over the scrape, and that per MiB of body. A fresh process per case, because
peak RSS never comes down.
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

MiB = 1 << 20
KINDS = ("a1", "distinct")


def write_body(path: Path, kind: str, size: int) -> None:
    with path.open("w") as f:
        if kind == "a1":
            f.write("a 1\n" * (size // 4))
            return
        written = i = 0
        while written < size:
            line = f'node_thing_total{{id="{i}"}} {i}\n'
            f.write(line)
            written += len(line)
            i += 1


def one_case(url: str, sample_limit: int) -> dict[str, float]:
    """Runs in the child: one scrape of ``url`` through the relay's TargetLoop."""
    from edge_relay.collect.targets import TargetLoop
    from edge_relay.selfmetrics import RelayMetrics
    from edge_relay.settings import Target

    settings = SimpleNamespace(
        sample_limit=sample_limit,
        timeout_seconds=30.0,
        body_limit_bytes=256 * MiB,
        cluster="c",
        node="n",
        add_node_labels=True,
        external_labels={},
    )
    loop = TargetLoop(Target("t", url, "t", "n:1", "auto", {}), settings, RelayMetrics())  # type: ignore[arg-type]
    gc.collect()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.monotonic()
    shaped = loop.run_once()
    elapsed = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "rss_before_mib": before / 1024,
        "growth_mib": (after - before) / 1024,
        "samples_kept": len(shaped),
        "seconds": elapsed,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=8, help="body size in MiB")
    ap.add_argument("--sample-limit", type=int, nargs="+", default=[200_000, 0])
    ap.add_argument("--child", nargs=2, metavar=("URL", "LIMIT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(one_case(args.child[0], int(args.child[1]))))
        return
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for kind in KINDS:
            write_body(root / f"{kind}.prom", kind, args.mib * MiB)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = subprocess.Popen(
            [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port), "--directory", tmp],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            time.sleep(1.0)
            head = "| sample_limit | samples kept | RSS growth MiB | per body MiB | seconds |"
            print(f"| body ({args.mib} MiB) {head}")
            print("| --- | ---: | ---: | ---: | ---: | ---: |")
            for kind in KINDS:
                for limit in args.sample_limit:
                    out = subprocess.run(
                        [
                            sys.executable,
                            __file__,
                            "--child",
                            f"http://127.0.0.1:{port}/{kind}.prom",
                            str(limit),
                        ],
                        capture_output=True,
                        text=True,
                        check=True,
                    )
                    r = json.loads(out.stdout.strip().splitlines()[-1])
                    print(
                        f"| {kind} | {limit} | {r['samples_kept']} | {r['growth_mib']:.1f} | "
                        f"{r['growth_mib'] / args.mib:.1f} | {r['seconds']:.2f} |"
                    )
        finally:
            server.kill()
            server.wait()


if __name__ == "__main__":
    main()
