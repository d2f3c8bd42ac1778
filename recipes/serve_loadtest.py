"""Open-loop load test of recipes/serve.py on 127.0.0.1: the service with adaptation on against the same service with
adaptation off (``--no-adapt``), at fixed request rates, in alternating blocks.

Both services run in their own processes (``python recipes/serve.py --port P [--no-adapt]``: the emoji benchmark's
shipped model, its 2,972 captions as the gallery; adaptation on = the answering process plus its spawned adapting
process) and are warmed up. Then, for each ``--rates`` value, each service gets ``--rounds`` alternating blocks (on,
off, on, off, ...: load from other users of the machine hits both alike) of ``--requests`` image queries in all (one
corruption of the emoji queries, in a seeded order), sent *open loop*: request i is due at ``i / rate`` s whatever the
answers do, and its latency counts from its due time (a stalled service cannot slow the client down and hide it).
After each block of the adapting service the script waits until it has adapted on what it owes (so that its backlog
never takes CPU from the other service's block). The run is bounded (a per-request timeout, ``--max-seconds``), and
nothing leaves the machine.

Reports per rate and service: p50 / p95 / p99 latency, errors, the adapted share (queries adapted on by the end of the
blocks / queries answered), the dropped share (the bounded queue's drops), the published state's age at answer time
(p50 / p95 over the answers with an adapted state) and R@1; the on/off ratios; one row per request (``--rows``).

    python recipes/serve_loadtest.py --rates 20 40 --requests 400 --rounds 4 --rows loadtest.csv

**Capacity** (``--capacity-p99-ms B``, issue 49): each service alone (the other idle) climbs the ascending ``--rates``
ladder, ``--requests`` requests per rate (at least 2,000 for a p99 worth reading), and stops at the first rate whose
p99 exceeds ``B`` ms or that loses a request; its capacity is the highest rate it sustained (:func:`capacity`). The
ladder runs ``--repeats`` times (services in alternating order), each cell with the machine's load average; then both
services answer at half the no-adapt service's median capacity, for the p99 ratio there. One row per request
(``--rows``) and one per cell (``--cells``) recompute every figure.

    python recipes/serve_loadtest.py --capacity-p99-ms 250 --rates 15 20 25 30 35 --requests 2000 --repeats 3 \
        --rows capacity.csv --cells capacity-cells.csv
"""

from __future__ import annotations

import argparse
import base64
import csv
import gzip
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
FIELDS = ["rate", "service", "i", "query", "status", "latency_ms", "version", "state_age_s", "queued", "top1"]


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
            if client.get("/readyz", timeout=2).status_code == 200:
                return
        except Exception:  # noqa: BLE001 - not listening yet
            pass
        time.sleep(0.5)
    raise TimeoutError("the service was not ready in time")


def run_open_loop(port: int, payloads: dict[int, str], order: np.ndarray, rate: float, concurrency: int, deadline: float) -> list[dict]:
    """Request i (``payloads[order[i]]``) is due at ``i / rate`` s; ``concurrency`` client threads send them. One row
    per request, latency from its due time."""
    import httpx

    rows: list[dict] = []
    lock, counter = threading.Lock(), iter(range(len(order)))
    start = time.perf_counter() + 0.1

    def worker() -> None:
        with httpx.Client(base_url=f"http://{HOST}:{port}", timeout=30) as client:
            while time.monotonic() < deadline:
                with lock:
                    i = next(counter, None)
                if i is None:
                    return
                q, due = int(order[i]), start + i / rate
                time.sleep(max(0.0, due - time.perf_counter()))
                try:
                    r = client.post("/search", json={"image": payloads[q], "k": 1})
                    status, body = r.status_code, (r.json() if r.status_code == 200 else {})
                except httpx.TransportError:
                    status, body = 599, {}
                latency = time.perf_counter() - due
                with lock:
                    rows.append({"i": i, "query": q, "status": status, "latency_ms": 1000 * latency,
                                 "version": body.get("version", -1), "state_age_s": body.get("state_age_s"),
                                 "queued": int(bool(body.get("queued_for_adaptation"))), "top1": (body.get("ids") or [-1])[0]})

    with ThreadPoolExecutor(concurrency) as pool:
        for f in [pool.submit(worker) for _ in range(concurrency)]:
            f.result()
    return sorted(rows, key=lambda r: r["i"])


