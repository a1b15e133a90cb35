/*
 * Collectives between the ranks of one host through a shared-memory segment, for CPU
 * tensor parallelism: a gloo all-reduce over loopback costs ~0.5 ms, this one a few
 * microseconds for a decode step's activations.
 *
 * Segment (a /dev/shm file every rank maps; shm_communicator.py names and unlinks it):
 *
 *   header   magic, world, slot_bytes, then one 64-byte line per rank: its sequence
 *            counter (the barrier), its pid (failure detection) and, per buffer, the
 *            op and byte count it is running (a mismatch is an error, not garbage)
 *   data     2 buffers x world slots of slot_bytes each, at a page boundary
 *
 * A collective step: rank r copies its part into slot [seq & 1][r], publishes seq with
 * a release store, waits (acquire) until every peer's counter reaches seq, then reads
 * every slot. Double buffering makes that one barrier enough: a rank overwrites buffer
 * b again only at step seq + 2, after every peer has reached seq + 1, i.e. has finished
 * reading step seq. Tensors larger than a slot take several steps (chunks).
 *
 * Waiting spins with a pause, then yields (two ranks on two cores must not starve each
 * other), then sleeps briefly; every few milliseconds it checks that the peers it waits
 * for are alive (their pid, /proc state) and that the timeout has not passed, so a dead
 * peer raises an error instead of hanging the others. After an error the communicator is
 * broken: every later call fails at once.
 *
 * all_reduce sums float32 / bfloat16 / float16 in float32, rank 0's part first, so every
 * rank computes bit-identical results.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "cpu_math.h"

#define SHM_MAGIC 0x31434d53474e45ULL /* "ENGSMC1" */
#define SHM_MAX_RANKS 64
#define SHM_PAGE 4096

enum {
    SHM_OK = 0,
    SHM_ETIMEDOUT = -1,
    SHM_EPEERDEAD = -2,
    SHM_EMISMATCH = -3,
    SHM_EINVAL = -4,
    SHM_EBROKEN = -5,
};

enum { OP_BARRIER = 1, OP_ALL_REDUCE = 2, OP_ALL_GATHER = 3, OP_BROADCAST = 4,
       OP_ALL_TO_ALL = 5 };

enum {
    SPIN_PAUSES = 200,           /* busy polls before yielding (a peer sharing this core
                                  * runs only once we yield: keep it short) */
    YIELD_UNTIL_NS = 5000000,    /* then sched_yield for up to 5 ms of waiting */
    SLEEP_NS = 50000,            /* then sleep 50 us per poll */
    CHECK_EVERY_NS = 5000000,    /* peer liveness and timeout checks */
};

typedef struct {
    uint64_t seq;        /* steps this rank has published (atomic) */
    int32_t pid;
    int32_t pad;
    int64_t op[2];       /* per buffer: op code | dtype << 8 | root << 16 */
    int64_t nbytes[2];   /* per buffer: the collective's total bytes */
    char fill[64 - 8 - 8 - 32];
} __attribute__((aligned(64))) rank_line;

typedef struct {
    uint64_t magic;
    int32_t world;
    int32_t pad;
    int64_t slot_bytes;
    char fill[64 - 24];
    rank_line ranks[SHM_MAX_RANKS];
} shm_header;

typedef struct {
    shm_header *hdr;
    char *data;
    size_t size;
    int world, rank;
    int64_t slot_bytes;
    uint64_t seq;
    int64_t timeout_ns;
    int failed_rank; /* the peer of the last error, -1 if none */
    int broken;
} shm_comm;

static size_t data_offset(void)
{
    return (sizeof(shm_header) + SHM_PAGE - 1) / SHM_PAGE * SHM_PAGE;
}

static size_t segment_size(int world, int64_t slot_bytes)
{
    return data_offset() + (size_t)2 * (size_t)world * (size_t)slot_bytes;
}

int64_t shm_comm_segment_bytes(int world, int64_t slot_bytes)
{
    if (world < 1 || world > SHM_MAX_RANKS || slot_bytes <= 0 || slot_bytes % 64)
        return SHM_EINVAL;
    return (int64_t)segment_size(world, slot_bytes);
}

int shm_comm_max_ranks(void) { return SHM_MAX_RANKS; }

static inline char *slot(const shm_comm *c, uint64_t seq, int rank)
{
    return c->data + ((size_t)(seq & 1) * c->world + rank) * (size_t)c->slot_bytes;
}

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static int64_t now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* Whether process ``pid`` runs: it exists and is no zombie (a dead rank nobody has
 * reaped yet still answers kill(pid, 0)). */
static int process_alive(int32_t pid)
{
    if (pid <= 0) return 1; /* not yet known */
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f) return errno == ENOENT ? 0 : 1;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    const char *close_paren = strrchr(buf, ')');
    if (!close_paren || close_paren[1] != ' ') return 1;
    const char state = close_paren[2];
    return state != 'Z' && state != 'X' && state != 'x';
}

