/*
 * The kernels' self-test driver: runs a list of kernel calls read from a file and writes
 * their outputs, so a build for another architecture (aarch64, cross-compiled and run
 * under qemu-user) is checked against the same float64 references as the native builds;
 * the references and the comparison live on the Python side (tests/plugins/cpu).
 *
 *     selftest CASES OUT
 *
 * CASES: records of  int32 op | int32 n_ints, int64 ints[] | int32 n_floats,
 * float floats[] | int32 n_arrays, then per array int32 dtype, int64 bytes, bytes[].
 * OUT: per record  int32 status | int32 n_arrays, then the arrays as above.
 * Dtype codes: those of cpu_math.h, 3 for int64, 4 for uint8, 7 for float64. Little-endian,
 * no padding.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_math.h"
#include "kernels.h"

int argmax_rows(const float *x, int64_t x_stride, int64_t rows, int64_t cols, int64_t *out);
int categorical_rows(const float *probs, int64_t stride, int64_t rows, int64_t cols,
                     const double *u, int64_t *out);
const char *isa_level(void);

enum { OP_GEMM_PACKED = 1, OP_GEMM_PLAIN = 2, OP_ATTENTION = 3, OP_RMS_NORM = 4,
       OP_SILU_AND_MUL = 5, OP_ROTARY = 6, OP_EMBEDDING = 7, OP_ARGMAX = 8, OP_QGEMM = 9,
       OP_QUANT_ACT = 10, OP_CATEGORICAL = 11 };
enum { DTYPE_I64 = 3, DTYPE_U8 = 4, MAX_ITEMS = 32 };

typedef struct {
    int dtype;
    int64_t bytes;
    void *data;
} array_t;

typedef struct {
    int op;
    int n_ints, n_floats, n_arrays;
    int64_t ints[MAX_ITEMS];
    float floats[MAX_ITEMS];
    array_t arrays[MAX_ITEMS];
} record_t;

static int read_exact(FILE *f, void *dst, size_t bytes) {
    return fread(dst, 1, bytes, f) == bytes;
}

/* 1: a record, 0: end of file, -1: a malformed file */
static int read_record(FILE *f, record_t *r) {
    int32_t n;
    if (!read_exact(f, &n, 4)) return 0;
    r->op = n;
    if (!read_exact(f, &n, 4) || n < 0 || n > MAX_ITEMS) return -1;
    r->n_ints = n;
    if (!read_exact(f, r->ints, 8 * (size_t)n)) return -1;
    if (!read_exact(f, &n, 4) || n < 0 || n > MAX_ITEMS) return -1;
    r->n_floats = n;
    if (!read_exact(f, r->floats, 4 * (size_t)n)) return -1;
    if (!read_exact(f, &n, 4) || n < 0 || n > MAX_ITEMS) return -1;
    r->n_arrays = n;
    for (int i = 0; i < n; i++) {
        int32_t dtype;
        int64_t bytes;
        if (!read_exact(f, &dtype, 4) || !read_exact(f, &bytes, 8) || bytes < 0) return -1;
        r->arrays[i].dtype = dtype;
        r->arrays[i].bytes = bytes;
        r->arrays[i].data = malloc(bytes > 0 ? (size_t)bytes : 1);
        if (r->arrays[i].data == NULL || !read_exact(f, r->arrays[i].data, (size_t)bytes))
            return -1;
    }
    return 1;
}

static void write_result(FILE *f, int32_t status, int n, const array_t *arrays) {
    int32_t count = n;
    fwrite(&status, 4, 1, f);
    fwrite(&count, 4, 1, f);
    for (int i = 0; i < n; i++) {
        int32_t dtype = arrays[i].dtype;
        fwrite(&dtype, 4, 1, f);
        fwrite(&arrays[i].bytes, 8, 1, f);
        fwrite(arrays[i].data, 1, (size_t)arrays[i].bytes, f);
    }
}

static array_t new_array(int dtype, int64_t count) {
    const int64_t size = dtype == DTYPE_I64 ? 8 : dtype == DTYPE_U8 ? 1 : dtype_size(dtype);
    array_t a = {dtype, count * size, calloc((size_t)(count > 0 ? count : 1), (size_t)size)};
    return a;
}

