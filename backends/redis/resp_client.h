// A small blocking Redis client (RESP2 over TCP) for tfde's native Redis
// ops: pipelines of commands on table buckets of a standalone server, the
// master a set of sentinels names, or the nodes of a cluster (or, for reads,
// their replicas).  No TensorFlow includes.
//
// Only what the ops need: AUTH, SELECT, READONLY, CLUSTER SLOTS, SENTINEL
// get-master-addr-by-name and replicas, EXISTS / SET NX of a table's meta
// key, and the commands they pipeline, which must be safe to send again (a
// retry resends them all): HMGET, HSET, HDEL, HLEN, DEL, transactions of
// HSETs, and EVALs that mark themselves applied.  A pipeline's commands go
// to every node before any reply is read (the nodes work at once), in
// pieces of kSendBytes as they are encoded; each node's replies are read in
// order, parsed in place from the receive buffer into reused Replies.
//
// The stream stays in step: every reply of a pipeline is read before any
// error reply is acted on, and a connection whose stream is not known to be
// in step (a failure mid-write or mid-read, a malformed reply, a timeout) is
// closed, never used again.  Error replies are classified by their code (the
// first word) with the table the ops receive from tfde/errors.py
// (REDIS_ERROR_KINDS): "not now" is retried with backoff, "no" fails at once.
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
#include <charconv>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
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
constexpr size_t kSendBytes = 1 << 13;  // a pipeline's commands queued for a node are sent once this many bytes
constexpr int kReplicaPauseMs = 30000;  // reads stay on the master this long after a replica failed

constexpr int64_t kMaxBulkBytes = int64_t{512} << 20;  // Redis's own proto-max-bulk-len default
constexpr int64_t kMaxReserve = 1 << 16;               // array slots reserved up front; more grow as read
constexpr size_t kMaxSpareBytes = size_t{1} << 20;     // reply strings a connection keeps for reuse

// Milliseconds to wait before the next attempt after `failures` (1, 2, ...)
// failures in a row: kBackoffBaseMs doubling, at most kBackoffMaxMs.  The
// same policy as backoff_s in tfde/tables/redis_table.py (the redis-py
// side); tests/test_redis_faults.py compares the two.
inline int BackoffMs(int failures) {
  return std::min(kBackoffMaxMs, kBackoffBaseMs << std::min(std::max(failures, 1) - 1, 10));
}

// What a failure means for the caller (tfde/errors.py names the classes):
enum class ErrorKind {
  kTransient,    // the connection broke or timed out, a reply was malformed, or the server said "not
                 // now" (LOADING, BUSY, ...): retried; BackendUnavailableError when retries run out
  kRefused,      // the server said no (WRONGTYPE, NOSCRIPT, ERR ...): BackendError, at once
  kCapacity,     // the server is out of memory (OOM): CapacityError, at once
  kCredentials,  // NOAUTH, WRONGPASS, NOPERM: CredentialsError, at once
  kTableLost,    // a table's meta key is gone (the server restarted empty or was flushed): BackendError
};

// A failure talking to a server.
class Error : public std::runtime_error {
 public:
  Error(const std::string& what, ErrorKind kind) : std::runtime_error(what), kind_(kind) {}
  // transient: kTransient, else kRefused.
  Error(const std::string& what, bool transient)
      : Error(what, transient ? ErrorKind::kTransient : ErrorKind::kRefused) {}
  // A transient error that ended the retries: how many attempts were made
  // and how long the backoff between them waited in all.
  Error(const std::string& what, int attempts, int waited_ms) : Error(what, ErrorKind::kTransient) {
    attempts_ = attempts;
    waited_ms_ = waited_ms;
  }
  ErrorKind kind() const { return kind_; }
  bool transient() const { return kind_ == ErrorKind::kTransient; }
  int attempts() const { return attempts_; }
  int waited_ms() const { return waited_ms_; }

 private:
  ErrorKind kind_;
  int attempts_ = 1;
  int waited_ms_ = 0;
};

// The code of an error reply: its first word ("WRONGTYPE", "LOADING", ...).
inline std::string_view ErrorCode(std::string_view reply) { return reply.substr(0, reply.find(' ')); }

