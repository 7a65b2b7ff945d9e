"""Layers on other machines through ggml's RPC backend: `river-gguf rpc-server` subprocesses on
localhost ports, Models with rpc_servers, against the local engine and llama.cpp's own RPC client.

CPU devices on both ends run the same ggml kernels, so a split model's logits equal the local
engine's to the bit wherever the same weight layouts are used."""
import gc
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from river_gguf import Model
from river_gguf.greedy import greedy
from river_gguf._loader import HAS_RPC, native
from river_gguf.eval.random_model import write_tiny_model
from river_gguf.measure.teacher import score

from support import LOGIT_TOL, PROSE

pytestmark = pytest.mark.skipif(
    not HAS_RPC, reason="ggml has no RPC backend: rebuild llama-cpp-python with CMAKE_ARGS=-DGGML_RPC=ON")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RpcServer:
    """`river-gguf rpc-server` in a subprocess, ready once its port accepts connections."""

    def __init__(self, port=None, threads=1, log_dir=None):
        self.port = port or free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        self.log = open(os.path.join(log_dir or "/tmp", f"rpc-server-{self.port}.log"), "w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "river_gguf.cli", "rpc-server", "--port", str(self.port), "--threads", str(threads)],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            assert self.proc.poll() is None, f"rpc-server exited: {self.output()}"
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                assert time.monotonic() < deadline, "rpc-server did not start"
                time.sleep(0.1)

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)

    def close(self):
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGCONT)
            except OSError:
                pass
        self.kill()
        self.log.close()


@pytest.fixture
def make_server(tmp_path):
    made = []

    def make(**kw):
        made.append(RpcServer(log_dir=str(tmp_path), **kw))
        return made[-1]

    yield make
    for s in made:
        s.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = RpcServer(log_dir=str(tmp_path_factory.mktemp("rpc")))
    yield s
    s.close()


@pytest.fixture(scope="module")
def server2(tmp_path_factory):
    s = RpcServer(log_dir=str(tmp_path_factory.mktemp("rpc")))
    yield s
    s.close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny") / "tiny-llama.gguf")
    write_tiny_model(path, "llama", n_layer=4, seed=3)
    return path


@pytest.fixture(scope="module")
def tiny_river(tmp_path_factory):
    """A 4-layer F32 backbone and the same weights in F16 as its river."""
    d = tmp_path_factory.mktemp("tiny-river")
    backbone, river = str(d / "backbone.gguf"), str(d / "river.gguf")
    write_tiny_model(backbone, "qwen2", n_layer=4, seed=5)
    write_tiny_model(river, "qwen2", n_layer=4, seed=5, dtype="f16")
    return backbone, river


def run_all(model, tokens, n_gen=8):
    """Prompt logits (all rows) and greedy decode through the single-token path."""
    logits = model.logits(tokens)
    gen = greedy(model, tokens, max_tokens=n_gen)
    return logits, gen.tokens, gen.stats.get("exit_layers")


# ----- placement ------------------------------------------------------------------------
@pytest.mark.parametrize("layers,devices", [
    (2, ["CPU", "CPU", "R", "R"]),
    ([0, 2], ["R", "CPU", "R", "CPU"]),
    (None, ["R", "R", "R", "R"]),
])
def test_backbone_split_is_bit_exact(server, tiny, layers, devices):
    local = Model(tiny, n_ctx=256, n_threads=1)
    toks = local.tokenize(PROSE)[:48]
    ref = run_all(local, toks)
    del local
    m = Model(tiny, n_ctx=256, n_threads=1, rpc_servers=[server.endpoint], rpc_layers=layers)
    assert m.layer_devices == [server.endpoint if d == "R" else d for d in devices]
    got = run_all(m, toks)
    assert np.array_equal(got[0], ref[0])
    assert got[1] == ref[1] and len(got[1]) == 8
    del m


