"""Load test of recipes/serve.py on 127.0.0.1: the service with adaptation on against the same service with it off.

Both services are started in their own processes (``python recipes/serve.py --port P [--no-adapt]``, the emoji
benchmark's shipped model, its 2,972 captions as the gallery) and warmed up; then each is sent the same ``--requests``
image queries (one corruption of the emoji queries, in a seeded order) by ``--concurrency`` client threads, in
``--rounds`` alternating blocks (on, off, on, off, ...: load from other users of the machine hits both alike; after
each block the adapting service finishes its backlog before the other block starts, so it never slows the baseline);
then both are stopped (SIGINT: graceful). The run is bounded: a fixed number of requests, a per-request timeout and a
``--max-seconds`` deadline. Nothing leaves the machine (the address is fixed to 127.0.0.1).

Reports p50 / p99 latency, queries per second and R@1 (each answer's top-1 against the query's captions) per service,
their ratios, and writes one row per request (``--rows``) so the table can be recomputed. The warm-up queries are
adapted on too (adaptation on), as a live service would.

    python recipes/serve_loadtest.py --requests 400 --concurrency 4
"""

from __future__ import annotations

import argparse
import base64
import csv
import io
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

HOST = "127.0.0.1"
REPO = Path(__file__).resolve().parents[1]


def encode_png(image: np.ndarray) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def wait_ready(client, proc: subprocess.Popen, deadline: float) -> None:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the service exited with code {proc.returncode} before it was ready")
        try:
            if client.get("/health", timeout=2).status_code == 200:
                return
        except Exception:  # noqa: BLE001 - not listening yet
            pass
        time.sleep(0.5)
    raise TimeoutError("the service was not ready in time")


def run_load(
    port: int, payloads: list[str], order: np.ndarray, concurrency: int, deadline: float, rate: float = 0.0
) -> tuple[list[dict], float]:
    """Send ``payloads[order[i]]`` for every i from ``concurrency`` threads; one row per request. ``rate`` > 0: request
    i is due at ``i / rate`` s (open loop) and its latency counts from then (waiting for a free client included)."""
    import httpx

    rows: list[dict] = []
    lock, counter = threading.Lock(), iter(range(len(order)))

    def worker() -> None:
        with httpx.Client(base_url=f"http://{HOST}:{port}", timeout=30) as client:
            while time.monotonic() < deadline:
                with lock:
                    i = next(counter, None)
                if i is None:
                    return
                q = int(order[i])
                t0 = time.perf_counter()
                if rate > 0:
                    due = start + i / rate
                    time.sleep(max(0.0, due - t0))
                    t0 = due
                r = client.post("/search", json={"image": payloads[q], "k": 1})
                latency = time.perf_counter() - t0
                body = r.json() if r.status_code == 200 else {}
                with lock:
                    rows.append({"i": i, "query": q, "status": r.status_code, "latency_ms": 1000 * latency,
                                 "version": body.get("version", -1), "top1": (body.get("ids") or [-1])[0]})

    start = time.perf_counter() + (0.05 if rate > 0 else 0.0)
    with ThreadPoolExecutor(concurrency) as pool:
        for f in [pool.submit(worker) for _ in range(concurrency)]:
            f.result()
    return sorted(rows, key=lambda r: r["i"]), time.perf_counter() - start