// MOVED / ASK: the cluster redirects the command to another node.
inline bool IsRedirect(std::string_view reply) {
  const std::string_view code = ErrorCode(reply);
  return code == "MOVED" || code == "ASK";
}

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

  // How long a read may wait for the server (SO_RCVTIMEO).
  void SetReceiveTimeout(int ms) const {
    timeval tv{ms / 1000, (ms % 1000) * 1000};
    ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  }

  // Queues one command (sent by Flush).
  void Append(const std::vector<std::string_view>& args) {
    AppendHeader('*', args.size());
    for (std::string_view a : args) {
      AppendHeader('$', a.size());
      out_.append(a.data(), a.size());
      out_.append("\r\n", 2);
    }
  }

  // Bytes queued by Append and not sent yet.
  size_t Queued() const { return out_.size(); }

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
    ReadInto(&r);
    return r;
  }

  // Reads the next reply into *r, reusing the buffers of what *r held and of
  // the elements earlier replies no longer need (spare_): a pipeline of
  // large arrays (HMGET's rows) allocates for its first reply, not for every
  // element of every reply.
  void ReadInto(Reply* r) {
    // The line is a view into the input buffer: used before the next read.
    const std::string_view line = ReadLine();
    if (line.empty()) throw Error(Address() + " sent an empty reply line", true);
    const std::string_view body = line.substr(1);
    if (line[0] != '*') Recycle(&r->elements, 0);
    r->str.clear();  // keeps its buffer
    r->integer = 0;
    switch (line[0]) {
      case '+':
        r->type = Reply::kStatus;
        r->str.assign(body);
        break;
      case '-':
        r->type = Reply::kError;
        r->str.assign(body);
        break;
      case ':':
        r->type = Reply::kInteger;
        r->integer = ParseInt(body);
        break;
      case '$': {
        const int64_t n = ParseInt(body);
        if (n < 0) {
          r->type = Reply::kNil;
          break;
        }
        if (n > kMaxBulkBytes) throw Error(Address() + " sent a malformed bulk length " + std::to_string(n), true);
        r->type = Reply::kBulk;
        const std::string_view payload = ReadExact(static_cast<size_t>(n) + 2);
        if (payload.substr(payload.size() - 2) != "\r\n") throw Error(Address() + " sent a malformed bulk reply", true);
        r->str.assign(payload.data(), payload.size() - 2);
        break;
      }
      case '*': {
        const int64_t n = ParseInt(body);
        if (n < 0) {
          Recycle(&r->elements, 0);
          r->type = Reply::kNil;
          break;
        }
        r->type = Reply::kArray;
        // Grown as elements arrive (a malformed length allocates nothing).
        const size_t count = static_cast<size_t>(n);
        if (r->elements.size() > count) Recycle(&r->elements, count);
        r->elements.reserve(std::min(count, static_cast<size_t>(kMaxReserve)));
        for (size_t i = 0; i < count; ++i) {
          if (i == r->elements.size()) {
            if (spare_.empty()) {
              r->elements.emplace_back();
            } else {
              spare_bytes_ -= spare_.back().str.capacity();
              r->elements.push_back(std::move(spare_.back()));
              spare_.pop_back();
            }
          }
          ReadInto(&r->elements[i]);
        }
        break;
      }
      default:
        throw Error(Address() + " sent an unknown reply type '" + std::string(line.substr(0, 1)) + "'", true);
    }
  }

  // Sends one command and returns its reply, an error reply included.
  Reply Exchange(const std::vector<std::string_view>& args) {
    Append(args);
    Flush();
    return Read();
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
    throw Error(std::string(what) + " to " + Address() +
                    (timeout ? " timed out" : " failed: " + std::string(std::strerror(err))),
                true);
  }

  // Receives what the server sent so far (at least a byte) after the bytes
  // not parsed yet, straight into the input buffer: the parsed bytes before
  // them are dropped first, and the buffer grows only for a reply larger
  // than it.
  void Fill() {
    if (begin_ > 0) {
      std::memmove(in_.data(), in_.data() + begin_, end_ - begin_);
      end_ -= begin_;
      begin_ = 0;
    }
    if (in_.size() - end_ < kReadChunk) in_.resize(std::max(in_.size() * 2, end_ + kReadChunk));
    ssize_t k;
    do {
      k = ::recv(fd_, in_.data() + end_, in_.size() - end_, 0);
    } while (k < 0 && errno == EINTR);
    if (k < 0) Fail("read", errno);
    if (k == 0) throw Error(Address() + " closed the connection", true);
    end_ += static_cast<size_t>(k);
  }

  // The next line, without its CRLF, as a view into the input buffer (valid
  // until the next Fill).
  std::string_view ReadLine() {
    size_t scanned = begin_;  // no CRLF ends before here
    for (;;) {
      const std::string_view have(in_.data() + scanned, end_ - scanned);
      const size_t at = have.find("\r\n");
      if (at != std::string_view::npos) {
        const std::string_view line(in_.data() + begin_, scanned + at - begin_);
        begin_ = scanned + at + 2;
        return line;
      }
      scanned = end_ > scanned ? end_ - 1 : scanned;  // a CR may be the last byte
      scanned -= begin_;
      Fill();  // moves the unparsed bytes to the front
      scanned += begin_;
    }
  }

  // The next n bytes, as a view into the input buffer (valid until the next
  // Fill).
  std::string_view ReadExact(size_t n) {
    while (end_ - begin_ < n) Fill();
    const std::string_view out(in_.data() + begin_, n);
    begin_ += n;
    return out;
  }

  // Appends "<type><n>\r\n".
  void AppendHeader(char type, size_t n) {
    char head[24];
    head[0] = type;
    char* end = std::to_chars(head + 1, head + sizeof(head) - 2, n).ptr;
    *end++ = '\r';
    *end++ = '\n';
    out_.append(head, static_cast<size_t>(end - head));
  }

  // Keeps the first `keep` of *elements; the rest (and their own elements)
  // go to spare_ for later replies to reuse, at most kMaxReserve of them
  // holding kMaxSpareBytes of strings: a connection keeps little between
  // calls, however large a reply was.
  void Recycle(std::vector<Reply>* elements, size_t keep) {
    for (size_t i = keep; i < elements->size(); ++i) {
      Reply& e = (*elements)[i];
      Recycle(&e.elements, 0);
      const size_t bytes = e.str.capacity();
      if (spare_.size() < static_cast<size_t>(kMaxReserve) && spare_bytes_ + bytes <= kMaxSpareBytes) {
        spare_bytes_ += bytes;
        spare_.push_back(std::move(e));
      }
    }
    elements->resize(keep);
  }

  int64_t ParseInt(std::string_view s) const {
    int64_t v = 0;
    const auto [end, error] = std::from_chars(s.data(), s.data() + s.size(), v);
    if (error != std::errc() || end != s.data() + s.size() || s.empty())
      throw Error(Address() + " sent a malformed integer '" + std::string(s) + "'", true);
    return v;
  }

  std::string host_;
  int port_;
  int fd_ = -1;
  std::string out_;       // commands not sent yet
  std::vector<char> in_;  // bytes received: parsed before begin_, not parsed yet in [begin_, end_)
  size_t begin_ = 0, end_ = 0;
  std::vector<Reply> spare_;  // elements of earlier replies, for ReadInto to reuse
  size_t spare_bytes_ = 0;    // the capacity of their strings
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
  // How long a failing call is retried: the backoff waited in all, in
  // milliseconds (redis_retry_deadline_ms; 0: one attempt).
  int retry_deadline_ms = 60000;
  // Kinds of error replies by code (tfde/errors.py REDIS_ERROR_KINDS); a
  // code not listed is kRefused.  MOVED / ASK are followed, never errors.
  std::map<std::string, ErrorKind, std::less<>> error_kinds;
  // The table's meta key ("" for none).  Each new connection to the node
  // holding it checks that it still exists: a server restarted without
  // persistence (or flushed) comes back empty, and reading on would hand out
  // initial rows for trained keys.  With recreate_meta the key is written
  // again (SET NX meta_value) instead and on_recreate is told.
  std::string table_name;  // for messages
  std::string meta_key, meta_value;
  bool recreate_meta = false;
  std::function<void(const std::string&)> on_recreate;
  // Reads from a replica (redis_read_access_slave; only the find op asks):
  // in a cluster each slot's first replica (READONLY on every connection),
  // with sentinels a replica they report up and in sync, at random; the
  // master when there is none.  A replica that fails (unreachable, or
  // without the table's meta key: lagging or resyncing) sends the client to
  // the master, on the retry, for kReplicaPauseMs.  Such a client must only
  // read: replicas refuse writes.
  bool read_from_replicas = false;
  // Durability (redis_write_replicas, redis_write_replicas_timeout_ms): a
  // pipeline of writes ends on each node with WAIT wait_replicas
  // wait_timeout_ms, and fewer acknowledgements than wait_replicas is a
  // transient failure (retried: the writes are safe to resend, and a
  // resyncing replica may catch up).  0: no WAIT.
  int wait_replicas = 0;
  int wait_timeout_ms = 1000;
};

