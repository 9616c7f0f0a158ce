// LD_PRELOAD shim: counts GOMP_parallel calls per thread and prints, every Nth call, the native
// backtrace and the calling thread's Python traceback (who fans out to OpenMP).
#define _GNU_SOURCE
#include <dlfcn.h>
#include <execinfo.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include <sys/syscall.h>
typedef void (*gomp_fn)(void (*)(void *), void *, unsigned, unsigned);
typedef void *(*tstate_fn)(void);
typedef const char *(*dump_fn)(int, void *);
static gomp_fn real;
static long count;
void GOMP_parallel(void (*fn)(void *), void *data, unsigned num_threads, unsigned flags) {
  if (!real) real = (gomp_fn)dlsym(RTLD_NEXT, "GOMP_parallel");
  long c = __atomic_fetch_add(&count, 1, __ATOMIC_RELAXED);
  long every = getenv("GOMP_SPY_EVERY") ? atol(getenv("GOMP_SPY_EVERY")) : 100;
  if (c % every == 0) {
    void *b[20];
    int n = backtrace(b, 20);
    dprintf(2, "\n@@ GOMP_parallel #%ld tid %ld threads %u\n", c, (long)syscall(SYS_gettid), num_threads);
    backtrace_symbols_fd(b, n, 2);
    tstate_fn ts = (tstate_fn)dlsym(RTLD_DEFAULT, "PyGILState_GetThisThreadState");
    dump_fn dump = (dump_fn)dlsym(RTLD_DEFAULT, "_Py_DumpTraceback");
    if (ts && dump && ts()) dump(2, ts());
    dprintf(2, "@@ end\n");
  }
  real(fn, data, num_threads, flags);
}
__attribute__((destructor)) static void spy_total(void) { dprintf(2, "\n@@ GOMP_parallel total %ld\n", count); }
