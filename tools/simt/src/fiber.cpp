// SIMT emulator (tools/simt): kernel launches, the block scheduler and the
// fibers that run a block's threads.
//
// A launch is queued on its stream (src/stream.cpp). When the stream runs it,
// the blocks execute one at a time on the draining host thread, in the order
// of the current schedule. A block's threads are fibers with their own
// stacks; a fiber runs until it reaches a barrier (__syncthreads: the whole
// block; __syncwarp or a shuffle: its warp) or returns. The scheduler resumes
// every runnable fiber once per pass, in schedule order, then releases the
// barriers every participant has reached. Schedule 0 runs threads (and
// blocks) in ascending order, schedule 1 in descending order: between two
// barriers one thread runs entirely before the next starts, so a missing
// barrier lets a thread read shared memory that, under one of the schedules,
// its writer has not written yet (or has already overwritten).
//
// Threads that returned count as arrived at every later barrier (as on the
// hardware). A barrier that the threads reach at different call sites, a
// warp synchronisation naming a lane that exited, and a deadlock are errors.
#include "internal.h"
#include <simt/simt.h>

#include <c10/util/Exception.h>

#include <sys/mman.h>

#include <algorithm>
#include <cstring>
#include <array>
#include <atomic>
#include <deque>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#define SIMT_ASAN 1
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#else
#define SIMT_ASAN 0
#endif

thread_local uint3 threadIdx;
thread_local uint3 blockIdx;
thread_local dim3 blockDim;
thread_local dim3 gridDim;

// x86-64 System V context switch: saves the callee-saved registers, MXCSR and
// the x87 control word on the current stack, stores the stack pointer in
// *save and continues on `load`. A new fiber's stack starts with a frame that
// "returns" into simt_fiber_start, which calls r13(r12).
extern "C" void simt_switch(void** save, void* load);
extern "C" void simt_fiber_start();
asm(R"(
  .text
  .p2align 4
  .globl simt_switch
  .hidden simt_switch
  .type simt_switch,@function
simt_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size simt_switch,.-simt_switch

  .p2align 4
  .globl simt_fiber_start
  .hidden simt_fiber_start
  .type simt_fiber_start,@function
simt_fiber_start:
  movq %r12, %rdi
  callq *%r13
  ud2
  .size simt_fiber_start,.-simt_fiber_start
)");

