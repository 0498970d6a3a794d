// Tells ThreadSanitizer about abseil's synchronization, for `./dev tsan`: preloaded (LD_PRELOAD) into the
// instrumented tests and daemons, it interposes absl::Mutex, absl::CondVar and absl::Notification, whose system
// library was built without TSan's annotations, and brackets each real call with them. Without it TSan sees no
// ordering through them and reports every guarded access as a race. Built without instrumentation, and its TSan
// hooks are weak, so that the uninstrumented processes that inherit the preload (the shell, `timeout`) run as if it
// were not there.
#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

extern "C" {
void __tsan_mutex_destroy(void* addr, unsigned flags) __attribute__((weak));
void __tsan_mutex_pre_lock(void* addr, unsigned flags) __attribute__((weak));
void __tsan_mutex_post_lock(void* addr, unsigned flags, int recursion) __attribute__((weak));
int __tsan_mutex_pre_unlock(void* addr, unsigned flags) __attribute__((weak));
void __tsan_mutex_post_unlock(void* addr, unsigned flags) __attribute__((weak));
void __tsan_acquire(void* addr) __attribute__((weak));
void __tsan_release(void* addr) __attribute__((weak));
void __tsan_ignore_thread_begin() __attribute__((weak));
void __tsan_ignore_thread_end() __attribute__((weak));
void __tsan_func_entry(void* caller_pc) __attribute__((weak));
void __tsan_func_exit() __attribute__((weak));
}

namespace {

// The flags of sanitizer/tsan_interface.h.
constexpr unsigned kReadLock = 1 << 3;
constexpr unsigned kTryLock = 1 << 4;
constexpr unsigned kTryLockFailed = 1 << 5;

bool Instrumented() { return __tsan_mutex_pre_lock != nullptr; }

void Acquired(void* mu, unsigned flags) {
  __tsan_mutex_pre_lock(mu, flags);
  __tsan_mutex_post_lock(mu, flags, 0);
}

void Releasing(void* mu, unsigned flags) {
  __tsan_mutex_pre_unlock(mu, flags);
  __tsan_mutex_post_unlock(mu, flags);
}

thread_local int nesting = 0;

// One interposed call. Only the outermost one on a thread is annotated: abseil's functions call each other through
// their exported symbols (AwaitWithTimeout calls AwaitWithDeadline, Notification::Notify locks a Mutex), which lands
// in this file again. Inside the library's code TSan ignores this thread's accesses: abseil evaluates a waiter's
// Condition (our code, reading what the mutex guards) inside Await and LockWhen, and also in another thread's Unlock,
// where TSan's view has the mutex released. Those reads go unchecked; every other access to the same state is.
// `caller` is the interposed function's return address. TSan's stacks are the frames its instrumented code pushed,
// and nothing here is instrumented: without the frame pushed here, a report on a mutex would skip the frame that
// locked, unlocked or destroyed it and show that frame's caller in its place.
class Interposed {
 public:
  explicit Interposed(void* caller) : outer_(nesting++ == 0 && Instrumented()) {
    if (Instrumented()) __tsan_func_entry(caller);
  }
  ~Interposed() {
    if (Instrumented()) __tsan_func_exit();
    --nesting;
  }
  Interposed(const Interposed&) = delete;
  Interposed& operator=(const Interposed&) = delete;

  bool outer() const { return outer_; }
  // Runs the library's call with this thread's accesses ignored.
  template <typename Call>
  auto Unobserved(Call call) const {
    if (outer_) __tsan_ignore_thread_begin();
    struct End {
      bool on;
      ~End() {
        if (on) __tsan_ignore_thread_end();
      }
    } end{outer_};
    return call();
  }

