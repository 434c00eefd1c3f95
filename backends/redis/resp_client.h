// A small blocking Redis client (RESP2 over TCP) for tfde's native Redis
// ops: pipelines of HMGET / HSET on table buckets of a standalone server, the
// master a set of sentinels names, or the nodes of a cluster.  No TensorFlow
// includes.
//
// Only what the ops need: AUTH, SELECT, CLUSTER SLOTS, SENTINEL
// get-master-addr-by-name, and the idempotent commands they pipeline.
// Commands for one node are sent together and their replies read in order.
//
// Thread-safety: a Client may be used from several threads; calls are
// serialized by its mutex (one connection per node).
#ifndef TFDE_BACKENDS_REDIS_RESP_CLIENT_H_
#define TFDE_BACKENDS_REDIS_RESP_CLIENT_H_

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

namespace tfde {
namespace resp {

constexpr int kClusterSlots = 16384;
constexpr int kBackoffBaseMs = 50;   // first retry delay; doubles per retry
constexpr int kBackoffMaxMs = 1000;  // longest delay between retries
constexpr size_t kReadChunk = 1 << 16;

// A failure talking to a server.  transient: the connection broke or timed
// out (worth a retry); otherwise the server answered with an error.
class Error : public std::runtime_error {
 public:
  Error(const std::string& what, bool transient) : std::runtime_error(what), transient_(transient) {}
  bool transient() const { return transient_; }

 private:
  bool transient_;
};

struct Reply {
  enum Type { kStatus, kError, kInteger, kBulk, kNil, kArray } type = kNil;
  std::string str;  // status, error or bulk payload
  int64_t integer = 0;
  std::vector<Reply> elements;
};

// CRC16 (XMODEM) of a key's hash slot, as Redis Cluster defines it: only the
// part between the first '{' and the next '}' counts when non-empty.
inline uint16_t Crc16(std::string_view s) {
  uint16_t crc = 0;
  for (unsigned char c : s) {
    crc ^= static_cast<uint16_t>(c) << 8;
    for (int i = 0; i < 8; ++i) crc = (crc & 0x8000) ? static_cast<uint16_t>((crc << 1) ^ 0x1021) : crc << 1;
  }
  return crc;
}

inline int KeySlot(std::string_view key) {
  const size_t open = key.find('{');
  if (open != std::string_view::npos) {
    const size_t close = key.find('}', open + 1);
    if (close != std::string_view::npos && close > open + 1) key = key.substr(open + 1, close - open - 1);
  }
  return Crc16(key) % kClusterSlots;
}

// One TCP connection to host:port.
class Connection {
 public:
  Connection(std::string host, int port, int connect_timeout_ms, int socket_timeout_ms)
      : host_(std::move(host)), port_(port) {
    Connect(connect_timeout_ms, socket_timeout_ms);
  }
  ~Connection() {
    if (fd_ >= 0) ::close(fd_);
  }
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  std::string Address() const { return host_ + ":" + std::to_string(port_); }

  // Queues one command (sent by Flush).
  void Append(const std::vector<std::string_view>& args) {
    out_ += "*" + std::to_string(args.size()) + "\r\n";
    for (std::string_view a : args) {
      out_ += "$" + std::to_string(a.size()) + "\r\n";
      out_.append(a.data(), a.size());
      out_ += "\r\n";
    }
  }

  void Flush() {
    size_t sent = 0;
    while (sent < out_.size()) {
      const ssize_t k = ::send(fd_, out_.data() + sent, out_.size() - sent, MSG_NOSIGNAL);
      if (k < 0) {
        if (errno == EINTR) continue;
        Fail("write", errno);
      }
      sent += static_cast<size_t>(k);
    }
    out_.clear();
  }

