#!/usr/bin/env python3
"""bench/attention_gpu.py: PyTorch's fused attention on the GPU at the shapes of
tests/gpu/bench.cu's attention rows: the reference for smp's kernels (what a user
of torch gets), run by tools/gpu-check. Not a test.

    python3 tools/bench/attention_gpu.py [--quick]

bf16, causal, T = 4096, 32 query heads of 128, B = 1, 2, 4 (32 kv heads) and B = 1
with 8 kv heads (GQA), through torch.nn.functional.scaled_dot_product_attention with
each backend that takes the shape (FlashAttention-2, cuDNN, memory-efficient), forced
one at a time. Timed as bench.cu times (CUDA events, warm-up calls, the median of
the rest): the forward alone, and the backward alone (torch.autograd.grad of a kept
forward). FLOPs as bench.cu counts them: 4 B nh T^2 hd / 2 forward (causal: half),
2.5x that backward. Lines: "RESULT torch <backend> fwd|bwd ...: X TFLOP/s", or
"SKIP ..." where torch, the GPU or a backend is missing.
"""
import statistics
import sys


def timed(torch, fn, warm, reps):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for i in range(warm + reps):
        a.record()
        fn()
        b.record()
        b.synchronize()
        if i >= warm:
            times.append(a.elapsed_time(b))
    return statistics.median(times)


def main():
    quick = "--quick" in sys.argv[1:]
    try:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError as e:
        print(f"SKIP torch attention: {e}")
        return 0
    if not torch.cuda.is_available():
        print("SKIP torch attention: no CUDA device")
        return 0
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}")
    warm, reps = (1, 3) if quick else (3, 10)
    T, nh, hd = 4096, 32, 128
    backends = [("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                ("efficient", SDPBackend.EFFICIENT_ATTENTION)]
    for B, nkv in [(1, 32), (2, 32), (4, 32), (1, 8)]:
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(B, nh, T, hd, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
        k = torch.randn(B, nkv, T, hd, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
        v = torch.randn(B, nkv, T, hd, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
        dout = torch.randn(B, nh, T, hd, device="cuda", dtype=torch.bfloat16, generator=g)
        fl = 4.0 * B * nh * T * T * hd / 2.0
        shape = f"B={B} T={T} nh={nh} nkv={nkv} hd={hd}"
        for name, be in backends:
            try:
                with sdpa_kernel([be]):
                    attn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=nkv != nh)
                    ms = timed(torch, attn, warm, reps)
                    out = attn()
                    bwd = lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
                    msb = timed(torch, bwd, warm, reps)
            except (RuntimeError, TypeError) as e:  # the backend (or this torch) does not take the shape
                print(f"SKIP torch {name} {shape}: {str(e).splitlines()[0][:160]}")
                torch.cuda.synchronize()
                continue
            print(f"RESULT torch {name} fwd bf16 {shape}: {ms:.3f} ms, {fl / ms / 1e9:.1f} TFLOP/s")
            print(f"RESULT torch {name} bwd bf16 {shape}: {msb:.3f} ms, {2.5 * fl / msb / 1e9:.1f} TFLOP/s")
            sys.stdout.flush()
            del out
    return 0


if __name__ == "__main__":
    sys.exit(main())
