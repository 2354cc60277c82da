// The packed Engram row reader without Python (adapter/engram/native.py builds and loads it).
//
// Positioned reads of 264-byte rows from one shard into caller memory (pinned host buffers on
// CUDA), by a pool of native threads, with the row store's set-associative cache and statistics.
// A plain C ABI called through ctypes, which releases the GIL for every call; nothing here ever
// touches Python, so dsv41_engram_host_fn can be a CUhostFn the CUDA driver runs on its own
// thread while Python threads hold the GIL.
//
// Results are those of adapter/engram/store.py byte for byte: rows outside the shard's range are
// zeros, a repeated id is read once and copied, the cache hashes and evicts as cache.py does, and
// the statistics use stats.py's histogram buckets.

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

namespace {

constexpr int kAbi = 1;
constexpr uint64_t kHeaderBytes = 4096;
constexpr uint64_t kWeightBytes = 256;
constexpr uint64_t kScaleBytes = 8;
constexpr uint64_t kRowBytes = kWeightBytes + kScaleBytes;
constexpr int kBuckets = 65 * 4;                  // stats.py: quarter-octave buckets of a u64
constexpr uint64_t kMix = 0x9E3779B97F4A7C15ull;  // cache.py: Fibonacci hashing of row ids
// The calling thread first reads up to this many rows itself with RWF_NOWAIT (page cache only):
// a row costs it well under a microsecond, less than waking a worker. The first row that is not
// in the page cache hands the rest of the batch to the pool at once.
constexpr uint64_t kInlineRows = 512;
// Rows a participant takes at a time: a cold batch is hinted and read a chunk at a time (see
// work), so that the drive's queue fills fast; a warm one is only spread for the copying.
constexpr uint64_t kColdChunk = 16;
constexpr uint64_t kWarmChunk = 256;
// A woken worker wakes this many more while the job wants them (a wake tree, not one caller
// paying for every futex wake).
constexpr int kWakeFanout = 2;
// The caller spins this many times for its workers' last rows before it sleeps.
constexpr int kSpins = 4000;

uint64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return uint64_t(ts.tv_sec) * 1000000000ull + uint64_t(ts.tv_nsec);
}

int bucket_of(uint64_t ns) {
  const int e = ns ? 64 - __builtin_clzll(ns) : 0;
  return e >= 3 ? e * 4 + int((ns >> (e - 3)) & 3) : e * 4;
}

void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

struct Histogram {
  uint64_t counts[kBuckets] = {};
  uint64_t total = 0;
  uint64_t max_ns = 0;
  int lo = kBuckets;  // range of buckets touched: merges skip the empty rest
  int hi = -1;

  void add(uint64_t ns) {
    const int b = bucket_of(ns);
    counts[b] += 1;
    total += 1;
    max_ns = std::max(max_ns, ns);
    lo = std::min(lo, b);
    hi = std::max(hi, b);
  }
  void merge(const Histogram& o) {
    for (int b = o.lo; b <= o.hi; ++b) counts[b] += o.counts[b];
    total += o.total;
    max_ns = std::max(max_ns, o.max_ns);
    lo = std::min(lo, o.lo);
    hi = std::max(hi, o.hi);
  }
  // total, max, then the buckets; and start over
  void take(uint64_t* out) {
    out[0] = total;
    out[1] = max_ns;
    std::memcpy(out + 2, counts, sizeof(counts));
    *this = Histogram();
  }
};

std::string errno_text(int e) {
  char buf[256];
  const char* s = strerror_r(e, buf, sizeof(buf));  // the GNU variant: returns the text
  return std::string(s) + " (errno " + std::to_string(e) + ")";
}

void copy_message(const std::string& msg, char* buf, uint64_t len) {
  if (buf == nullptr || len == 0) return;
  const uint64_t n = std::min<uint64_t>(msg.size(), len - 1);
  std::memcpy(buf, msg.data(), n);
  buf[n] = '\0';
}

// cache.py's RowCache: sets x ways slots of one row, least recently used way replaced.
class Cache {
 public:
  Cache(uint64_t sets, uint64_t ways) : sets_(sets), ways_(ways) {
    const uint64_t slots = sets * ways;
    bytes_ = slots * kRowBytes;
    // Anonymous memory: pages are only touched when a row is put there.
    void* p = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    data_ = static_cast<uint8_t*>(p);
    tags_.assign(slots, -1);
    used_.assign(slots, 0);
  }
  ~Cache() { munmap(data_, bytes_); }
  Cache(const Cache&) = delete;
  Cache& operator=(const Cache&) = delete;

