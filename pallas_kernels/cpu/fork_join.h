// fork_join: the native kernels' one way of spreading work over XLA:CPU's intra-op threads (the FFI's ThreadPool
// context; a second pool of our own would compete with XLA's for the cores). Shared by quant_matmul.cc and
// paged_attention.cc.
#pragma once

#include <immintrin.h>

#include <atomic>
#include <functional>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace jpg {

// Runs f(c, count) for c in [0, count) on the calling thread and the pool, returning when all are done. Chunks are
// claimed from a counter, so a pool thread that starts late (or never: a busy or one-thread pool) finds nothing
// left and the caller has run its chunk; the shared state outlives the call for such late starters, and `f` is
// only called for claimed chunks, all finished before this returns.
inline void fork_join(xla::ffi::ThreadPool& pool, int count, const std::function<void(int, int)>& f) {
  if (count <= 1) {
    f(0, 1);
    return;
  }
  struct State {
    std::atomic<int> next{0}, done{0};
    const std::function<void(int, int)>* f = nullptr;
    int count = 0;
  };
  auto state = std::make_shared<State>();
  state->f = &f;
  state->count = count;
  auto run = [](State& st) {
    for (int c; (c = st.next.fetch_add(1, std::memory_order_relaxed)) < st.count;) {
      (*st.f)(c, st.count);
      st.done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int t = 1; t < count; ++t) pool.Schedule([state, run] { run(*state); });
  run(*state);
  for (int spins = 0; state->done.load(std::memory_order_acquire) < count; ++spins) {
    if (spins < 4096) {
      _mm_pause();
    } else {
      std::this_thread::yield();
    }
  }
}

}  // namespace jpg
