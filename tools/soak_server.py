"""Soak test of `river-gguf serve`: many clients for a long time, every answer checked, memory watched.

    .venv/bin/python tools/soak_server.py MODEL.gguf [--parallel 4] [--n-ctx 4096] [--threads T]
        [--clients 8] [--minutes 30] [--seed 0] [--require-flat] [--json OUT.json]
    .venv/bin/python tools/soak_server.py --url http://127.0.0.1:8000 [--pid PID] ...

Starts `river-gguf serve MODEL --parallel P` on a free port (or drives the server at --url; its
memory is watched only when --pid names its process), then runs --clients threads until
--minutes pass. Each thread sends, at random (seeded): completions and chat completions, streamed
or not, with prompts of mixed length and max_tokens of mixed size (each request fits its slot's
context: a slot holds -c/P positions rounded up to 256, as the server documents); about 10% of the
streams are dropped by the client after a few chunks; about 5% of the requests are malformed (bad
JSON, a field of the wrong type, an unknown field, a negative max_tokens, no prompt, no messages,
a prompt longer than the context, streamed or not) and must get the documented 400 with an
OpenAI error object. Every other answer is checked:
  - status 200, the OpenAI schema (object, id, choices[0] with its text or message);
  - finish_reason "stop" or "length"; usage: total = prompt + completion tokens, completion tokens
    at most max_tokens (plus UTF8_OVERRUN: llama-cpp-python's Llama, which the server follows, ends
    a completion only on a whole UTF-8 character), at least max_tokens when the reason is "length",
    none only for an empty text; a completion's prompt_tokens equal /extras/tokenize/count of
    its prompt;
  - a stream: `data:` lines of JSON chunks, the last chunk with a finish_reason, then `data: [DONE]`.
The server's RSS (VmRSS of /proc/PID/status) is sampled every --rss-every seconds. At the end the
server must report every slot idle again (dropped streams freed theirs). The summary (printed as
JSON, --json writes it too) gives the requests by kind, the failures with up to 5 examples per
kind, and RSS first/last/max with a verdict: "flat" when the maximum over the last quarter of the
run after warm-up (the first --warmup-fraction of the run) is within --rss-margin (a fraction,
default 0.05) plus 8 MiB of the maximum over the first quarter after warm-up.

Exit status: 0 when every answer was as expected (and, with --require-flat, the RSS is flat);
1 on any unexpected answer, a server that died, or slots left busy; 3 when only the RSS verdict
failed under --require-flat.
"""
import argparse
import collections
import http.client
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse

START_TIMEOUT_S = 600
MIB = 1 << 20
RSS_SLACK = 8 * MIB
WORDS = ("river", "stone", "water", "valley", "the", "flows", "under", "bridge", "mountain", "rain", "a", "and",
         "north", "light", "quickly", "old", "forest", "sea", "of", "to", "def", "return", "x", "=", "1", "+")
FINISH_REASONS = ("stop", "length")
#: Tokens a completion may run past max_tokens: llama-cpp-python's Llama (which the server's
#: class follows) checks max_tokens only once the text ends on a whole UTF-8 character, and a
#: character takes at most 4 bytes, so at most 3 more tokens.
UTF8_OVERRUN = 3


# ----- HTTP ------------------------------------------------------------------------------
class Target:
    """The server under test: its base URL, and its process when this script started it."""

    def __init__(self, url: str, pid=None, proc=None, log_path=None):
        u = urllib.parse.urlsplit(url)
        self.host, self.port = u.hostname, u.port or 80
        self.url, self.pid, self.proc, self.log_path = url, pid, proc, log_path

    def connection(self, timeout: float) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout)

    def request(self, method: str, path: str, body=None, timeout: float = 300.0):
        """(status, parsed JSON or None, raw bytes) of one request; body: bytes sent as they are,
        or an object sent as JSON."""
        conn = self.connection(timeout)
        try:
            data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
            conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            raw = r.read()
        finally:
            conn.close()
        try:
            parsed = json.loads(raw) if raw else None
        except ValueError:
            parsed = None
        return r.status, parsed, raw

    def alive(self) -> bool:
        return self.proc is None or self.proc.poll() is None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args) -> Target:
    port = _free_port()
    log_path = args.server_log or os.path.join(tempfile.gettempdir(), f"river-soak-server-{port}.log")
    argv = [sys.executable, "-m", "river_gguf.cli", "serve", args.model, "--port", str(port), "--parallel",
            str(args.parallel), "--n-ctx", str(args.n_ctx), "--log-level", "warning"]
    if args.threads:
        argv += ["--threads", str(args.threads)]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    target = Target(f"http://127.0.0.1:{port}", pid=proc.pid, proc=proc, log_path=log_path)
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_server(target)
            raise SystemExit(f"the server did not start (log: {log_path}):\n{_tail(log_path)}")
        try:
            if target.request("GET", "/health", timeout=5)[0] == 200:
                return target
        except OSError:
            pass
        time.sleep(0.25)


