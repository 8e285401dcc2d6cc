// Flags in memory every rank of a group maps (minddp/algorithms/shared_memory.py):
// how ranks on one host tell one another "this phase is done" without a round
// trip through gloo's sockets (a gloo all-reduce of one value took 0.2-0.9 ms on
// 2 CPU ranks; a flag is seen within microseconds of being set).
//
// Each rank owns one 32-bit word, in its own file, and only it writes there: a
// generation that grows by one at every phase. `arrive` makes everything this
// rank wrote before it visible, then sets the word and wakes its waiters;
// `wait` returns once every peer's word has reached a generation, sleeping in
// the kernel (futex) meanwhile, so a waiting rank takes no CPU from the ranks
// it waits for. A peer that dies or never arrives gives an error within the
// group's timeout, never a hang.
#include <torch/extension.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#ifdef __linux__
#include <errno.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#endif

namespace py = pybind11;

namespace minddp {
namespace {

#ifdef __linux__
// Generations wrap at 2^32: compare by difference, as TCP compares sequence numbers.
bool at_least(uint32_t seen, uint32_t generation) {
  return static_cast<int32_t>(seen - generation) >= 0;
}

bool reached(const std::atomic<uint32_t>* word, uint32_t generation) {
  return at_least(word->load(std::memory_order_acquire), generation);
}

std::atomic<uint32_t>* word_at(uintptr_t address) {
  static_assert(sizeof(std::atomic<uint32_t>) == 4 && std::atomic<uint32_t>::is_always_lock_free,
                "a flag must be a plain 32-bit word that another process can read");
  TORCH_INTERNAL_ASSERT(address % 4 == 0, "minddp shm flag: unaligned word");
  return reinterpret_cast<std::atomic<uint32_t>*>(address);
}

// Whether process `pid` has exited: gone, or a zombie its parent has not reaped yet (kill(pid,
// 0) still succeeds on one, and a parent that is itself a rank waiting here never reaps it).
bool exited(int64_t pid) {
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%lld/stat", static_cast<long long>(pid));
  std::FILE* f = std::fopen(path, "r");
  if (f == nullptr) return kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH;
  char buf[512];
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[n] = '\0';
  // "pid (comm) state ...": comm may hold spaces and parentheses, the state follows the last ')'.
  const char* close = std::strrchr(buf, ')');
  if (close == nullptr || close[1] == '\0' || close[2] == '\0') return false;
  return close[2] == 'Z' || close[2] == 'X';
}

// Not FUTEX_PRIVATE: the word is in a shared mapping, and the waker is another process.
void arrive(uintptr_t address, uint32_t generation) {
  // A full fence: the phase's data, also what non-temporal stores wrote, is
  // visible before the flag that says it is there.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  word_at(address)->store(generation, std::memory_order_release);
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(address), FUTEX_WAKE, INT32_MAX, nullptr,
          nullptr, 0);
}

// (0, -1): every word reached `generation`; (1, i): peer i's process is gone;
// (2, i): peer i did not arrive within timeout_s. Runs without the GIL, taking it
// every 50 ms of waiting to raise a pending KeyboardInterrupt.
std::pair<int, int64_t> wait(const std::vector<uintptr_t>& addresses, uint32_t generation,
                             const std::vector<int64_t>& pids, double timeout_s) {
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration<double>(timeout_s);
  for (size_t i = 0; i < addresses.size(); ++i) {
    std::atomic<uint32_t>* word = word_at(addresses[i]);
    for (;;) {
      const uint32_t seen = word->load(std::memory_order_acquire);
      if (at_least(seen, generation)) break;
      // Sleeps until the word changes from `seen`; wakes at least every 50 ms to
      // look at the peer and the clock.
      const timespec nap = {0, 50 * 1000 * 1000};
      syscall(SYS_futex, reinterpret_cast<uint32_t*>(addresses[i]), FUTEX_WAIT, seen, &nap,
              nullptr, 0);
      if (reached(word, generation)) break;
      for (size_t k = i; k < addresses.size(); ++k) {  // every peer not yet seen here
        if (!reached(word_at(addresses[k]), generation) && exited(pids[k])) return {1, k};
      }
      if (std::chrono::steady_clock::now() > deadline) return {2, i};
      // Ctrl-C while waiting: Python's handler only notes the signal, and nothing would
      // look at the note until the peer came or the timeout passed.
      py::gil_scoped_acquire gil;
      if (PyErr_CheckSignals() != 0) throw py::error_already_set();
    }
  }
  return {0, -1};
}
#endif

}  // namespace

void bind_shm_flags(py::module& m) {
#ifdef __linux__
  m.def("flag_arrive", &arrive, py::arg("address"), py::arg("generation"),
        py::call_guard<py::gil_scoped_release>(),
        "Make this rank's writes visible, set its flag word to `generation`, wake waiters.");
  m.def("flag_wait", &wait, py::arg("addresses"), py::arg("generation"), py::arg("pids"),
        py::arg("timeout_s"), py::call_guard<py::gil_scoped_release>(),
        "Until every word reached `generation`: (0, -1), or (1, i) peer i died, (2, i) timed "
        "out on peer i.");
#endif
}

}  // namespace minddp
