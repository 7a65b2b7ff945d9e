#include "rpc_link.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <map>

#include "ggml-backend.h"

#ifdef RIVER_HAVE_RPC
#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include "ggml-rpc.h"
#endif

namespace river {

bool rpc_compiled() {
#ifdef RIVER_HAVE_RPC
    return true;
#else
    return false;
#endif
}

bool rpc_available() { return rpc_compiled() && ggml_backend_reg_by_name("RPC") != nullptr; }

#ifndef RIVER_HAVE_RPC

namespace {
const char* kNoRpc =
    "this river_gguf was built against a ggml without RPC; rebuild llama-cpp-python with RPC on and river_gguf "
    "against it: CMAKE_ARGS=-DGGML_RPC=ON pip install --force-reinstall --no-cache-dir llama-cpp-python==0.3.36 "
    "&& pip install --no-build-isolation --force-reinstall river_gguf (scripts/setup.sh does this)";
}

std::string rpc_protocol_version() { return ""; }
std::string rpc_serve(const std::string&, int, int, const std::string&, const std::vector<std::string>&) {
    throw std::runtime_error(kNoRpc);
}
RpcLink::RpcLink(const std::string&, double) { throw std::runtime_error(kNoRpc); }
RpcLink::~RpcLink() = default;
std::string RpcLink::failure() const { return ""; }
void RpcLink::relay() {}
void RpcLink::serve_client(int) {}
void RpcLink::fail(const std::string&) {}
bool RpcLink::forward_reply(uint8_t, uint64_t, std::vector<uint8_t>&) { return false; }

#else  // RIVER_HAVE_RPC

std::string rpc_protocol_version() {
    return std::to_string(RPC_PROTO_MAJOR_VERSION) + "." + std::to_string(RPC_PROTO_MINOR_VERSION) + "." +
           std::to_string(RPC_PROTO_PATCH_VERSION);
}

std::string rpc_serve(const std::string& host, int port, int n_threads, const std::string& cache_dir,
                      const std::vector<std::string>& devices) {
    if (n_threads < 1) throw std::invalid_argument("threads must be >= 1");
    std::vector<ggml_backend_dev_t> devs;
    auto names = [] {
        std::string s;
        for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
            s += (i ? ", " : "") + std::string(ggml_backend_dev_name(ggml_backend_dev_get(i)));
        }
        return s;
    };
    for (const std::string& name : devices) {
        ggml_backend_dev_t dev = ggml_backend_dev_by_name(name.c_str());
        if (!dev) throw std::invalid_argument("unknown device '" + name + "'; this machine has: " + names());
        devs.push_back(dev);
    }
    if (devs.empty()) {
        // As llama.cpp's rpc-server: every GPU, else the CPU.
        for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
            ggml_backend_dev_t dev = ggml_backend_dev_get(i);
            const auto type = ggml_backend_dev_type(dev);
            if (type == GGML_BACKEND_DEVICE_TYPE_GPU || type == GGML_BACKEND_DEVICE_TYPE_IGPU) devs.push_back(dev);
        }
        if (devs.empty()) devs.push_back(ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU));
    }
    if (!devs.back()) throw std::runtime_error("no ggml device to serve");
    const std::string endpoint = host + ":" + std::to_string(port);
    ggml_backend_rpc_start_server(endpoint.c_str(), cache_dir.empty() ? nullptr : cache_dir.c_str(),
                                  static_cast<size_t>(n_threads), devs.size(), devs.data());
    // It returns only when it could not start (its reason went to stderr).
    return "the RPC server on " + endpoint + " could not start or stopped accepting connections";
}

