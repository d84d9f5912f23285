/* backends/dev.c: opening a backend (dev.h): the C one built in, the CUDA one loaded
 * from libsmp_cuda.so. */
#include "dev.h"

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* the folder of the library or program that holds this function (build/lib or build/bin) */
static void own_dir(char *buf, size_t cap)
{
    Dl_info info;
    buf[0] = 0;
    if (dladdr((void *)own_dir, &info) && info.dli_fname) {
        snprintf(buf, cap, "%s", info.dli_fname);
        char *slash = strrchr(buf, '/');
        if (slash) *slash = 0;
        else buf[0] = 0;
    }
}

static shard_status load_cuda(const dev_ops **out)
{
    const char *env = getenv("SMP_CUDA_LIB");
    char dir[1024], path[1200];
    void *h = NULL;
    const char *tried = "libsmp_cuda.so";
    if (env && *env) {
        tried = env;
        h = dlopen(env, RTLD_NOW | RTLD_LOCAL);
    } else {
        own_dir(dir, sizeof dir); /* build/bin/smp-train -> build/lib/libsmp_cuda.so */
        snprintf(path, sizeof path, "%s/../lib/libsmp_cuda.so", dir[0] ? dir : ".");
        h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
        if (!h) h = dlopen("libsmp_cuda.so", RTLD_NOW | RTLD_LOCAL);
    }
    if (!h) /* what this machine or build lacks: a runtime failure (exit 1), not bad input */
        return shard_fail(SHARD_E_IO,
                          "the CUDA backend could not be loaded (%s): %s; it is built with the CUDA toolkit "
                          "(scons with nvcc on the PATH)",
                          tried, dlerror());
    const dev_ops *(*entry)(void) = (const dev_ops *(*)(void))dlsym(h, DEV_CUDA_ENTRY);
    const dev_ops *ops = entry ? entry() : NULL;
    if (!ops || ops->abi != DEV_ABI)
        return shard_fail(SHARD_E_UNSUPPORTED, "%s: not a CUDA backend of this smp-train (%s)", tried,
                          ops ? "another version" : "no " DEV_CUDA_ENTRY);
    *out = ops; /* the library stays loaded for the life of the process */
    return SHARD_OK;
}

shard_status dev_open(dev *d, const char *backend, shard_dtype dt, int device)
{
    memset(d, 0, sizeof *d);
    const dev_ops *ops = NULL;
    if (!backend || !strcmp(backend, "cpu")) {
        ops = dev_c_ops();
        if (dt != SHARD_DT_F32)
            return shard_fail(SHARD_E_USAGE, "the C backend computes in fp32 (--dtype fp32); bf16 needs --backend cuda");
    } else if (!strcmp(backend, "cuda")) {
        shard_status s = load_cuda(&ops);
        if (s) return s;
    } else {
        return shard_fail(SHARD_E_USAGE, "unknown backend \"%s\" (cpu or cuda)", backend);
    }
    if (dt != SHARD_DT_F32 && dt != SHARD_DT_BF16)
        return shard_fail(SHARD_E_USAGE, "compute dtype %s: fp32 or bf16", shard_dtype_name(dt));
    d->ops = ops;
    d->dt = dt;
    d->es = shard_dtype_size(dt);
    d->device = device;
    shard_status s = ops->init(d, device);
    if (s) {
        if (!shard_errmsg()[0] || d->err) s = dev_status(d);
        d->ops = NULL;
        return s;
    }
    return SHARD_OK;
}

void dev_close(dev *d)
{
    if (d->ops && d->ops->fini) d->ops->fini(d);
    d->ops = NULL;
}

/* up: host fp32 src -> backend dst; else backend src -> host fp32 dst. Directly in
 * fp32, else converted through a host buffer. */
static void move_f32(dev *d, void *dst, const void *src, size_t n, int up)
{
    if (d->dt == SHARD_DT_F32) {
        if (up) d->ops->upload(d, dst, src, n * sizeof(float));
        else d->ops->download(d, dst, src, n * sizeof(float));
        return;
    }
    void *tmp = malloc(n ? n * d->es : 1);
    if (!tmp) {
        dev_fail(d, SHARD_E_NOMEM, "out of host memory staging %zu elements", n);
        return;
    }
    if (up) {
        shard_convert(tmp, d->dt, src, SHARD_DT_F32, n);
        d->ops->upload(d, dst, tmp, n * d->es);
    } else {
        d->ops->download(d, tmp, src, n * d->es);
        shard_convert(dst, SHARD_DT_F32, tmp, d->dt, n);
    }
    free(tmp);
}

void dev_upload_f32(dev *d, void *dst, const float *host, size_t n) { move_f32(d, dst, host, n, 1); }
void dev_download_f32(dev *d, float *host, const void *src, size_t n) { move_f32(d, host, src, n, 0); }