  // Copies cached rows to out at their positions; the indexes of rows missed go to missed.
  void get_into(const std::vector<int64_t>& rows, const std::vector<uint32_t>& pos, uint8_t* out,
                std::vector<uint32_t>& missed) {
    std::lock_guard<std::mutex> guard(m_);
    for (uint32_t k = 0; k < rows.size(); ++k) {
      const uint64_t base = first_slot(rows[k]);
      bool hit = false;
      for (uint64_t slot = base; slot < base + ways_; ++slot) {
        if (tags_[slot] == rows[k]) {
          used_[slot] = ++tick_;
          std::memcpy(out + uint64_t(pos[k]) * kRowBytes, data_ + slot * kRowBytes, kRowBytes);
          hit = true;
          break;
        }
      }
      if (!hit) missed.push_back(k);
    }
  }

  void put_from(const std::vector<int64_t>& rows, const std::vector<uint32_t>& pos, const uint8_t* src) {
    std::lock_guard<std::mutex> guard(m_);
    for (size_t k = 0; k < rows.size(); ++k) {
      const uint64_t base = first_slot(rows[k]);
      uint64_t victim = base;
      for (uint64_t slot = base; slot < base + ways_; ++slot) {
        if (tags_[slot] == rows[k]) {
          victim = slot;
          break;
        }
        if (used_[slot] < used_[victim]) victim = slot;
      }
      used_[victim] = ++tick_;
      tags_[victim] = rows[k];
      std::memcpy(data_ + victim * kRowBytes, src + uint64_t(pos[k]) * kRowBytes, kRowBytes);
    }
  }

 private:
  uint64_t first_slot(int64_t row) const {
    return ((uint64_t(row) * kMix) >> 32) % sets_ * ways_;
  }

  const uint64_t sets_, ways_;
  uint64_t bytes_ = 0;
  uint8_t* data_ = nullptr;
  std::vector<int64_t> tags_;
  std::vector<uint64_t> used_;
  uint64_t tick_ = 0;
  std::mutex m_;
};

struct Reader;

// The argument of one host function: the buffers of one size class and a row count (an array
// of rows + 1 of these per class, so a launch only picks the entry of its count).
struct Launch {
  Reader* reader;
  const int64_t* ids;
  uint8_t* out;
  uint64_t n;
};

// The missed rows of one batch, shared by the caller and the workers it woke.
struct Job {
  const int64_t* rows = nullptr;
  const uint32_t* pos = nullptr;
  uint64_t count = 0;
  uint8_t* out = nullptr;
  std::atomic<uint64_t> next{0};
  uint64_t chunk = 1;  // rows a worker takes at a time
  bool hint = false;   // WILLNEED hints before each chunk's reads (rows not in the page cache)
  int wanted = 0;   // workers asked for (pool mutex)
  int claimed = 0;  // workers that took the job (pool mutex)
  std::atomic<int> active{0};
  std::atomic<bool> failed{false};
  std::mutex m;  // error, and the last worker's wake-up of the caller
  std::condition_variable done;
  std::string error;

  void fail(std::string msg) {
    std::lock_guard<std::mutex> guard(m);
    if (!failed.load()) {
      error = std::move(msg);
      failed.store(true);
    }
  }
};

struct Reader {
  int fd = -1;
  std::string path;
  std::string hint;  // the fix a short read names
  int64_t lo = 0, hi = 0;
  const uint8_t* scales = nullptr;  // resident scales (the store's memory), or null
  std::unique_ptr<Cache> cache;

  int threads = 0;
  std::vector<std::thread> pool;
  std::mutex pool_m;
  std::condition_variable pool_cv;
  std::deque<Job*> queue;
  bool stopping = false;

  std::mutex stats_m;
  uint64_t lookups = 0, hits = 0, misses = 0, batches = 0;
  Histogram reads, batch;

  std::mutex fail_m;
  bool host_failed = false;
  std::string host_failure;
  std::string exit_line;  // when set, a failed host function logs this + the error and exits
  int exit_code = 0;