  Reply Read() {
    Reply r;
    const std::string line = ReadLine();
    if (line.empty()) throw Error(Address() + " sent an empty reply line", true);
    const std::string_view body(line.data() + 1, line.size() - 1);
    switch (line[0]) {
      case '+': r.type = Reply::kStatus; r.str = std::string(body); break;
      case '-': r.type = Reply::kError; r.str = std::string(body); break;
      case ':': r.type = Reply::kInteger; r.integer = ParseInt(body); break;
      case '$': {
        const int64_t n = ParseInt(body);
        if (n < 0) {
          r.type = Reply::kNil;
          break;
        }
        r.type = Reply::kBulk;
        r.str = ReadExact(static_cast<size_t>(n));
        if (ReadExact(2) != "\r\n") throw Error(Address() + " sent a malformed bulk reply", true);
        break;
      }
      case '*': {
        const int64_t n = ParseInt(body);
        if (n < 0) {
          r.type = Reply::kNil;
          break;
        }
        r.type = Reply::kArray;
        r.elements.reserve(static_cast<size_t>(n));
        for (int64_t i = 0; i < n; ++i) r.elements.push_back(Read());
        break;
      }
      default:
        throw Error(Address() + " sent an unknown reply type '" + line.substr(0, 1) + "'", true);
    }
    return r;
  }

  // Sends one command and returns its reply; an error reply throws.
  Reply Call(const std::vector<std::string_view>& args) {
    Append(args);
    Flush();
    Reply r = Read();
    if (r.type == Reply::kError) throw Error(Address() + " answered " + std::string(args[0]) + ": " + r.str, false);
    return r;
  }

 private:
  void Connect(int connect_timeout_ms, int socket_timeout_ms) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* found = nullptr;
    const int rc = ::getaddrinfo(host_.c_str(), std::to_string(port_).c_str(), &hints, &found);
    if (rc != 0) throw Error("cannot resolve " + Address() + ": " + gai_strerror(rc), true);
    std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> guard(found, &::freeaddrinfo);
    std::string last = "no address";
    for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
      const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
      if (fd < 0) continue;
      if (ConnectWithTimeout(fd, a, connect_timeout_ms, &last)) {
        fd_ = fd;
        break;
      }
      ::close(fd);
    }
    if (fd_ < 0) throw Error("cannot connect to " + Address() + ": " + last, true);
    const int one = 1;
    ::setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    timeval tv{socket_timeout_ms / 1000, (socket_timeout_ms % 1000) * 1000};
    ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    ::setsockopt(fd_, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  }

  static bool ConnectWithTimeout(int fd, const addrinfo* a, int timeout_ms, std::string* why) {
    const int flags = ::fcntl(fd, F_GETFL, 0);
    ::fcntl(fd, F_SETFL, flags | O_NONBLOCK);
    int rc = ::connect(fd, a->ai_addr, a->ai_addrlen);
    if (rc != 0 && errno == EINPROGRESS) {
      pollfd p{fd, POLLOUT, 0};
      rc = ::poll(&p, 1, timeout_ms);
      if (rc == 0) {
        *why = "timed out after " + std::to_string(timeout_ms) + " ms";
        return false;
      }
      int err = 0;
      socklen_t len = sizeof(err);
      ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
      if (rc < 0 || err != 0) {
        *why = std::strerror(rc < 0 ? errno : err);
        return false;
      }
    } else if (rc != 0) {
      *why = std::strerror(errno);
      return false;
    }
    ::fcntl(fd, F_SETFL, flags);
    return true;
  }

  [[noreturn]] void Fail(const char* what, int err) {
    const bool timeout = err == EAGAIN || err == EWOULDBLOCK;
    throw Error(std::string(what) + " to " + Address() + (timeout ? " timed out" : " failed: " + std::string(std::strerror(err))),
                true);
  }

  void Fill() {
    if (pos_ > 0 && pos_ == in_.size()) {
      in_.clear();
      pos_ = 0;
    }
    char buf[kReadChunk];
    ssize_t k;
    do {
      k = ::recv(fd_, buf, sizeof(buf), 0);
    } while (k < 0 && errno == EINTR);
    if (k < 0) Fail("read", errno);
    if (k == 0) throw Error(Address() + " closed the connection", true);
    in_.append(buf, static_cast<size_t>(k));
  }

  std::string ReadLine() {
    size_t end;
    while ((end = in_.find("\r\n", pos_)) == std::string::npos) Fill();
    std::string line = in_.substr(pos_, end - pos_);
    pos_ = end + 2;
    return line;
  }