// One command of a pipeline: `key` (a Redis key the command touches) routes
// it to its cluster node; `args` is the whole command (args[0] its name).
struct Command {
  std::string_view key;
  std::vector<std::string_view> args;
};

// Runs pipelines of commands safe to resend (see the top) against the servers of
// a Config, reconnecting and retrying (with backoff) when a connection breaks,
// a server answers "not now", or a cluster slot moves.
class Client {
 public:
  explicit Client(Config config) : config_(std::move(config)) {}

  // Sends `commands` (pipelined per node) and passes each reply to
  // deliver(i, reply) in command order per node; error replies are never
  // delivered.  On a retry every command runs again (so deliver may see a
  // command twice; the last call counts).  Throws an Error naming the
  // server: a permanent one (kRefused, kCapacity, kCredentials, kTableLost)
  // at once, a transient one once the next wait would take the backoff
  // waited in all past config.retry_deadline_ms (BackoffMs per failure).  An
  // exception thrown by deliver propagates (after the node's other replies
  // are read, so the connection stays in step) and is not retried unless it
  // is a transient Error.  `writes`: the commands write, so with
  // config.wait_replicas each node's pipeline waits for its replicas.
  void Pipeline(const std::vector<Command>& commands, const std::function<void(size_t, const Reply&)>& deliver,
                bool writes = false) {
    std::lock_guard<std::mutex> lock(mu_);
    std::string last;
    int waited = 0;
    int failures = 0;
    // ASK redirects of this call: the first command of a unit (see Units)
    // -> the node it was redirected to.  An ASK holds for one query only
    // (the slot still belongs to the node that answered it), so they are
    // forgotten when the call returns, and when the slot map is read again.
    std::map<size_t, std::string> asked;
    for (int attempt = 1;; ++attempt) {
      try {
        const size_t known = asked.size();
        const Outcome outcome = TryPipeline(commands, deliver, &asked, writes && config_.wait_replicas > 0);
        if (outcome == Outcome::kDone) return;
        // Units a node handed on with ASK are sent on at once; an ASK that
        // taught nothing new waits like any retry.
        if (outcome == Outcome::kAsked && asked.size() > known) continue;
        last = outcome == Outcome::kMoved ? "the cluster moved a slot" : "a slot being migrated answered ASK again";
        if (outcome == Outcome::kMoved) asked.clear();
      } catch (const Error& e) {
        if (!e.transient()) throw;
        last = e.what();
        // Reconnect (and find the master or the slots again) on the next
        // attempt: a "not now" such as READONLY or MASTERDOWN may mean the
        // master moved.  A client reading a replica reads the master for a
        // while (Config::read_from_replicas).
        connections_.clear();
        discovered_ = false;
        asked.clear();
        if (!replica_nodes_.empty())
          replicas_paused_until_ = std::chrono::steady_clock::now() + std::chrono::milliseconds(kReplicaPauseMs);
      }
      ++failures;
      const int wait = BackoffMs(failures);
      if (waited + wait > config_.retry_deadline_ms) throw Error(last, attempt, waited);
      std::this_thread::sleep_for(std::chrono::milliseconds(wait));
      waited += wait;
    }
  }

