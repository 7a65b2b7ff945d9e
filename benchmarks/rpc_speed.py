"""The cost of ggml's RPC protocol: tokens/s with layers local against layers on an rpc-server
over loopback, on SmolLM2 Q4_1 and Qwen2.5-Coder-0.5B.

    .venv/bin/python benchmarks/rpc_speed.py [--threads 2] [--tokens 64] [--repeats 3]
        [--models smollm2,qwen2.5-coder-0.5b] [--json out.json]

One `river-gguf rpc-server` runs on this machine (loopback), with as many threads as the
client. Placements: every layer local; the deep half of the layers on the server; every layer on
the server (embeddings and head stay local). Backbone mode, greedy, one token per eval as in
decode_speed.py; prefill is the best of the repeats, decode the median, and repeats alternate
the placement order. Both processes share this machine's cores, so the numbers show the
protocol's round trips and copies, not what a second machine would add in compute.
Qwen2.5-Coder-0.5B is fetched by river_gguf.eval.model_zoo when missing.
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# decode_speed.py's prompt, context and river_gguf side (the package's token loop, each evaluation timed alone)
from decode_speed import N_CTX, PROMPT_TOKENS, prompt_tokens, river_decode, river_prefill  # noqa: E402


def model_path(name):
    if name == "smollm2":
        from river_gguf.default_model import default_model_path

        return "SmolLM2-135M-Instruct Q4_1", default_model_path()
    from river_gguf.eval import model_zoo

    return name, model_zoo.source_path(name)


class Server:
    """`river-gguf rpc-server` on a free loopback port."""

    def __init__(self, threads):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.endpoint = f"127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "river_gguf.cli", "rpc-server", "--port", str(self.port),
                                      "--threads", str(threads)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError("rpc-server exited")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("rpc-server did not start")
                time.sleep(0.1)

    def close(self):
        self.proc.terminate()
        self.proc.wait(30)


class Side:
    """One placement. Its Model is loaded for each of its runs and dropped after: the server
    serves one client at a time."""

    def __init__(self, name, path, threads, **rpc):
        self.name, self.path, self.threads, self.rpc = name, path, threads, rpc
        self.m = None

    def load(self):
        from river_gguf import Model

        t0 = time.perf_counter()
        self.m = Model(self.path, n_ctx=N_CTX, n_threads=self.threads, mode="backbone", **self.rpc)
        self.load_s = time.perf_counter() - t0

    def unload(self):
        self.m = None  # closes the server connection now

    def prefill(self, toks):
        return river_prefill(self.m, toks)

    def decode(self, toks, n):
        return river_decode(self.m, toks, n)


def bench_model(label, path, server, args):
    from river_gguf import Model

    n_layer = Model(path, n_ctx=64, n_threads=1, mode="backbone").n_layer
    sides = [Side("local", path, args.threads),
             Side(f"remote {n_layer // 2}/{n_layer}", path, args.threads, rpc_servers=[server.endpoint],
                  rpc_layers=n_layer // 2),
             Side(f"remote {n_layer}/{n_layer}", path, args.threads, rpc_servers=[server.endpoint], rpc_layers=-1)]
    pre = {s.name: [] for s in sides}
    dec = {s.name: [] for s in sides}
    load = {}
    outs = {}
    toks = None
    for r in range(args.repeats):
        for s in (sides if r % 2 == 0 else sides[::-1]):
            s.load()  # one at a time: the server serves one client
            load.setdefault(s.name, s.load_s)
            if toks is None:
                toks = prompt_tokens(s)
            s.decode(toks, 4)  # warm-up
            pre[s.name].append(len(toks) / s.prefill(toks)[0])
            dt, outs[s.name] = s.decode(toks, args.tokens)
            dec[s.name].append(args.tokens / dt)
            s.unload()

    def agree(a, b):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    return {
        "model": label, "path": path, "n_layer": n_layer, "prompt_tokens": len(toks),
        "load_s": load,
        "prefill_tok_s": {k: max(v) for k, v in pre.items()},
        "decode_tok_s": {k: statistics.median(v) for k, v in dec.items()},
        "runs": {"prefill": pre, "decode": dec},
        "greedy_agreement_with_local": {k: agree(outs["local"], v) for k, v in outs.items()},
    }


def markdown(results, args) -> str:
    lines = [f"threads={args.threads} (client and server each), prompt={PROMPT_TOKENS} tokens, "
             f"decode={args.tokens} tokens, repeats={args.repeats} (prefill: best, decode: median), loopback", "",
             "| model | placement | load s | prefill tok/s | decode tok/s | decode vs local | greedy agree |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in results:
        base = r["decode_tok_s"]["local"]
        for name, d in r["decode_tok_s"].items():
            lines.append(f"| {r['model']} | {name} | {r['load_s'][name]:.2f} | {r['prefill_tok_s'][name]:.1f} | "
                         f"{d:.1f} | {d / base:.2f}x | {r['greedy_agreement_with_local'][name]}/{args.tokens} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--models", default="smollm2,qwen2.5-coder-0.5b")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from river_gguf._loader import HAS_RPC, RPC_FIX

    if not HAS_RPC:
        sys.exit(f"rpc_speed: ggml has no RPC backend; {RPC_FIX}")
    server = Server(args.threads)
    results = []
    try:
        for name in args.models.split(","):
            label, path = model_path(name.strip())
            print(f"== {label}", file=sys.stderr)
            results.append(bench_model(label, path, server, args))
    finally:
        server.close()
    print(markdown(results, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
        print(f"wrote {os.path.abspath(args.json)}", file=sys.stderr)


if __name__ == "__main__":
    main()
