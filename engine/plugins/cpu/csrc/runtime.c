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

/* The ISA level this library was built for (kernel_build.LEVELS names). */
const char *isa_level(void) { return ENGINE_ISA_LEVEL; }

/* Float32 lanes per vector register of the level. */
int vector_lanes(void) { return VF; }

/* FEATURE_* bits: which native paths beyond float32 multiply-adds the level has. */
int kernel_features(void)
{
    int features = 0;
    if (HAVE_BF16_DOT) features |= FEATURE_BF16_DOT;
#if defined(ENGINE_AMX)
    features |= FEATURE_AMX;
#endif
    return features;
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
