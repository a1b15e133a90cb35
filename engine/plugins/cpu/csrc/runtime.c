/*
 * What a built library is (its ISA level and native paths) and the worker's thread
 * pinning, for native.py and the CPU platform's init_worker.
 */
#define _GNU_SOURCE
#include <omp.h>
#include <sched.h>
#include <stdint.h>

#include "cpu_math.h"
#include "kernels.h"
#include "simd.h"
#include "gemm_bf16.h"

enum { FEATURE_BF16_DOT = 1, FEATURE_AMX = 2 };

int gemm_amx_ready(void); /* gemm.c */

int stream_prefetch_mode = STREAM_PREFETCH_NTA; /* cpu_math.h */

/* Set how once-read streams are prefetched (STREAM_PREFETCH_*); returns the previous
 * mode, or -1 (nothing changed) for an unknown one. */
int set_stream_prefetch(int mode)
{
    if (mode < STREAM_PREFETCH_NTA || mode > STREAM_PREFETCH_NONE)
        return -1;
    const int previous = stream_prefetch_mode;
    stream_prefetch_mode = mode;
    return previous;
}

int batch_invariant_mode = 0; /* cpu_math.h */

/* Turn batch-invariant mode on (1) or off (0); returns the previous setting. */
int set_batch_invariant(int enabled)
{
    const int previous = batch_invariant_mode;
    batch_invariant_mode = enabled != 0;
    return previous;
}

/* The ISA level this library was built for (kernel_build.LEVELS names). */
const char *isa_level(void) { return ENGINE_ISA_LEVEL; }

/* Float32 lanes per vector register of the level. */
int vector_lanes(void) { return VF; }

/* FEATURE_* bits: which native paths beyond float32 multiply-adds the level has. */
int kernel_features(void)
{
    int features = 0;
    if (HAVE_BF16_DOT) features |= FEATURE_BF16_DOT;
    if (gemm_amx_ready()) features |= FEATURE_AMX;
    return features;
}

/*
 * The level's float32 multiply-add peak, in GFLOP/s over the pool's threads: each thread
 * runs `rounds` rounds of FMA_CHAINS independent vector multiply-adds (enough chains to
 * cover the FMA latency on every x86 and Arm core), timed together. What the GEMMs'
 * "percent of peak" is measured against (ci/bench_gemm.py).
 */
#define FMA_CHAINS 12
double fma_peak_gflops(int64_t rounds)
{
    double seconds = 0.0;
    int threads = 1;
    float sink = 0.0f;
#pragma omp parallel reduction(+ : sink)
    {
        vf acc[FMA_CHAINS];
        for (int c = 0; c < FMA_CHAINS; c++)
            acc[c] = vf_splat(1.0f + 1e-3f * (float)(c + omp_get_thread_num()));
        const vf scale = vf_splat(0.999999f), shift = vf_splat(1e-7f);
#pragma omp barrier
        const double start = omp_get_wtime();
        for (int64_t r = 0; r < rounds; r++)
#pragma GCC unroll 12
            for (int c = 0; c < FMA_CHAINS; c++)
                acc[c] = acc[c] * scale + shift;
#pragma omp barrier
#pragma omp master
        {
            seconds = omp_get_wtime() - start;
            threads = omp_get_num_threads();
        }
        for (int c = 0; c < FMA_CHAINS; c++)
            sink += vf_sum(acc[c]);
    }
    volatile float keep = sink; /* the chains' results are used: nothing is optimized out */
    (void)keep;
    return seconds > 0 ? 2.0 * VF * FMA_CHAINS * (double)rounds * threads / seconds / 1e9 : 0.0;
}

/*
 * Pin OpenMP thread i of the pool to CPU cpus[i] (count entries; the pool has at most
 * that many threads). Each thread pins itself inside one parallel region, which is the
 * only way to reach the pool's threads. Returns 0, or -1 when a pin was refused (the
 * threads pinned before it stay pinned).
 */
int pin_threads(const int *cpus, int count)
{
    if (count <= 0) return -1;
#if defined(__linux__)
    int failed = 0;
#pragma omp parallel num_threads(count) reduction(| : failed)
    {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(cpus[omp_get_thread_num()], &set);
        failed |= sched_setaffinity(0, sizeof set, &set) != 0;
    }
    return failed ? -1 : 0;
#else
    (void)cpus;
    return -1; /* no per-thread affinity API here */
#endif
}
