/* kernels/moe.cu: Mixture-of-Experts routing, dispatch and combine (CUDA).
 * route / route_backward: one warp per token row (E <= 1024 experts, so a lane holds
 * at most 32 of them: its chosen set is one 32-bit mask); the top k come from k warp
 * arg-max rounds under the order "larger prob, then lower expert", op_moe_route's tie
 * rule. The backward keeps the row's probs gradient in shared memory (E floats per
 * warp) so that the top-k terms can land on any lane's experts.
 * combine, its backward and scatter_add: one block per token, the threads striding
 * over H and each thread adding the k experts' rows in order j: deterministic, no
 * atomics. gather: a grid-stride copy of whole rows, 16-byte units where they fit.
 * group: a stable counting sort of the (token, choice) pairs by expert in chunks of
 * GROUP_CHUNK pairs, one warp each: the chunk's counts per expert, their scan over
 * experts and chunks (one block), then each chunk placed 32 pairs at a time, a pair's
 * rank among its warp's pairs of the same expert found by shuffles: no atomics, the
 * same rows as op_moe_group. prob_sums: a thread per expert adds its column in token
 * order, in double, as op_moe_prob_sums. */
#include "cuda_common.cuh"

enum { MOE_THREADS = 256, ROUTE_WARPS = 4, MOE_EMAX = 1024, MOE_KMAX = 32 };

/* (p, e) before (q, f) in the top-k order */
__device__ __forceinline__ bool moe_before(float p, int e, float q, int f) { return p > q || (p == q && e < f); }

/* what top-k ranks by: the prob, a NaN (from NaN logits) below every number but above
 * "none" (-1), so that every pick is a valid expert (op_moe_route ranks the same) */
__device__ __forceinline__ float moe_key(float p) { return p >= 0.0f ? p : -0.5f; }

/* the warp's first expert in the top-k order among those no lane has taken, and its prob;
 * every lane gets them */
__device__ __forceinline__ void moe_argmax(const float *p, int E, uint32_t taken, float *bp, int *be)
{
    const int lane = threadIdx.x & 31;
    float b = -1.0f; /* the key of none yet */
    int i = INT_MAX;
    for (int s = 0, e = lane; e < E; s++, e += 32)
        if (!(taken >> s & 1u) && moe_key(p[e]) > b) b = moe_key(p[e]), i = e;
    for (int o = 16; o > 0; o >>= 1) {
        const float q = __shfl_xor_sync(0xffffffffu, b, o);
        const int f = __shfl_xor_sync(0xffffffffu, i, o);
        if (moe_before(q, f, b, i)) b = q, i = f;
    }
    *be = i; /* k <= E: some expert was left */
    *bp = b >= 0.0f ? b : NAN; /* the prob again: a key of -0.5 was a NaN */
}

template <typename T>
__global__ void moe_route_kernel(float *probs, int32_t *idx, float *wts, const T *logits, int N, int E, int k,
                                 int renorm)
{
    const int lane = threadIdx.x & 31, t = blockIdx.x * ROUTE_WARPS + (threadIdx.x >> 5);
    if (t >= N) return; /* the whole warp */
    const T *z = logits + (size_t)t * E;
    float *p = probs + (size_t)t * E, m = -INFINITY, s = 0.0f;
    for (int e = lane; e < E; e += 32) m = fmaxf(m, ld_f(z + e));
    m = warp_max(m);
    for (int e = lane; e < E; e += 32) s += p[e] = expf(ld_f(z + e) - m);
    s = warp_sum(s);
    for (int e = lane; e < E; e += 32) p[e] /= s; /* each lane rereads only its own writes */

    uint32_t taken = 0;
    float mine = 0.0f, sum = 0.0f;
    int mine_e = 0;
    for (int j = 0; j < k; j++) {
        float b;
        int e;
        moe_argmax(p, E, taken, &b, &e);
        if ((e & 31) == lane) taken |= 1u << (e >> 5);
        if (lane == j) mine = b, mine_e = e;
        sum += b; /* in j order, as the C op */
    }
    if (lane < k) {
        idx[(size_t)t * k + lane] = mine_e;
        wts[(size_t)t * k + lane] = renorm ? mine / sum : mine;
    }
}