  // Pipeline for commands that write (see Config::wait_replicas).
  void Write(const std::vector<Command>& commands, const std::function<void(size_t, const Reply&)>& deliver) {
    Pipeline(commands, deliver, true);
  }

  int retry_deadline_ms() const { return config_.retry_deadline_ms; }
  int db() const { return config_.db; }

  // "host:port, host:port" of the configured servers (sentinels in mode 1),
  // as tfde's Python side names them (RedisTableConfig.describe_servers).
  std::string Servers() const {
    std::string s;
    for (size_t i = 0; i < config_.servers.size(); ++i)
      s += (i ? ", " : "") + config_.servers[i].first + ":" + std::to_string(config_.servers[i].second);
    return s;
  }

  std::string Describe() const {
    return (config_.mode == 0 ? "cluster " : config_.mode == 1 ? "sentinels " : "server ") + Servers();
  }

  ErrorKind KindOf(std::string_view reply) const {
    auto it = config_.error_kinds.find(ErrorCode(reply));
    return it == config_.error_kinds.end() ? ErrorKind::kRefused : it->second;
  }

 private:
  enum class Outcome {
    kDone,   // every reply delivered
    kMoved,  // a MOVED reply: the slot map changed (read again); the caller retries
    kAsked,  // ASK replies: the caller sends those units again to the nodes in `asked`
  };

