#!/usr/bin/env python3
"""dlm-serve under load: N concurrent streaming clients (asyncio tasks of this process) against a ``dlm-serve`` process
on 127.0.0.1, next to sequential single-request serving and plain ``dlm`` (the Python API) on the same prompts.

    python experiments/bench_serve.py                                  # embedded model, 1/4/16/64 clients
    python experiments/bench_serve.py --model random --clients 1,16 --requests 64

Per concurrency level: aggregate output TPS (completion tokens of all requests / wall time of the level), TTFT
(arrival to the first streamed text), TPOT ((latency - TTFT) / (completion tokens - 1)) and ITL (gaps between
streamed chunks) at p50/p99, and the histogram of batch sizes the requests were decoded in. ``sequential`` sends
the same requests one at a time (one client, the server's max_batch_size=1); ``dlm`` decodes them with
``Session.generate`` one prompt at a time, no HTTP. Server overhead per request: one client, non-streaming,
client latency minus the batch's decode time (HTTP, JSON, queue and hand-over between threads), median and p99,
and the same as the server measures it (its answer's ``dlm.overhead``: no client or loopback time).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from collections import Counter

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json  # noqa: E402

PROMPTS = ["347+085=", "901-256=", "name a fruit:", "sum 9:", "12+34=", "name a color:", "77-15=", "sum 4:"]
STREAM = True
RANDOM = ["model=tiny_random", "model.random.d_model=256", "model.random.n_layers=4",
          "model.random.mlp_hidden_size=768", "model.random.n_heads=4"]


def pct(xs, q):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


async def plain_one(client, body):
    """The figures of :func:`stream_one` for a request that is not streamed (TTFT = latency, no chunk gaps)."""
    t0 = time.perf_counter()
    r = await client.post("/v1/completions", json=body)
    if r.status_code != 200:
        raise RuntimeError(r.text)
    d = r.json()
    lat = time.perf_counter() - t0
    return lat, lat, [], d["usage"]["completion_tokens"], d["choices"][0]["dlm"]["batch_size"]


async def stream_one(client, body):
    """(latency, ttft, chunk gaps, completion tokens, batch size) of one streamed request."""
    if not STREAM:
        return await plain_one(client, body)
    t0 = time.perf_counter()
    first, last, gaps, fig = None, None, [], None
    async with client.stream("POST", "/v1/completions", json=dict(body, stream=True,
                                                                  stream_options={"include_usage": True})) as r:
        if r.status_code != 200:
            raise RuntimeError((await r.aread()).decode())
        usage = 0
        async for line in r.aiter_lines():
            if not line.startswith("data:") or "[DONE]" in line:
                continue
            d = json.loads(line[5:])
            if d.get("usage"):
                usage = d["usage"]["completion_tokens"]
            for ch in d.get("choices", []):
                now = time.perf_counter()
                if ch.get("text"):
                    if first is None:
                        first = now
                    else:
                        gaps.append(now - last)
                    last = now
                if ch.get("dlm"):
                    fig = ch["dlm"]
    end = time.perf_counter()
    return end - t0, (first or end) - t0, gaps, usage, fig["batch_size"] if fig else 0


def level(url, bodies, clients):
    """``clients`` concurrent clients (tasks of one asyncio loop, one connection each: threads would spend this
    machine's cores on the GIL) sending ``bodies`` until none is left."""
    import asyncio

    import httpx

    todo = list(bodies)

    async def client(results):
        async with httpx.AsyncClient(base_url=url, timeout=600) as c:
            while todo:
                results.append(await stream_one(c, todo.pop()))

    async def run():
        results = []
        await asyncio.gather(*(client(results) for _ in range(clients)))
        return results

    t0 = time.perf_counter()
    results = asyncio.run(run())
    wall = time.perf_counter() - t0
    lat = [r[0] for r in results]
    ttft = [r[1] for r in results]
    itl = [g for r in results for g in r[2]]
    tpot = [(r[0] - r[1]) / (r[3] - 1) for r in results if r[3] > 1]
    toks = sum(r[3] for r in results)
    return {"requests": len(results), "wall": wall, "tps": toks / wall, "ttft": ttft, "tpot": tpot, "itl": itl,
            "latency": lat, "batches": Counter(r[4] for r in results)}


def overhead(url, bodies):
    """Per request, one client, not streamed: (client latency - decode time, the server's own ``dlm.overhead``:
    arrival in its handler to the answer built, less the decode). The first includes this process's httpx
    client and the loopback TCP; the second is what the server spends."""
    import httpx

    client, server = [], []
    with httpx.Client(base_url=url, timeout=600) as c:
        for body in bodies:
            t0 = time.perf_counter()
            r = c.post("/v1/completions", json=body)
            lat = time.perf_counter() - t0
            d = r.json()
            client.append(lat - d["choices"][0]["dlm"]["decode_time"])
            server.append(d["dlm"]["overhead"])
    return client, server


def show(name, m):
    ms = lambda x: f"{1000 * x:7.1f}"        # noqa: E731
    hist = " ".join(f"{k}:{v}" for k, v in sorted(m["batches"].items()))
    print(f"{name:>12} {m['requests']:5d} {m['tps']:9.1f} {ms(pct(m['ttft'], 50))} {ms(pct(m['ttft'], 99))} "
          f"{ms(pct(m['tpot'], 50))} {ms(pct(m['tpot'], 99))} {ms(pct(m['itl'], 50))} {ms(pct(m['itl'], 99))}  {hist}",
          flush=True)


class Server:
    """``dlm-serve OVERRIDES`` as a subprocess on a free port of 127.0.0.1 (its own interpreter: the clients'
    threads do not share its GIL)."""

    def __init__(self, overrides, out):
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.args = [os.path.join(os.path.dirname(sys.executable), "dlm-serve"), *overrides, f"port={self.port}",
                     f"hydra.run.dir={out}/{self.port}"]

    def __enter__(self):
        import subprocess

        import httpx

        self.proc = subprocess.Popen(self.args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        url = f"http://127.0.0.1:{self.port}"
        for _ in range(1200):
            if self.proc.poll() is not None:
                raise SystemExit(f"dlm-serve exited: {self.proc.stderr.read()}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    return url
            except httpx.TransportError:
                time.sleep(0.1)
        raise SystemExit("dlm-serve did not start in 120 s")

    def __exit__(self, *exc):
        import signal

        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except Exception:
            self.proc.kill()


def engine_only(model, a, prompts, out, size=16, reps=5):
    """The decode worker without HTTP (in this process): median time of a batch of ``size`` requests submitted
    together, against the same requests decoded one at a time by ``dlm``'s path (run_prompts, batch size 1)."""
    from dlm_engine.app.api import run_prompts
    from dlm_engine.app.run import build_cache, build_strategy
    from dlm_engine.serve.cli import ServerThread
    from dlm_engine.serve.config import batch_key
    from dlm_engine.serve.engine import Request

    st = ServerThread(model + ["device=cpu", f"strategy={a.strategy}", f"cache={a.cache}",
                               f"gen_length={a.max_tokens}", f"max_batch_size={size}"], out)
    srv, eng = st.server, st.server.engine
    cfg = srv.configs.get({})
    ids = [srv.lm.encode(p) for p in prompts[:size]]
    eng.start()
    try:
        batch, alone = [], []
        for _ in range(reps):
            done, got = threading.Event(), []

            def emit(kind, payload):
                if kind in ("done", "error"):
                    got.append(payload)
                    if len(got) == len(ids):
                        done.set()

            t0 = time.perf_counter()
            eng.submit([Request(id=str(i), cfg=cfg, key=batch_key(cfg), prompt_ids=x, emit=emit)
                        for i, x in enumerate(ids)])
            done.wait(600)
            batch.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            run_prompts(srv.lm, ids, build_strategy(cfg), build_cache(cfg), a.max_tokens, 1, warmup=False)
            alone.append(time.perf_counter() - t0)
    finally:
        eng.close()
    b, s1 = statistics.median(batch), statistics.median(alone)
    print(f"decode worker without HTTP: {size} requests together {1000 * b:.1f} ms, one at a time (dlm's path) "
          f"{1000 * s1:.1f} ms: {s1 / b:.2f}x", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("tiny", "random"), default="tiny")
    ap.add_argument("--clients", default="1,4,16,64")
    ap.add_argument("--requests", type=int, default=64, help="requests per level")
    ap.add_argument("--strategy", default="threshold")
    ap.add_argument("--cache", default="dual")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--no-stream", action="store_true", help="plain requests (TTFT = latency, no ITL)")
    a = ap.parse_args(argv)
    global STREAM
    STREAM = not a.no_stream

    import tempfile

    import torch

    if a.threads:
        torch.set_num_threads(a.threads)
    model = ["model=tiny"] if a.model == "tiny" else RANDOM
    base = model + ["device=cpu", f"strategy={a.strategy}", f"cache={a.cache}", f"gen_length={a.max_tokens}"]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(a.requests)]
    bodies = [{"prompt": p, "max_tokens": a.max_tokens} for p in prompts]
    print(f"# {a.model} model, strategy={a.strategy} cache={a.cache}, max_tokens={a.max_tokens}, {a.requests} requests "
          f"per level, {'streamed' if STREAM else 'not streamed'}, "
          f"torch threads {torch.get_num_threads()}, {os.cpu_count()} CPUs", flush=True)
    print(f"{'clients':>12} {'reqs':>5} {'out TPS':>9} {'TTFT50':>7} {'TTFT99':>7} {'TPOT50':>7} {'TPOT99':>7} "
          f"{'ITL50':>7} {'ITL99':>7}  batch sizes (size:requests), ms", flush=True)
    out = tempfile.mkdtemp(prefix="bench_serve_")
    figures = {}
    extra = [f"threads={a.threads}"] if a.threads else []
    with Server(base + extra + ["max_batch_size=64", "queue_size=1024"], out) as url:
        level(url, bodies[:4], 1)                       # warm-up (configs composed, kernels)
        for n in [int(x) for x in a.clients.split(",")]:
            figures[n] = level(url, bodies, n)
            show(str(n), figures[n])
        ov = overhead(url, bodies[:32])
    with Server(base + extra + ["max_batch_size=1"], out) as url:
        level(url, bodies[:4], 1)
        seq = level(url, bodies, 1)
        show("sequential", seq)
    import dlm_engine

    sess = dlm_engine.Session(model=model[0].split("=")[1], device="cpu",
                              **{o.split("=")[0]: o.split("=")[1] for o in model[1:]})
    sess.generate(prompts[:2], strategy=a.strategy, cache=a.cache, gen_length=a.max_tokens, batch_size=1)
    t0 = time.perf_counter()
    res = sess.generate(prompts, strategy=a.strategy, cache=a.cache, gen_length=a.max_tokens, batch_size=1)
    wall = time.perf_counter() - t0
    print(f"{'dlm (API)':>12} {len(prompts):5d} {res.metrics['generated_tokens'] / wall:9.1f}  (one prompt at a time, "
          "no HTTP)", flush=True)
    print(f"server overhead per request (one client, client latency - decode time): median "
          f"{1000 * statistics.median(ov[0]):.2f} ms, p99 {1000 * pct(ov[0], 99):.2f} ms; as the server measures it "
          f"(dlm.overhead): median {1000 * statistics.median(ov[1]):.2f} ms, p99 {1000 * pct(ov[1], 99):.2f} ms",
          flush=True)
    engine_only(model, a, prompts, out)
    best = max(figures.get(16, seq)["tps"], 0)
    print(f"16 clients / sequential serving: {best / seq['tps']:.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