template <typename T>
__global__ void moe_route_backward_kernel(T *dlogits, const float *dwts, const float *dprobs, const float *probs,
                                          const int32_t *idx, int N, int E, int k, int renorm)
{
    SMP_DYN_SMEM(float, sm);
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, t = blockIdx.x * ROUTE_WARPS + w;
    if (t >= N) return;
    float *g = sm + (size_t)w * E; /* the probs' gradient */
    const float *p = probs + (size_t)t * E;
    for (int e = lane; e < E; e += 32) g[e] = dprobs ? dprobs[(size_t)t * E + e] : 0.0f;
    __syncwarp();
    int ej = 0;
    float pj = 0.0f, c = 0.0f; /* lane j < k: expert j's index, prob and gradient */
    if (lane < k) ej = idx[(size_t)t * k + lane], pj = p[ej], c = dwts[(size_t)t * k + lane];
    if (renorm) {
        const float s = warp_sum(pj), dot = warp_sum(c * (pj / s));
        c = (c - dot) / s;
    }
    if (lane < k) g[ej] += c; /* distinct experts: no two lanes meet */
    __syncwarp();
    float dot = 0.0f;
    for (int e = lane; e < E; e += 32) dot += p[e] * g[e];
    dot = warp_sum(dot);
    for (int e = lane; e < E; e += 32) st_f(dlogits + (size_t)t * E + e, p[e] * (g[e] - dot));
}

template <typename U>
__global__ void moe_gather_kernel(U *xs, const U *x, const int32_t *rows, size_t n, int hu)
{
    for (size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x; e < n; e += (size_t)gridDim.x * blockDim.x) {
        const size_t r = e / (size_t)hu;
        xs[e] = x[(size_t)rows[r] * hu + (e - r * hu)];
    }
}

template <typename T>
__global__ void moe_combine_kernel(T *out, const T *ys, const float *wts, const int32_t *slot, int k, int H)
{
    const size_t t = blockIdx.x;
    const float *w = wts + t * k;
    const int32_t *sl = slot + t * k;
    for (int h = threadIdx.x; h < H; h += blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < k; j++) acc += w[j] * ld_f(ys + (size_t)sl[j] * H + h);
        st_f(out + t * H + h, acc);
    }
}

template <typename T>
__global__ void moe_combine_backward_kernel(T *dys, float *dwts, const T *dout, const T *ys, const float *wts,
                                            const int32_t *slot, int k, int H)
{
    __shared__ float red[32];
    const size_t t = blockIdx.x;
    const T *g = dout + t * H;
    for (int j = 0; j < k; j++) {
        const size_t tj = t * k + j, r = (size_t)slot[tj] * H;
        const float w = wts[tj];
        float dot = 0.0f;
        for (int h = threadIdx.x; h < H; h += blockDim.x) {
            const float gh = ld_f(g + h);
            st_f(dys + r + h, w * gh);
            dot += gh * ld_f(ys + r + h);
        }
        dot = block_sum(dot, red);
        if (threadIdx.x == 0) dwts[tj] = dot;
    }
}

template <typename T>
__global__ void moe_scatter_add_kernel(T *dx, const T *dxs, const int32_t *slot, int k, int H)
{
    const size_t t = blockIdx.x;
    const int32_t *sl = slot + t * k;
    for (int h = threadIdx.x; h < H; h += blockDim.x) {
        float s = 0.0f;
        for (int j = 0; j < k; j++) s += ld_f(dxs + (size_t)sl[j] * H + h);
        st_f(dx + t * H + h, ld_f(dx + t * H + h) + s);
    }
}

/* ------------------------------------------------------------------ launchers */
#define MOE_DT_CHECK(dt) SMP_ARG(SMP_DT_OK(dt), "dtype %d is not CUDA_R_32F or CUDA_R_16BF", (int)(dt))
#define MOE_ROUTE_SHAPE(N, E, k)                                                                            \
    SMP_ARG((N) >= 0 && (k) >= 1 && (k) <= (E) && (E) <= MOE_EMAX && (k) <= MOE_KMAX,                   \
            "bad shape N=%d E=%d k=%d (1 <= k <= E <= %d, k <= %d)", N, E, k, MOE_EMAX, MOE_KMAX)
#define MOE_ROWS_SHAPE(N, k, H) SMP_ARG((N) >= 0 && (k) >= 1 && (H) > 0, "bad shape N=%d k=%d H=%d", N, k, H)

static unsigned route_blocks(int N) { return (unsigned)((N + ROUTE_WARPS - 1) / ROUTE_WARPS); }