def test_two_servers_split_by_memory_and_by_share(server, server2, tiny):
    local = Model(tiny, n_ctx=256, n_threads=1)
    toks = local.tokenize(PROSE)[:32]
    ref = run_all(local, toks)
    del local
    a, b = server.endpoint, server2.endpoint
    # Default: every layer remote, split by the servers' free memory (one machine here: about
    # even), in contiguous runs in the order given.
    m = Model(tiny, n_ctx=256, n_threads=1, rpc_servers=f"{a},{b}")
    devs = m.layer_devices
    assert set(devs) == {a, b} and devs == sorted(devs, key=[a, b].index)
    got = run_all(m, toks)
    assert np.array_equal(got[0], ref[0]) and got[1] == ref[1]
    del m
    m = Model(tiny, n_ctx=256, n_threads=1, rpc_servers=[a, b], rpc_split=[3, 1])
    assert m.layer_devices == [a, a, a, b]
    got = run_all(m, toks)
    assert np.array_equal(got[0], ref[0]) and got[1] == ref[1]
    del m
    m = Model(tiny, n_ctx=256, n_threads=1, rpc_servers=[a, b], rpc_layers=[1, 2, 3], rpc_split=[0, 1])
    assert m.layer_devices == ["CPU", b, b, b]
    del m


_LLAMA_CPP_RPC = textwrap.dedent("""
    # llama.cpp's own RPC client, registered as llama.cpp's --rpc does (add_rpc_devices).
    import ctypes, json, os, sys
    import numpy as np
    import llama_cpp

    path, endpoint, n_gpu_layers, out = sys.argv[1:5]
    tokens = json.loads(sys.stdin.read())
    ggml = ctypes.CDLL(os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml.so"))
    ggml.ggml_backend_reg_by_name.restype = ctypes.c_void_p
    ggml.ggml_backend_reg_by_name.argtypes = [ctypes.c_char_p]
    ggml.ggml_backend_reg_get_proc_address.restype = ctypes.c_void_p
    ggml.ggml_backend_reg_get_proc_address.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    ggml.ggml_backend_register.argtypes = [ctypes.c_void_p]
    rpc = ggml.ggml_backend_reg_by_name(b"RPC")
    add_server = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)(
        ggml.ggml_backend_reg_get_proc_address(rpc, b"ggml_backend_rpc_add_server"))
    ggml.ggml_backend_register(add_server(endpoint.encode()))
    llm = llama_cpp.Llama(path, n_ctx=512, n_threads=1, n_threads_batch=1, logits_all=True, flash_attn=True,
                          n_gpu_layers=int(n_gpu_layers), verbose=False)
    llm.eval(tokens)
    np.save(out, np.array(llm.scores[: len(tokens)], dtype=np.float32))
    llm.close()
""")