/* ints: m n k adt wdt has_bias | arrays: x [m, k] adt, w [n, k] wdt, (bias [n] adt) */
static int32_t run_gemm(const record_t *r, array_t *out, int packed) {
    const int64_t m = r->ints[0], n = r->ints[1], k = r->ints[2];
    const int adt = (int)r->ints[3], wdt = (int)r->ints[4];
    const void *bias = r->ints[5] ? r->arrays[2].data : NULL;
    *out = new_array(adt, m * n);
    if (!packed)
        return gemm_plain(r->arrays[0].data, k, r->arrays[1].data, k, bias, out->data, n, m, n,
                          k, adt, wdt);
    void *weights = malloc((size_t)(n * k * dtype_size(wdt)));
    int32_t status = gemm_pack(r->arrays[1].data, n, k, wdt, adt, weights);
    if (status == 0)
        status = gemm_packed(r->arrays[0].data, k, weights, bias, out->data, n, m, n, k, adt,
                             wdt);
    free(weights);
    return status;
}

/*
 * ints: reqs heads kv_heads head_size block_size num_blocks cache_dt q_dt window splits
 * blocks_per_seq [src_dt] | floats: scale soft_cap [k_scale v_scale] | arrays: q [reqs,
 * heads, D] q_dt; keys, values [num_blocks * block_size, kv_heads, D] src_dt (default
 * cache_dt; every slot, token-major); block_tables [reqs, blocks_per_seq] int64;
 * seq_lens [reqs] int64. The driver stores every slot through write_kv, in its own K
 * layout (an fp8 cache: quantized by the scales), then attends. Outputs: the attention,
 * then the V cache as stored (token-major: the quantized values of an fp8 one).
 */
static int32_t run_attention(const record_t *r, array_t *out) {
    const int reqs = (int)r->ints[0], heads = (int)r->ints[1], kv_heads = (int)r->ints[2];
    const int head_size = (int)r->ints[3], block_size = (int)r->ints[4];
    const int64_t num_blocks = r->ints[5], slots_total = num_blocks * block_size;
    const int cache_dt = (int)r->ints[6], q_dt = (int)r->ints[7];
    const int window = (int)r->ints[8], splits = (int)r->ints[9];
    const int64_t per_seq = r->ints[10];
    const int src_dt = r->n_ints > 11 ? (int)r->ints[11] : cache_dt;
    const float k_scale = r->n_floats > 2 ? r->floats[2] : 1.0f;
    const float v_scale = r->n_floats > 3 ? r->floats[3] : 1.0f;
    const int64_t cache_count = slots_total * kv_heads * head_size;
    array_t k_cache = new_array(cache_dt, cache_count), v_cache = new_array(cache_dt, cache_count);
    array_t slots = new_array(DTYPE_I64, slots_total);
    for (int64_t s = 0; s < slots_total; s++)
        ((int64_t *)slots.data)[s] = s;
    int32_t status = write_kv(r->arrays[1].data, (int64_t)kv_heads * head_size, head_size,
                              r->arrays[2].data, (int64_t)kv_heads * head_size, head_size,
                              slots.data, slots_total, k_cache.data, v_cache.data, num_blocks,
                              kv_heads, head_size, block_size, cache_dt, src_dt, k_scale,
                              v_scale);
    out[0] = new_array(q_dt, (int64_t)reqs * heads * head_size);
    if (status == 0)
        status = paged_decode_attention(
            r->arrays[0].data, (int64_t)heads * head_size, head_size, k_cache.data,
            v_cache.data, r->arrays[3].data, per_seq, r->arrays[4].data, out->data, reqs, heads,
            kv_heads, head_size, block_size, cache_dt, r->floats[0], window, r->floats[1],
            splits, q_dt, k_scale, v_scale);
    out[1] = v_cache;
    free(k_cache.data), free(slots.data);
    return status;
}

/*
 * ints: m adt has_zeros has_act_scales has_bias, then qgemm_pack's parameter words |
 * arrays: x [m, k] adt, codes uint8, scales, (zeros), (perm int64), (act_scales),
 * (bias [n] adt). Packs, then multiplies.
 */
