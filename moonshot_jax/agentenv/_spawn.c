/* agentenv spawn helper: becomes a sandbox command (see _init.Init.exec and _spawn.py).
 *
 * Init starts this binary with posix_spawn (a vfork-style clone: no copy of init's page tables, none of the
 * copy-on-write faults a fork of the ~14 MB interpreter pays) right after unshare(CLONE_NEWPID), so this process
 * is pid 1 of the command's fresh PID namespace. It does what Init._child does in a forked init, in the same
 * order, then execs the command in place: same process, same pid, same namespaces.
 *
 *   usage: agentenv-spawn -c CPU_S -f FSIZE_B [-m AS_B] [-n NPROC] [-s] [-g] -d CWD -- ARGV...
 *   fds:   0-2 the command's stdin / stdout / stderr (init's posix_spawn file actions put them there),
 *          3 the seccomp BPF program (-s; packed sock_filter array written by _seccomp.program_fd),
 *          4 the agent memory cgroup's tasks / cgroup.procs file (-g).
 *   environment: exactly the command's (posix_spawn's env); PATH in it is searched as os.execvpe does.
 *
 * Exit codes as the fork path: 126 setup failure (message on stderr) or cwd missing, 127 exec failure.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#define USER_ID 1000
#define SECCOMP_FD 3
#define CGROUP_FD 4
#define MAX_INSNS 4096 /* BPF_MAXINSNS */
#ifndef SYS_close_range
#define SYS_close_range 436 /* the same on every architecture; C libraries older than glibc 2.34 lack a wrapper */
#endif

extern char **environ;

static void fail(const char *what) {
  dprintf(2, "agentenv: cannot start command: %s: %s\n", what, strerror(errno));
  _exit(126);
}

static unsigned long long number(const char *s, const char *what) {
  char *end;
  errno = 0;
  unsigned long long v = strtoull(s, &end, 10);
  if (errno || !*s || *end) {
    errno = EINVAL;
    fail(what);
  }
  return v;
}

static void limit(int resource, unsigned long long v, const char *what) {
  struct rlimit r = {v, v};
  if (setrlimit(resource, &r)) fail(what);
}

/* os.execvpe's search, not glibc's execvpe: no /bin/sh retry of a file without a #! line (ENOEXEC is an error),
 * and the error reported is the first one that is not ENOENT / ENOTDIR, else the last. */
static int exec_search(char **argv) {
  const char *file = argv[0];
  if (strchr(file, '/')) {
    execve(file, argv, environ);
    return errno;
  }
  const char *path = getenv("PATH");
  if (!path) path = "/bin:/usr/bin"; /* os.defpath */
  int saved = 0, last = ENOENT;
  for (const char *dir = path;;) {
    const char *end = strchrnul(dir, ':');
    size_t n = end - dir;
    char *full = malloc(n + strlen(file) + 2);
    if (!full) return ENOMEM;
    /* os.path.join(dir, file): "" -> file (relative to cwd); a trailing "/" is not doubled */
    sprintf(full, "%.*s%s%s", (int)n, dir, n && dir[n - 1] != '/' ? "/" : "", file);
    execve(full, argv, environ);
    last = errno;
    if (!saved && last != ENOENT && last != ENOTDIR) saved = last;
    free(full);
    if (!*end) break;
    dir = end + 1;
  }
  return saved ? saved : last;
}

