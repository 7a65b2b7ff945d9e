"""Aggregate decode throughput of concurrent clients: `river-gguf serve --parallel N` against
`llama-server --parallel C` on the same GGUF.

    .venv/bin/python benchmarks/parallel_throughput.py [--model FILE.gguf] [--clients 4] [--tokens 128]
        [--threads T] [--n-ctx 1024] [--river-parallel 1[,4]] [--rounds 3] [--json OUT.json]

C clients (--clients) each send a different prompt to POST /v1/completions at the same moment,
greedy (temperature 0), max_tokens --tokens, not streamed; a round's aggregate is the completion
tokens of all clients (each answer's usage) over the wall time from the common start to the last
answer. Each server runs alone in turn, started fresh, warmed up by one short request per client
prompt, then timed for --rounds rounds (the median is reported):
  - river-gguf serve --parallel N for each N of --river-parallel (default 1: today's queued
    server, one request decoding at a time), each slot --n-ctx tokens;
  - llama-server --parallel C (built by scripts/build_llama_tools.sh into
    .cache/llama-tools/build/bin), its context C x --n-ctx split among the C slots, so each slot
    holds as many tokens as a river-gguf slot.
Both sides: flash attention on, --threads threads, the same prompts and the same file (without
--model: the default River GGUF, which llama.cpp opens as its plain backbone). End of generation
is not suppressed (river-gguf's server has no ignore_eos), so each row's token count is what was
generated; the JSON also says, client by client, whether both sides gave the same text.

The output is one JSON object (--json writes it to a file too) and a markdown row per river-gguf
row. Run it alone on the machine; at a tiny size (--tokens 8) it only checks that it works.
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
LLAMA_SERVER = os.path.join(ROOT, ".cache", "llama-tools", "build", "bin", "llama-server")

#: One prompt per client, all different (no prefix shared between clients).
PROMPTS = (
    "Write a short paragraph explaining why rivers flow to the sea.\n\n",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "The three most important inventions of the nineteenth century were",
    "Q: A train travels 60 km in 45 minutes. What is its speed in km/h?\nA:",
    "Once upon a time, in a village at the edge of a great forest,",
    "SELECT name, COUNT(*) FROM orders JOIN customers ON",
    "Here is a list of ten fruits, one per line:\n1.",
    "The difference between a compiler and an interpreter is",
)
START_TIMEOUT_S = 300
REQUEST_TIMEOUT_S = 1800
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never through a proxy


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(base: str, body: dict) -> dict:
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with _OPENER.open(req, timeout=REQUEST_TIMEOUT_S) as r:
        return json.loads(r.read())


def _ready(base: str) -> bool:
    try:
        with _OPENER.open(base + "/health", timeout=5) as r:
            return r.status == 200
    except (urllib.error.URLError, ConnectionError, OSError):
        return False


class Server:
    """A server process on a free port, stopped on exit."""

    def __init__(self, name: str, argv, port: int, log_path: str):
        self.name, self.base, self.log_path = name, f"http://127.0.0.1:{port}", log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT)

    def __enter__(self):
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _ready(self.base):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                with open(self.log_path, errors="replace") as f:
                    raise RuntimeError(f"{self.name} did not start:\n{f.read()[-3000:]}")
            time.sleep(0.25)
        return self

    def __exit__(self, *exc):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def river_server(args, n_slots: int, log_dir: str) -> Server:
    port = _free_port()
    argv = [sys.executable, "-m", "river_gguf.cli", "serve", args.model, "--port", str(port),
            "--threads", str(args.threads), "--n-ctx", str(args.n_ctx * n_slots), "--parallel", str(n_slots),
            "--log-level", "warning"]
    return Server(f"river-gguf serve --parallel {n_slots}", argv, port,
                  os.path.join(log_dir, f"river-{n_slots}.log"))


def llama_server(args, n_slots: int, log_dir: str) -> Server:
    if not os.path.isfile(args.llama_server):
        raise SystemExit(f"{args.llama_server} not found: run scripts/build_llama_tools.sh llama-server")
    port = _free_port()
    argv = [args.llama_server, "-m", args.model, "--host", "127.0.0.1", "--port", str(port),
            "-t", str(args.threads), "-tb", str(args.threads), "-c", str(args.n_ctx * n_slots),
            "--parallel", str(n_slots), "-fa", "on"]
    return Server(f"llama-server --parallel {n_slots}", argv, port,
                  os.path.join(log_dir, f"llama-server-{n_slots}.log"))


def one_round(base: str, prompts, tokens: int) -> dict:
    """All clients at once: aggregate tokens/s over the wall time, and each client's answer."""
    answers, errors = [None] * len(prompts), []
    barrier = threading.Barrier(len(prompts) + 1)

    def client(i):
        try:
            barrier.wait(timeout=60)
            answers[i] = _post(base, {"prompt": prompts[i], "max_tokens": tokens, "temperature": 0})
        except Exception as e:  # noqa: BLE001 - reported after the round
            errors.append(e)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    barrier.wait(timeout=60)
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"a client failed: {errors[0]!r}")
    n = [a["usage"]["completion_tokens"] for a in answers]
    return {"wall_s": wall, "tokens": sum(n), "tok_s": sum(n) / wall,
            "texts": [a["choices"][0]["text"] for a in answers]}