 private:
  const bool outer_;
};

// The library's definition of the function this file defines at `ours`: the symbol of the same (mangled) name next
// in the lookup order after the preload.
void* RealOf(void* ours) {
  Dl_info info{};
  void* real = nullptr;
  if (dladdr(ours, &info) != 0 && info.dli_sname != nullptr) real = dlsym(RTLD_NEXT, info.dli_sname);
  if (real == nullptr) {
    std::fprintf(stderr, "absl_mutex_annotations: no library definition behind %p (%s)\n", ours,
                 info.dli_sname != nullptr ? info.dli_sname : "unnamed");
    std::abort();
  }
  return real;
}

// A non-virtual member function's code address (the Itanium ABI's pointer to member: {address, adjustment}).
template <typename MemberFunction>
void* CodeOf(MemberFunction member) {
  static_assert(sizeof(member) == 2 * sizeof(void*));
  void* address = nullptr;
  std::memcpy(&address, &member, sizeof(address));
  return address;
}

// The real member function as a plain function of `this` and the arguments.
template <typename Result, typename Class, typename... Args>
auto Real(Result (Class::*member)(Args...)) {
  using Plain = Result (*)(Class*, Args...);
  return reinterpret_cast<Plain>(RealOf(CodeOf(member)));
}
template <typename Result, typename Class, typename... Args>
auto Real(Result (Class::*member)(Args...) const) {
  using Plain = Result (*)(const Class*, Args...);
  return reinterpret_cast<Plain>(RealOf(CodeOf(member)));
}

// Runs the library's `real(args...)` as one interposed call after which `mu` is held (flags: kReadLock for a reader
// lock; a LockWhen that timed out holds it too). `releases`: the call may give the mutex up and take it again
// meanwhile (an Await, a CondVar wait), which TSan sees as an unlock before it and a lock after. `caller`: the
// interposed function's return address (Interposed's).
template <typename Real, typename... Args>
auto Holding(void* caller, void* mu, unsigned flags, bool releases, Real real, Args&&... args) {
  const Interposed call(caller);
  if (call.outer() && releases) Releasing(mu, flags);
  // At the return, once the result is taken, whether the call returns one or not.
  struct AcquiredOnReturn {
    const Interposed& call;
    void* mu;
    unsigned flags;
    ~AcquiredOnReturn() {
      if (call.outer()) Acquired(mu, flags);
    }
  } const acquired{call, mu, flags};
  return call.Unobserved([&] { return real(std::forward<Args>(args)...); });
}

}  // namespace