namespace {

// ggml-rpc's wire format, as ggml-rpc.cpp (protocol 7.0.0) defines it: a request is
// | cmd (1 byte) | size (8 bytes) | payload |, a reply | size (8 bytes) | payload |. The relay
// reads only what it needs to know where a reply ends; a new protocol version must be
// reviewed here, hence the assertion.
static_assert(RPC_PROTO_MAJOR_VERSION == 7 && RPC_PROTO_MINOR_VERSION == 0,
              "ggml-rpc's protocol changed: review the reply table in native/rpc.cpp");
enum Cmd : uint8_t {
    ALLOC_BUFFER = 0, GET_ALIGNMENT, GET_MAX_SIZE, BUFFER_GET_BASE, FREE_BUFFER, BUFFER_CLEAR, SET_TENSOR,
    SET_TENSOR_HASH, GET_TENSOR, COPY_TENSOR, GRAPH_COMPUTE, GET_DEVICE_MEMORY, INIT_TENSOR, GET_ALLOC_SIZE, HELLO,
    DEVICE_COUNT, GRAPH_RECOMPUTE, MEMSET_TENSOR, CMD_COUNT = 19,
};
constexpr uint64_t kNoReply = ~uint64_t(0);
constexpr size_t kCapsSize = 24;  // RPC_CONN_CAPS_SIZE: transport upgrade offers (RDMA); none here
constexpr size_t kHelloReply = 4 + kCapsSize;

// Bytes in the reply to `cmd`; GET_TENSOR's is the size its request asks for (its last field).
uint64_t reply_size(uint8_t cmd, const std::vector<uint8_t>& payload) {
    switch (cmd) {
        case ALLOC_BUFFER: return 16;  // remote_ptr, remote_size
        case GET_ALIGNMENT: return 8;
        case GET_MAX_SIZE: return 8;
        case BUFFER_GET_BASE: return 8;
        case SET_TENSOR_HASH: return 1;
        case COPY_TENSOR: return 1;
        case GET_DEVICE_MEMORY: return 16;  // free, total
        case GET_ALLOC_SIZE: return 8;
        case HELLO: return kHelloReply;
        case DEVICE_COUNT: return 4;
        case GET_TENSOR: {
            uint64_t n = 0;
            if (payload.size() >= 8) std::memcpy(&n, payload.data() + payload.size() - 8, 8);
            return n;
        }
        default: return kNoReply;  // FREE_BUFFER, BUFFER_CLEAR, SET_TENSOR, GRAPH_COMPUTE, INIT_TENSOR, ...
    }
}

// A well-formed reply once the server is gone: ggml goes on without aborting, reads zeros, and
// the engine raises the recorded failure after the step. Values ggml asserts on are valid.
void placeholder_reply(uint8_t cmd, uint64_t n, std::vector<uint8_t>& out) {
    out.assign(8 + n, 0);
    std::memcpy(out.data(), &n, 8);
    uint8_t* p = out.data() + 8;
    auto put64 = [&](uint64_t v) { std::memcpy(p, &v, 8); };
    switch (cmd) {
        case GET_ALIGNMENT: put64(32); break;  // a power of two
        case GET_MAX_SIZE: put64(~uint64_t(0) >> 1); break;
        case BUFFER_GET_BASE: put64(4096); break;  // ggml asserts a buffer base is not NULL
        case DEVICE_COUNT: {
            const uint32_t one = 1;
            std::memcpy(p, &one, 4);
            break;
        }
        case HELLO:
            p[0] = RPC_PROTO_MAJOR_VERSION;
            p[1] = RPC_PROTO_MINOR_VERSION;
            p[2] = RPC_PROTO_PATCH_VERSION;
            break;
        default: break;  // ALLOC_BUFFER: a null buffer (ggml reports an allocation failure)
    }
}

enum class Io { Ok, Closed, Timeout, Stopped };

std::string sys_error(int err) { return std::strerror(err); }

#ifdef MSG_NOSIGNAL
constexpr int kSendFlags = MSG_NOSIGNAL;  // a closed peer is an error, not SIGPIPE
#else
constexpr int kSendFlags = 0;
#endif

// Wait until fd is readable (or writable); timeout_ms < 0 waits forever, but wakes every
// 100 ms to look at *stop when given.
Io wait_fd(int fd, short events, int timeout_ms, const std::atomic<bool>* stop) {
    const auto start = std::chrono::steady_clock::now();
    for (;;) {
        int slice = 100;
        if (timeout_ms >= 0) {
            const auto spent =
                std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start).count();
            if (spent >= timeout_ms) return Io::Timeout;
            slice = static_cast<int>(std::min<long long>(slice, timeout_ms - spent));
        }
        pollfd p{fd, events, 0};
        const int r = poll(&p, 1, stop || timeout_ms >= 0 ? slice : -1);
        if (r > 0) return Io::Ok;  // ready, or an error/hang-up the next call reports
        if (r < 0 && errno != EINTR) return Io::Closed;
        if (stop && stop->load()) return Io::Stopped;
    }
}

