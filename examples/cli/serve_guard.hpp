// kimik3 serve, the connection layer: every request bounded before it is parsed, every connection on its
// own thread, and each handler told which connection its request came on.
// ====================================================================================================
//
// WHY A LAYER UNDER cpp-httplib
//   Debian's cpp-httplib 0.11.4 reads a request with one SocketStream per request and a fixed pool of
//   threads. That leaves a server open to four things no handler can fix: a chunked body has no size
//   limit (payload_max_length applies to Content-Length only), a client that sends one header line a
//   second holds a pool thread for as long as it likes (the read timeout is per read, not per request),
//   a handler cannot tell which socket its request came on, and pipelined requests are lost with the
//   per-request stream's read-ahead. The library offers the extension point its own SSLServer uses:
//   Server::process_and_close_socket(sock) is virtual, and process_request(Stream&, ...) is protected,
//   so a subclass may serve a socket through a Stream of its own. GuardedServer does exactly that and
//   nothing else; routing, parsing, chunked replies stay the library's.
//
//   Connection (our Stream)   one per TCP connection, kept across keep-alive requests (so pipelined
//                             bytes survive). A request is read in two phases with a deadline and a byte
//                             cap each: request line + headers (--header-time, 32 KiB), then the body
//                             (--body-time, twice --max-body: chunk framing included). Past either, a
//                             read fails and the connection is closed. Between requests, an idle
//                             connection waits at most the keep-alive time.
//   ConnectionThreads         a TaskQueue with one thread per connection, at most kMaxConnections: a
//                             slow client holds its own thread, never another client's. Beyond the cap a
//                             connection gets a 503 at once and is closed.
//   Connection::current()     the connection whose request this thread is serving (the handler runs on
//                             the connection's thread), so a handler asks its own socket whether the
//                             client is still there: no port matching, no scan of open descriptors.
//
// WHAT IT DOES NOT DO
//   No TLS (run behind a TLS proxy to leave this machine). A client that half-closes its connection
//   (shutdown(SHUT_WR)) after sending a request cannot be told apart from one that left; both count as
//   gone: a reply not streamed is cancelled and answered with a "client_closed" error. An attacker who
//   opens kMaxConnections connections at once fills the cap (the others get 503 until the deadlines
//   above close them).
// ====================================================================================================
#pragma once

#include <httplib.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace kimik3::cli {

struct HttpLimits {
    std::size_t max_body = 4u << 20;        // decoded body bytes (--max-body)
    std::size_t max_head = 32u << 10;       // request line + headers
    std::size_t max_headers = 64;           // header fields
    std::chrono::milliseconds head_time{10000}, body_time{30000}, keep_alive{5000};
    int write_timeout_ms = 30000;           // one write that cannot proceed for this long fails
};

inline constexpr std::size_t kMaxConnections = 128;

// One TCP connection as cpp-httplib's Stream, with the phases, deadlines and caps described above.
class Connection : public httplib::Stream {
  public:
    Connection(int fd, const HttpLimits& lim) : fd_(fd), lim_(lim) {}
    Connection(const Connection&) = delete;
    Connection& operator=(const Connection&) = delete;

    enum class Limit { none, time, size, closed };

    // A next request has begun: bytes are buffered, or arrive within `wait`. False when the client
    // closed the connection, the wait ran out, or `stopping()` turned true.
    bool wait_request(std::chrono::milliseconds wait, const std::function<bool()>& stopping) {
        const auto end = std::chrono::steady_clock::now() + wait;
        while (off_ == len_) {
            if (stopping() || std::chrono::steady_clock::now() >= end) return false;
            pollfd p{fd_, POLLIN, 0};
            const int r = ::poll(&p, 1, 100);
            if (r < 0 && errno != EINTR) return false;
            if (r > 0) return fill() > 0;
        }
        return true;
    }
    void begin_request() { phase(lim_.head_time, lim_.max_head); }
    void begin_body() { phase(lim_.body_time, 2 * lim_.max_body + (64u << 10)); }
    // The request is in: any further read (a body the handler did not ask for) fails.
    void end_receiving() { left_ = 0; }
    Limit limit_hit() const { return hit_; }

    // The client closed its end, or the connection failed (a reply not yet written has no reader).
    bool peer_gone() const {
        if (off_ < len_) return false;  // a pipelined request is waiting: the client is there
        char c;
        const ssize_t n = ::recv(fd_, &c, 1, MSG_PEEK | MSG_DONTWAIT);
        return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
    }

    bool close_after = false;  // close once this reply is written (a body was left unread, a limit hit)

    // httplib::Stream
    bool is_readable() const override {
        if (off_ < len_) return true;
        pollfd p{fd_, POLLIN, 0};
        return ::poll(&p, 1, ms_left()) > 0;
    }
    bool is_writable() const override {
        pollfd p{fd_, POLLOUT, 0};
        return ::poll(&p, 1, lim_.write_timeout_ms) > 0 && !(p.revents & (POLLERR | POLLHUP)) && !peer_gone();
    }
    ssize_t read(char* ptr, size_t size) override {
        if (left_ == 0) return hit(Limit::size);
        if (off_ == len_) {
            pollfd p{fd_, POLLIN, 0};
            for (;;) {
                const int ms = ms_left();
                if (ms == 0) return hit(Limit::time);
                const int r = ::poll(&p, 1, ms);
                if (r > 0) break;
                if (r < 0 && errno != EINTR) return hit(Limit::closed);
            }
            const ssize_t n = fill();
            if (n == 0) return hit(Limit::closed), 0;
            if (n < 0) return hit(Limit::closed);
        }
        const std::size_t n = std::min({size, len_ - off_, left_});
        std::memcpy(ptr, buf_ + off_, n);
        off_ += n, left_ -= n;
        return ssize_t(n);
    }
    ssize_t write(const char* ptr, size_t size) override {
        pollfd p{fd_, POLLOUT, 0};
        if (::poll(&p, 1, lim_.write_timeout_ms) <= 0) return -1;
        return ::send(fd_, ptr, size, MSG_NOSIGNAL);
    }
    void get_remote_ip_and_port(std::string& ip, int& port) const override { address(::getpeername, ip, port); }
    void get_local_ip_and_port(std::string& ip, int& port) const override { address(::getsockname, ip, port); }
    socket_t socket() const override { return fd_; }