  // The units of a pipeline, as [begin, end) ranges of commands: a
  // transaction (MULTI ... EXEC) is one unit, sent to one node as a whole;
  // any other command is a unit of its own.
  static std::vector<std::pair<size_t, size_t>> Units(const std::vector<Command>& commands) {
    std::vector<std::pair<size_t, size_t>> units;
    for (size_t i = 0; i < commands.size();) {
      size_t end = i + 1;
      if (commands[i].args[0] == "MULTI")
        while (end < commands.size() && commands[end - 1].args[0] != "EXEC") ++end;
      units.emplace_back(i, end);
      i = end;
    }
    return units;
  }

  Outcome TryPipeline(const std::vector<Command>& commands, const std::function<void(size_t, const Reply&)>& deliver,
                      std::map<size_t, std::string>* asked, bool wait) {
    if (discovered_ && paused_reads_ && !ReplicasPaused()) {
      connections_.clear();  // the pause is over: find the replicas again
      discovered_ = false;
    }
    Discover();
    const auto units = Units(commands);
    std::map<std::string, std::vector<size_t>> by_node;  // node -> its units (indices into units)
    for (size_t u = 0; u < units.size(); ++u) {
      auto it = asked->find(units[u].first);
      by_node[it != asked->end() ? it->second : NodeOf(commands[units[u].first].key)].push_back(u);
    }
    const std::string replicas = std::to_string(config_.wait_replicas);
    const std::string timeout = std::to_string(config_.wait_timeout_ms);
    // Nodes sent commands whose replies are not all read yet: their streams
    // are out of step if this attempt stops early, so they are closed then.
    std::set<std::string> unread;
    try {
      // Every node gets all its commands before any reply is read, so the
      // nodes work at once; within a node, each unit goes out once
      // kSendBytes are queued, so the server starts on the first chunks
      // while the client encodes the rest.
      std::vector<Connection*> to;
      for (const auto& [node, list] : by_node) {
        Connection& c = ConnectionTo(node);
        unread.insert(node);
        for (size_t u : list) {
          // A unit an ASK sent here is preceded by ASKING, which lets the
          // importing node serve its next command, or, before MULTI, the
          // whole transaction.
          if (asked->count(units[u].first) != 0) c.Append({"ASKING"});
          for (size_t i = units[u].first; i < units[u].second; ++i) c.Append(commands[i].args);
          if (c.Queued() >= kSendBytes) c.Flush();
        }
        if (wait) c.Append({"WAIT", replicas, timeout});
        c.Flush();
        to.push_back(&c);
      }
      // Every reply is read, whatever came before it: a reply left unread
      // would be taken for the answer to a later command.  After the first
      // problem (an error reply, a redirect, a throwing deliver) nothing
      // more is delivered; the first node's problem decides, a redirect
      // first.
      bool moved = false;
      std::unique_ptr<Error> refused;  // the first error reply
      std::exception_ptr undelivered;  // what deliver threw
      bool straddles = false;
      std::string straddle;
      std::map<size_t, std::string> redirected;  // this attempt's ASKs
      Reply r;                                   // each reply in turn, reusing the buffers of the ones before
      size_t part = 0;
      for (const auto& [node, list] : by_node) {
        Connection& c = *to[part++];
        for (size_t u : list) {
          const auto [begin, end] = units[u];
          if (asked->count(begin) != 0) {
            c.ReadInto(&r);
            if (r.type != Reply::kStatus && refused == nullptr)
              refused = std::make_unique<Error>(c.Address() + " answered ASKING: " + r.str,
                                                r.type == Reply::kError ? KindOf(r.str) : ErrorKind::kTransient);
          }
          std::string ask_to;  // where an ASK reply of this unit points
          size_t served = 0;   // commands of a transaction this node queued
          std::unique_ptr<Error> unit_refused;
          for (size_t i = begin; i < end; ++i) {
            c.ReadInto(&r);
            const bool inner = end - begin > 1 && i > begin && i + 1 < end;  // queued inside MULTI ... EXEC
            if (r.type == Reply::kError) {
              const std::string_view code = ErrorCode(r.str);
              if (code == "MOVED") {
                moved = true;
              } else if (code == "ASK") {
                const size_t space = r.str.rfind(' ');
                ask_to = r.str.substr(space + 1);
              } else if (unit_refused == nullptr) {
                unit_refused = std::make_unique<Error>(c.Address() + " answered " + std::string(commands[i].args[0]) +
                                                           " " + std::string(commands[i].key) + ": " + r.str,
                                                       KindOf(r.str));
              }
              continue;
            }
            if (inner) ++served;
            if (moved || refused != nullptr || undelivered != nullptr || !ask_to.empty()) continue;
            try {
              deliver(i, r);
            } catch (...) {
              undelivered = std::current_exception();
            }
          }
          if (ask_to.empty()) {
            if (unit_refused != nullptr && refused == nullptr) refused = std::move(unit_refused);
          } else if (served > 0) {
            // Some keys of the transaction are still here, others moved on:
            // it cannot run on either node until the migration moves the
            // rest (the EXECABORT that followed applied none of it).
            straddles = true;
            straddle = c.Address() + " holds some keys of the transaction on " + std::string(commands[begin].key) +
                       " and sent the others on with ASK to " + ask_to + " (a slot migration is moving them)";
          } else {
            redirected[begin] = ask_to;  // the EXECABORT of an asked transaction applied none of it
          }
        }
        if (wait) {
          // WAIT answers once the replicas acknowledged every write before
          // it on this connection, or the timeout passed: how many did.  Its
          // reply may take the WAIT timeout on top of the socket timeout.
          c.SetReceiveTimeout(config_.socket_timeout_ms + config_.wait_timeout_ms);
          c.ReadInto(&r);
          c.SetReceiveTimeout(config_.socket_timeout_ms);
          if (r.type != Reply::kInteger) {
            if (refused == nullptr)
              refused = std::make_unique<Error>(c.Address() + " answered WAIT: " + r.str,
                                                r.type == Reply::kError ? KindOf(r.str) : ErrorKind::kTransient);
          } else if (r.integer < config_.wait_replicas && refused == nullptr && !moved) {
            refused = std::make_unique<Error>(
                "only " + std::to_string(r.integer) + " of the " + replicas +
                    " replicas redis_write_replicas asks for " + "acknowledged the writes to " + c.Address() +
                    " within " + timeout +
                    " ms (redis_write_replicas_timeout_ms); the master applied them, but they may be lost if it "
                    "fails before a replica has them",
                ErrorKind::kTransient);
          }
        }
        unread.erase(node);
      }
      // A redirect first: inside MULTI a moved slot makes the queued command
      // answer MOVED and EXEC answer EXECABORT (nothing applied), which is a
      // retry on the new node, not a refusal.
      if (moved) {
        discovered_ = false;
        return Outcome::kMoved;
      }
      if (refused != nullptr) throw *refused;
      if (undelivered != nullptr) std::rethrow_exception(undelivered);
      if (straddles) throw Error(straddle, ErrorKind::kTransient);
      if (redirected.empty()) return Outcome::kDone;
      for (auto& [begin, node] : redirected) (*asked)[begin] = std::move(node);
      return Outcome::kAsked;
    } catch (...) {
      // Failed mid-write or mid-read (closed, timed out, malformed), or
      // before some node's replies were read: those streams are out of
      // step, so their connections are never used again.
      for (const std::string& node : unread) connections_.erase(node);
      throw;
    }
  }

