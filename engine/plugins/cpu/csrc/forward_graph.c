/*
 * Replay of a recorded model forward: a table of kernel calls run back to back in C.
 *
 * Why: at decode batch sizes a forward is ~10 kernel calls per layer of a few
 * microseconds each, and the Python that chains them (module calls, views, ctypes
 * argument conversion) costs as much again; llama-tiny at batch 1 spent ~1 ms of a
 * 2.5 ms forward there. graphs.py records the calls a forward makes (their pointers
 * already planned into one arena) and this loop replays them with no Python at all.
 *
 * Table layout: num_ops rows of GRAPH_OP_WORDS int64 words, the kernel id (see
 * graph_kernel_id) then the kernel's arguments in its C order, pointers as addresses
 * and float arguments as their float32 bits.
 *
 * Tensor-parallel forwards record their all-reduces too (shm_comm_all_reduce, the
 * communicator's handle as a plain address): every rank replays the same table, so the
 * ranks meet in the same collectives in the same order as an eager forward would.
 */
#include <stdint.h>
#include <string.h>

#include "kernels.h"

#define GRAPH_OP_WORDS 23 /* kernel id + up to 22 arguments (paged_decode_attention's) */

enum {
    GK_RMS_NORM,
    GK_SILU_AND_MUL,
    GK_ROTARY_NEOX,
    GK_EMBEDDING_ROWS,
    GK_WRITE_KV,
    GK_PAGED_DECODE_ATTENTION,
    GK_GEMM_PACKED,
    GK_GEMM_PLAIN,
    GK_QGEMM,
    GK_RESIDUAL_ADD,
    GK_LORA_SHRINK,
    GK_LORA_EXPAND,
    GK_MLA_DECODE_ATTENTION,
    GK_MLA_WRITE_ENTRIES,
    GK_EMBEDDING_SHARD_ROWS,
    GK_SHM_ALL_REDUCE,
    GK_COUNT
};

static const char *const KERNEL_NAMES[GK_COUNT] = {
    "rms_norm", "silu_and_mul", "rotary_neox", "embedding_rows",
    "write_kv", "paged_decode_attention", "gemm_packed", "gemm_plain", "qgemm",
    "residual_add", "lora_shrink", "lora_expand", "mla_decode_attention", "mla_write_entries",
    "embedding_shard_rows", "shm_comm_all_reduce",
};

/* The id a recorded call of the entry point `name` carries, or -1: not replayable. */
int graph_kernel_id(const char *name)
{
    for (int id = 0; id < GK_COUNT; id++)
        if (strcmp(name, KERNEL_NAMES[id]) == 0) return id;
    return -1;
}

int graph_op_words(void) { return GRAPH_OP_WORDS; }

static inline float f32_word(int64_t word)
{
    const uint32_t bits = (uint32_t)word;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* Runs ops[0 .. num_ops) in order. Returns 0, or the status of the first call that
 * refused its arguments (its index in *failed_op; the calls after it do not run). */
int replay_forward_graph(const int64_t *ops, int64_t num_ops, int64_t *failed_op)
{
#define P(i) ((void *)(intptr_t)a[i])
#define I(i) ((int)a[i])
    for (int64_t op = 0; op < num_ops; op++) {
        const int64_t *row = ops + op * GRAPH_OP_WORDS, *a = row + 1;
        int status;
        switch (row[0]) {
        case GK_RMS_NORM:
            status = rms_norm(P(0), a[1], a[2], P(3), a[4], P(5), P(6), a[7], a[8],
                              f32_word(a[9]), I(10));
            break;
        case GK_SILU_AND_MUL:
            status = silu_and_mul(P(0), a[1], P(2), a[3], a[4], I(5));
            break;
        case GK_ROTARY_NEOX:
            status = rotary_neox(P(0), a[1], P(2), P(3), a[4], a[5], a[6], a[7], I(8));
            break;
        case GK_EMBEDDING_ROWS:
            status = embedding_rows(P(0), a[1], P(2), a[3], a[4], I(5), P(6), I(7));
            break;
        case GK_WRITE_KV:
            status = write_kv(P(0), a[1], a[2], P(3), a[4], a[5], P(6), a[7], P(8), P(9), a[10],
                              I(11), I(12), I(13), I(14), I(15), f32_word(a[16]),
                              f32_word(a[17]));
            break;
        case GK_PAGED_DECODE_ATTENTION:
            status = paged_decode_attention(P(0), a[1], a[2], P(3), P(4), P(5), a[6], P(7), P(8),
                                            I(9), I(10), I(11), I(12), I(13), I(14),
                                            f32_word(a[15]), I(16), f32_word(a[17]), I(18),
                                            I(19), f32_word(a[20]), f32_word(a[21]));
            break;
        case GK_GEMM_PACKED:
            status = gemm_packed(P(0), a[1], P(2), P(3), P(4), a[5], a[6], a[7], a[8], I(9),
                                 I(10));
            break;
        case GK_GEMM_PLAIN:
            status = gemm_plain(P(0), a[1], P(2), a[3], P(4), P(5), a[6], a[7], a[8], a[9],
                                I(10), I(11));
            break;
        case GK_QGEMM:
            status = qgemm(P(0), a[1], P(2), P(3), P(4), a[5], a[6], I(7));
            break;
        case GK_RESIDUAL_ADD:
            status = residual_add(P(0), a[1], P(2), a[3], a[4], a[5], I(6));
            break;
        case GK_LORA_SHRINK:
            status = lora_shrink(P(0), a[1], P(2), P(3), P(4), a[5], a[6], a[7], a[8], a[9],
                                 I(10));
            break;
        case GK_LORA_EXPAND:
            status = lora_expand(P(0), a[1], P(2), P(3), P(4), a[5], P(6), a[7], a[8], a[9],
                                 a[10], a[11], I(12));
            break;
        case GK_MLA_DECODE_ATTENTION:
            status = mla_decode_attention(P(0), a[1], a[2], P(3), P(4), a[5], P(6), P(7), I(8),
                                          I(9), I(10), I(11), I(12), a[13], I(14),
                                          f32_word(a[15]), I(16), I(17));
            break;
        case GK_MLA_WRITE_ENTRIES:
            status = mla_write_entries(P(0), a[1], P(2), a[3], P(4), a[5], I(6), I(7), I(8));
            break;
        case GK_EMBEDDING_SHARD_ROWS:
            status = embedding_shard_rows(P(0), a[1], P(2), a[3], a[4], a[5], a[6], I(7), P(8),
                                          I(9));
            break;
        case GK_SHM_ALL_REDUCE: /* a tensor-parallel layer's sum over the ranks */
            status = shm_comm_all_reduce(P(0), P(1), a[2], I(3));
            break;
        default:
            status = -2;
        }
        if (status != 0) {
            *failed_op = op;
            return status;
        }
    }
#undef P
#undef I
    return 0;
}