def test_smollm2_split_matches_local_and_llama_cpp_rpc(server, q4_1_path, tmp_path):
    n_remote = 15  # of 30 layers: the deep half, as llama.cpp's n_gpu_layers=15
    local = Model(q4_1_path, n_ctx=512, n_threads=1)
    toks = local.tokenize(PROSE)
    ref = local.logits(toks)
    del local
    m = Model(q4_1_path, n_ctx=512, n_threads=1, rpc_servers=[server.endpoint], rpc_layers=n_remote)
    assert m.layer_devices.count(server.endpoint) == n_remote and m.layer_devices[-1] == server.endpoint
    ours = m.logits(toks)
    del m  # its server connection closes now: a server takes one client at a time
    assert np.array_equal(ours, ref)

    out = str(tmp_path / "llama_rpc.npy")
    r = subprocess.run([sys.executable, "-c", _LLAMA_CPP_RPC, q4_1_path, server.endpoint, str(n_remote), out],
                       input=json.dumps(toks), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    theirs = np.load(out)
    assert theirs.shape == ours.shape
    assert np.abs(ours - theirs).max() < LOGIT_TOL
    assert (ours.argmax(1) == theirs.argmax(1)).all()
    assert "Accepted client connection" in server.output()


def _river_decode(path, toks, prefix, opts, **engine_kw):
    """What measure.teacher.score runs, on a bare engine: a backbone prefill, then River decoding token by
    token; the exit layer and logits of every step."""
    e = native.Engine(path, "", n_ctx=512, n_threads=1, n_batch=512, **engine_kw)
    e.eval(toks[:prefix], **opts.engine_args(prompt=True))
    steps = []
    for t in toks[prefix:-1]:  # as score: the last token is only predicted
        logits, exit_layer, _ = e.eval([t], **opts.engine_args(prompt=False))
        steps.append((exit_layer, logits))
    return steps


def test_river_with_remote_layers_matches_local_river(server, river_gguf_path):
    """The deep half on the server: River decoding exits where the local engine does, with the
    same logits, with both models' weights remote and with only the backbone's (the river's deep
    layers then run here over the remote KV cache).

    Bit for bit against a local engine with repack=False: the server keeps weights in ggml's
    plain CPU layout, while a local engine repacks Q4_0 (the river) into another layout whose
    kernels round differently (up to ~0.8 in a logit here, RPC or not).

    Exit settings fixed here, not the file's defaults: the first threshold of a few at which the
    local run's tokens exit at different layers on this CPU."""
    m = Model(river_gguf_path, n_ctx=512, n_threads=1)
    toks = m.tokenize(PROSE)[:32]
    for tau in (0.97, 0.965, 0.975, 0.96, 0.95):
        settings = dict(mode="river", threshold=tau, min_exit_layer=0, river_head=True, prefill="backbone", tail=0)
        ref_score = score(m, toks, prefix=8, **settings)
        if len(set(ref_score.exit_layers.tolist())) > 2:
            break
    else:
        pytest.fail("the test needs tokens that exit at different layers; no threshold tried gives them on this CPU")
    opts = m.options(**settings)
    del m
    ref = _river_decode(river_gguf_path, toks, 8, opts, repack=False)
    assert [e for e, _ in ref] == ref_score.exit_layers.tolist()[1:]
    for weights in (0, 1):  # "all", "backbone"
        got = _river_decode(river_gguf_path, toks, 8, opts, repack=False, rpc_servers=[server.endpoint],
                            rpc_n_layers=15, rpc_weights=weights)
        assert [e for e, _ in got] == [e for e, _ in ref], weights
        assert all(np.array_equal(a, b) for (_, a), (_, b) in zip(got, ref)), weights
    # Through Model (repacking the local layers): the same exits, which the F16 backbone decides.
    m = Model(river_gguf_path, n_ctx=512, n_threads=1, rpc_servers=[server.endpoint], rpc_layers=15, **settings)
    remote = score(m, toks, prefix=8)
    del m
    assert remote.exit_layers.tolist() == ref_score.exit_layers.tolist()
    assert np.abs(remote.logprobs - ref_score.logprobs).max() < 0.5


def test_tiny_river_fixed_and_dynamic_exits(server, tiny_river):
    backbone, river = tiny_river
    local = Model(backbone, river=river, n_ctx=256, n_threads=1, threshold=0.5)
    toks = local.tokenize(PROSE)[:24]
    ref = [score(local, toks, prefix=4, mode="river", threshold=t) for t in (0.0, 0.5, 2.0)]
    ref_fixed = local.logits(toks, exit_layer=1)
    del local
    # Offloaded layers decide exits on the graph by default (ggml ops on the server, one float
    # per token read back); the CPU op pulls the hidden states here. Both match the local run.
    for decision, on_graph in (("auto", True), ("cpu", False)):
        m = Model(backbone, river=river, n_ctx=256, n_threads=1, threshold=0.5, rpc_servers=[server.endpoint],
                  rpc_layers=[1, 3], rpc_weights="river", exit_decision=decision)
        assert m.exits_on_graph == on_graph
        for t, r in zip((0.0, 0.5, 2.0), ref):
            s = score(m, toks, prefix=4, mode="river", threshold=t)
            assert s.exit_layers.tolist() == r.exit_layers.tolist() and np.array_equal(s.logprobs, r.logprobs)
        assert np.array_equal(m.logits(toks, exit_layer=1), ref_fixed)
        del m


def test_remote_layers_verify_in_the_batched_kernels(server, tiny_river):
    """A layer on an RPC server runs the server's kernels, so a decode step's bits cannot be
    promised for a verify batch: a model that asks for the decode kernels verifies in the batched
    ones, as the same model on the CPU alone does not."""
    backbone, river = tiny_river
    kw = dict(river=river, n_ctx=64, n_threads=1, lossless_kernels="decode")
    assert Model(backbone, **kw).lossless_kernels == "decode"
    m = Model(backbone, rpc_servers=[server.endpoint], rpc_layers=[1], **kw)
    assert m.lossless_kernels == "batch"
    with m.session(mode="lossless", draft_max=2) as s:
        s.prefill(m.tokenize(PROSE)[:8])
        assert len(s.verify(m.tokenize(PROSE)[8:11])) == 3


# ----- faults ---------------------------------------------------------------------------
def test_server_down_at_load_names_the_endpoint(tiny):
    endpoint = f"127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(ConnectionError, match=f"cannot connect to RPC server '{endpoint}'.*refused"):
        Model(tiny, n_ctx=64, n_threads=1, rpc_servers=[endpoint])
    assert time.monotonic() - t0 < 10


def test_not_an_rpc_server(tiny):
    with socket.socket() as lsock:
        lsock.bind(("127.0.0.1", 0))
        lsock.listen(1)
        endpoint = f"127.0.0.1:{lsock.getsockname()[1]}"

        def answer():
            conn, _ = lsock.accept()
            conn.recv(100)
            conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
            conn.close()

        t = threading.Thread(target=answer, daemon=True)
        t.start()
        with pytest.raises(ConnectionError, match="not an RPC server"):
            Model(tiny, n_ctx=64, n_threads=1, rpc_servers=[endpoint], rpc_timeout=5)
        t.join(5)


def test_busy_server_times_out_at_load(server, tiny):
    first = Model(tiny, n_ctx=64, n_threads=1, rpc_servers=[server.endpoint])
    t0 = time.monotonic()
    with pytest.raises(ConnectionError, match="one client at a time"):
        Model(tiny, n_ctx=64, n_threads=1, rpc_servers=[server.endpoint], rpc_timeout=1.5)
    assert time.monotonic() - t0 < 10
    toks = first.tokenize("still fine")
    assert np.isfinite(first.logits(toks)).all()
    del first


def test_server_killed_mid_generation_then_reload(make_server, tiny):
    local = Model(tiny, n_ctx=256, n_threads=1)
    toks = local.tokenize(PROSE)[:16]
    ref = local.logits(toks)
    del local
    srv = make_server()
    m = Model(tiny, n_ctx=256, n_threads=1, rpc_servers=[srv.endpoint], rpc_layers=2, rpc_timeout=5)
    s = m.session()
    row = s.extend(toks)
    for _ in range(2):  # two decode steps through the server
        row = s.extend([int(row.argmax())], decode=True)
    srv.kill()
    t0 = time.monotonic()
    with pytest.raises(ConnectionError, match=f"RPC server '{srv.endpoint}'"):
        for _ in range(64):
            row = s.extend([int(row.argmax())], decode=True)
    assert time.monotonic() - t0 < 5 + 2
    del s  # the session holds the engine too
    # The Model refuses further work with the same error, and closes without hanging.
    with pytest.raises(ConnectionError, match="load it again"):
        m.logits(toks)
    t0 = time.monotonic()
    del m
    assert time.monotonic() - t0 < 5
    # A server back on the same port serves a new Model as before.
    srv2 = make_server(port=srv.port)
    m = Model(tiny, n_ctx=256, n_threads=1, rpc_servers=[srv2.endpoint], rpc_layers=2)
    assert np.array_equal(m.logits(toks), ref)
    del m


def test_server_killed_during_a_long_prompt(make_server, q4_1_path):
    srv = make_server()
    m = Model(q4_1_path, n_ctx=1024, n_threads=1, rpc_servers=[srv.endpoint], rpc_layers=20, rpc_timeout=10)
    toks = m.tokenize(" ".join([PROSE] * 8))[:900]
    killer = threading.Timer(0.3, srv.kill)
    killer.start()
    t0 = time.monotonic()
    with pytest.raises(ConnectionError, match=f"RPC server '{srv.endpoint}'"):
        for _ in range(50):  # the kill lands in one of these prompts, most likely the first
            m.logits(toks)
    killer.join()
    assert time.monotonic() - t0 < 10 + 5
    del m


def test_hung_server_times_out(make_server, tiny):
    srv = make_server()
    m = Model(tiny, n_ctx=256, n_threads=1, rpc_servers=[srv.endpoint], rpc_layers=1, rpc_timeout=1.5)
    toks = m.tokenize(PROSE)[:8]
    m.logits(toks)
    os.kill(srv.proc.pid, signal.SIGSTOP)  # alive, connected, silent
    t0 = time.monotonic()
    with pytest.raises(ConnectionError, match=r"did not answer within 1.5 s"):
        m.logits(toks)
    assert 1.0 < time.monotonic() - t0 < 1.5 + 3
    t0 = time.monotonic()
    del m
    assert time.monotonic() - t0 < 5


# ----- options --------------------------------------------------------------------------
@pytest.mark.parametrize("kw,msg", [
    (dict(rpc_servers="localhost"), "not host:port"),
    (dict(rpc_servers=["127.0.0.1:0"]), "not host:port"),
    (dict(rpc_servers=[1234]), "host:port"),
    (dict(rpc_servers=["127.0.0.1:5000", "127.0.0.1:5000"]), "twice"),
    (dict(rpc_layers=2), "without rpc_servers"),
    (dict(rpc_weights="backbone"), "without rpc_servers"),
    (dict(rpc_servers=["127.0.0.1:5000"], rpc_layers=0), "no layer"),
    (dict(rpc_servers=["127.0.0.1:5000"], rpc_layers="2"), "rpc_layers"),
    (dict(rpc_servers=["127.0.0.1:5000"], rpc_layers=[True]), "rpc_layers"),
    (dict(rpc_servers=["127.0.0.1:5000"], rpc_split=[0, 0]), "rpc_split"),
    (dict(rpc_servers=["127.0.0.1:5000"], rpc_weights="both"), "rpc_weights"),
    (dict(rpc_servers=["127.0.0.1:5000"], rpc_timeout=0), "rpc_timeout"),
    (dict(rpc_servers=["127.0.0.1:5000"], rpc_timeout=float("nan")), "rpc_timeout"),
])
def test_bad_rpc_options(tiny, kw, msg):
    with pytest.raises(ValueError, match=msg):
        Model(tiny, n_ctx=64, n_threads=1, **kw)


def test_placement_errors_after_connecting(server, tiny):
    with pytest.raises(ValueError, match="layer 9 is outside"):
        Model(tiny, n_ctx=64, n_threads=1, rpc_servers=[server.endpoint], rpc_layers=[0, 9])
    with pytest.raises(ValueError, match="rpc_split has 2 shares but there are 1 remote devices"):
        Model(tiny, n_ctx=64, n_threads=1, rpc_servers=[server.endpoint], rpc_split=[1, 1])
    gc.collect()
    m = Model(tiny, n_ctx=64, n_threads=1, rpc_servers=[server.endpoint])  # the server is free again
    del m


# ----- command line ---------------------------------------------------------------------
def test_cli_generate_with_rpc_matches_local(server, tiny):
    cmd = [sys.executable, "-m", "river_gguf.cli", "generate", tiny, "-p", "The river", "-n", "6", "--temp", "0",
           "-t", "1", "-c", "128"]
    local = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    remote = subprocess.run(cmd + ["--rpc", server.endpoint, "--rpc-layers", "1-3"], capture_output=True, text=True,
                            timeout=300)
    assert local.returncode == 0 and remote.returncode == 0, remote.stderr
    assert remote.stdout == local.stdout and local.stdout.strip()
    bad = subprocess.run(cmd + ["--rpc-layers", "2"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "without rpc_servers" in bad.stderr


def test_rpc_server_stops_on_ctrl_c_and_refuses_a_taken_port(tmp_path, default_sigint):
    srv = RpcServer(log_dir=str(tmp_path))
    try:
        taken = subprocess.run([sys.executable, "-m", "river_gguf.cli", "rpc-server", "--port", str(srv.port)],
                               capture_output=True, text=True, timeout=120)
        assert taken.returncode == 2 and f"cannot listen on 127.0.0.1:{srv.port}" in taken.stderr
        srv.proc.send_signal(signal.SIGINT)
        assert srv.proc.wait(30) == 130
        assert "stopped" in srv.output()
        assert "no authentication" not in srv.output()  # localhost: no warning needed
    finally:
        srv.close()


def test_rpc_server_warns_off_localhost(tmp_path):
    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "river_gguf.cli", "rpc-server", "--host", "0.0.0.0", "--port",
                          str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        line = ""
        deadline = time.monotonic() + 60
        while "no authentication" not in line and time.monotonic() < deadline:
            line = p.stderr.readline()
            assert line or p.poll() is None
        assert "no authentication" in line and "Trusted networks only" in line
    finally:
        p.terminate()
        assert p.wait(30) == 143


def test_module_reports_rpc():
    assert native.HAS_RPC and native.rpc_available()
    assert native.RPC_PROTOCOL.startswith("7.")