namespace simt {
namespace {

#if SIMT_ASAN
constexpr size_t kStackSize = size_t{512} << 10;
#else
constexpr size_t kStackSize = size_t{64} << 10;
#endif
constexpr size_t kGuard = 4096;

std::atomic<int> g_schedule{0};

enum class Wait { kRunnable, kBlock, kWarp, kDone };

struct Fiber {
  void* sp = nullptr;
  char* stack = nullptr;  // lowest usable address (a guard page lies below)
  Wait wait = Wait::kRunnable;
  uint3 tid{0, 0, 0};
  int linear = 0;
  const char* file = nullptr;  // __syncthreads call site
  int line = 0;
  unsigned mask = 0;     // warp barrier mask
  uint64_t bits = 0;     // value published for a shuffle
  uint64_t result = 0;   // value received by a shuffle
  int src = -1;          // lane a shuffle reads (-1: a plain __syncwarp)
  void* fake_stack = nullptr;
};

struct BlockRun {
  std::vector<Fiber> fibers;
  void* sched_sp = nullptr;
  Fiber* current = nullptr;
  const std::function<void()>* body = nullptr;
  std::string error;
  const void* sched_bottom = nullptr;
  size_t sched_size = 0;
};

thread_local BlockRun* tl_run = nullptr;

// Fiber stacks of this OS thread, reused by every block it runs.
struct StackPool {
  std::vector<char*> stacks;
  ~StackPool() {
    for (char* s : stacks) munmap(s - kGuard, kStackSize + kGuard);
  }
  char* get(size_t i) {
    while (stacks.size() <= i) {
      void* p = mmap(nullptr, kStackSize + kGuard, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      TORCH_CHECK(p != MAP_FAILED, "simt: cannot map a fiber stack");
      mprotect(p, kGuard, PROT_NONE);  // overflow faults instead of corrupting
      stacks.push_back(static_cast<char*>(p) + kGuard);
    }
    return stacks[i];
  }
};
thread_local StackPool tl_stacks;

void switch_to_fiber(BlockRun& run, Fiber& f) {
  run.current = &f;
  threadIdx = f.tid;
#if SIMT_ASAN
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(&fake, f.stack, kStackSize);
  simt_switch(&run.sched_sp, f.sp);
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#else
  simt_switch(&run.sched_sp, f.sp);
#endif
  run.current = nullptr;
}

// From a fiber back to the scheduler. `exiting`: the fiber never resumes.
void switch_to_scheduler(BlockRun& run, Fiber& f, bool exiting) {
#if SIMT_ASAN
  __sanitizer_start_switch_fiber(exiting ? nullptr : &f.fake_stack, run.sched_bottom,
                                 run.sched_size);
  simt_switch(&f.sp, run.sched_sp);
  __sanitizer_finish_switch_fiber(f.fake_stack, &run.sched_bottom, &run.sched_size);
#else
  (void)exiting;
  simt_switch(&f.sp, run.sched_sp);
#endif
}

extern "C" void simt_fiber_main(BlockRun* run) {
#if SIMT_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &run->sched_bottom, &run->sched_size);
#endif
  Fiber& self = *run->current;
  try {
    (*run->body)();
  } catch (const std::exception& e) {
    if (run->error.empty()) run->error = e.what();
  } catch (...) {
    if (run->error.empty()) run->error = "unknown exception";
  }
  self.wait = Wait::kDone;
  switch_to_scheduler(*run, self, /*exiting=*/true);
  __builtin_trap();  // a finished fiber is never resumed
}

void init_fiber(BlockRun& run, Fiber& f, char* stack) {
  f.stack = stack;
  f.wait = Wait::kRunnable;
  f.fake_stack = nullptr;
#if SIMT_ASAN
  __asan_unpoison_memory_region(stack, kStackSize);
#endif
  // Initial frame, popped by simt_switch: [mxcsr|fpucw] r15 r14 r13 r12 rbx rbp ret.
  auto top = reinterpret_cast<uintptr_t>(stack + kStackSize) & ~uintptr_t{15};
  auto* frame = reinterpret_cast<uint64_t*>(top - 80);
  uint32_t mxcsr = 0;
  uint16_t fpucw = 0;
  asm volatile("stmxcsr %0" : "=m"(mxcsr));
  asm volatile("fnstcw %0" : "=m"(fpucw));
  frame[0] = mxcsr | (static_cast<uint64_t>(fpucw) << 32);
  frame[1] = 0;                                                // r15
  frame[2] = 0;                                                // r14
  frame[3] = reinterpret_cast<uint64_t>(&simt_fiber_main);     // r13: entry
  frame[4] = reinterpret_cast<uint64_t>(&run);                 // r12: its argument
  frame[5] = 0;                                                // rbx
  frame[6] = 0;                                                // rbp (ends frame chains)
  frame[7] = reinterpret_cast<uint64_t>(&simt_fiber_start);    // ret
  f.sp = frame;
}

std::string describe_waits(const BlockRun& run) {
  std::ostringstream ss;
  int shown = 0;
  for (const Fiber& f : run.fibers) {
    if (f.wait == Wait::kDone || shown >= 4) continue;
    ss << " thread " << f.linear << ": "
       << (f.wait == Wait::kBlock ? "at __syncthreads " : "at a warp barrier, mask ");
    if (f.wait == Wait::kBlock) {
      ss << f.file << ':' << f.line << ';';
    } else {
      ss << std::hex << f.mask << std::dec << ';';
    }
    ++shown;
  }
  return ss.str();
}

// Releases the block barrier or complete warp barriers; false if none.
bool release_barriers(BlockRun& run, const uint3& block_idx) {
  bool any_live = false;
  bool all_block = true;
  for (const Fiber& f : run.fibers) {
    if (f.wait == Wait::kDone) continue;
    any_live = true;
    if (f.wait != Wait::kBlock) all_block = false;
  }
  if (!any_live) return true;
  if (all_block) {
    const Fiber* first = nullptr;
    for (Fiber& f : run.fibers) {
      if (f.wait == Wait::kDone) continue;
      if (first == nullptr) {
        first = &f;
      } else if (f.line != first->line || std::string(f.file) != first->file) {
        TORCH_CHECK(false, "simt: divergent __syncthreads in block (", block_idx.x, ",",
                    block_idx.y, ",", block_idx.z, "): thread ", first->linear, " waits at ",
                    first->file, ":", first->line, ", thread ", f.linear, " at ", f.file, ":",
                    f.line);
      }
      f.wait = Wait::kRunnable;
    }
    return true;
  }
  bool released = false;
  const int n = static_cast<int>(run.fibers.size());
  for (int w0 = 0; w0 < n; w0 += 32) {
    const int w1 = std::min(n, w0 + 32);
    unsigned mask = 0;
    bool waiting = false;
    for (int i = w0; i < w1; ++i) {
      if (run.fibers[i].wait == Wait::kWarp) {
        mask = run.fibers[i].mask;
        waiting = true;
        break;
      }
    }
    if (!waiting) continue;
    bool complete = true;
    for (int lane = 0; lane < 32; ++lane) {
      if (!(mask & (1u << lane))) continue;
      const int i = w0 + lane;
      TORCH_CHECK(i < w1 && run.fibers[i].wait != Wait::kDone, "simt: warp barrier with mask 0x",
                  std::hex, mask, std::dec, " names lane ", lane, " of warp ", w0 / 32,
                  ", which does not exist or has exited");
      const Fiber& f = run.fibers[i];
      if (f.wait != Wait::kWarp) {
        complete = false;
        continue;
      }
      TORCH_CHECK(f.mask == mask, "simt: lanes of warp ", w0 / 32,
                  " synchronise with different masks");
    }
    if (!complete) continue;
    for (int lane = 0; lane < 32; ++lane) {
      if (!(mask & (1u << lane))) continue;
      Fiber& f = run.fibers[w0 + lane];
      if (f.src >= 0) {
        TORCH_CHECK(mask & (1u << f.src), "simt: shuffle from lane ", f.src,
                    ", which is not in the mask 0x", std::hex, mask);
        f.result = run.fibers[w0 + f.src].bits;
      }
      f.wait = Wait::kRunnable;
    }
    released = true;
  }
  return released;
}

void run_block(BlockRun& run, size_t threads, bool reverse) {
  run.fibers.assign(threads, Fiber{});
  for (size_t i = 0; i < threads; ++i) {
    Fiber& f = run.fibers[i];
    const auto lin = static_cast<unsigned>(i);
    f.linear = static_cast<int>(i);
    f.tid = uint3{lin % blockDim.x, (lin / blockDim.x) % blockDim.y,
                  lin / (blockDim.x * blockDim.y)};
    init_fiber(run, f, tl_stacks.get(i));
  }
  for (;;) {
    for (size_t k = 0; k < threads; ++k) {
      Fiber& f = run.fibers[reverse ? threads - 1 - k : k];
      if (f.wait == Wait::kRunnable) switch_to_fiber(run, f);
      if (!run.error.empty()) {
        TORCH_CHECK(false, "simt: a thread of block (", blockIdx.x, ",", blockIdx.y, ",",
                    blockIdx.z, ") threw: ", run.error);
      }
    }
    const bool all_done = std::all_of(run.fibers.begin(), run.fibers.end(),
                                      [](const Fiber& f) { return f.wait == Wait::kDone; });
    if (all_done) return;
    TORCH_CHECK(release_barriers(run, blockIdx), "simt: deadlock in block (", blockIdx.x, ",",
                blockIdx.y, ",", blockIdx.z, "):", describe_waits(run));
  }
}

Fiber& current_fiber(const char* what) {
  TORCH_CHECK(tl_run != nullptr && tl_run->current != nullptr, "simt: ", what,
              " called outside a kernel");
  return *tl_run->current;
}

// ------------------------------------------------------------ launch log --

std::mutex g_log_mutex;
std::deque<std::string> g_log;
constexpr size_t kLogMax = 1024;

void log_launch(const LaunchConfig& cfg) {
  std::ostringstream ss;
  ss << cfg.name << " grid=(" << cfg.grid.x << "," << cfg.grid.y << "," << cfg.grid.z
     << ") block=(" << cfg.block.x << "," << cfg.block.y << "," << cfg.block.z
     << ") stream=" << stream_id(cfg.stream);
  log_call(ss.str());
}

cudaError_t check_config(const LaunchConfig& cfg) {
  const cudaDeviceProp& p = *device_properties(current_device());
  const dim3 b = cfg.block;
  const dim3 g = cfg.grid;
  const uint64_t threads = uint64_t{b.x} * b.y * b.z;
  if (threads == 0 || threads > static_cast<uint64_t>(p.maxThreadsPerBlock) ||
      b.x > static_cast<unsigned>(p.maxThreadsDim[0]) ||
      b.y > static_cast<unsigned>(p.maxThreadsDim[1]) ||
      b.z > static_cast<unsigned>(p.maxThreadsDim[2])) {
    return cudaErrorInvalidConfiguration;
  }
  if (g.x == 0 || g.y == 0 || g.z == 0 || g.x > static_cast<unsigned>(p.maxGridSize[0]) ||
      g.y > static_cast<unsigned>(p.maxGridSize[1]) ||
      g.z > static_cast<unsigned>(p.maxGridSize[2])) {
    return cudaErrorInvalidConfiguration;
  }
  if (cfg.shmem > p.sharedMemPerBlock) return cudaErrorInvalidValue;
  return cudaSuccess;
}

}  // namespace

int schedule() { return g_schedule.load(); }

void set_schedule(int s) {
  TORCH_CHECK(s == 0 || s == 1, "simt: schedule must be 0 (ascending) or 1 (descending), got ", s);
  g_schedule.store(s);
}

std::vector<std::string> launch_log() {
  const std::lock_guard<std::mutex> lock(g_log_mutex);
  return {g_log.begin(), g_log.end()};
}

void log_call(const std::string& entry) {
  const std::lock_guard<std::mutex> lock(g_log_mutex);
  g_log.push_back(entry);
  if (g_log.size() > kLogMax) g_log.pop_front();
}

void clear_launch_log() {
  const std::lock_guard<std::mutex> lock(g_log_mutex);
  g_log.clear();
}

namespace detail {

void launch(const LaunchConfig& cfg, const void* kernel, std::function<void()> thread_body) {
  const cudaError_t err = check_config(cfg);
  if (err != cudaSuccess) {
    set_last_error(err);
    return;
  }
  log_launch(cfg);
  // Stream 0 is the default stream, as in CUDA (not the current c10 stream).
  cudaStream_t stream = cfg.stream != nullptr ? cfg.stream : default_stream(current_device());
  const LaunchConfig c = cfg;
  const std::vector<SharedArray>& shared = shared_arrays(kernel);
  enqueue(stream, [c, &shared, body = std::move(thread_body)]() {
    TORCH_CHECK(tl_run == nullptr, "simt: a kernel launched from inside a kernel");
    const bool reverse = schedule() == 1;
    const size_t threads = size_t{c.block.x} * c.block.y * c.block.z;
    const uint64_t blocks = uint64_t{c.grid.x} * c.grid.y * c.grid.z;
    BlockRun run;
    run.body = &body;
    blockDim = c.block;
    gridDim = c.grid;
    tl_run = &run;
    try {
      for (uint64_t k = 0; k < blocks; ++k) {
        const uint64_t b = reverse ? blocks - 1 - k : k;
        blockIdx = uint3{static_cast<unsigned>(b % c.grid.x),
                         static_cast<unsigned>((b / c.grid.x) % c.grid.y),
                         static_cast<unsigned>(b / (uint64_t{c.grid.x} * c.grid.y))};
        for (const SharedArray& a : shared) std::memset(a.data, 0xFF, a.bytes);  // uninitialised
        run_block(run, threads, reverse);
      }
    } catch (...) {
      tl_run = nullptr;
      throw;
    }
    tl_run = nullptr;
  });
}

void sync_block(const char* file, int line) {
  Fiber& f = current_fiber("__syncthreads");
  f.wait = Wait::kBlock;
  f.file = file;
  f.line = line;
  switch_to_scheduler(*tl_run, f, /*exiting=*/false);
  threadIdx = f.tid;
}

void sync_warp(unsigned mask) {
  Fiber& f = current_fiber("__syncwarp");
  TORCH_CHECK(mask & (1u << (f.linear % 32)), "simt: __syncwarp mask 0x", std::hex, mask,
              " does not name the calling lane ", std::dec, f.linear % 32);
  f.wait = Wait::kWarp;
  f.mask = mask;
  f.src = -1;
  switch_to_scheduler(*tl_run, f, /*exiting=*/false);
  threadIdx = f.tid;
}

uint64_t warp_exchange(unsigned mask, uint64_t bits, int src) {
  Fiber& f = current_fiber("a warp shuffle");
  TORCH_CHECK(mask & (1u << (f.linear % 32)), "simt: shuffle mask 0x", std::hex, mask,
              " does not name the calling lane ", std::dec, f.linear % 32);
  TORCH_CHECK(src >= 0 && src < 32, "simt: shuffle source lane ", src, " out of range");
  f.wait = Wait::kWarp;
  f.mask = mask;
  f.bits = bits;
  f.src = src;
  switch_to_scheduler(*tl_run, f, /*exiting=*/false);
  threadIdx = f.tid;
  return f.result;
}

int lane_id() { return current_fiber("lane_id").linear % 32; }

}  // namespace detail
}  // namespace simt
