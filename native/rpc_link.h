// Layers on other machines through ggml's own RPC backend (ggml-rpc, llama.cpp's rpc-server).
//
// The protocol between machines is ggml-rpc's, byte for byte. What this file adds is on the
// client side: a guard between ggml's RPC client and the server, because ggml's client aborts
// the whole process (GGML_ABORT in its dispatcher thread) when a server is refused, resets the
// connection or sends a short reply, and waits forever on a server that stops answering.
#pragma once
#include <atomic>
#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace river {

// A failure talking to an RPC server: refused, reset, timed out, busy, or not ggml-rpc.
// Python sees ConnectionError.
class RpcError : public std::runtime_error {
public:
    using std::runtime_error::runtime_error;
};

// Whether this module was compiled against a ggml that has RPC (RIVER_HAVE_RPC).
bool rpc_compiled();
// Compiled with RPC and the loaded ggml registers the "RPC" backend.
bool rpc_available();
// ggml-rpc's protocol version this build speaks, "major.minor.patch" ("" without RPC).
std::string rpc_protocol_version();

// Serve this machine's devices with ggml_backend_rpc_start_server; blocks for as long as the
// server runs and returns only when it could not start (the message says why). `devices`
// names ggml devices (empty: every GPU, else the CPU).
std::string rpc_serve(const std::string& host, int port, int n_threads, const std::string& cache_dir,
                      const std::vector<std::string>& devices);

// One client connection to an RPC server, guarded. The constructor connects and checks
// ggml-rpc's handshake itself, so a server that is down, busy with another client (an
// rpc-server serves one at a time) or not an RPC server is a clear RpcError before ggml ever
// sees the endpoint. ggml's client is then pointed at local_endpoint(), a loopback relay that
// passes every message through unchanged. When the server fails (closed, reset, or no reply
// within timeout_s), the relay records why and answers ggml's outstanding and later requests
// with well-formed empty replies, so ggml neither aborts nor hangs; the engine checks failed()
// after each step and raises. The relay lives until the link is destroyed, which the engine
// does after freeing every ggml object of the server.
class RpcLink {
public:
    RpcLink(const std::string& endpoint, double timeout_s);
    ~RpcLink();
    RpcLink(const RpcLink&) = delete;
    RpcLink& operator=(const RpcLink&) = delete;

    const std::string& endpoint() const { return endpoint_; }
    // What ggml connects to. Unique per link (see rpc_link.cpp), as ggml caches per endpoint name.
    const std::string& local_endpoint() const { return local_endpoint_; }
    bool failed() const { return failed_.load(); }
    std::string failure() const;

private:
    void relay();
    void serve_client(int client);
    void fail(const std::string& why);
    bool forward_reply(uint8_t cmd, uint64_t expected, std::vector<uint8_t>& reply);

    std::string endpoint_;
    std::string local_endpoint_;
    int timeout_ms_;
    int upstream_ = -1;  // the server
    int listener_ = -1;  // where ggml connects
    std::atomic<bool> failed_{false};
    std::atomic<bool> stop_{false};
    mutable std::mutex mu_;
    std::string failure_;
    std::thread thread_;
};

}  // namespace river