/* Wait until every peer has published step ``seq``. */
static int wait_peers(shm_comm *c, uint64_t seq)
{
    int64_t start = 0, next_check = 0;
    long polls = 0;
    for (int j = 0; j < c->world; j++) {
        if (j == c->rank) continue;
        const uint64_t *counter = &c->hdr->ranks[j].seq;
        while (__atomic_load_n(counter, __ATOMIC_ACQUIRE) < seq) {
            polls++;
            if (polls < SPIN_PAUSES) {
                cpu_relax();
                continue;
            }
            const int64_t t = now_ns();
            if (start == 0) {
                start = t;
                next_check = t + CHECK_EVERY_NS;
            }
            if (t >= next_check) {
                next_check = t + CHECK_EVERY_NS;
                for (int k = 0; k < c->world; k++) {
                    if (k != c->rank && __atomic_load_n(&c->hdr->ranks[k].seq,
                                                        __ATOMIC_ACQUIRE) < seq
                        && !process_alive(c->hdr->ranks[k].pid)) {
                        c->failed_rank = k;
                        return SHM_EPEERDEAD;
                    }
                }
                if (c->timeout_ns > 0 && t - start > c->timeout_ns) {
                    c->failed_rank = j;
                    return SHM_ETIMEDOUT;
                }
            }
            if (t - start < YIELD_UNTIL_NS) {
                sched_yield();
            } else {
                const struct timespec pause = {0, SLEEP_NS};
                nanosleep(&pause, NULL);
            }
        }
    }
    return SHM_OK;
}

/* One step: copy ``len`` bytes of ``src`` into this rank's slot, publish, wait for the
 * peers, and check they run the same collective. */
static int step(shm_comm *c, int64_t op, int64_t nbytes, const void *src, int64_t len)
{
    if (c->broken) return SHM_EBROKEN;
    const uint64_t seq = ++c->seq;
    const int buf = (int)(seq & 1);
    if (len > 0) memcpy(slot(c, seq, c->rank), src, (size_t)len);
    rank_line *mine = &c->hdr->ranks[c->rank];
    mine->op[buf] = op;
    mine->nbytes[buf] = nbytes;
    __atomic_store_n(&mine->seq, seq, __ATOMIC_RELEASE);
    int status = wait_peers(c, seq);
    if (status == SHM_OK) {
        for (int j = 0; j < c->world; j++) {
            const rank_line *peer = &c->hdr->ranks[j];
            if (peer->op[buf] != op || peer->nbytes[buf] != nbytes) {
                c->failed_rank = j;
                status = SHM_EMISMATCH;
                break;
            }
        }
    }
    if (status != SHM_OK) c->broken = 1;
    return status;
}

/* Map the segment at ``path`` (``create``: make it, rank 0 only). Returns 0 with the
 * handle in *out, or -errno / SHM_EINVAL. */
int shm_comm_open(const char *path, int world, int rank, int64_t slot_bytes, int create,
                  double timeout_s, void **out)
{
    *out = NULL;
    if (world < 1 || world > SHM_MAX_RANKS || rank < 0 || rank >= world || slot_bytes <= 0
        || slot_bytes % 64)
        return SHM_EINVAL;
    const size_t size = segment_size(world, slot_bytes);
    const int fd = open(path, create ? O_RDWR | O_CREAT | O_EXCL : O_RDWR, 0600);
    if (fd < 0) return -errno;
    if (create) {
        const int err = posix_fallocate(fd, 0, (off_t)size); /* ENOSPC now, not SIGBUS */
        if (err) {
            close(fd);
            unlink(path);
            return -err;
        }
    } else {
        struct stat st;
        if (fstat(fd, &st) != 0 || (size_t)st.st_size != size) {
            close(fd);
            return SHM_EINVAL;
        }
    }
    void *base = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    const int map_errno = errno;
    close(fd);
    if (base == MAP_FAILED) {
        if (create) unlink(path);
        return -map_errno;
    }
    shm_header *hdr = base;
    if (create) {
        hdr->world = world;
        hdr->slot_bytes = slot_bytes;
        __atomic_store_n(&hdr->magic, SHM_MAGIC, __ATOMIC_RELEASE);
    } else if (__atomic_load_n(&hdr->magic, __ATOMIC_ACQUIRE) != SHM_MAGIC
               || hdr->world != world || hdr->slot_bytes != slot_bytes) {
        munmap(base, size);
        return SHM_EINVAL;
    }
    shm_comm *c = calloc(1, sizeof *c);
    if (!c) {
        munmap(base, size);
        return -ENOMEM;
    }
    c->hdr = hdr;
    c->data = (char *)base + data_offset();
    c->size = size;
    c->world = world;
    c->rank = rank;
    c->slot_bytes = slot_bytes;
    c->seq = __atomic_load_n(&hdr->ranks[rank].seq, __ATOMIC_ACQUIRE);
    c->timeout_ns = timeout_s > 0 ? (int64_t)(timeout_s * 1e9) : 0;
    c->failed_rank = -1;
    __atomic_store_n(&hdr->ranks[rank].pid, (int32_t)getpid(), __ATOMIC_RELEASE);
    *out = c;
    return SHM_OK;
}