  std::mutex launch_m;
  std::vector<std::unique_ptr<Launch[]>> launches;

  // Cleared when the file system refuses RWF_NOWAIT: every row is then read by the pool.
  std::atomic<bool> nowait{true};

  uint64_t read_bytes() const { return scales ? kWeightBytes : kRowBytes; }
};

// Reads len bytes at offset, through EINTR and partial reads; the bytes read, or -errno.
int64_t pread_full(int fd, uint8_t* dst, uint64_t len, uint64_t at) {
  uint64_t done = 0;
  while (done < len) {
    const ssize_t n = pread(fd, dst + done, len - done, off_t(at + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      return -int64_t(errno);
    }
    if (n == 0) break;
    done += uint64_t(n);
  }
  return int64_t(done);
}

enum class Read { kDone, kWouldBlock, kFailed };

// Row k of the job; with nowait only from the page cache (kWouldBlock when it is not all there).
Read read_row(Reader* r, Job* job, uint64_t k, Histogram& h, bool nowait) {
  const uint64_t len = r->read_bytes();
  const int64_t row = job->rows[k];
  uint8_t* dst = job->out + uint64_t(job->pos[k]) * kRowBytes;
  const uint64_t at = kHeaderBytes + uint64_t(row - r->lo) * kRowBytes;
  const uint64_t t0 = now_ns();
  int64_t got;
  if (nowait) {
    iovec iov{dst, len};
    const ssize_t n = preadv2(r->fd, &iov, 1, off_t(at), RWF_NOWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) return Read::kWouldBlock;
    if (n < 0 && (errno == EOPNOTSUPP || errno == EINVAL || errno == ENOSYS)) {
      r->nowait.store(false);
      return Read::kWouldBlock;
    }
    // Part of the row cached, or the end of the file: the blocking read decides.
    if (n >= 0 && uint64_t(n) != len) return Read::kWouldBlock;
    got = n < 0 ? -int64_t(errno) : int64_t(n);
  } else {
    got = pread_full(r->fd, dst, len, at);
  }
  h.add(now_ns() - t0);
  if (got < 0) {
    job->fail(r->path + ": reading row " + std::to_string(row) + " failed: " + errno_text(int(-got)));
    return Read::kFailed;
  }
  if (uint64_t(got) != len) {
    job->fail(r->path + ": short read of row " + std::to_string(row) + " (" + std::to_string(got) + " of " +
              std::to_string(len) + " bytes): the file changed under the rank; " + r->hint);
    return Read::kFailed;
  }
  if (r->scales) {
    std::memcpy(dst + kWeightBytes, r->scales + uint64_t(row - r->lo) * kScaleBytes, kScaleBytes);
  }
  return Read::kDone;
}

void add_reads(Reader* r, Job* job, const Histogram& h) {
  if (h.total == 0 || job->failed.load()) return;  // as the store: a failed batch records nothing
  std::lock_guard<std::mutex> guard(r->stats_m);
  r->reads.merge(h);
}

// Blocking reads of the job's rows, a chunk at a time, until its cursor runs out. A cold job
// first hints each chunk's rows (WILLNEED: asynchronous reads of exactly their pages), so the
// drive sees every chunk in flight at once, not one read per thread.
void work(Reader* r, Job* job, Histogram& h) {
  const uint64_t chunk = job->chunk;
  for (;;) {
    if (job->failed.load(std::memory_order_relaxed)) break;
    const uint64_t k = job->next.fetch_add(chunk, std::memory_order_relaxed);
    if (k >= job->count) break;
    const uint64_t end = std::min(job->count, k + chunk);
    if (job->hint && end - k > 1) {
      for (uint64_t i = k; i < end; ++i) {
        posix_fadvise(r->fd, off_t(kHeaderBytes + uint64_t(job->rows[i] - r->lo) * kRowBytes),
                      off_t(r->read_bytes()), POSIX_FADV_WILLNEED);
      }
    }
    for (uint64_t i = k; i < end; ++i) {
      if (read_row(r, job, i, h, false) != Read::kDone) return;
    }
  }
}

void work(Reader* r, Job* job) {
  Histogram h;
  work(r, job, h);
  add_reads(r, job, h);
}

void wake(Reader* r, int n) {
  for (int i = 0; i < n; ++i) r->pool_cv.notify_one();
}

void worker(Reader* r) {
  for (;;) {
    Job* job = nullptr;
    int more = 0;
    {
      std::unique_lock<std::mutex> lock(r->pool_m);
      r->pool_cv.wait(lock, [r] { return r->stopping || !r->queue.empty(); });
      if (r->stopping) return;
      job = r->queue.front();
      job->active.fetch_add(1);
      if (++job->claimed >= job->wanted) r->queue.pop_front();
      more = std::min(kWakeFanout, int(r->queue.empty() ? 0 : r->queue.front()->wanted - r->queue.front()->claimed));
    }
    wake(r, more);
    work(r, job);
    // Decremented under the job's mutex: the caller takes it before the job goes away.
    std::lock_guard<std::mutex> guard(job->m);
    if (job->active.fetch_sub(1) == 1) job->done.notify_all();
  }
}

// Reads the missed rows into out, with workers for a batch large enough; false and the error
// when a read failed.
bool read_misses(Reader* r, const std::vector<int64_t>& rows, const std::vector<uint32_t>& pos, uint8_t* out,
                 std::string& error) {
  Job job;
  job.rows = rows.data();
  job.pos = pos.data();
  job.count = rows.size();
  job.out = out;
  Histogram h;
  int wanted = 0;
  if (r->threads > 0) {
    uint64_t k = 0;
    bool blocked = !r->nowait.load(std::memory_order_relaxed);
    for (const uint64_t limit = std::min(job.count, kInlineRows); !blocked && k < limit; ++k) {
      const Read done = read_row(r, &job, k, h, true);
      if (done == Read::kFailed) break;
      blocked = done == Read::kWouldBlock;
      if (blocked) break;
    }
    job.next.store(k);
    const uint64_t left = job.failed.load() ? 0 : job.count - k;
    job.hint = blocked;
    job.chunk = blocked ? kColdChunk : kWarmChunk;
    if (left > job.chunk) {
      wanted = int(std::min<uint64_t>(uint64_t(r->threads), (left + job.chunk - 1) / job.chunk));
    }
  } else {
    // The caller alone: every row's hint first, then the reads (the store's Python path).
    job.hint = true;
    job.chunk = std::max<uint64_t>(job.count, 1);
  }
  if (wanted) {
    {
      std::lock_guard<std::mutex> guard(r->pool_m);
      job.wanted = wanted;
      r->queue.push_back(&job);
    }
    wake(r, std::min(kWakeFanout, wanted));
  }
  work(r, &job, h);
  add_reads(r, &job, h);
  if (wanted) {
    {
      std::lock_guard<std::mutex> guard(r->pool_m);
      auto it = std::find(r->queue.begin(), r->queue.end(), &job);
      if (it != r->queue.end()) r->queue.erase(it);
    }
    for (int i = 0; i < kSpins && job.active.load(std::memory_order_acquire); ++i) cpu_relax();
    std::unique_lock<std::mutex> lock(job.m);
    job.done.wait(lock, [&job] { return job.active.load() == 0; });
  }
  if (job.failed.load()) {
    std::lock_guard<std::mutex> guard(job.m);
    error = job.error;
    return false;
  }
  return true;
}

// store.py's read_rows_into: n rows of ids into out (n * 264 bytes).
bool read_batch(Reader* r, const int64_t* ids, uint64_t n, uint8_t* out, std::string& error) {
  try {
    if (n >= (uint64_t(1) << 32)) {
      error = r->path + ": a batch of " + std::to_string(n) + " rows is too large";
      return false;
    }
    const uint64_t started = now_ns();
    // (row, position) of owned ids; sorted, the first of each run is the row's first position.
    std::vector<std::pair<int64_t, uint32_t>> owned;
    owned.reserve(n);
    for (uint64_t p = 0; p < n; ++p) {
      const int64_t id = ids[p];
      if (id >= r->lo && id < r->hi) {
        owned.emplace_back(id, uint32_t(p));
      } else {
        std::memset(out + p * kRowBytes, 0, kRowBytes);
      }
    }
    std::sort(owned.begin(), owned.end());
    std::vector<std::pair<uint32_t, int64_t>> first;  // (first position, row), one per row
    std::vector<std::pair<uint32_t, uint32_t>> repeats;  // (position, first position)
    for (size_t k = 0; k < owned.size(); ++k) {
      if (k && owned[k].first == owned[k - 1].first) {
        repeats.emplace_back(owned[k].second, first.back().first);
      } else {
        first.emplace_back(owned[k].second, owned[k].first);
      }
    }
    // In order of first appearance, as the store does: the cache's recency follows it.
    std::sort(first.begin(), first.end());
    std::vector<int64_t> rows(first.size());
    std::vector<uint32_t> pos(first.size());
    for (size_t k = 0; k < first.size(); ++k) {
      pos[k] = first[k].first;
      rows[k] = first[k].second;
    }
    uint64_t hit_count = 0;
    if (r->cache && !rows.empty()) {
      std::vector<uint32_t> missed;
      r->cache->get_into(rows, pos, out, missed);
      hit_count = rows.size() - missed.size();
      std::vector<int64_t> mrows(missed.size());
      std::vector<uint32_t> mpos(missed.size());
      for (size_t k = 0; k < missed.size(); ++k) {
        mrows[k] = rows[missed[k]];
        mpos[k] = pos[missed[k]];
      }
      rows.swap(mrows);
      pos.swap(mpos);
    }
    if (!rows.empty() && !read_misses(r, rows, pos, out, error)) return false;
    if (r->cache && !rows.empty()) r->cache->put_from(rows, pos, out);
    for (const auto& rp : repeats) {
      std::memcpy(out + uint64_t(rp.first) * kRowBytes, out + uint64_t(rp.second) * kRowBytes, kRowBytes);
    }
    const uint64_t took = now_ns() - started;
    std::lock_guard<std::mutex> guard(r->stats_m);
    r->lookups += n;
    r->hits += hit_count;
    r->misses += rows.size();
    r->batches += 1;
    r->batch.add(took);
    return true;
  } catch (const std::bad_alloc&) {
    error = r->path + ": out of memory reading " + std::to_string(n) + " rows";
    return false;
  } catch (const std::exception& e) {
    error = r->path + ": " + e.what();
    return false;
  }
}

void write_all(int fd, const std::string& text) {
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    done += size_t(n);
  }
}

}  // namespace