namespace absl {

Mutex::~Mutex() {
  // The destructor's address cannot be taken: its symbol is Lock's with the destructor's name in place of "4Lock".
  static const auto real = [] {
    Dl_info info{};
    if (dladdr(CodeOf(&Mutex::Lock), &info) == 0 || info.dli_sname == nullptr) std::abort();
    std::string name = info.dli_sname;
    name.replace(name.rfind("4LockEv"), 7, "D1Ev");
    void* found = dlsym(RTLD_NEXT, name.c_str());
    if (found == nullptr) std::abort();
    return reinterpret_cast<void (*)(Mutex*)>(found);
  }();
  const Interposed call(__builtin_return_address(0));
  if (call.outer()) __tsan_mutex_destroy(this, 0);
  call.Unobserved([&] { real(this); });
}

void Mutex::Lock() {
  static const auto real = Real(&Mutex::Lock);
  Holding(__builtin_return_address(0), this, 0, /*releases=*/false, real, this);
}

void Mutex::ReaderLock() {
  static const auto real = Real(&Mutex::ReaderLock);
  Holding(__builtin_return_address(0), this, kReadLock, /*releases=*/false, real, this);
}

bool Mutex::TryLock() {
  static const auto real = Real(&Mutex::TryLock);
  const Interposed call(__builtin_return_address(0));
  const bool locked = call.Unobserved([&] { return real(this); });
  if (call.outer()) {
    __tsan_mutex_pre_lock(this, kTryLock);
    __tsan_mutex_post_lock(this, locked ? kTryLock : kTryLock | kTryLockFailed, 0);
  }
  return locked;
}

bool Mutex::ReaderTryLock() {
  static const auto real = Real(&Mutex::ReaderTryLock);
  const Interposed call(__builtin_return_address(0));
  const bool locked = call.Unobserved([&] { return real(this); });
  if (call.outer()) {
    __tsan_mutex_pre_lock(this, kReadLock | kTryLock);
    __tsan_mutex_post_lock(this, kReadLock | (locked ? kTryLock : kTryLock | kTryLockFailed), 0);
  }
  return locked;
}

void Mutex::Unlock() {
  static const auto real = Real(&Mutex::Unlock);
  const Interposed call(__builtin_return_address(0));
  if (call.outer()) Releasing(this, 0);
  call.Unobserved([&] { real(this); });
}

void Mutex::ReaderUnlock() {
  static const auto real = Real(&Mutex::ReaderUnlock);
  const Interposed call(__builtin_return_address(0));
  if (call.outer()) Releasing(this, kReadLock);
  call.Unobserved([&] { real(this); });
}

void Mutex::LockWhen(const Condition& cond) {
  static const auto real = Real(&Mutex::LockWhen);
  Holding(__builtin_return_address(0), this, 0, /*releases=*/false, real, this, cond);
}

void Mutex::ReaderLockWhen(const Condition& cond) {
  static const auto real = Real(&Mutex::ReaderLockWhen);
  Holding(__builtin_return_address(0), this, kReadLock, /*releases=*/false, real, this, cond);
}

bool Mutex::LockWhenWithTimeout(const Condition& cond, Duration timeout) {
  static const auto real = Real(&Mutex::LockWhenWithTimeout);
  return Holding(__builtin_return_address(0), this, 0, /*releases=*/false, real, this, cond, timeout);
}

bool Mutex::LockWhenWithDeadline(const Condition& cond, Time deadline) {
  static const auto real = Real(&Mutex::LockWhenWithDeadline);
  return Holding(__builtin_return_address(0), this, 0, /*releases=*/false, real, this, cond, deadline);
}

void Mutex::Await(const Condition& cond) {
  static const auto real = Real(&Mutex::Await);
  Holding(__builtin_return_address(0), this, 0, /*releases=*/true, real, this, cond);
}

bool Mutex::AwaitWithTimeout(const Condition& cond, Duration timeout) {
  static const auto real = Real(&Mutex::AwaitWithTimeout);
  return Holding(__builtin_return_address(0), this, 0, /*releases=*/true, real, this, cond, timeout);
}

bool Mutex::AwaitWithDeadline(const Condition& cond, Time deadline) {
  static const auto real = Real(&Mutex::AwaitWithDeadline);
  return Holding(__builtin_return_address(0), this, 0, /*releases=*/true, real, this, cond, deadline);
}

void CondVar::Wait(Mutex* mu) {
  static const auto real = Real(&CondVar::Wait);
  Holding(__builtin_return_address(0), mu, 0, /*releases=*/true, real, this, mu);
}

bool CondVar::WaitWithTimeout(Mutex* mu, Duration timeout) {
  static const auto real = Real(&CondVar::WaitWithTimeout);
  return Holding(__builtin_return_address(0), mu, 0, /*releases=*/true, real, this, mu, timeout);
}

bool CondVar::WaitWithDeadline(Mutex* mu, Time deadline) {
  static const auto real = Real(&CondVar::WaitWithDeadline);
  return Holding(__builtin_return_address(0), mu, 0, /*releases=*/true, real, this, mu, deadline);
}

// A notification orders what came before Notify before what follows a wait that saw it (the wait's fast path
// reads an atomic flag that TSan cannot see).
void Notification::Notify() {
  static const auto real = Real(&Notification::Notify);
  const Interposed call(__builtin_return_address(0));
  if (call.outer()) __tsan_release(this);
  call.Unobserved([&] { real(this); });
}

void Notification::WaitForNotification() const {
  static const auto real = Real(&Notification::WaitForNotification);
  const Interposed call(__builtin_return_address(0));
  call.Unobserved([&] { real(this); });
  if (call.outer()) __tsan_acquire(const_cast<Notification*>(this));
}

bool Notification::WaitForNotificationWithTimeout(Duration timeout) const {
  static const auto real = Real(&Notification::WaitForNotificationWithTimeout);
  const Interposed call(__builtin_return_address(0));
  const bool notified = call.Unobserved([&] { return real(this, timeout); });
  if (notified && call.outer()) __tsan_acquire(const_cast<Notification*>(this));
  return notified;
}

bool Notification::WaitForNotificationWithDeadline(Time deadline) const {
  static const auto real = Real(&Notification::WaitForNotificationWithDeadline);
  const Interposed call(__builtin_return_address(0));
  const bool notified = call.Unobserved([&] { return real(this, deadline); });
  if (notified && call.outer()) __tsan_acquire(const_cast<Notification*>(this));
  return notified;
}

}  // namespace absl
