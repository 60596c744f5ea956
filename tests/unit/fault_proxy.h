// A TCP proxy in front of a real server that breaks some connections the
// way networks and overloaded servers do: a 503 answer, a reset before any
// answer, an answer cut off midway, or silence. Used to test the S3
// backend's retries against a real S3 server. One request per connection
// (clients set ObjectStoreOptions::reuse_connections = false), so the fault plan
// chooses per request.
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
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace ckptfs::testing {

class FaultProxy {
 public:
  enum class Fault { kNone, kServiceUnavailable, kResetBeforeAnswer, kCutAnswer, kSilence };

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
    ::listen(listener_, 64);
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
    for (auto& t : workers_) t.join();
  }
  int port() const { return port_; }
  int faults() const { return faults_; }
  int connections() const { return connections_; }

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
      workers_.emplace_back([this, client, f] { Serve(client, f); });
    }
  }

  static void Reset(int fd) {
    linger l{1, 0};  // close with RST
    ::setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof l);
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
      case Fault::kServiceUnavailable: {
        ReadHeaders(client);
        const char* answer =
            "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/xml\r\nContent-Length: 64\r\n"
            "Connection: close\r\n\r\n<Error><Code>SlowDown</Code><Message></Message></Error>\n        ";
        (void)!::write(client, answer, std::strlen(answer));
        Reset(client);
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
  std::mutex mu_;
  std::vector<std::thread> workers_;
};

}  // namespace ckptfs::testing
