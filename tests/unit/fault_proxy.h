// A TCP proxy in front of a real server that breaks some connections the
// way networks and overloaded servers do: a 503 SlowDown or 429 answer, a
// reset before any answer, an answer cut off midway, or silence. Used to
// test the S3 backend's retries against a real S3 server, and, with a
// RateLimit in its plan, to throttle like a store's request-rate limit
// (tools/bench/restart_storm_bench.cc). One request per connection
// (clients set ObjectStoreOptions::reuse_connections = false), so the fault plan
// chooses per request. Counts the bytes each way.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <algorithm>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace ckptfs::testing {

class FaultProxy {
 public:
  enum class Fault { kNone, kServiceUnavailable, kTooManyRequests, kResetBeforeAnswer, kCutAnswer, kSilence };

  // Forwards 127.0.0.1:port() to 127.0.0.1:upstream_port; plan(n) decides
  // the fate of the n-th connection (from 0).
  FaultProxy(int upstream_port, std::function<Fault(int)> plan) : upstream_(upstream_port), plan_(std::move(plan)) {
    listener_ = ::socket(AF_INET, SOCK_STREAM, 0);
    int one = 1;
    ::setsockopt(listener_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = 0;
    ::bind(listener_, reinterpret_cast<sockaddr*>(&a), sizeof a);
    ::listen(listener_, 1024);
    socklen_t len = sizeof a;
    ::getsockname(listener_, reinterpret_cast<sockaddr*>(&a), &len);
    port_ = ntohs(a.sin_port);
    accept_thread_ = std::thread([this] { AcceptLoop(); });
  }
  ~FaultProxy() {
    stop_ = true;
    accept_thread_.join();
    ::close(listener_);
    std::lock_guard lock(mu_);
    for (auto& w : workers_) w.thread.join();
  }
  int port() const { return port_; }
  int faults() const { return faults_; }
  int connections() const { return connections_; }
  // Bytes the server answered (what clients downloaded, at the wire:
  // headers included) and bytes clients sent.
  uint64_t bytes_down() const { return bytes_down_; }
  uint64_t bytes_up() const { return bytes_up_; }

 private:
  void AcceptLoop() {
    while (!stop_) {
      pollfd p{listener_, POLLIN, 0};
      if (::poll(&p, 1, 50) <= 0) continue;
      int client = ::accept(listener_, nullptr, nullptr);
      if (client < 0) continue;
      const Fault f = plan_(connections_++);
      if (f != Fault::kNone) ++faults_;
      std::lock_guard lock(mu_);
      // Threads of connections that ended are joined as new ones come.
      std::erase_if(workers_, [](Worker& w) {
        if (!w.done->load()) return false;
        w.thread.join();
        return true;
      });
      auto done = std::make_shared<std::atomic<bool>>(false);
      workers_.push_back({std::thread([this, client, f, done] {
                            Serve(client, f);
                            done->store(true);
                          }),
                          done});
    }
  }

  static void Reset(int fd) {
    linger l{1, 0};  // close with RST
    ::setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof l);
    ::close(fd);
  }

  // Ends a connection whose answer was sent the way a server does: the
  // client reads the whole answer, where a reset could reach it first.
  static void CloseAfterAnswer(int fd) {
    ::shutdown(fd, SHUT_WR);
    char buf[4096];
    for (int i = 0; i < 20; ++i) {
      pollfd p{fd, POLLIN, 0};
      if (::poll(&p, 1, 50) > 0 && ::read(fd, buf, sizeof buf) <= 0) break;
    }
    ::close(fd);
  }

  // Reads until the end of the request's headers (or the client goes).
  static void ReadHeaders(int fd) {
    std::string seen;
    char buf[4096];
    while (seen.find("\r\n\r\n") == std::string::npos) {
      pollfd p{fd, POLLIN, 0};
      if (::poll(&p, 1, 5000) <= 0) return;
      ssize_t n = ::read(fd, buf, sizeof buf);
      if (n <= 0) return;
      seen.append(buf, static_cast<size_t>(n));
    }
  }

  void Serve(int client, Fault f) {
    switch (f) {
      case Fault::kServiceUnavailable:
      case Fault::kTooManyRequests: {
        ReadHeaders(client);
        const char* answer =
            f == Fault::kServiceUnavailable
                ? "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/xml\r\nContent-Length: 64\r\n"
                  "Connection: close\r\n\r\n<Error><Code>SlowDown</Code><Message></Message></Error>\n        "
                : "HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/xml\r\nContent-Length: 64\r\n"
                  "Connection: close\r\n\r\n<Error><Code>TooManyRequests</Code><Message></Message></Error>  ";
        (void)!::write(client, answer, std::strlen(answer));
        CloseAfterAnswer(client);
        return;
      }
      case Fault::kResetBeforeAnswer:
        ReadHeaders(client);
        Reset(client);
        return;
      case Fault::kSilence:
        ReadHeaders(client);
        for (int i = 0; i < 40 && !stop_; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
        Reset(client);
        return;
      case Fault::kNone:
      case Fault::kCutAnswer:
        break;
    }
    int server = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<uint16_t>(upstream_));
    if (::connect(server, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
      ::close(server);
      Reset(client);
      return;
    }
    // Pumps both ways until one side closes; a cut answer stops after the
    // first 200 bytes from the server.
    size_t answered = 0;
    char buf[1 << 16];
    bool open = true;
    while (open && !stop_) {
      pollfd p[2] = {{client, POLLIN, 0}, {server, POLLIN, 0}};
      if (::poll(p, 2, 100) <= 0) continue;
      for (int i = 0; i < 2 && open; ++i) {
        if (!(p[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
        const int from = i == 0 ? client : server, to = i == 0 ? server : client;
        ssize_t n = ::read(from, buf, sizeof buf);
        if (n <= 0) {
          open = false;
          break;
        }
        size_t send = static_cast<size_t>(n);
        if (f == Fault::kCutAnswer && from == server) {
          send = std::min(send, answered < 200 ? 200 - answered : 0);
          answered += send;
        }
        for (size_t done = 0; done < send;) {
          ssize_t w = ::write(to, buf + done, send - done);
          if (w <= 0) {
            open = false;
            break;
          }
          done += static_cast<size_t>(w);
        }
        (from == server ? bytes_down_ : bytes_up_) += send;
        if (f == Fault::kCutAnswer && answered >= 200) open = false;
      }
    }
    ::close(server);
    Reset(client);
  }

  int upstream_;
  std::function<Fault(int)> plan_;
  int listener_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::atomic<int> connections_{0};
  std::atomic<int> faults_{0};
  std::thread accept_thread_;
  std::atomic<uint64_t> bytes_down_{0}, bytes_up_{0};
  std::mutex mu_;
  struct Worker {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> done;
  };
  std::vector<Worker> workers_;
};

// A request-rate limit for a FaultProxy's plan: a token bucket admitting
// `per_second` requests a second on average and `burst` at once. Admit() is
// called from the proxy's accept thread only.
class RateLimit {
 public:
  RateLimit(double per_second, double burst) : rate_(per_second), burst_(burst), tokens_(burst) {}
  bool Admit() {
    const auto now = std::chrono::steady_clock::now();
    tokens_ = std::min(burst_, tokens_ + rate_ * std::chrono::duration<double>(now - last_).count());
    last_ = now;
    if (tokens_ < 1) return false;
    tokens_ -= 1;
    return true;
  }

 private:
  double rate_, burst_, tokens_;
  std::chrono::steady_clock::time_point last_ = std::chrono::steady_clock::now();
};

}  // namespace ckptfs::testing