  // One command outside a pipeline; an error reply throws, classified.
  Reply Call(Connection& c, const std::vector<std::string_view>& args) const {
    Reply r = c.Exchange(args);
    if (r.type == Reply::kError)
      throw Error(c.Address() + " answered " + std::string(args[0]) + ": " + r.str,
                  IsRedirect(r.str) ? ErrorKind::kTransient : KindOf(r.str));
    return r;
  }

  std::string NodeOf(std::string_view key) const { return config_.mode == 0 ? slot_nodes_[KeySlot(key)] : server_; }

  Connection& ConnectionTo(const std::string& node) {
    auto it = connections_.find(node);
    if (it != connections_.end()) return *it->second;
    const size_t colon = node.rfind(':');
    std::unique_ptr<Connection> c;
    try {
      c = std::make_unique<Connection>(node.substr(0, colon), std::stoi(node.substr(colon + 1)),
                                       config_.connect_timeout_ms, config_.socket_timeout_ms);
    } catch (const Error& e) {
      if (config_.mode != 1 || replica_nodes_.count(node) != 0) throw;
      // Say whose address it is: the sentinels keep naming a master that
      // died until they promote a replica (never, if it has none).
      throw Error(std::string(e.what()) + " (the master the sentinels name for '" + config_.master_name +
                      "'; they name another once they promote one of its replicas)",
                  ErrorKind::kTransient);
    }
    Authenticate(*c, config_.user, config_.password);
    if (config_.mode != 0 && config_.db != 0) Call(*c, {"SELECT", std::to_string(config_.db)});
    if (config_.mode == 0 && config_.read_from_replicas) Call(*c, {"READONLY"});
    CheckTable(*c, node);
    return *connections_.emplace(node, std::move(c)).first->second;
  }