void shm_comm_close(void *handle)
{
    shm_comm *c = handle;
    if (!c) return;
    munmap(c->hdr, c->size);
    free(c);
}

int shm_comm_failed_rank(void *handle) { return ((shm_comm *)handle)->failed_rank; }

int shm_comm_barrier(void *handle)
{
    return step(handle, OP_BARRIER, 0, NULL, 0);
}

static void sum_f32(const shm_comm *c, uint64_t seq, float *out, int64_t count)
{
    const float *first = (const float *)slot(c, seq, 0);
    for (int64_t i = 0; i < count; i++) out[i] = first[i];
    for (int j = 1; j < c->world; j++) {
        const float *part = (const float *)slot(c, seq, j);
        for (int64_t i = 0; i < count; i++) out[i] += part[i];
    }
}

/* bf16 / fp16: widen, sum in float32 (rank order), round once. */
static void sum_half(const shm_comm *c, uint64_t seq, uint16_t *out, int64_t count,
                     int dtype)
{
    enum { BLOCK = 512 };
    float acc[BLOCK];
    for (int64_t base = 0; base < count; base += BLOCK) {
        const int64_t n = count - base < BLOCK ? count - base : BLOCK;
        for (int j = 0; j < c->world; j++) {
            const uint16_t *part = (const uint16_t *)slot(c, seq, j) + base;
            if (dtype == DTYPE_BF16) {
                if (j == 0)
                    for (int64_t i = 0; i < n; i++) acc[i] = bf16_to_f32(part[i]);
                else
                    for (int64_t i = 0; i < n; i++) acc[i] += bf16_to_f32(part[i]);
            } else {
                if (j == 0)
                    for (int64_t i = 0; i < n; i++) acc[i] = f16_to_f32(part[i]);
                else
                    for (int64_t i = 0; i < n; i++) acc[i] += f16_to_f32(part[i]);
            }
        }
        if (dtype == DTYPE_BF16)
            for (int64_t i = 0; i < n; i++) out[base + i] = f32_to_bf16(acc[i]);
        else
            for (int64_t i = 0; i < n; i++) out[base + i] = f32_to_f16(acc[i]);
    }
}

/* In place: data[0 .. count) becomes the sum over ranks. */
int shm_comm_all_reduce(void *handle, void *data, int64_t count, int dtype)
{
    shm_comm *c = handle;
    if (count < 0 || (dtype != DTYPE_F32 && dtype != DTYPE_BF16 && dtype != DTYPE_F16))
        return SHM_EINVAL;
    const int64_t size = dtype_size(dtype);
    const int64_t per_step = c->slot_bytes / size;
    char *bytes = data;
    for (int64_t off = 0; off < count || (count == 0 && off == 0); off += per_step) {
        const int64_t n = count - off < per_step ? count - off : per_step;
        const int status = step(c, OP_ALL_REDUCE | (int64_t)dtype << 8, count * size,
                                bytes + off * size, n * size);
        if (status != SHM_OK) return status;
        if (dtype == DTYPE_F32)
            sum_f32(c, c->seq, (float *)(bytes + off * size), n);
        else
            sum_half(c, c->seq, (uint16_t *)(bytes + off * size), n, dtype);
        if (count == 0) break;
    }
    return SHM_OK;
}

/* Every rank's ``outer x inner`` bytes into dst laid out [outer][world][inner]: the
 * concatenation along the dimension that splits ``outer`` from ``inner`` (dim 0 of a
 * tensor is outer = 1). */
int shm_comm_all_gather(void *handle, const void *src, int64_t outer, int64_t inner,
                        void *dst)
{
    shm_comm *c = handle;
    if (outer < 0 || inner < 0) return SHM_EINVAL;
    const int64_t total = outer * inner;
    const char *in = src;
    char *out = dst;
    for (int64_t start = 0; start < total || (total == 0 && start == 0);
         start += c->slot_bytes) {
        const int64_t len = total - start < c->slot_bytes ? total - start : c->slot_bytes;
        const int status = step(c, OP_ALL_GATHER, total, in + start, len);
        if (status != SHM_OK) return status;
        for (int j = 0; j < c->world; j++) {
            const char *part = slot(c, c->seq, j);
            int64_t a = start;
            while (a < start + len) {
                const int64_t row = a / inner, col = a % inner;
                int64_t piece = inner - col;
                if (piece > start + len - a) piece = start + len - a;
                memcpy(out + (row * c->world + j) * inner + col, part + (a - start),
                       (size_t)piece);
                a += piece;
            }
        }
        if (total == 0) break;
    }
    return SHM_OK;
}

