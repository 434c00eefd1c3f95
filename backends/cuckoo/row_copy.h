// Row copies for big finds.  No TensorFlow includes.
//
// A find of millions of rows writes hundreds of MiB of output that the CPU
// will not read again soon.  Ordinary stores first read each destination
// cache line (read-for-ownership), so such a copy moves every byte through
// memory twice; non-temporal (streaming) stores write around the caches and
// skip that read (measured: find of 1M keys at dim 64, +15-20%).  Small
// batches keep ordinary stores: their output is read right away (the next
// op of a training step) and should stay in cache.  Inserts do not stream:
// with a row's key inline, streaming the rest of the row measured slower;
// with value-only rows it measured the same (within 2%), so plain stores
// stay.
#ifndef TFDE_BACKENDS_CUCKOO_ROW_COPY_H_
#define TFDE_BACKENDS_CUCKOO_ROW_COPY_H_

#include <cstdint>
#include <cstring>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace tfde {

// A batch whose destination rows add up to at least this many bytes is
// copied with streaming stores (well beyond a core's L2, so its lines would
// be evicted before anyone reads them anyway).
constexpr int64_t kStreamingCopyBytes = int64_t{16} << 20;

// Copies `bytes` from src to dst; `streaming` selects non-temporal stores,
// used when dst is 8-byte aligned and bytes a multiple of 8 (table rows
// always are; anything else, and hosts without SSE2, fall back to memcpy).
// Threads that made streaming copies must call StoreFence() before they
// signal that their writes are done.
inline void CopyRow(char* dst, const char* src, int64_t bytes, bool streaming) {
#if defined(__SSE2__) && defined(__x86_64__)
  if (streaming && (reinterpret_cast<uintptr_t>(dst) & 7) == 0 && (bytes & 7) == 0) {
    int64_t off = 0;
    auto stream8 = [&] {
      long long w;
      std::memcpy(&w, src + off, 8);
      _mm_stream_si64(reinterpret_cast<long long*>(dst + off), w);
      off += 8;
    };
    if ((reinterpret_cast<uintptr_t>(dst) & 15) != 0 && off < bytes) stream8();
    for (; off + 16 <= bytes; off += 16) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + off));
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + off), v);
    }
    if (off < bytes) stream8();
    return;
  }
#endif
  std::memcpy(dst, src, static_cast<size_t>(bytes));
}

// Orders this thread's earlier streaming stores before its later stores.
inline void StoreFence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

}  // namespace tfde

#endif  // TFDE_BACKENDS_CUCKOO_ROW_COPY_H_