extern "C" cudaError_t cuda_op_moe_route(float *probs, int32_t *idx, float *wts, const void *logits, int N, int E,
                                         int k, int renorm, cudaDataType_t dt, cudaStream_t stream)
{
    MOE_ROUTE_SHAPE(N, E, k);
    MOE_DT_CHECK(dt);
    if (N == 0) return cudaSuccess;
    SMP_ARG(probs && idx && wts && logits, "NULL pointer");
    if (dt == CUDA_R_32F) {
        auto kern = moe_route_kernel<float>;
        SMP_LAUNCH(kern, route_blocks(N), 32 * ROUTE_WARPS, 0, stream, probs, idx, wts, (const float *)logits, N, E,
                   k, renorm);
    } else {
        auto kern = moe_route_kernel<bf16>;
        SMP_LAUNCH(kern, route_blocks(N), 32 * ROUTE_WARPS, 0, stream, probs, idx, wts, (const bf16 *)logits, N, E,
                   k, renorm);
    }
    return smp_cuda_launched("cuda_op_moe_route");
}

extern "C" cudaError_t cuda_op_moe_route_backward(void *dlogits, const float *dwts, const float *dprobs,
                                                  const float *probs, const int32_t *idx, int N, int E, int k,
                                                  int renorm, cudaDataType_t dt, cudaStream_t stream)
{
    MOE_ROUTE_SHAPE(N, E, k);
    MOE_DT_CHECK(dt);
    if (N == 0) return cudaSuccess;
    SMP_ARG(dlogits && dwts && probs && idx, "NULL pointer");
    const size_t smem = (size_t)ROUTE_WARPS * E * sizeof(float);
    if (dt == CUDA_R_32F) {
        auto kern = moe_route_backward_kernel<float>;
        SMP_LAUNCH(kern, route_blocks(N), 32 * ROUTE_WARPS, smem, stream, (float *)dlogits, dwts, dprobs, probs, idx,
                   N, E, k, renorm);
    } else {
        auto kern = moe_route_backward_kernel<bf16>;
        SMP_LAUNCH(kern, route_blocks(N), 32 * ROUTE_WARPS, smem, stream, (bf16 *)dlogits, dwts, dprobs, probs, idx,
                   N, E, k, renorm);
    }
    return smp_cuda_launched("cuda_op_moe_route_backward");
}

template <typename U>
static void gather_launch(void *xs, const void *x, const int32_t *rows, size_t n, int hu, cudaStream_t stream)
{
    const int sms = smp_cuda_sm_count();
    const unsigned cap = (unsigned)(sms > 0 ? sms * 8 : 1024);
    auto kern = moe_gather_kernel<U>;
    SMP_LAUNCH(kern, smp_blocks(n, MOE_THREADS, cap), MOE_THREADS, 0, stream, (U *)xs, (const U *)x, rows, n, hu);
}

extern "C" cudaError_t cuda_op_moe_gather(void *xs, const void *x, const int32_t *rows, int M, int H,
                                          cudaDataType_t dt, cudaStream_t stream)
{
    SMP_ARG(M >= 0 && H > 0, "bad shape M=%d H=%d", M, H);
    MOE_DT_CHECK(dt);
    if (M == 0) return cudaSuccess;
    SMP_ARG(xs && x && rows, "NULL pointer");
    const size_t es = dt == CUDA_R_32F ? 4 : 2, bytes = (size_t)H * es, n = (size_t)M * H;
    if (bytes % 16 == 0 && smp_aligned16(xs) && smp_aligned16(x))
        gather_launch<int4>(xs, x, rows, n * es / 16, (int)(bytes / 16), stream);
    else if (es == 4)
        gather_launch<uint32_t>(xs, x, rows, n, H, stream);
    else
        gather_launch<uint16_t>(xs, x, rows, n, H, stream);
    return smp_cuda_launched("cuda_op_moe_gather");
}

extern "C" cudaError_t cuda_op_moe_combine(void *out, const void *ys, const float *wts, const int32_t *slot, int N,
                                           int k, int H, cudaDataType_t dt, cudaStream_t stream)
{
    MOE_ROWS_SHAPE(N, k, H);
    MOE_DT_CHECK(dt);
    if (N == 0) return cudaSuccess;
    SMP_ARG(out && ys && wts && slot, "NULL pointer");
    if (dt == CUDA_R_32F) {
        auto kern = moe_combine_kernel<float>;
        SMP_LAUNCH(kern, (unsigned)N, MOE_THREADS, 0, stream, (float *)out, (const float *)ys, wts, slot, k, H);
    } else {
        auto kern = moe_combine_kernel<bf16>;
        SMP_LAUNCH(kern, (unsigned)N, MOE_THREADS, 0, stream, (bf16 *)out, (const bf16 *)ys, wts, slot, k, H);
    }
    return smp_cuda_launched("cuda_op_moe_combine");
}