  // On a new connection to the node holding the table's meta key (every
  // connection but in a cluster): the key must still be there (see Config).
  void CheckTable(Connection& c, const std::string& node) const {
    if (config_.meta_key.empty() || NodeOf(config_.meta_key) != node) return;
    if (replica_nodes_.count(node) != 0) {
      // A replica without the key may lag or resync: a transient failure,
      // and the retry reads the master, which decides (and recreates).
      const Reply r = Call(c, {"EXISTS", config_.meta_key});
      if (r.type != Reply::kInteger || r.integer == 0)
        throw Error("replica " + c.Address() + " does not hold table '" + config_.table_name +
                        "' (lagging or resyncing); reading the master instead",
                    true);
      return;
    }
    if (config_.recreate_meta) {
      const Reply r = Call(c, {"SET", config_.meta_key, config_.meta_value, "NX"});
      if (r.type == Reply::kStatus && config_.on_recreate)
        config_.on_recreate("Redis at " + c.Address() + " held no table '" + config_.table_name + "' (its meta key '" +
                            config_.meta_key + "' was gone): recreated it empty, as recreate_if_missing asks");
      return;
    }
    const Reply r = Call(c, {"EXISTS", config_.meta_key});
    if (r.type != Reply::kInteger) throw Error(c.Address() + " sent a malformed EXISTS reply", true);
    if (r.integer == 0)
      throw Error("Redis at " + c.Address() + " no longer holds table '" + config_.table_name + "' (its meta key '" +
                      config_.meta_key +
                      "' is gone): the server was restarted without persistence or was flushed, so the table's "
                      "rows are lost; restore them from a checkpoint, or set \"recreate_if_missing\": true in the "
                      "Redis config to start the table afresh",
                  ErrorKind::kTableLost);
  }

  void Authenticate(Connection& c, const std::string& user, const std::string& password) const {
    if (password.empty()) return;
    if (user.empty() || user == "default") {
      Call(c, {"AUTH", password});
    } else {
      Call(c, {"AUTH", user, password});
    }
  }

  bool ReplicasPaused() const { return std::chrono::steady_clock::now() < replicas_paused_until_; }

