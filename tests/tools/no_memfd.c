/* no-memfd COMMAND [ARG...]: runs COMMAND where memfd_create(2) fails with ENOSYS, as on
 * kernels before 3.17 and in sandboxes that filter it (a seccomp filter, inherited by
 * every process COMMAND starts). The tests use it to reach smp-eval's /dev/shm path.
 * Exit 125 when the filter cannot be installed (the test then skips), else COMMAND's. */
#include <errno.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#if defined(__x86_64__)
#define ARCH AUDIT_ARCH_X86_64
#elif defined(__aarch64__)
#define ARCH AUDIT_ARCH_AARCH64
#endif

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: no-memfd COMMAND [ARG...]\n");
        return 2;
    }
#ifdef ARCH
    struct sock_filter f[] = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, ARCH, 1, 0), /* another ABI: let it be */
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_memfd_create, 0, 1),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (ENOSYS & SECCOMP_RET_DATA)),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
    };
    struct sock_fprog prog = {(unsigned short)(sizeof f / sizeof f[0]), f};
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) || prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog)) {
        fprintf(stderr, "no-memfd: cannot install a seccomp filter: %s\n", strerror(errno));
        return 125;
    }
#else
    fprintf(stderr, "no-memfd: no seccomp filter for this architecture\n");
    return 125;
#endif
    execvp(argv[1], argv + 1);
    fprintf(stderr, "no-memfd: %s: %s\n", argv[1], strerror(errno));
    return 127;
}