def measure(server: Server, args, prompts) -> dict:
    with server:
        for p in prompts:  # warm-up: graphs built, pages mapped
            _post(server.base, {"prompt": p, "max_tokens": min(4, args.tokens), "temperature": 0})
        rounds = [one_round(server.base, prompts, args.tokens) for _ in range(args.rounds)]
    return {"server": server.name, "tok_s": statistics.median(r["tok_s"] for r in rounds),
            "rounds": [{k: r[k] for k in ("wall_s", "tokens", "tok_s")} for r in rounds],
            "texts": rounds[-1]["texts"]}


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="the GGUF both servers load (default: the default River GGUF)")
    ap.add_argument("--clients", type=int, default=4, help="concurrent clients, each its own prompt (default 4)")
    ap.add_argument("--tokens", type=int, default=128, help="max_tokens of each request (default 128)")
    ap.add_argument("--threads", type=int, default=min(4, os.cpu_count() or 1), help="threads of both servers")
    ap.add_argument("--n-ctx", type=int, default=1024, help="context of one slot, both servers (default 1024)")
    ap.add_argument("--river-parallel", default="1",
                    help="comma-separated slot counts of river-gguf serve to time (default 1: the queued server)")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per server (default 3; the median)")
    ap.add_argument("--llama-server", default=LLAMA_SERVER, help="the llama-server binary")
    ap.add_argument("--llama-queued", action="store_true",
                    help="also time llama-server --parallel 1: what llama.cpp's own slots gain over its queue")
    ap.add_argument("--json", default=None, metavar="OUT.json", help="also write the result here")
    args = ap.parse_args(argv)
    if not 1 <= args.clients <= len(PROMPTS):
        ap.error(f"--clients must be 1 to {len(PROMPTS)} (one distinct prompt each)")
    if args.tokens < 1 or args.rounds < 1 or args.threads < 1:
        ap.error("--tokens, --rounds and --threads must be at least 1")
    args.river_parallel = [int(n) for n in args.river_parallel.split(",")]
    if args.model is None:
        from river_gguf.default_model import default_model_path
        args.model = default_model_path()
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    prompts = list(PROMPTS[:args.clients])
    log_dir = os.path.join(ROOT, ".cache", "parallel_throughput")
    os.makedirs(log_dir, exist_ok=True)
    # Each server alone in turn: llama-server first, then each river-gguf slot count.
    reference = measure(llama_server(args, args.clients, log_dir), args, prompts)
    queued = measure(llama_server(args, 1, log_dir), args, prompts) if args.llama_queued else None
    rows = [measure(river_server(args, n, log_dir), args, prompts) for n in args.river_parallel]
    result = {"model": os.path.abspath(args.model), "clients": args.clients, "tokens": args.tokens,
              "threads": args.threads, "n_ctx_per_slot": args.n_ctx, "rounds": args.rounds,
              "llama_server": reference, "llama_server_queued": queued, "river_gguf": [], "prompts": prompts}
    for n, row in zip(args.river_parallel, rows):
        row["parallel"] = n
        row["over_llama_server"] = row["tok_s"] / reference["tok_s"]
        row["same_text_as_llama_server"] = [a == b for a, b in zip(row["texts"], reference["texts"])]
        result["river_gguf"].append(row)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    print("\n| model | clients | tokens | threads | river-gguf --parallel N | tok/s | llama-server -np C tok/s "
          "| river / llama-server |\n|---|---|---|---|---|---|---|---|")
    for row in result["river_gguf"]:
        print(f"| {os.path.basename(args.model)} | {args.clients} | {args.tokens} | {args.threads} | "
              f"{row['parallel']} | {row['tok_s']:.1f} | {reference['tok_s']:.1f} | {row['over_llama_server']:.2f}x |")
    if queued:
        print(f"\nllama-server --parallel 1: {queued['tok_s']:.1f} tok/s; its --parallel {args.clients} gets "
              f"{reference['tok_s'] / queued['tok_s']:.2f}x that")
    return 0


if __name__ == "__main__":
    sys.exit(main())