  void Discover() {
    if (discovered_) return;
    replica_nodes_.clear();
    paused_reads_ = config_.read_from_replicas && ReplicasPaused();
    const bool replicas = config_.read_from_replicas && !paused_reads_;
    std::string last = "no servers configured";
    if (config_.mode == 2) {
      server_ = config_.servers.at(0).first + ":" + std::to_string(config_.servers.at(0).second);
      discovered_ = true;
      return;
    }
    for (const auto& [host, port] : config_.servers) {
      try {
        Connection c(host, port, config_.connect_timeout_ms, config_.socket_timeout_ms);
        if (config_.mode == 1) {
          Authenticate(c, config_.sentinel_user, config_.sentinel_password);
          Reply r = Call(c, {"SENTINEL", "get-master-addr-by-name", config_.master_name});
          if (r.type != Reply::kArray || r.elements.size() != 2)
            throw Error(c.Address() + " knows no master named '" + config_.master_name + "'", false);
          server_ = r.elements[0].str + ":" + r.elements[1].str;
          if (replicas) PickReplica(c);
        } else {
          Authenticate(c, config_.user, config_.password);
          LoadSlots(Call(c, {"CLUSTER", "SLOTS"}), c.Address(), replicas);
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

  void LoadSlots(const Reply& r, const std::string& from, bool replicas) {
    slot_nodes_.assign(kClusterSlots, "");
    if (r.type != Reply::kArray) throw Error(from + " sent a malformed CLUSTER SLOTS reply", false);
    for (const Reply& range : r.elements) {
      if (range.type != Reply::kArray || range.elements.size() < 3 || range.elements[2].type != Reply::kArray ||
          range.elements[2].elements.size() < 2)
        throw Error(from + " sent a malformed CLUSTER SLOTS entry", false);
      const int64_t lo = range.elements[0].integer, hi = range.elements[1].integer;
      const Reply& node = range.elements[2];
      // Entries after the master are its replicas.
      const bool replica = replicas && range.elements.size() > 3 && range.elements[3].type == Reply::kArray &&
                           range.elements[3].elements.size() >= 2;
      const Reply& reader = replica ? range.elements[3] : node;
      const std::string addr = reader.elements[0].str + ":" + std::to_string(reader.elements[1].integer);
      if (replica) replica_nodes_.insert(addr);
      for (int64_t s = lo; s <= hi && s < kClusterSlots; ++s)
        if (s >= 0) slot_nodes_[static_cast<size_t>(s)] = addr;
    }
    for (const std::string& n : slot_nodes_)
      if (n.empty()) throw Error(from + ": the cluster does not cover every slot", false);
  }

  // server_ := a replica the sentinel `c` reports up (not s_down / o_down /
  // disconnected) and in sync (master-link-status ok), chosen at random; it
  // stays the master when there is none, or when the sentinel refuses
  // SENTINEL replicas (before Redis 5, or an ACL without it).
  void PickReplica(Connection& c) {
    Reply r;
    try {
      r = Call(c, {"SENTINEL", "replicas", config_.master_name});
    } catch (const Error& e) {
      if (e.transient()) throw;
      return;
    }
    std::vector<std::string> up;
    for (const Reply& replica : r.type == Reply::kArray ? r.elements : std::vector<Reply>{}) {
      std::map<std::string, std::string> fields;
      for (size_t i = 0; i + 1 < replica.elements.size(); i += 2)
        fields[replica.elements[i].str] = replica.elements[i + 1].str;
      const std::string& flags = fields["flags"];
      if (fields["ip"].empty() || fields["port"].empty() || fields["master-link-status"] != "ok" ||
          flags.find("s_down") != std::string::npos || flags.find("o_down") != std::string::npos ||
          flags.find("disconnected") != std::string::npos)
        continue;
      up.push_back(fields["ip"] + ":" + fields["port"]);
    }
    if (up.empty()) return;
    static std::mutex rng_mu;
    static std::mt19937 rng{std::random_device{}()};
    std::lock_guard<std::mutex> lock(rng_mu);
    server_ = up[std::uniform_int_distribution<size_t>(0, up.size() - 1)(rng)];
    replica_nodes_.insert(server_);
  }

  Config config_;
  std::mutex mu_;
  bool discovered_ = false;              // server_ / slot_nodes_ are current
  std::string server_;                   // modes 1, 2: "host:port" of the master, or a replica (see Config)
  std::vector<std::string> slot_nodes_;  // mode 0: "host:port" per cluster slot (a replica: see Config)
  std::set<std::string> replica_nodes_;  // which of server_ / slot_nodes_ are replicas
  std::chrono::steady_clock::time_point replicas_paused_until_{};  // see Config::read_from_replicas
  bool paused_reads_ = false;  // discovered while paused: reading the master instead of replicas
  // By "host:port"; only connections whose stream is in step (every reply
  // read) are kept here.
  std::map<std::string, std::unique_ptr<Connection>> connections_;
};

}  // namespace resp
}  // namespace tfde

#endif  // TFDE_BACKENDS_REDIS_RESP_CLIENT_H_