def start_service(adapt: bool, port: int, args) -> subprocess.Popen:
    cmd = [sys.executable, str(REPO / "recipes" / "serve.py"), "--port", str(port), "--checkpoint-every", "0",
           "--batch-size", str(args.batch_size), "--max-wait", str(args.max_wait), "--worker-nice", str(args.worker_nice)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen(cmd + ([] if adapt else ["--no-adapt"]), env=env)


def wait_idle(client, deadline: float) -> None:
    """Until the service has adapted on every buffered query (its backlog must not slow the other service's block)."""
    while time.monotonic() < deadline:
        health = client.get("/health").json()
        if not health["pending"] and not health["adapting"]:
            return
        time.sleep(0.05)


def serve_and_load(args, payloads, order, warm) -> tuple[dict[str, list[dict]], dict[str, float], dict[str, dict]]:
    """Both services up at once (the idle one takes no CPU); ``--rounds`` alternating blocks of the requests, adaptation
    on first in each round, so that drifting load from other users of the machine hits both alike."""
    import httpx

    services = {"adaptation on": (True, args.port), "adaptation off": (False, args.port + 1)}
    procs = {label: start_service(adapt, port, args) for label, (adapt, port) in services.items()}
    rows: dict[str, list[dict]] = {label: [] for label in services}
    walls = dict.fromkeys(services, 0.0)
    health = {}
    try:
        clients = {label: httpx.Client(base_url=f"http://{HOST}:{port}", timeout=30) for label, (_, port) in services.items()}
        deadline = time.monotonic() + args.max_seconds
        for label in services:
            wait_ready(clients[label], procs[label], deadline)
            run_load(services[label][1], payloads, warm, args.concurrency, deadline)
            wait_idle(clients[label], deadline)
        for block in np.array_split(np.arange(len(order)), args.rounds):
            for label, (_, port) in services.items():
                got, wall = run_load(port, payloads, order[block], args.concurrency, deadline, args.rate)
                rows[label] += [{**r, "i": int(block[r["i"]]), "service": label} for r in got]
                walls[label] += wall
                wait_idle(clients[label], deadline)
        health = {label: c.get("/health").json() for label, c in clients.items()}
    finally:
        for proc in procs.values():
            proc.send_signal(signal.SIGINT)
        for proc in procs.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    return rows, walls, health


def summarise(rows: list[dict], wall: float, captions_of: list[list[int]]) -> dict:
    ok = [r for r in rows if r["status"] == 200]
    lat = np.array([r["latency_ms"] for r in ok])
    hits = [r["top1"] in captions_of[r["query"]] for r in ok]
    return {"n": len(ok), "errors": len(rows) - len(ok), "p50": float(np.percentile(lat, 50)),
            "p99": float(np.percentile(lat, 99)), "qps": len(ok) / wall, "r1": 100 * float(np.mean(hits))}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--warmup", type=int, default=32)
    p.add_argument("--rate", type=float, default=0.0, help="requests/s, open loop (0: closed loop, as fast as answered)")
    p.add_argument("--rounds", type=int, default=4, help="alternating blocks of requests per service")
    p.add_argument("--shift", default="defocus_blur")
    p.add_argument("--severity", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--max-wait", type=float, default=0.05)
    p.add_argument("--worker-nice", type=int, default=10, help="passed to serve.py")
    p.add_argument("--port", type=int, default=8765, help="adaptation on uses PORT, off uses PORT+1")
    p.add_argument("--max-seconds", type=float, default=900, help="deadline per service (start + load)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rows", default=None, help="CSV of one row per request")
    args = p.parse_args(argv)
    if args.requests < 1 or args.concurrency < 1 or args.warmup < 0 or not 1 <= args.rounds <= args.requests:
        p.error("--requests and --concurrency must be positive, --warmup >= 0, 1 <= --rounds <= --requests")
    from hf_tta.benchmarks import load_emoji_benchmark
    from hf_tta.benchmarks.emoji import query_images
    from hf_tta.benchmarks.source_model import weights_input_side

    bench = load_emoji_benchmark()
    images = query_images(bench, args.shift, args.severity, input_side=weights_input_side(), seed=args.seed)
    rng = np.random.default_rng(args.seed)
    order = np.concatenate([rng.permutation(len(images)) for _ in range(-(-(args.requests + args.warmup) // len(images)))])
    warm, order = order[: args.warmup], order[args.warmup : args.warmup + args.requests]
    payloads = {}
    for q in np.unique(np.concatenate([warm, order])):
        payloads[int(q)] = encode_png(images[q])
    rows, walls, health = serve_and_load(args, payloads, order, warm)
    stats = {label: {**summarise(rows[label], walls[label], bench.image_to_captions), "batches": health[label]["batches_adapted"]}
             for label in rows}
    all_rows = [r for label in rows for r in rows[label]]
    on, off = stats["adaptation on"], stats["adaptation off"]
    print(f"{args.requests} requests per service in {args.rounds} alternating rounds at concurrency {args.concurrency}, {args.shift} {args.severity}, batch {args.batch_size}, "
          f"max_wait {args.max_wait}, worker nice +{args.worker_nice}, "
          f"{'rate %g/s' % args.rate if args.rate else 'closed loop'}")
    print("| service | requests | errors | p50 ms | p99 ms | queries/s | R@1 | batches adapted |")
    print("|---|---|---|---|---|---|---|---|")
    for label, s in stats.items():
        print(f"| {label} | {s['n']} | {s['errors']} | {s['p50']:.1f} | {s['p99']:.1f} | {s['qps']:.1f} | {s['r1']:.1f} | {s['batches']} |")
    print(f"ratios on/off: p50 {on['p50'] / off['p50']:.2f}x, p99 {on['p99'] / off['p99']:.2f}x, queries/s {on['qps'] / off['qps']:.2f}x")
    if args.rows:
        with open(args.rows, "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=["service", "i", "query", "status", "latency_ms", "version", "top1"])
            writer.writeheader()
            writer.writerows(all_rows)


if __name__ == "__main__":
    main()