  std::string ReadExact(size_t n) {
    while (in_.size() - pos_ < n) Fill();
    std::string out = in_.substr(pos_, n);
    pos_ += n;
    return out;
  }

  int64_t ParseInt(std::string_view s) const {
    try {
      size_t used = 0;
      const int64_t v = std::stoll(std::string(s), &used);
      if (used != s.size()) throw std::invalid_argument("trailing bytes");
      return v;
    } catch (const std::exception&) {
      throw Error(Address() + " sent a malformed integer '" + std::string(s) + "'", true);
    }
  }

  std::string host_;
  int port_;
  int fd_ = -1;
  std::string out_;  // commands not sent yet
  std::string in_;   // bytes received, not parsed yet from pos_
  size_t pos_ = 0;
};

// Where and how to connect; mirrors the Redis JSON config's fields.
struct Config {
  int mode = 2;  // 0 cluster, 1 sentinel, 2 standalone (TFRA's redis_connection_mode)
  std::vector<std::pair<std::string, int>> servers;
  std::string master_name;
  int db = 0;
  std::string user, password;
  std::string sentinel_user, sentinel_password;
  int connect_timeout_ms = 1000;
  int socket_timeout_ms = 1000;
  int retries = 4;
};

// One command of a pipeline: `key` (a Redis key the command touches) routes
// it to its cluster node; `args` is the whole command (args[0] its name).
struct Command {
  std::string_view key;
  std::vector<std::string_view> args;
};

// Runs pipelines of idempotent commands (HMGET, HSET) against the servers of
// a Config, reconnecting and retrying (with backoff) when a connection breaks
// or a cluster slot moves.
class Client {
 public:
  explicit Client(Config config) : config_(std::move(config)) {}

  // Sends `commands` (pipelined per node) and passes each reply to
  // deliver(i, reply) in command order per node.  On a retry every command
  // runs again (so deliver may see a command twice; the last call counts).
  // An error reply throws a non-transient Error naming the server.
  void Pipeline(const std::vector<Command>& commands, const std::function<void(size_t, const Reply&)>& deliver) {
    std::lock_guard<std::mutex> lock(mu_);
    std::string last;
    for (int attempt = 0; attempt <= config_.retries; ++attempt) {
      if (attempt > 0) {
        const int ms = std::min(kBackoffMaxMs, kBackoffBaseMs << std::min(attempt - 1, 10));
        std::this_thread::sleep_for(std::chrono::milliseconds(ms));
      }
      try {
        if (TryPipeline(commands, deliver)) return;
        last = "the cluster moved a slot";
      } catch (const Error& e) {
        if (!e.transient()) throw;
        last = e.what();
        connections_.clear();  // reconnect (and rediscover) on the next attempt
        discovered_ = false;
      }
    }
    throw Error("Redis (" + Describe() + ") unreachable after " + std::to_string(config_.retries + 1) +
                    " attempts: " + last,
                true);
  }

  std::string Describe() const {
    std::string s = config_.mode == 0 ? "cluster " : config_.mode == 1 ? "sentinels " : "server ";
    for (size_t i = 0; i < config_.servers.size(); ++i)
      s += (i ? "," : "") + config_.servers[i].first + ":" + std::to_string(config_.servers[i].second);
    return s;
  }

 private:
  // false: a MOVED/ASK reply (the slot map changed); the caller retries.
  bool TryPipeline(const std::vector<Command>& commands, const std::function<void(size_t, const Reply&)>& deliver) {
    Discover();
    std::map<std::string, std::vector<size_t>> by_node;
    for (size_t i = 0; i < commands.size(); ++i) by_node[NodeOf(commands[i].key)].push_back(i);
    for (const auto& [node, list] : by_node) {
      Connection& c = ConnectionTo(node);
      for (size_t i : list) c.Append(commands[i].args);
      c.Flush();
      bool moved = false;
      for (size_t i : list) {  // read every reply, even after a MOVED, to keep the stream in step
        Reply r = c.Read();
        if (r.type == Reply::kError) {
          if (r.str.rfind("MOVED", 0) == 0 || r.str.rfind("ASK", 0) == 0) {
            moved = true;
            continue;
          }
          throw Error(c.Address() + " answered " + std::string(commands[i].args[0]) + " " +
                          std::string(commands[i].key) + ": " + r.str,
                      false);
        }
        if (!moved) deliver(i, r);
      }
      if (moved) {
        discovered_ = false;
        return false;
      }
    }
    return true;
  }