extern "C" cudaError_t cuda_op_moe_combine_backward(void *dys, float *dwts, const void *dout, const void *ys,
                                                    const float *wts, const int32_t *slot, int N, int k, int H,
                                                    cudaDataType_t dt, cudaStream_t stream)
{
    MOE_ROWS_SHAPE(N, k, H);
    MOE_DT_CHECK(dt);
    if (N == 0) return cudaSuccess;
    SMP_ARG(dys && dwts && dout && ys && wts && slot, "NULL pointer");
    if (dt == CUDA_R_32F) {
        auto kern = moe_combine_backward_kernel<float>;
        SMP_LAUNCH(kern, (unsigned)N, MOE_THREADS, 0, stream, (float *)dys, dwts, (const float *)dout,
                   (const float *)ys, wts, slot, k, H);
    } else {
        auto kern = moe_combine_backward_kernel<bf16>;
        SMP_LAUNCH(kern, (unsigned)N, MOE_THREADS, 0, stream, (bf16 *)dys, dwts, (const bf16 *)dout,
                   (const bf16 *)ys, wts, slot, k, H);
    }
    return smp_cuda_launched("cuda_op_moe_combine_backward");
}

extern "C" cudaError_t cuda_op_moe_scatter_add(void *dx, const void *dxs, const int32_t *slot, int N, int k, int H,
                                               cudaDataType_t dt, cudaStream_t stream)
{
    MOE_ROWS_SHAPE(N, k, H);
    MOE_DT_CHECK(dt);
    if (N == 0) return cudaSuccess;
    SMP_ARG(dx && dxs && slot, "NULL pointer");
    if (dt == CUDA_R_32F) {
        auto kern = moe_scatter_add_kernel<float>;
        SMP_LAUNCH(kern, (unsigned)N, MOE_THREADS, 0, stream, (float *)dx, (const float *)dxs, slot, k, H);
    } else {
        auto kern = moe_scatter_add_kernel<bf16>;
        SMP_LAUNCH(kern, (unsigned)N, MOE_THREADS, 0, stream, (bf16 *)dx, (const bf16 *)dxs, slot, k, H);
    }
    return smp_cuda_launched("cuda_op_moe_scatter_add");
}

/* ---- grouping by expert --------------------------------------------------------------- */
enum { GROUP_CHUNK = 1024 };

/* among the warp's lanes holding expert e (-1: none), this lane's rank and their count */
__device__ __forceinline__ void warp_peers(int e, int *rank, int *count)
{
    const int lane = threadIdx.x & 31;
    int r = 0, c = 0;
    for (int s = 0; s < 32; s++) {
        const int f = __shfl_sync(0xffffffffu, e, s);
        c += f == e;
        r += f == e && s < lane;
    }
    *rank = r;
    *count = c;
}

/* counts[c][e]: the pairs of chunk c with expert e (one warp per chunk) */
__global__ void moe_count_kernel(int32_t *counts, const int32_t *idx, int Nk, int E)
{
    __shared__ int32_t h[MOE_EMAX];
    const int lane = threadIdx.x, c = blockIdx.x, p0 = c * GROUP_CHUNK, p1 = p0 + GROUP_CHUNK < Nk ? p0 + GROUP_CHUNK : Nk;
    for (int e = lane; e < E; e += 32) h[e] = 0;
    __syncwarp();
    for (int base = p0; base < p1; base += 32) { /* every lane runs each round: the shuffles need them all */
        const int p = base + lane, e = p < p1 ? idx[p] : -1;
        int rank, count;
        warp_peers(e, &rank, &count);
        if (e >= 0 && rank == 0) h[e] += count; /* one lane per expert */
        __syncwarp();
    }
    for (int e = lane; e < E; e += 32) counts[(size_t)c * E + e] = h[e];
}

/* off[e] = the pairs of experts before e; counts[c][e] becomes chunk c's first row of
 * expert e (one block of MOE_EMAX threads, thread e for expert e) */