def stop_server(target: Target) -> None:
    if target.proc is None:
        return
    target.proc.terminate()
    try:
        target.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        target.proc.kill()
        target.proc.wait()


def _tail(path, n: int = 3000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return ""


# ----- requests --------------------------------------------------------------------------
class Unexpected(Exception):
    """An answer that is not what the server documents."""


def _check(condition: bool, what: str, answer) -> None:
    if not condition:
        raise Unexpected(f"{what}: {str(answer)[:600]}")


def slot_context(n_ctx: int, parallel: int) -> int:
    """Positions of one slot: -c/P rounded up to a multiple of 256 (docs/usage.md, serve)."""
    return -(-(-(-n_ctx // parallel)) // 256) * 256


class Plan:
    """What one client sends next, drawn from its own random stream."""

    def __init__(self, rng: random.Random, slot_ctx: int):
        self.rng, self.slot_ctx = rng, slot_ctx
        # Room for a chat template's tokens and a word that tokenizes as several tokens.
        self.max_words = max(2, slot_ctx // 8)
        self.max_tokens = [n for n in (1, 4, 16, 64, 128) if n <= slot_ctx // 4] or [1]

    def prompt(self) -> str:
        n = self.rng.choice([1, 3, 10, 30, 100, 300])
        n = min(n, self.max_words)
        return " ".join(self.rng.choice(WORDS) for _ in range(n))

    def request(self) -> tuple:
        """(kind, path, body, extra): kind names the request for the summary."""
        r = self.rng.random()
        if r < 0.05:
            return self.malformed()
        chat = self.rng.random() < 0.5
        stream = self.rng.random() < 0.5
        drop = stream and self.rng.random() < 0.10
        # A dropped stream asks for the most tokens, so that it is dropped mid-way, not after its end.
        max_tokens = self.max_tokens[-1] if drop else self.rng.choice(self.max_tokens)
        body = {"max_tokens": max_tokens, "temperature": self.rng.choice([0, 0.8]), "stream": stream}
        if chat:
            body["messages"] = [{"role": "user", "content": self.prompt()}]
            path = "/v1/chat/completions"
        else:
            body["prompt"] = self.prompt()
            path = "/v1/completions"
        kind = ("chat" if chat else "completion") + ("-stream" if stream else "") + ("-dropped" if drop else "")
        return kind, path, body, {"drop_after": self.rng.randint(1, 3) if drop else None}

    def malformed(self) -> tuple:
        too_long = "hello " * (4 * self.slot_ctx)
        cases = [
            ("bad-json", "/v1/completions", b'{"prompt": "Hi", "max_tokens": ', None),
            ("wrong-type", "/v1/completions", {"prompt": "Hi", "max_tokens": "many"}, "max_tokens"),
            ("wrong-type", "/v1/chat/completions", {"messages": "hello"}, "messages"),
            ("unknown-field", "/v1/completions", {"prompt": "Hi", "bogus": 1}, "bogus"),
            ("unknown-field", "/v1/chat/completions",
             {"messages": [{"role": "user", "content": "Hi"}], "bogus": True}, "bogus"),
            ("negative-max-tokens", "/v1/completions", {"prompt": "Hi", "max_tokens": -5}, "max_tokens"),
            ("no-prompt", "/v1/completions", {"max_tokens": 4}, "prompt"),
            ("no-messages", "/v1/chat/completions", {"messages": []}, "messages"),
            ("over-long", "/v1/completions", {"prompt": too_long, "max_tokens": 4}, None),
            ("over-long-stream", "/v1/completions", {"prompt": too_long, "max_tokens": 4, "stream": True}, None),
        ]
        kind, path, body, param = self.rng.choice(cases)
        return "malformed-" + kind, path, body, {"param": param}


def check_error(status: int, parsed, raw, param) -> None:
    """The documented refusal: 400 with an OpenAI error object (naming the field where given)."""
    _check(status == 400, f"expected 400, got {status}", raw)
    err = parsed.get("error") if isinstance(parsed, dict) else None
    _check(isinstance(err, dict) and isinstance(err.get("message"), str) and err["message"], "no error object",
           raw)
    _check(all(k in err for k in ("type", "param", "code")), "error object lacks type/param/code", raw)
    if param is not None:
        _check(err["param"] == param, f"error param {err['param']!r}, expected {param!r}", raw)


def check_usage(target: Target, path: str, body, text: str, finish: str, usage) -> None:
    _check(finish in FINISH_REASONS, f"finish_reason {finish!r}", usage)
    _check(isinstance(usage, dict) and all(isinstance(usage.get(k), int) for k in
                                           ("prompt_tokens", "completion_tokens", "total_tokens")), "usage", usage)
    n, m = usage["completion_tokens"], body["max_tokens"]
    _check(usage["total_tokens"] == usage["prompt_tokens"] + n, "total != prompt + completion", usage)
    _check(usage["prompt_tokens"] > 0 and 0 <= n <= m + UTF8_OVERRUN, f"counts out of range (max_tokens {m})", usage)
    # "length": max_tokens reached (every request fits its slot, so the context never ends it first).
    _check(n >= m or finish != "length", f"{n} tokens with finish {finish!r}, max_tokens {m}", usage)
    # A token may decode to no text (a byte of a character left unfinished), so only one way round:
    _check(n > 0 or text == "", f"no tokens for text {text!r}", usage)
    if path == "/v1/completions":
        status, counted, raw = target.request("POST", "/extras/tokenize/count", {"input": body["prompt"]})
        _check(status == 200 and counted.get("count") == usage["prompt_tokens"],
               f"prompt_tokens {usage['prompt_tokens']} but /extras/tokenize/count says", raw)


def check_whole(target: Target, path: str, body, status: int, parsed, raw) -> None:
    _check(status == 200, f"status {status}", raw)
    chat = path == "/v1/chat/completions"
    _check(isinstance(parsed, dict) and parsed.get("object") == ("chat.completion" if chat else "text_completion")
           and isinstance(parsed.get("id"), str) and isinstance(parsed.get("choices"), list)
           and len(parsed["choices"]) == 1, "schema", raw)
    choice = parsed["choices"][0]
    if chat:
        msg = choice.get("message")
        _check(isinstance(msg, dict) and msg.get("role") == "assistant" and isinstance(msg.get("content"), str),
               "message", raw)
        text = msg["content"]
    else:
        _check(isinstance(choice.get("text"), str), "text", raw)
        text = choice["text"]
    check_usage(target, path, body, text, choice.get("finish_reason"), parsed.get("usage"))


def run_stream(target: Target, path: str, body, drop_after, timeout: float) -> None:
    """A streamed request, read to [DONE] and checked, or dropped after `drop_after` chunks."""
    chat = path == "/v1/chat/completions"
    conn = target.connection(timeout)
    try:
        conn.request("POST", path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            raw = r.read()
            _check(False, f"stream status {r.status}", raw)
        chunks, done = [], False
        while True:
            line = r.readline()
            if not line:
                break
            line = line.strip()
            if not line or line.startswith(b":"):
                continue  # a comment line (the server's keep-alive ": ping"), valid SSE
            _check(line.startswith(b"data: "), "not an SSE data line", line)
            data = line[len(b"data: "):]
            _check(not done, "data after [DONE]", line)
            if data == b"[DONE]":
                done = True
                continue
            chunk = json.loads(data)
            _check("error" not in chunk, "error event in a stream", chunk)
            _check(chunk.get("object") == ("chat.completion.chunk" if chat else "text_completion")
                   and len(chunk.get("choices", ())) == 1, "chunk schema", chunk)
            chunks.append(chunk)
            if drop_after is not None and len(chunks) >= drop_after:
                return  # the client leaves mid-stream: the connection closes below
    finally:
        conn.close()
    _check(done, "the stream ended without [DONE]", chunks[-1:] if chunks else "no chunk")
    finishes = [c["choices"][0].get("finish_reason") for c in chunks]
    _check(bool(chunks) and finishes[-1] in FINISH_REASONS and not any(finishes[:-1]),
           "finish_reason must come in the last chunk only", finishes)
    n_text = sum(bool(c["choices"][0].get("delta", {}).get("content") if chat else c["choices"][0].get("text"))
                 for c in chunks)
    _check(n_text <= body["max_tokens"] + UTF8_OVERRUN, f"{n_text} text chunks for max_tokens {body['max_tokens']}", finishes)


def send(target: Target, plan_item, timeout: float) -> None:
    kind, path, body, extra = plan_item
    if kind.startswith("malformed-"):
        status, parsed, raw = target.request("POST", path, body, timeout)  # a refused stream is JSON too
        check_error(status, parsed, raw, extra["param"])
    elif body.get("stream"):
        run_stream(target, path, body, extra["drop_after"], timeout)
    else:
        status, parsed, raw = target.request("POST", path, body, timeout)
        check_whole(target, path, body, status, parsed, raw)


# ----- the soak --------------------------------------------------------------------------
class Tally:
    """Requests by kind, and failures by kind with a few examples, shared by the client threads."""

    def __init__(self):
        self.lock = threading.Lock()
        self.by_kind = collections.Counter()
        self.failed = collections.Counter()
        self.examples = collections.defaultdict(list)

    def add(self, kind: str, error=None, body=None) -> None:
        with self.lock:
            self.by_kind[kind] += 1
            if error is not None:
                self.failed[kind] += 1
                if len(self.examples[kind]) < 5:
                    sent = body if isinstance(body, bytes) else json.dumps(body)
                    self.examples[kind].append({"error": f"{type(error).__name__}: {error}"[:800],
                                                "request": str(sent)[:800]})


def client(target: Target, seed: int, slot_ctx: int, deadline: float, timeout: float, tally: Tally) -> None:
    plan = Plan(random.Random(seed), slot_ctx)
    while time.monotonic() < deadline and target.alive():
        item = plan.request()
        try:
            send(target, item, timeout)
        except Exception as e:  # noqa: BLE001 - every failure is counted and shown in the summary
            tally.add(item[0], e, item[2])
        else:
            tally.add(item[0])


def rss_bytes(pid: int):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def watch_rss(pid, every: float, stop: threading.Event, samples: list) -> None:
    t0 = time.monotonic()
    while True:
        if pid is not None:
            rss = rss_bytes(pid)
            if rss is not None:
                samples.append((time.monotonic() - t0, rss))
        if stop.wait(every):
            return


def rss_verdict(samples, seconds: float, warmup_fraction: float, margin: float) -> dict:
    """First/last/max RSS, and whether the last quarter after warm-up stays within the margin of
    the first quarter's maximum."""
    if not samples:
        return {"verdict": "unknown (no RSS samples: give --pid with --url)"}
    rss = [b for _, b in samples]
    out = {"samples": len(samples), "first_mib": rss[0] / MIB, "last_mib": rss[-1] / MIB, "max_mib": max(rss) / MIB}
    start = seconds * warmup_fraction
    quarter = (seconds - start) / 4
    first = [b for t, b in samples if start <= t < start + quarter]
    last = [b for t, b in samples if t >= seconds - quarter]
    if not first or not last:
        out["verdict"] = "unknown (too few samples after warm-up: run longer or sample more often)"
        return out
    bound = max(first) * (1 + margin) + RSS_SLACK
    out.update({"first_quarter_max_mib": max(first) / MIB, "last_quarter_max_mib": max(last) / MIB,
                "bound_mib": bound / MIB, "margin": margin, "slack_mib": RSS_SLACK / MIB,
                "warmup_s": start, "verdict": "flat" if max(last) <= bound else "grew"})
    return out


def wait_idle(target: Target, parallel, seconds: float = 60.0) -> str:
    """None when /health reports every slot idle and nothing waiting within `seconds`; else why not."""
    deadline, last = time.monotonic() + seconds, None
    while time.monotonic() < deadline:
        if not target.alive():
            return f"the server exited with {target.proc.returncode}:\n{_tail(target.log_path)}"
        try:
            status, last, _ = target.request("GET", "/health", timeout=10)
            if status == 200 and not last.get("busy") and not last.get("waiting") and (
                    parallel is None or last.get("slots_idle") == parallel):
                return None
        except OSError as e:
            last = repr(e)
        time.sleep(0.5)
    return f"slots still busy after the soak: /health says {last}"


def soak(target: Target, args) -> dict:
    tally, samples, stop = Tally(), [], threading.Event()
    watcher = threading.Thread(target=watch_rss, args=(target.pid, args.rss_every, stop, samples), daemon=True)
    watcher.start()
    t0 = time.monotonic()
    deadline = t0 + args.minutes * 60
    threads = [threading.Thread(target=client, args=(target, args.seed * 1000 + i, args.slot_ctx, deadline,
                                                      args.request_timeout, tally), daemon=True)
               for i in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.monotonic() - t0
    problems = []
    if not target.alive():
        problems.append(f"the server exited with {target.proc.returncode}:\n{_tail(target.log_path)}")
    else:
        idle = wait_idle(target, args.parallel if target.proc is not None else None)
        if idle:
            problems.append(idle)
    stop.set()
    watcher.join()
    return {"seconds": seconds, "clients": args.clients, "parallel": args.parallel, "slot_ctx": args.slot_ctx,
            "requests": sum(tally.by_kind.values()), "by_kind": dict(sorted(tally.by_kind.items())),
            "failures": sum(tally.failed.values()), "failed_by_kind": dict(sorted(tally.failed.items())),
            "failure_examples": dict(tally.examples), "server_problems": problems,
            "rss": rss_verdict(samples, seconds, args.warmup_fraction, args.rss_margin)}


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", help="the GGUF to serve (not with --url)")
    ap.add_argument("--url", help="drive this running server instead of starting one")
    ap.add_argument("--pid", type=int, help="with --url: the server's process id, for its RSS")
    ap.add_argument("--parallel", type=int, default=4, help="slots of the started server (default 4)")
    ap.add_argument("--n-ctx", type=int, default=4096, help="-c of the started server, all slots (default 4096)")
    ap.add_argument("--threads", type=int, default=None, help="--threads of the started server")
    ap.add_argument("--clients", type=int, default=8, help="client threads (default 8)")
    ap.add_argument("--minutes", type=float, default=30.0, help="how long the clients run (default 30)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request (default 600)")
    ap.add_argument("--rss-every", type=float, default=10.0, help="seconds between RSS samples (default 10)")
    ap.add_argument("--warmup-fraction", type=float, default=0.1, help="share of the run that is warm-up")
    ap.add_argument("--rss-margin", type=float, default=0.05, help="the flat verdict's margin, a fraction")
    ap.add_argument("--require-flat", action="store_true", help="exit 3 when the RSS verdict is not flat")
    ap.add_argument("--server-log", default=None, help="where the started server's output goes (default: the temp folder)")
    ap.add_argument("--json", default=None, metavar="OUT.json", help="also write the summary here")
    args = ap.parse_args(argv)
    if (args.model is None) == (args.url is None):
        ap.error("give a MODEL to serve, or --url of a running server")
    if args.clients < 1 or args.parallel < 1 or args.minutes <= 0 or args.rss_every <= 0:
        ap.error("--clients and --parallel must be >= 1, --minutes and --rss-every > 0")
    args.slot_ctx = slot_context(args.n_ctx, args.parallel)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    target = start_server(args) if args.url is None else Target(args.url, pid=args.pid)
    try:
        summary = soak(target, args)
    finally:
        stop_server(target)
    summary["model"] = args.model or args.url
    text = json.dumps(summary, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    rss = summary["rss"]
    print(f"\n{summary['requests']} requests in {summary['seconds']:.0f} s, {summary['failures']} unexpected; "
          f"server problems: {len(summary['server_problems'])}; RSS {rss['verdict']}")
    if summary["failures"] or summary["server_problems"] or summary["requests"] == 0:
        return 1
    if args.require_flat and rss["verdict"] != "flat":
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