// Read / write exactly n bytes; the timeout counts from the last progress.
Io read_all(int fd, void* buf, size_t n, int timeout_ms, const std::atomic<bool>* stop, std::string* why) {
    auto* p = static_cast<uint8_t*>(buf);
    while (n > 0) {
        const Io w = wait_fd(fd, POLLIN, timeout_ms, stop);
        if (w != Io::Ok) return w;
        const ssize_t r = recv(fd, p, n, 0);
        if (r == 0) {
            if (why) *why = "closed the connection";
            return Io::Closed;
        }
        if (r < 0) {
            if (errno == EINTR || errno == EAGAIN) continue;
            if (why) *why = sys_error(errno);
            return Io::Closed;
        }
        p += r;
        n -= size_t(r);
    }
    return Io::Ok;
}

Io write_all(int fd, const void* buf, size_t n, int timeout_ms, std::string* why) {
    const auto* p = static_cast<const uint8_t*>(buf);
    while (n > 0) {
        const Io w = wait_fd(fd, POLLOUT, timeout_ms, nullptr);
        if (w != Io::Ok) return w;
        const ssize_t r = send(fd, p, n, kSendFlags);
        if (r < 0) {
            if (errno == EINTR || errno == EAGAIN) continue;
            if (why) *why = sys_error(errno);
            return Io::Closed;
        }
        p += r;
        n -= size_t(r);
    }
    return Io::Ok;
}

void set_options(int fd) {
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));  // as ggml: small messages go now
#ifdef SO_NOSIGPIPE
    setsockopt(fd, SOL_SOCKET, SO_NOSIGPIPE, &one, sizeof(one));
#endif
}

std::string seconds(int ms) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%g s", ms / 1000.0);
    return buf;
}

// ggml-rpc's endpoint form, host:port (IPv4 or a host name, as ggml resolves it).
void parse_endpoint(const std::string& endpoint, std::string& host, int& port) {
    const size_t colon = endpoint.rfind(':');
    const std::string p = colon == std::string::npos ? "" : endpoint.substr(colon + 1);
    host = colon == std::string::npos ? "" : endpoint.substr(0, colon);
    bool digits = !p.empty() && p.size() <= 5;
    for (char c : p) digits = digits && c >= '0' && c <= '9';
    port = digits ? std::stoi(p) : 0;
    if (host.empty() || port < 1 || port > 65535) {
        throw std::invalid_argument("RPC server '" + endpoint + "' is not host:port (e.g. 192.168.1.10:50052)");
    }
}

int connect_to(const std::string& endpoint, int timeout_ms) {
    std::string host;
    int port;
    parse_endpoint(endpoint, host, port);
    addrinfo hints{};
    hints.ai_family = AF_INET;  // ggml-rpc's client and server speak IPv4
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* res = nullptr;
    const int rc = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res);
    if (rc != 0 || !res) throw RpcError("cannot resolve RPC server '" + endpoint + "': " + gai_strerror(rc));
    sockaddr_in addr;
    std::memcpy(&addr, res->ai_addr, sizeof(addr));
    freeaddrinfo(res);

    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) throw RpcError("cannot create a socket: " + sys_error(errno));
    fcntl(fd, F_SETFD, FD_CLOEXEC);
    const int flags = fcntl(fd, F_GETFL, 0);
    fcntl(fd, F_SETFL, flags | O_NONBLOCK);
    int err = 0;
    if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) < 0) {
        err = errno;
        if (err == EINPROGRESS) {
            if (wait_fd(fd, POLLOUT, timeout_ms, nullptr) == Io::Timeout) {
                close(fd);
                throw RpcError("cannot connect to RPC server '" + endpoint + "': no answer within " + seconds(timeout_ms));
            }
            socklen_t len = sizeof(err);
            getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
        }
    }
    if (err != 0) {
        close(fd);
        throw RpcError("cannot connect to RPC server '" + endpoint + "': " + sys_error(err) +
                       " (is `river-gguf rpc-server` or llama.cpp's rpc-server running there?)");
    }
    fcntl(fd, F_SETFL, flags);
    set_options(fd);
    return fd;
}