__global__ void moe_scan_kernel(int32_t *off, int32_t *counts, int nchunks, int E, int Nk)
{
    __shared__ int32_t s[MOE_EMAX];
    const int e = threadIdx.x;
    int total = 0;
    for (int c = 0; e < E && c < nchunks; c++) total += counts[(size_t)c * E + e];
    s[e] = total;
    __syncthreads();
    for (int d = 1; d < MOE_EMAX; d <<= 1) { /* inclusive scan over the experts */
        const int v = e >= d ? s[e - d] : 0;
        __syncthreads();
        s[e] += v;
        __syncthreads();
    }
    if (e < E) {
        int at = s[e] - total;
        off[e] = at;
        for (int c = 0; c < nchunks; c++) {
            const size_t i = (size_t)c * E + e;
            const int n = counts[i];
            counts[i] = at;
            at += n;
        }
    }
    if (e == 0) off[E] = Nk;
}

/* each chunk's pairs to their rows, in pair order within each expert (one warp per chunk) */
__global__ void moe_place_kernel(int32_t *rows, int32_t *slot, const int32_t *first, const int32_t *idx, int Nk,
                                 int k, int E)
{
    __shared__ int32_t cur[MOE_EMAX];
    const int lane = threadIdx.x, c = blockIdx.x, p0 = c * GROUP_CHUNK, p1 = p0 + GROUP_CHUNK < Nk ? p0 + GROUP_CHUNK : Nk;
    for (int e = lane; e < E; e += 32) cur[e] = first[(size_t)c * E + e];
    __syncwarp();
    for (int base = p0; base < p1; base += 32) {
        const int p = base + lane, e = p < p1 ? idx[p] : -1;
        int rank, count;
        warp_peers(e, &rank, &count);
        if (e >= 0) {
            const int r = cur[e] + rank;
            rows[r] = p / k;
            slot[p] = r;
        }
        __syncwarp(); /* every lane has read cur before one moves it on */
        if (e >= 0 && rank == 0) cur[e] += count;
        __syncwarp();
    }
}

__global__ void moe_prob_sums_kernel(double *sums, const float *probs, int N, int E)
{
    const int e = blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= E) return;
    double s = 0.0;
    for (int t = 0; t < N; t++) s += probs[(size_t)t * E + e];
    sums[e] = s;
}

extern "C" size_t cuda_op_moe_group_scratch(int N, int k, int E)
{
    const size_t chunks = ((size_t)N * k + GROUP_CHUNK - 1) / GROUP_CHUNK;
    return (chunks ? chunks : 1) * (size_t)E * sizeof(int32_t);
}

extern "C" cudaError_t cuda_op_moe_group(int32_t *off, int32_t *rows, int32_t *slot, int32_t *scratch,
                                         const int32_t *idx, int N, int k, int E, cudaStream_t stream)
{
    SMP_ARG(N >= 0 && k >= 1 && E >= 1 && E <= MOE_EMAX && (long long)N * k <= INT_MAX,
            "bad shape N=%d k=%d E=%d (1 <= E <= %d)", N, k, E, (int)MOE_EMAX);
    SMP_ARG(off && scratch && (N == 0 || (rows && slot && idx)), "NULL pointer");
    const int Nk = N * k, chunks = (Nk + GROUP_CHUNK - 1) / GROUP_CHUNK;
    if (chunks) SMP_LAUNCH(moe_count_kernel, (unsigned)chunks, 32, 0, stream, scratch, idx, Nk, E);
    SMP_LAUNCH(moe_scan_kernel, 1, MOE_EMAX, 0, stream, off, scratch, chunks, E, Nk);
    if (chunks) SMP_LAUNCH(moe_place_kernel, (unsigned)chunks, 32, 0, stream, rows, slot, scratch, idx, Nk, k, E);
    return smp_cuda_launched("cuda_op_moe_group");
}

extern "C" cudaError_t cuda_op_moe_prob_sums(double *sums, const float *probs, int N, int E, cudaStream_t stream)
{
    SMP_ARG(N >= 0 && E >= 1, "bad shape N=%d E=%d", N, E);
    SMP_ARG(sums && (N == 0 || probs), "NULL pointer");
    SMP_LAUNCH(moe_prob_sums_kernel, (unsigned)((E + 127) / 128), 128, 0, stream, sums, probs, N, E);
    return smp_cuda_launched("cuda_op_moe_prob_sums");
}