/* ``root``'s nbytes of data to every rank (in place on the others). */
int shm_comm_broadcast(void *handle, void *data, int64_t nbytes, int root)
{
    shm_comm *c = handle;
    if (nbytes < 0 || root < 0 || root >= c->world) return SHM_EINVAL;
    char *bytes = data;
    for (int64_t start = 0; start < nbytes || (nbytes == 0 && start == 0);
         start += c->slot_bytes) {
        const int64_t len = nbytes - start < c->slot_bytes ? nbytes - start : c->slot_bytes;
        const int mine = c->rank == root;
        const int status = step(c, OP_BROADCAST | (int64_t)root << 16, nbytes,
                                bytes + start, mine ? len : 0);
        if (status != SHM_OK) return status;
        if (!mine && len > 0) memcpy(bytes + start, slot(c, c->seq, root), (size_t)len);
        if (nbytes == 0) break;
    }
    return SHM_OK;
}

/* Uneven rows to and from every rank (expert parallelism's dispatch and combine), as
 * bytes: this rank's ``send`` holds send_bytes[j] bytes for rank j, in rank order, and
 * ``recv`` gets recv_bytes[j] bytes from rank j, in rank order. Each round a rank puts a
 * header (its per-destination counts and its total) and the next slot-full of its send
 * buffer in its slot; every rank copies out the part of each peer's window that is
 * addressed to it. Round 0 tells every rank every total, hence how many rounds the
 * largest sender needs. A peer whose count for this rank differs from recv_bytes is a
 * mismatch (the ranks disagree on the exchange), reported after the last round so that
 * no peer is left waiting, not garbage. */
int shm_comm_all_to_all(void *handle, const void *send, const int64_t *send_bytes,
                        void *recv, const int64_t *recv_bytes)
{
    shm_comm *c = handle;
    const int world = c->world;
    const int64_t header = ((int64_t)(world + 1) * 8 + 63) / 64 * 64;
    const int64_t cap = c->slot_bytes - header;
    if (cap <= 0) return SHM_EINVAL;
    int64_t total = 0, recv_at[SHM_MAX_RANKS], from[SHM_MAX_RANKS];
    for (int j = 0; j < world; j++) {
        if (send_bytes[j] < 0 || recv_bytes[j] < 0) return SHM_EINVAL;
        total += send_bytes[j];
    }
    for (int j = 0; j < world; j++)
        recv_at[j] = j == 0 ? 0 : recv_at[j - 1] + recv_bytes[j - 1];
    const char *in = send;
    char *out = recv;
    int64_t rounds = 1;
    int mismatch = -1; /* a peer whose count for this rank is not recv_bytes' */
    for (int64_t r = 0; r < rounds; r++) {
        int64_t *mine = (int64_t *)slot(c, c->seq + 1, c->rank);
        memcpy(mine, send_bytes, (size_t)world * 8);
        mine[world] = total;
        const int64_t start = r * cap;
        const int64_t len = total - start < cap ? (total - start > 0 ? total - start : 0) : cap;
        if (len > 0) memcpy((char *)mine + header, in + start, (size_t)len);
        const int status = step(c, OP_ALL_TO_ALL, 0, NULL, 0);
        if (status != SHM_OK) return status;
        for (int j = 0; j < world; j++) {
            const int64_t *theirs = (const int64_t *)slot(c, c->seq, j);
            if (r == 0) {
                if (theirs[c->rank] != recv_bytes[j] && mismatch < 0) mismatch = j;
                int64_t offset = 0;
                for (int k = 0; k < c->rank; k++) offset += theirs[k];
                from[j] = offset; /* where this rank's bytes start in j's send buffer */
                const int64_t need = (theirs[world] + cap - 1) / cap;
                if (need > rounds) rounds = need;
            }
            /* This round's window of j's buffer, [start, start + cap), against the bytes
             * j addresses here, [from, from + recv_bytes[j]). */
            const int64_t lo = start > from[j] ? start : from[j];
            const int64_t end_window = start + cap, end_mine = from[j] + recv_bytes[j];
            const int64_t hi = end_window < end_mine ? end_window : end_mine;
            if (hi > lo && mismatch < 0)
                memcpy(out + recv_at[j] + (lo - from[j]),
                       (const char *)theirs + header + (lo - start), (size_t)(hi - lo));
        }
    }
    if (mismatch >= 0) { /* after every round: the peers are not left waiting */
        c->failed_rank = mismatch;
        c->broken = 1;
        return SHM_EMISMATCH;
    }
    return SHM_OK;
}