int main(int argc, char **argv) {
  const char *cpu = NULL, *fsize = NULL, *as = NULL, *nproc = NULL, *cwd = NULL;
  int seccomp = 0, cgroup = 0, opt;
  while ((opt = getopt(argc, argv, "+c:f:m:n:sgd:")) != -1) {
    switch (opt) {
      case 'c': cpu = optarg; break;
      case 'f': fsize = optarg; break;
      case 'm': as = optarg; break;
      case 'n': nproc = optarg; break;
      case 's': seccomp = 1; break;
      case 'g': cgroup = 1; break;
      case 'd': cwd = optarg; break;
      default: errno = EINVAL; fail("usage");
    }
  }
  if (!cpu || !fsize || !cwd || optind >= argc) {
    errno = EINVAL;
    fail("usage");
  }
  char **cmd = argv + optind;
  prctl(PR_SET_NAME, "agentenv-spawn", 0, 0, 0); /* else ps shows the fd number init exec'd us through */
  /* glibc's posix_spawn leaves its internal signals (32 .. SIGRTMIN-1) ignored in the child, and an ignored signal
   * stays ignored across exec: back to the default a forked init's command gets. glibc's sigaction refuses these
   * numbers, hence the raw call (kernel struct sigaction: handler, flags, restorer, mask). */
  struct { void (*handler)(int); unsigned long flags; void (*restorer)(void); unsigned long mask; } dfl = {SIG_DFL};
  for (int sig = 32; sig < SIGRTMIN; sig++) syscall(SYS_rt_sigaction, sig, &dfl, NULL, sizeof dfl.mask);

  /* Read the filter before fd 3 goes with the rest; it is installed last, once the uid is 1000. */
  static struct sock_filter filter[MAX_INSNS];
  struct sock_fprog prog = {0, filter};
  if (seccomp) {
    ssize_t got = pread(SECCOMP_FD, filter, sizeof filter, 0);
    if (got <= 0 || got % sizeof *filter) {
      if (got >= 0) errno = EINVAL;
      fail("read seccomp program");
    }
    prog.len = got / sizeof *filter;
  }
  /* "0" moves just this thread (= process) into the agent memory cgroup: see _sys.cg_join_self */
  if (cgroup && write(CGROUP_FD, "0", 1) != 1) fail("join agent cgroup");
  /* A /proc of this PID namespace (ps & co. check that /proc/self is getpid()). */
  if (unshare(CLONE_NEWNS)) fail("unshare");
  if (mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL)) fail("mount /proc");
  /* Nothing of init's may reach the command: its sockets, the lifeline, this binary, the program above. */
  if (syscall(SYS_close_range, 3, ~0U, 0)) {
    if (errno != ENOSYS) fail("close_range");
    for (int fd = 3; fd < 1 << 16; fd++) close(fd); /* Linux < 5.9: as the fork path's os.closerange(3, 1 << 16) */
  }
  if (prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)) fail("PR_SET_DUMPABLE");
  /* A cgroup OOM must take the command, never init / services (raising needs no privilege). */
  int fd = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);
  if (fd < 0 || write(fd, "1000", 4) != 4) fail("oom_score_adj");
  close(fd);
  limit(RLIMIT_CPU, number(cpu, "cpu seconds"), "RLIMIT_CPU");
  limit(RLIMIT_FSIZE, number(fsize, "file size"), "RLIMIT_FSIZE");
  limit(RLIMIT_CORE, 0, "RLIMIT_CORE");
  if (as) limit(RLIMIT_AS, number(as, "memory"), "RLIMIT_AS"); /* no memory cgroup: per process */
  if (nproc) limit(RLIMIT_NPROC, number(nproc, "pids"), "RLIMIT_NPROC"); /* no pids cgroup: per uid */
  if (setgroups(0, NULL)) fail("setgroups");
  if (setresgid(USER_ID, USER_ID, USER_ID)) fail("setresgid");
  if (setresuid(USER_ID, USER_ID, USER_ID)) fail("setresuid");
  if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)) fail("PR_SET_NO_NEW_PRIVS");
  if (seccomp && prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog, 0, 0)) fail("seccomp");
  if (chdir(cwd)) {
    dprintf(2, "agentenv: cannot chdir to %s: %s\n", cwd, strerror(errno));
    _exit(126);
  }
  int err = exec_search(cmd);
  dprintf(2, "agentenv: cannot exec %s: %s\n", cmd[0], strerror(err));
  _exit(127);
}