// ggml's RPC client caches buffer types and devices by endpoint name for the whole process.
// A relay's port can come back for a later relay (to another server), so every link gets a
// name of its own: the port with leading zeros, which ggml's parser (std::stoi) reads as the
// same port.
std::string unique_local_endpoint(int port) {
    static std::mutex mu;
    static std::map<int, int> uses;
    std::lock_guard<std::mutex> lock(mu);
    return "127.0.0.1:" + std::string(size_t(uses[port]++), '0') + std::to_string(port);
}

}  // namespace

RpcLink::RpcLink(const std::string& endpoint, double timeout_s)
    : endpoint_(endpoint), timeout_ms_(timeout_s > 0 ? static_cast<int>(timeout_s * 1000 + 0.5) : -1) {
    const int connect_ms = timeout_ms_ < 0 ? 30000 : timeout_ms_;
    upstream_ = connect_to(endpoint, connect_ms);
    try {
        // The handshake, as ggml's client sends it (no transport upgrade offered).
        uint8_t hello[9 + kCapsSize] = {HELLO};
        const uint64_t n = kCapsSize;
        std::memcpy(hello + 1, &n, 8);
        std::string why;
        uint64_t size = 0;
        uint8_t reply[kHelloReply];
        Io io = write_all(upstream_, hello, sizeof(hello), connect_ms, &why);
        if (io == Io::Ok) io = read_all(upstream_, &size, 8, connect_ms, nullptr, &why);
        if (io == Io::Timeout) {
            throw RpcError("RPC server '" + endpoint + "' accepted the connection but did not answer ggml-rpc's handshake "
                           "within " + seconds(connect_ms) + "; an rpc-server serves one client at a time: is another "
                           "client (another Model or llama.cpp) connected to it?");
        }
        if (io != Io::Ok || size != kHelloReply ||
            read_all(upstream_, reply, sizeof(reply), connect_ms, nullptr, &why) != Io::Ok) {
            throw RpcError("'" + endpoint + "' did not answer ggml-rpc's handshake" + (why.empty() ? "" : " (" + why + ")") +
                           ": it is not an RPC server (river-gguf rpc-server or llama.cpp's rpc-server)");
        }
        if (reply[0] != RPC_PROTO_MAJOR_VERSION || reply[1] > RPC_PROTO_MINOR_VERSION) {
            throw RpcError("RPC server '" + endpoint + "' speaks ggml-rpc protocol " + std::to_string(reply[0]) + "." +
                           std::to_string(reply[1]) + "." + std::to_string(reply[2]) + ", this client " +
                           rpc_protocol_version() + ": run the same llama.cpp/ggml version on both machines");
        }

        listener_ = socket(AF_INET, SOCK_STREAM, 0);
        if (listener_ < 0) throw RpcError("cannot create a socket: " + sys_error(errno));
        fcntl(listener_, F_SETFD, FD_CLOEXEC);
        sockaddr_in local{};
        local.sin_family = AF_INET;
        local.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        local.sin_port = 0;
        socklen_t len = sizeof(local);
        if (bind(listener_, reinterpret_cast<sockaddr*>(&local), sizeof(local)) < 0 || listen(listener_, 4) < 0 ||
            getsockname(listener_, reinterpret_cast<sockaddr*>(&local), &len) < 0) {
            throw RpcError("cannot open the local RPC relay: " + sys_error(errno));
        }
        local_endpoint_ = unique_local_endpoint(ntohs(local.sin_port));
        thread_ = std::thread(&RpcLink::relay, this);
    } catch (...) {
        if (listener_ >= 0) close(listener_);
        close(upstream_);
        throw;
    }
}

RpcLink::~RpcLink() {
    // The engine frees every ggml object of this server first, so ggml has closed its side and
    // the relay waits for the next connection; stop_ ends it.
    stop_ = true;
    if (thread_.joinable()) thread_.join();
    for (int fd : {listener_, upstream_}) {
        if (fd >= 0) close(fd);
    }
}

std::string RpcLink::failure() const {
    std::lock_guard<std::mutex> lock(mu_);
    return failure_;
}

void RpcLink::fail(const std::string& why) {
    {
        std::lock_guard<std::mutex> lock(mu_);
        if (failure_.empty()) failure_ = "RPC server '" + endpoint_ + "' " + why;
    }
    failed_ = true;
    if (upstream_ >= 0) {
        shutdown(upstream_, SHUT_RDWR);
        close(upstream_);
        upstream_ = -1;
    }
}