def start_service(adapt: bool, port: int, args) -> subprocess.Popen:
    cmd = [sys.executable, str(REPO / "recipes" / "serve.py"), "--port", str(port), "--no-access-log",
           "--worker-nice", str(args.worker_nice), "--worker-idle" if args.worker_idle else "--no-worker-idle"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen(cmd + ([] if adapt else ["--no-adapt"]), env=env)


def wait_drained(client, deadline: float) -> None:
    """Until the adapting service has adapted on every batch it owes (fewer than its min batch may stay queued)."""
    while time.monotonic() < deadline:
        if client.get("/health").json()["drained"]:
            return
        time.sleep(0.1)


def adapted_queries(client) -> tuple[int, int]:
    health = client.get("/health").json()
    return int(health["adapted"].get("queries", 0)), sum(health["queue"]["dropped"].values())


def summarise(rows: list[dict], captions_of: list[list[int]]) -> dict:
    """p50/p95/p99 latency (ms), errors, state age p50/p95 (s, answers from an adapted state) and R@1 of ``rows``."""
    ok = [r for r in rows if r["status"] == 200]
    lat = np.array([r["latency_ms"] for r in ok]) if ok else np.array([np.nan])
    ages = np.array([float(r["state_age_s"]) for r in ok if r.get("state_age_s") not in (None, "")])
    hits = [r["top1"] in captions_of[r["query"]] for r in ok]
    return {"n": len(ok), "errors": len(rows) - len(ok), "p50": float(np.percentile(lat, 50)),
            "p95": float(np.percentile(lat, 95)), "p99": float(np.percentile(lat, 99)),
            "age50": float(np.percentile(ages, 50)) if ages.size else float("nan"),
            "age95": float(np.percentile(ages, 95)) if ages.size else float("nan"),
            "r1": 100 * float(np.mean(hits)) if hits else float("nan")}


def capacity(cells: list[dict], bound_ms: float) -> float:
    """The highest rate of an ascending ladder of ``cells`` (``rate``, ``p99`` ms, ``errors``) that every rate up to
    it sustained (p99 at most ``bound_ms``, no request lost); 0 when the first rate fails."""
    best = 0.0
    for cell in sorted(cells, key=lambda c: c["rate"]):
        if cell["errors"] or not cell["p99"] <= bound_ms:
            break
        best = cell["rate"]
    return best


def capacity_run(args, services, clients, payloads, order, captions_of, deadline, request_rows: list[dict]) -> list[dict]:
    """The capacity ladder of every service, ``args.repeats`` times, then both at half the no-adapt capacity; one
    summary per cell (with the load average at its end); the request rows are appended to ``request_rows``."""
    cells: list[dict] = []
    used = 0

    def cell(label: str, port: int, rate: float, repeat: int, kind: str) -> dict:
        nonlocal used
        part = order[used : used + args.requests]
        used += args.requests
        got = run_open_loop(port, payloads, part, rate, args.concurrency, deadline)
        request_rows.extend({**x, "service": label, "rate": rate} for x in got)
        if label == "adaptation on":
            wait_drained(clients[label], deadline)
        out = {"kind": kind, "repeat": repeat, "service": label, "rate": rate, "load1": os.getloadavg()[0],
               **summarise(got, captions_of)}
        cells.append(out)
        return out

    for repeat in range(args.repeats):
        labels = list(services) if repeat % 2 == 0 else list(reversed(services))
        for label in labels:
            for rate in sorted(args.rates):
                c = cell(label, services[label][1], rate, repeat, "ladder")
                if c["errors"] or not c["p99"] <= args.capacity_p99_ms:
                    break
            time.sleep(args.cooldown)  # the next ladder starts on a machine at rest, not behind an overloaded rung
    caps = [capacity([c for c in cells if c["kind"] == "ladder" and c["repeat"] == r and c["service"] == "adaptation off"],
                     args.capacity_p99_ms) for r in range(args.repeats)]
    half = float(np.median(caps)) / 2
    if half > 0:
        for label in services:
            cell(label, services[label][1], half, 0, "half")
    return cells


def read_cells(path: str) -> list[dict]:
    """The cells a capacity run wrote (``--cells``), numbers as numbers."""
    with open(path, newline="") as fh:
        return [{k: v if k in ("kind", "service") else float(v) for k, v in row.items()} for row in csv.DictReader(fh)]


def capacity_table(cells: list[dict], bound_ms: float, repeats: int) -> str:
    """The capacity summary of ``cells`` (what the capacity mode prints; the serving card quotes it)."""
    lines = [f"capacity: the highest rate with p99 <= {bound_ms:g} ms and no request lost, each ladder alone",
             "| service | capacity per repeat (req/s) | median | load average during the ladders |", "|---|---|---|---|"]
    med = {}
    for label in ("adaptation on", "adaptation off"):
        ladders = [[c for c in cells if c["kind"] == "ladder" and int(c["repeat"]) == r and c["service"] == label]
                   for r in range(repeats)]
        caps = [capacity(cs, bound_ms) for cs in ladders]
        med[label] = float(np.median(caps))
        loads = [float(c["load1"]) for cs in ladders for c in cs]
        lines.append(f"| {label} | {', '.join(f'{c:g}' for c in caps)} | {med[label]:g} | {min(loads):.1f}-{max(loads):.1f} |")
    if med["adaptation off"] > 0:
        lines.append(f"capacity ratio on/off: {med['adaptation on'] / med['adaptation off']:.2f}")
    half = {c["service"]: c for c in cells if c["kind"] == "half"}
    if len(half) == 2:
        a, b = half["adaptation on"], half["adaptation off"]
        lines.append(f"at half the no-adapt capacity ({float(a['rate']):g}/s): p50 {a['p50'] / b['p50']:.2f}x, "
                     f"p95 {a['p95'] / b['p95']:.2f}x, p99 {a['p99'] / b['p99']:.2f}x (adaptation on / off)")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rates", type=float, nargs="+", default=[20.0, 40.0], help="requests/s, open loop")
    p.add_argument("--requests", type=int, default=400, help="per service and rate")
    p.add_argument("--rounds", type=int, default=4, help="alternating blocks per service and rate")
    p.add_argument("--concurrency", type=int, default=16, help="client threads (enough that requests go out when due)")
    p.add_argument("--warmup", type=int, default=64)
    p.add_argument("--shift", default="defocus_blur")
    p.add_argument("--severity", type=int, default=3)
    p.add_argument("--worker-nice", type=int, default=10, help="passed to serve.py")
    p.add_argument("--worker-idle", action=argparse.BooleanOptionalAction, default=True, help="passed to serve.py")
    p.add_argument("--port", type=int, default=8765, help="adaptation on uses PORT, off uses PORT+1")
    p.add_argument("--max-seconds", type=float, default=1800, help="deadline of the whole run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rows", default=None, help="CSV of one row per request")
    p.add_argument("--capacity-p99-ms", type=float, default=None, help="capacity mode: the p99 bound (ms) of a sustained rate")
    p.add_argument("--repeats", type=int, default=3, help="capacity mode: ladders per service")
    p.add_argument("--cells", default=None, help="capacity mode: CSV of one row per cell")
    p.add_argument("--cooldown", type=float, default=20.0, help="capacity mode: seconds of rest after each ladder")
    args = p.parse_args(argv)
    if args.capacity_p99_ms is not None and (args.capacity_p99_ms <= 0 or args.repeats < 1 or args.cooldown < 0):
        p.error("--capacity-p99-ms must be positive, --repeats at least 1 and --cooldown >= 0")
    if args.requests < 1 or args.concurrency < 1 or args.warmup < 0 or not 1 <= args.rounds <= args.requests or min(args.rates) <= 0:
        p.error("--requests, --concurrency and --rates must be positive, --warmup >= 0, 1 <= --rounds <= --requests")
    import httpx

    from hf_tta.benchmarks import load_emoji_benchmark
    from hf_tta.benchmarks.emoji import query_images
    from hf_tta.benchmarks.source_model import weights_input_side

    bench = load_emoji_benchmark()
    images = query_images(bench, args.shift, args.severity, input_side=weights_input_side(), seed=args.seed)
    rng = np.random.default_rng(args.seed)
    cells_max = len(args.rates) if args.capacity_p99_ms is None else 2 * len(args.rates) * args.repeats + 2
    need = args.warmup + args.requests * cells_max
    order = np.concatenate([rng.permutation(len(images)) for _ in range(-(-need // len(images)))])
    warm, order = order[: args.warmup], order[args.warmup : need]
    payloads = {int(q): encode_png(images[q]) for q in np.unique(np.concatenate([warm, order]))}
    services = {"adaptation on": (True, args.port), "adaptation off": (False, args.port + 1)}
    procs = {label: start_service(adapt, port, args) for label, (adapt, port) in services.items()}
    rows: list[dict] = []
    shares: dict[float, tuple[float, float]] = {}
    deadline = time.monotonic() + args.max_seconds
    try:
        clients = {label: httpx.Client(base_url=f"http://{HOST}:{port}", timeout=30) for label, (_, port) in services.items()}
        for label, (_, port) in services.items():
            wait_ready(clients[label], procs[label], deadline)
            run_open_loop(port, payloads, warm, max(args.rates), args.concurrency, deadline)
        on = clients["adaptation on"]
        wait_drained(on, deadline)
        if args.capacity_p99_ms is not None:
            cells = capacity_run(args, services, clients, payloads, order, bench.image_to_captions, deadline, rows)
        for r, rate in enumerate(args.rates if args.capacity_p99_ms is None else []):
            part = order[r * args.requests : (r + 1) * args.requests]
            adapted0, dropped0 = adapted_queries(on)
            for block in np.array_split(np.arange(len(part)), args.rounds):
                for label, (_, port) in services.items():
                    got = run_open_loop(port, payloads, part[block], rate, args.concurrency, deadline)
                    rows += [{**x, "i": int(block[x["i"]]), "service": label, "rate": rate} for x in got]
                    if label == "adaptation on":
                        wait_drained(on, deadline)
            adapted1, dropped1 = adapted_queries(on)
            shares[rate] = ((adapted1 - adapted0) / len(part), (dropped1 - dropped0) / len(part))
    finally:
        for proc in procs.values():
            proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    if args.capacity_p99_ms is not None:
        print(capacity_table(cells, args.capacity_p99_ms, args.repeats))
        if args.cells:
            with open(args.cells, "w", newline="") as fh:
                writer = csv.DictWriter(fh, fieldnames=list(cells[0]))
                writer.writeheader()
                writer.writerows(cells)
    else:
        print_open_loop(args, rows, shares, bench.image_to_captions, services)
    if args.rows:
        with open(args.rows, "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=FIELDS)
            writer.writeheader()
            writer.writerows(rows)


def open_loop_table(rows: list[dict], shares: dict, captions_of: list[list[int]], services, rates) -> str:
    """The open-loop table of ``rows`` (one per request) per rate and service, with the on/off ratios; ``shares``
    (rate -> (adapted share, dropped share)) is read from ``/health`` during the run, not from the rows."""
    lines = ["| rate/s | service | answered | errors | p50 ms | p95 ms | p99 ms | adapted share | dropped | state age p50/p95 s | R@1 |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for rate in rates:
        stats = {label: summarise([x for x in rows if x["rate"] == rate and x["service"] == label], captions_of) for label in services}
        for label, s in stats.items():
            on = label == "adaptation on"
            share = f"{100 * shares[rate][0]:.1f} %" if on else "—"
            dropped = f"{100 * shares[rate][1]:.1f} %" if on else "—"
            age = f"{s['age50']:.2f} / {s['age95']:.2f}" if on else "—"
            lines.append(f"| {rate:g} | {label} | {s['n']} | {s['errors']} | {s['p50']:.1f} | {s['p95']:.1f} | {s['p99']:.1f} | {share} "
                         f"| {dropped} | {age} | {s['r1']:.1f} |")
        a, b = stats["adaptation on"], stats["adaptation off"]
        lines.append(f"| {rate:g} | ratio on/off | | | {a['p50'] / b['p50']:.2f}x | {a['p95'] / b['p95']:.2f}x | {a['p99'] / b['p99']:.2f}x | | | | |")
    return "\n".join(lines)


def read_rows(path) -> list[dict]:
    """The request rows of a ``--rows`` CSV (plain or ``.gz``), typed as the run wrote them."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", newline="") as fh:
        return [{**r, "rate": float(r["rate"]), "status": int(r["status"]), "latency_ms": float(r["latency_ms"]),
                 "query": int(r["query"]), "top1": int(r["top1"]), "state_age_s": r["state_age_s"] or None}
                for r in csv.DictReader(fh)]


def print_open_loop(args, rows: list[dict], shares: dict, captions_of: list[list[int]], services: dict) -> None:
    print(f"open loop, {args.requests} requests per service and rate in {args.rounds} alternating blocks, {args.shift} "
          f"{args.severity}, serve.py defaults (batch 32, min batch 8, max wait 1 s), worker nice +{args.worker_nice}"
          f"{', SCHED_IDLE' if args.worker_idle else ''}")
    print(open_loop_table(rows, shares, captions_of, services, args.rates))

if __name__ == "__main__":
    main()