static int32_t run_qgemm(const record_t *r, array_t *out) {
    const int64_t m = r->ints[0], *params = r->ints + 5, n = params[0];
    const int adt = (int)r->ints[1];
    int next = 3;
    const void *zeros = r->ints[2] ? r->arrays[next++].data : NULL;
    const void *perm = params[9] ? r->arrays[next++].data : NULL;
    const void *act_scales = r->ints[3] ? r->arrays[next++].data : NULL;
    const void *bias = r->ints[4] ? r->arrays[next++].data : NULL;
    *out = new_array(adt, m * n);
    const int64_t bytes = qgemm_pack_bytes(params);
    if (bytes < 0) return -1;
    void *packed = malloc((size_t)bytes);
    int32_t status = qgemm_pack(params, r->arrays[1].data, r->arrays[2].data, zeros, perm,
                                act_scales, packed);
    if (status == 0)
        status = qgemm(r->arrays[0].data, params[1], packed, bias, out->data, n, m, adt);
    free(packed);
    return status;
}

static int32_t run(const record_t *r, array_t *outs, int *n_outs) {
    const int64_t *p = r->ints;
    const array_t *a = r->arrays;
    *n_outs = 1;
    switch (r->op) {
    case OP_GEMM_PACKED: return run_gemm(r, &outs[0], 1);
    case OP_GEMM_PLAIN: return run_gemm(r, &outs[0], 0);
    case OP_ATTENTION:
        *n_outs = 2;
        return run_attention(r, outs);
    case OP_RMS_NORM: { /* rows hidden dtype has_residual | x, weight, (residual) */
        const int dt = (int)p[2];
        outs[0] = new_array(dt, p[0] * p[1]);
        void *residual = p[3] ? a[2].data : NULL;
        const int32_t status = rms_norm(a[0].data, p[1], 1, residual, p[1], a[1].data,
                                        outs[0].data, p[0], p[1], r->floats[0], dt);
        if (p[3]) { /* the updated residual is an output too */
            outs[1] = a[2];
            *n_outs = 2;
        }
        return status;
    }
    case OP_SILU_AND_MUL: /* rows inter dtype | x [rows, 2 inter] */
        outs[0] = new_array((int)p[2], p[0] * p[1]);
        return silu_and_mul(a[0].data, 2 * p[1], outs[0].data, p[0], p[1], (int)p[2]);
    case OP_ROTARY: /* rows heads head_size positions dtype | x, positions, cos_sin */
        outs[0] = a[0]; /* rotated in place */
        return rotary_neox(a[0].data, p[1] * p[2], a[1].data, a[2].data, p[0], p[1], p[2], p[3],
                           (int)p[4]);
    case OP_EMBEDDING: /* ids vocab hidden table_dt out_dt | ids, table */
        outs[0] = new_array((int)p[4], p[0] * p[2]);
        return embedding_rows(a[0].data, p[0], a[1].data, p[1], p[2], (int)p[3], outs[0].data,
                              (int)p[4]);
    case OP_QGEMM: return run_qgemm(r, &outs[0]);
    case OP_QUANT_ACT: /* m k adt scheme strategy dynamic group | scale | x -> float32 */
        outs[0] = new_array(DTYPE_F32, p[0] * p[1]);
        return quantize_activations(a[0].data, p[1], p[0], p[1], (int)p[2], (int)p[3],
                                    (int)p[4], (int)p[5], p[6], r->floats[0], outs[0].data);
    case OP_ARGMAX: /* rows cols | x float32 */
        outs[0] = new_array(DTYPE_I64, p[0]);
        return argmax_rows(a[0].data, p[1], p[0], p[1], outs[0].data);
    case OP_CATEGORICAL: /* rows cols | probs float32, u float64 */
        outs[0] = new_array(DTYPE_I64, p[0]);
        return categorical_rows(a[0].data, p[1], p[0], p[1], a[1].data, outs[0].data);
    default:
        *n_outs = 0;
        return -100;
    }
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s CASES OUT (the %s kernels)\n", argv[0], isa_level());
        return 2;
    }
    FILE *in = fopen(argv[1], "rb"), *out = fopen(argv[2], "wb");
    if (in == NULL || out == NULL) {
        perror("selftest");
        return 2;
    }
    record_t record;
    int got, count = 0;
    while ((got = read_record(in, &record)) == 1) {
        array_t outs[2];
        int n_outs = 0;
        const int32_t status = run(&record, outs, &n_outs);
        write_result(out, status, n_outs, outs);
        count++;
    }
    fclose(in);
    fclose(out);
    if (got < 0) {
        fprintf(stderr, "selftest: record %d of %s is malformed\n", count, argv[1]);
        return 3;
    }
    printf("%s: %d cases\n", isa_level(), count);
    return 0;
}