bool RpcLink::forward_reply(uint8_t cmd, uint64_t expected, std::vector<uint8_t>& reply) {
    std::string why;
    uint64_t size = 0;
    Io io = read_all(upstream_, &size, 8, timeout_ms_, nullptr, &why);
    if (io == Io::Ok && size != expected) {
        fail("sent a malformed reply (" + std::to_string(size) + " bytes to command " + std::to_string(cmd) +
             ", expected " + std::to_string(expected) + ")");
        return false;
    }
    if (io == Io::Ok) {
        reply.resize(8 + size);
        std::memcpy(reply.data(), &size, 8);
        io = read_all(upstream_, reply.data() + 8, size, timeout_ms_, nullptr, &why);
    }
    if (io == Io::Timeout) fail("did not answer within " + seconds(timeout_ms_) + " (rpc_timeout)");
    else if (io != Io::Ok) fail(why.empty() ? "failed" : why);
    return io == Io::Ok;
}

void RpcLink::relay() {
    // ggml connects to an endpoint whenever it has no live connection there, and closes it when
    // its last user goes: a few short connections while the engine asks for devices, memory and
    // alignment, then one for as long as the engine holds buffers. They arrive one after another
    // and all go over the one server connection (whose buffers live as long as it does).
    while (!stop_) {
        if (wait_fd(listener_, POLLIN, 100, nullptr) != Io::Ok) continue;
        const int client = accept(listener_, nullptr, nullptr);
        if (client < 0) continue;
        set_options(client);
        serve_client(client);
        close(client);
    }
}

void RpcLink::serve_client(int client) {
    constexpr uint64_t kWhole = 1 << 20;  // requests up to this size are forwarded in one write
    std::vector<uint8_t> req, reply;
    for (;;) {
        uint8_t head[9];
        if (read_all(client, head, sizeof(head), -1, &stop_, nullptr) != Io::Ok) return;  // ggml closed
        const uint8_t cmd = head[0];
        uint64_t size;
        std::memcpy(&size, head + 1, 8);
        if (cmd >= CMD_COUNT) {
            fail("link: ggml sent an unknown command " + std::to_string(cmd));
            return;
        }
        std::string why;
        Io sent = Io::Ok;
        if (size <= kWhole) {
            req.resize(size_t(size));
            if (read_all(client, req.data(), req.size(), -1, &stop_, nullptr) != Io::Ok) return;
            if (cmd == HELLO) {
                // Done with the server once, in the constructor; each ggml connection gets the
                // same answer, with no transport upgrade.
                placeholder_reply(HELLO, kHelloReply, reply);
                if (write_all(client, reply.data(), reply.size(), -1, nullptr) != Io::Ok) return;
                continue;
            }
            if (!failed_) {
                reply.assign(head, head + sizeof(head));
                reply.insert(reply.end(), req.begin(), req.end());
                sent = write_all(upstream_, reply.data(), reply.size(), timeout_ms_, &why);
            }
        } else {
            // Tensor data: streamed through in chunks rather than held whole.
            req.clear();
            if (!failed_) sent = write_all(upstream_, head, sizeof(head), timeout_ms_, &why);
            std::vector<uint8_t> chunk(kWhole);
            for (uint64_t left = size; left > 0;) {
                const size_t n = size_t(std::min<uint64_t>(left, chunk.size()));
                if (read_all(client, chunk.data(), n, -1, &stop_, nullptr) != Io::Ok) return;
                if (!failed_ && sent == Io::Ok) sent = write_all(upstream_, chunk.data(), n, timeout_ms_, &why);
                left -= n;
            }
        }
        if (!failed_ && sent != Io::Ok) {
            fail(sent == Io::Timeout ? "did not take a request within " + seconds(timeout_ms_) + " (rpc_timeout)"
                                     : (why.empty() ? "failed" : why));
        }
        const uint64_t expected = reply_size(cmd, req);
        if (expected == kNoReply) continue;
        if (failed_ || !forward_reply(cmd, expected, reply)) placeholder_reply(cmd, expected, reply);
        if (write_all(client, reply.data(), reply.size(), -1, nullptr) != Io::Ok) return;
    }
}

#endif  // RIVER_HAVE_RPC

}  // namespace river