// Built with -fvisibility=hidden: only these functions are the library's interface.
#define DSV41_EXPORT __attribute__((visibility("default")))

extern "C" {

DSV41_EXPORT int dsv41_engram_abi() { return kAbi; }

DSV41_EXPORT uint64_t dsv41_engram_launch_bytes() { return sizeof(Launch); }

// A reader of the shard open as fd (duplicated: the reader owns its copy). scales: the resident
// scale bytes of every owned row (8 a row, the caller's memory, kept while the reader lives) or
// null; cache_sets 0: no cache; threads: pool workers (0: the caller reads alone). Null and a
// message in err on failure.
DSV41_EXPORT void* dsv41_engram_open(int fd, const char* path, const char* hint, int64_t lo, int64_t hi, const uint8_t* scales,
                        uint64_t cache_sets, uint64_t cache_ways, int threads, char* err, uint64_t errlen) {
  std::unique_ptr<Reader> r;
  try {
    r.reset(new Reader());
    r->path = path ? path : "";
    r->hint = hint ? hint : "";
    if (lo < 0 || hi < lo || threads < 0) {
      copy_message(r->path + ": bad reader arguments", err, errlen);
      return nullptr;
    }
    r->fd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (r->fd < 0) {
      copy_message(r->path + ": duplicating the shard's descriptor failed: " + errno_text(errno), err, errlen);
      return nullptr;
    }
    r->lo = lo;
    r->hi = hi;
    r->scales = scales;
    if (cache_sets) r->cache.reset(new Cache(cache_sets, cache_ways));
    r->threads = threads;
    r->pool.reserve(size_t(threads));
    for (int i = 0; i < threads; ++i) r->pool.emplace_back(worker, r.get());
    return r.release();
  } catch (const std::exception& e) {
    copy_message(std::string("opening the native Engram reader failed: ") + e.what(), err, errlen);
    if (r) {
      {
        std::lock_guard<std::mutex> guard(r->pool_m);
        r->stopping = true;
      }
      r->pool_cv.notify_all();
      for (auto& t : r->pool) t.join();
      if (r->fd >= 0) close(r->fd);
    }
    return nullptr;
  }
}

// No read may be in flight (the caller's stream work is done).
DSV41_EXPORT void dsv41_engram_close(void* handle) {
  auto* r = static_cast<Reader*>(handle);
  if (r == nullptr) return;
  {
    std::lock_guard<std::mutex> guard(r->pool_m);
    r->stopping = true;
  }
  r->pool_cv.notify_all();
  for (auto& t : r->pool) t.join();
  if (r->fd >= 0) close(r->fd);
  delete r;
}

DSV41_EXPORT int dsv41_engram_fd(void* handle) { return static_cast<Reader*>(handle)->fd; }

DSV41_EXPORT int dsv41_engram_threads(void* handle) { return static_cast<Reader*>(handle)->threads; }

// n ids into out (n * 264 bytes); 0, or -1 with the message in err.
DSV41_EXPORT int dsv41_engram_read(void* handle, const int64_t* ids, uint64_t n, uint8_t* out, char* err, uint64_t errlen) {
  std::string error;
  if (read_batch(static_cast<Reader*>(handle), ids, n, out, error)) return 0;
  copy_message(error, err, errlen);
  return -1;
}

// rows + 1 launch arguments over one pair of buffers (ids: rows int64, out: rows x 264 bytes), the
// entry k reading the first k ids; owned by the reader. Null when out of memory.
DSV41_EXPORT void* dsv41_engram_launches(void* handle, const int64_t* ids, uint8_t* out, uint64_t rows) {
  auto* r = static_cast<Reader*>(handle);
  try {
    std::unique_ptr<Launch[]> table(new Launch[rows + 1]);
    for (uint64_t k = 0; k <= rows; ++k) table[k] = Launch{r, ids, out, k};
    Launch* base = table.get();
    std::lock_guard<std::mutex> guard(r->launch_m);
    r->launches.push_back(std::move(table));
    return base;
  } catch (const std::bad_alloc&) {
    return nullptr;
  }
}

// The CUhostFn: reads one launch's rows on the driver's thread. A failure is kept for
// dsv41_engram_failure and, with an exit line set, logged to stderr before the process exits.
DSV41_EXPORT void dsv41_engram_host_fn(void* arg) {
  auto* launch = static_cast<Launch*>(arg);
  Reader* r = launch->reader;
  std::string error;
  if (read_batch(r, launch->ids, launch->n, launch->out, error)) return;
  std::string line;
  int code = 0;
  {
    std::lock_guard<std::mutex> guard(r->fail_m);
    if (!r->host_failed) {
      r->host_failed = true;
      r->host_failure = error;
    }
    if (r->exit_code) {
      line = r->exit_line + error + "; the rank stops\n";
      code = r->exit_code;
    }
  }
  if (code) {
    write_all(2, line);
    _exit(code);
  }
}

DSV41_EXPORT void dsv41_engram_set_exit(void* handle, const char* line, int code) {
  auto* r = static_cast<Reader*>(handle);
  std::lock_guard<std::mutex> guard(r->fail_m);
  r->exit_line = line ? line : "";
  r->exit_code = code;
}

// 1 and the first host function failure's message, or 0.
DSV41_EXPORT int dsv41_engram_failure(void* handle, char* buf, uint64_t len) {
  auto* r = static_cast<Reader*>(handle);
  std::lock_guard<std::mutex> guard(r->fail_m);
  if (!r->host_failed) return 0;
  copy_message(r->host_failure, buf, len);
  return 1;
}

DSV41_EXPORT uint64_t dsv41_engram_stats_words() { return 4 + 2 * (2 + kBuckets); }

// The counters since the last call, and start over: lookups, hits, misses, batches, then the row
// read and the batch histograms (each: total, max ns, the buckets' counts).
DSV41_EXPORT void dsv41_engram_take_stats(void* handle, uint64_t* out) {
  auto* r = static_cast<Reader*>(handle);
  std::lock_guard<std::mutex> guard(r->stats_m);
  out[0] = r->lookups;
  out[1] = r->hits;
  out[2] = r->misses;
  out[3] = r->batches;
  r->lookups = r->hits = r->misses = r->batches = 0;
  r->reads.take(out + 4);
  r->batch.take(out + 4 + 2 + kBuckets);
}

}  // extern "C"