    // The connection whose request the calling thread serves (nullptr outside a request).
    static Connection* current() { return current_; }
    struct Serving {  // makes `c` current for this thread while it lives
        explicit Serving(Connection* c) { current_ = c; }
        ~Serving() { current_ = nullptr; }
    };

  private:
    void phase(std::chrono::milliseconds time, std::size_t cap) {
        deadline_ = std::chrono::steady_clock::now() + time;
        left_ = cap;
        hit_ = Limit::none;
    }
    int ms_left() const {
        const auto d = std::chrono::duration_cast<std::chrono::milliseconds>(deadline_ - std::chrono::steady_clock::now()).count();
        return d <= 0 ? 0 : int(std::min<long long>(d, 1000000));
    }
    ssize_t hit(Limit l) {
        hit_ = l;
        close_after = true;
        return -1;
    }
    ssize_t fill() {  // one recv into the empty buffer
        ssize_t n;
        do n = ::recv(fd_, buf_, sizeof buf_, 0);
        while (n < 0 && errno == EINTR);
        off_ = 0, len_ = n > 0 ? std::size_t(n) : 0;
        return n;
    }
    template <class F> void address(F get, std::string& ip, int& port) const {
        sockaddr_storage a{};
        socklen_t n = sizeof a;
        ip.clear(), port = -1;
        if (get(fd_, reinterpret_cast<sockaddr*>(&a), &n) != 0) return;
        char text[INET6_ADDRSTRLEN] = {};
        if (a.ss_family == AF_INET) {
            const auto& s = reinterpret_cast<const sockaddr_in&>(a);
            inet_ntop(AF_INET, &s.sin_addr, text, sizeof text), port = ntohs(s.sin_port);
        } else if (a.ss_family == AF_INET6) {
            const auto& s = reinterpret_cast<const sockaddr_in6&>(a);
            inet_ntop(AF_INET6, &s.sin6_addr, text, sizeof text), port = ntohs(s.sin6_port);
        }
        ip = text;
    }

    int fd_;
    const HttpLimits& lim_;
    char buf_[4096];
    std::size_t off_ = 0, len_ = 0;  // buffered bytes not yet delivered
    std::size_t left_ = 0;           // bytes this phase may still deliver
    std::chrono::steady_clock::time_point deadline_{};
    Limit hit_ = Limit::none;
    static inline thread_local Connection* current_ = nullptr;
};

// One thread per connection, at most kMaxConnections; past the cap the connection is served inline by
// the accepting thread, which GuardedServer answers with a 503 and closes at once.
class ConnectionThreads : public httplib::TaskQueue {
  public:
    void enqueue(std::function<void()> fn) override {
        {
            std::lock_guard<std::mutex> g(mu_);
            if (active_ < kMaxConnections) {
                ++active_;
                try {
                    std::thread([this, fn] {
                        fn();
                        std::lock_guard<std::mutex> g2(mu_);
                        --active_;
                        cv_.notify_all();
                    }).detach();
                    return;
                } catch (const std::system_error&) {
                    --active_;  // no thread to be had: refuse like a full server
                }
            }
        }
        over_limit_ = true;
        fn();
        over_limit_ = false;
    }
    void shutdown() override {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return active_ == 0; });
    }
    static bool over_limit() { return over_limit_; }

  private:
    std::mutex mu_;
    std::condition_variable cv_;
    std::size_t active_ = 0;
    static inline thread_local bool over_limit_ = false;
};

// cpp-httplib's Server, serving each socket through a Connection.
class GuardedServer : public httplib::Server {
  public:
    explicit GuardedServer(HttpLimits lim) : lim_(lim) {
        new_task_queue = [] { return new ConnectionThreads; };
        set_keep_alive_max_count(1000);
        set_payload_max_length(lim_.max_body);
    }
    const HttpLimits& limits() const { return lim_; }

  private:
    bool process_and_close_socket(socket_t sock) override {
        bool ret = false;
        if (ConnectionThreads::over_limit()) {
            const std::string body =
                "{\"error\":{\"message\":\"too many open connections: try again later\",\"type\":\"server_error\",\"param\":null,"
                "\"code\":\"too_many_connections\"}}\n";
            const std::string reply = "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
                                      "Connection: close\r\nContent-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
            [[maybe_unused]] const ssize_t n = ::send(sock, reply.data(), reply.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
        } else {
            Connection conn(sock, lim_);
            Connection::Serving serving(&conn);
            for (std::size_t count = keep_alive_max_count_; count > 0; --count) {
                if (!conn.wait_request(lim_.keep_alive, [&] { return svr_sock_ == INVALID_SOCKET; })) break;
                conn.begin_request();
                bool closed = false;
                // Range requests are ignored (RFC 9110 allows it): one reply of the whole resource, never
                // thousands of copies of it in one multipart answer.
                ret = process_request(conn, count == 1, closed, [](httplib::Request& r) { r.ranges.clear(); });
                if (!ret || closed || conn.close_after) break;
            }
        }
        ::shutdown(sock, SHUT_RDWR);
        ::close(sock);
        return ret;
    }
    HttpLimits lim_;
};

}  // namespace kimik3::cli