  std::string NodeOf(std::string_view key) const {
    return config_.mode == 0 ? slot_nodes_[KeySlot(key)] : master_;
  }

  Connection& ConnectionTo(const std::string& node) {
    auto it = connections_.find(node);
    if (it != connections_.end()) return *it->second;
    const size_t colon = node.rfind(':');
    auto c = std::make_unique<Connection>(node.substr(0, colon), std::stoi(node.substr(colon + 1)),
                                          config_.connect_timeout_ms, config_.socket_timeout_ms);
    Authenticate(*c, config_.user, config_.password);
    if (config_.mode != 0 && config_.db != 0) c->Call({"SELECT", std::to_string(config_.db)});
    return *connections_.emplace(node, std::move(c)).first->second;
  }

  static void Authenticate(Connection& c, const std::string& user, const std::string& password) {
    if (password.empty()) return;
    if (user.empty() || user == "default") {
      c.Call({"AUTH", password});
    } else {
      c.Call({"AUTH", user, password});
    }
  }

  void Discover() {
    if (discovered_) return;
    std::string last = "no servers configured";
    if (config_.mode == 2) {
      master_ = config_.servers.at(0).first + ":" + std::to_string(config_.servers.at(0).second);
      discovered_ = true;
      return;
    }
    for (const auto& [host, port] : config_.servers) {
      try {
        Connection c(host, port, config_.connect_timeout_ms, config_.socket_timeout_ms);
        if (config_.mode == 1) {
          Authenticate(c, config_.sentinel_user, config_.sentinel_password);
          Reply r = c.Call({"SENTINEL", "get-master-addr-by-name", config_.master_name});
          if (r.type != Reply::kArray || r.elements.size() != 2)
            throw Error(c.Address() + " knows no master named '" + config_.master_name + "'", false);
          master_ = r.elements[0].str + ":" + r.elements[1].str;
        } else {
          Authenticate(c, config_.user, config_.password);
          LoadSlots(c.Call({"CLUSTER", "SLOTS"}), c.Address());
        }
        discovered_ = true;
        return;
      } catch (const Error& e) {
        last = e.what();
        if (!e.transient() && config_.mode == 1) throw;
      }
    }
    throw Error(last, true);
  }

  void LoadSlots(const Reply& r, const std::string& from) {
    slot_nodes_.assign(kClusterSlots, "");
    if (r.type != Reply::kArray) throw Error(from + " sent a malformed CLUSTER SLOTS reply", false);
    for (const Reply& range : r.elements) {
      if (range.type != Reply::kArray || range.elements.size() < 3 || range.elements[2].type != Reply::kArray ||
          range.elements[2].elements.size() < 2)
        throw Error(from + " sent a malformed CLUSTER SLOTS entry", false);
      const int64_t lo = range.elements[0].integer, hi = range.elements[1].integer;
      const Reply& node = range.elements[2];
      const std::string addr = node.elements[0].str + ":" + std::to_string(node.elements[1].integer);
      for (int64_t s = lo; s <= hi && s < kClusterSlots; ++s)
        if (s >= 0) slot_nodes_[static_cast<size_t>(s)] = addr;
    }
    for (const std::string& n : slot_nodes_)
      if (n.empty()) throw Error(from + ": the cluster does not cover every slot", false);
  }

  Config config_;
  std::mutex mu_;
  bool discovered_ = false;                // master_ / slot_nodes_ are current
  std::string master_;                     // modes 1, 2: "host:port" of the server to read
  std::vector<std::string> slot_nodes_;    // mode 0: "host:port" per cluster slot
  std::map<std::string, std::unique_ptr<Connection>> connections_;  // by "host:port"
};

}  // namespace resp
}  // namespace tfde

#endif  // TFDE_BACKENDS_REDIS_RESP_CLIENT_H_
