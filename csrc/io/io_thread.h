#pragma once
// The end of a reader's or writer's I/O thread, shared by their close().

#include <condition_variable>
#include <mutex>
#include <thread>

namespace mlxfast::io {

// With lk held on the state's mutex: waits on cv until exited() or the
// deadline, then joins a thread that exited or detaches one still stuck in a
// syscall (a hung disk; it frees the shared state when it returns). True when
// the thread exited.
template <class TimePoint, class Exited>
bool join_or_detach(std::thread& thread, std::unique_lock<std::mutex>& lk, std::condition_variable& cv,
                    TimePoint deadline, Exited exited) {
  if (!thread.joinable()) return exited();  // closed before
  bool done = cv.wait_until(lk, deadline, exited);
  lk.unlock();
  if (done)
    thread.join();
  else
    thread.detach();
  return done;
}

} // namespace mlxfast::io
