/*
 * kvfs.client._fastread: the host load path's per-block work, without the GIL.
 *
 * A verified load of block files into host memory is, per block: open the file, read its
 * header, payload and a probe past its end with one preadv (in pieces, each hashed right after
 * it lands, for payloads over ONE_READ_BYTES), close it, check the header against the one the
 * reader's model spec expects, and check the payload's xxh3_64 against the header's. In Python
 * that is 20-30 us of interpreter work per block between the system calls, each releasing
 * and retaking the GIL; at 1 MiB blocks the loads measured 0.87-0.92x of raw threaded preadv
 * plus one xxh3 pass for it, against 1.00x with this module (kvfs bench restore, 2-core VM,
 * quiet; docs/bench/restore.notes.md).
 * Here one call does all of it for every block a thread takes, with the GIL released.
 *
 * It is a shortcut, never a looser rule: a block it does not accept outright (absent, an I/O
 * error, a header that is not exactly the spec's, a wrong size or checksum) is reported as
 * such, and kvfs.client.load reads that block again in Python, which says why it fails (or
 * finds it sound, if it was replaced meanwhile). The rules are those of
 * kvfs.format.blockfile.HeaderCheck.payload_checksum and kvfs.client.transport.read_file; tests check that
 * both give the same verdict on the same files.
 *
 * xxh3_64 comes from the xxhash header (libxxhash-dev), inlined, with the x86 vector kernels
 * picked at run time (AVX-512, AVX2, SSE2), as python-xxhash does: the same digests at the
 * same speed.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#define XXH_INLINE_ALL
#define XXH_STATIC_LINKING_ONLY
#if defined(__x86_64__) && defined(__GNUC__)
#define KVFS_X86 1
#define XXH_X86DISPATCH 1 /* 64-byte alignment for the AVX-512 kernel */
#define XXH_DISPATCH_AVX2 1
#define XXH_DISPATCH_AVX512 1
#define XXH_TARGET_AVX2 __attribute__((__target__("avx2")))
#define XXH_TARGET_AVX512 __attribute__((__target__("avx512f")))
#include <immintrin.h>
#endif
#include <xxhash.h>

/* The block format (docs/format.md; kvfs/format/blockfile.py): exported below and checked by a test. */
#define HEADER_SIZE 4096
#define LEAD_LEN 16     /* magic, version, header size */
#define BHASH_OFF 16
#define FP_OFF 48
#define CSUM_OFF 160    /* payload checksum; the fingerprint .. payload length lie before it */
#define HCSUM_OFF 168   /* header checksum */
#define SUMS_OFF 176    /* version 2: word sum (u64), row sum (u32), column sum (u32) */
#define SUMS_END 192    /* after it, zeros to the end of the header */
#define SUMS_PRIME 2147483647u
/* kvfs/client/transport.py: HASH_PIECE, ONE_READ_BYTES; at most this many buffers a transfer. */
#define HASH_PIECE (256 << 10)
#define ONE_READ_BYTES (1 << 20)
#define MAX_IOV 1024
#define MAX_PROBE 8192

/* What happened to one block. */
enum { ST_NOT_READ = 0, ST_OK = 1, ST_ABSENT = 2, ST_OSERROR = 3, ST_RECHECK = 4 };

/* -- xxh3_64, streaming, with the widest vector kernel this CPU has -------------------- */

/* One buffer (one call), or a stream of them (reset, updates, digest): the same digest. */
typedef XXH64_hash_t (*one_fn)(const void *, size_t);
typedef XXH_errorcode (*update_fn)(XXH3_state_t *, const xxh_u8 *, size_t);

#ifdef KVFS_X86
#define KERNELS(name, target)                                                               \
    __attribute__((__target__(target))) static XXH64_hash_t                                 \
    one_##name(const void *p, size_t n)                                                     \
    {                                                                                       \
        if (n <= XXH3_MIDSIZE_MAX)                                                          \
            return XXH3_64bits(p, n);                                                       \
        return XXH3_hashLong_64b_internal(p, n, XXH3_kSecret, sizeof(XXH3_kSecret),         \
                                          XXH3_accumulate_512_##name,                       \
                                          XXH3_scrambleAcc_##name);                         \
    }                                                                                       \
    __attribute__((__target__(target))) static XXH_errorcode                                \
    update_##name(XXH3_state_t *s, const xxh_u8 *p, size_t n)                               \
    {                                                                                       \
        return XXH3_update(s, p, n, XXH3_accumulate_512_##name, XXH3_scrambleAcc_##name);   \
    }
KERNELS(avx512, "avx512f")
KERNELS(avx2, "avx2")
#endif

static XXH64_hash_t
one_default(const void *p, size_t n)
{
    return XXH3_64bits(p, n);
}

static XXH_errorcode
update_default(XXH3_state_t *s, const xxh_u8 *p, size_t n)
{
    return XXH3_64bits_update(s, p, n);
}

static one_fn hash_one = one_default;
static update_fn hash_update = update_default;

/* -- a load's reads -------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    Py_ssize_t n;                /* blocks */
    char **paths;                /* each a copy, owned; NULL where the block's fd is given */
    int *fds;                    /* a file the caller holds open (a lookup's lease), or -1 */
    unsigned char *hashes;       /* n x 16 */
    unsigned char *want;         /* checksum block i's payload */
    Py_buffer *bufs;             /* every block's destination buffers, in order */
    Py_ssize_t *first;           /* block i's buffers: bufs[first[i]] .. bufs[first[i + 1]] */
    Py_ssize_t nbufs;
    unsigned char lead1[LEAD_LEN], lead2[LEAD_LEN], mid[CSUM_OFF - FP_OFF];
    Py_ssize_t payload;          /* payload bytes of each block */
    Py_ssize_t file_size;        /* of a sound block file */
    Py_ssize_t probe;            /* bytes read past the payload: the padding, and one more */
    unsigned char *status;
    long long *total;            /* bytes read (header, payload, probe) */
    int *err;                    /* errno of ST_OSERROR */
    Py_ssize_t *order;           /* the order blocks are taken in: the checksummed first */
    atomic_long next;            /* the next block a thread takes */
    atomic_long end;             /* the first block that failed (n: none) */
    atomic_int nowait;           /* RWF_NOWAIT works here (cleared on EOPNOTSUPP) */
} Reads;

/* The iovecs of bytes [a, b) of a block's stream: header, payload buffers, probe. */
typedef struct {
    struct iovec v[MAX_IOV + 2];
    int cnt;
} Span;

static void
span(Span *s, const struct iovec *all, int cnt, size_t a, size_t b)
{
    size_t off = 0;
    s->cnt = 0;
    for (int k = 0; k < cnt && off < b; k++) {
        size_t len = all[k].iov_len, lo = off, hi = off + len;
        off = hi;
        if (hi <= a)
            continue;
        size_t from = a > lo ? a - lo : 0, to = (b < hi ? b : hi) - lo;
        s->v[s->cnt].iov_base = (char *)all[k].iov_base + from;
        s->v[s->cnt].iov_len = to - from;
        s->cnt++;
    }
}

/* preadv of stream bytes [a, b) at file offset a until `need` bytes are in or the file
 * ends; returns the bytes read, or -1 (errno set). */
static long long
fill(int fd, const struct iovec *all, int cnt, size_t a, size_t b, size_t need)
{
    size_t n = 0;
    while (n < need) {
        Span s;
        span(&s, all, cnt, a + n, b);
        ssize_t got = preadv(fd, s.v, s.cnt, (off_t)(a + n));
        if (got < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        if (got == 0)
            break;
        n += (size_t)got;
    }
    return (long long)n;
}

/* Hash payload bytes [a, b) (payload coordinates) of block i's buffers. */
static void
hash_payload(Reads *r, Py_ssize_t i, XXH3_state_t *st, size_t a, size_t b)
{
    size_t off = 0;
    for (Py_ssize_t k = r->first[i]; k < r->first[i + 1] && off < b; k++) {
        size_t len = (size_t)r->bufs[k].len, lo = off, hi = off + len;
        off = hi;
        if (hi <= a)
            continue;
        size_t from = a > lo ? a - lo : 0, to = (b < hi ? b : hi) - lo;
        hash_update(st, (const xxh_u8 *)r->bufs[k].buf + from, to - from);
    }
}

static uint64_t
get_u64(const unsigned char *p)
{
    uint64_t x;
    memcpy(&x, p, 8);
    return x; /* the format is little-endian, as are the hosts kvfs builds on */
}

static uint32_t
get_u32(const unsigned char *p)
{
    uint32_t x;
    memcpy(&x, p, 4);
    return x;
}

/* kvfs.format.blockfile.HeaderCheck.payload_checksum: 1 and the recorded payload checksum if
 * `h` is exactly this spec's header for block hash `bh`, else 0. */
static int
header_ok(const Reads *r, const unsigned char *h, const unsigned char *bh, uint64_t *csum)
{
    static const unsigned char zeros[HEADER_SIZE];
    if (memcmp(h + BHASH_OFF, bh, 16) || memcmp(h + FP_OFF, r->mid, sizeof r->mid) ||
        memcmp(h + SUMS_END, zeros, HEADER_SIZE - SUMS_END))
        return 0;
    if (!memcmp(h, r->lead1, LEAD_LEN)) {
        if (memcmp(h + SUMS_OFF, zeros, SUMS_END - SUMS_OFF))
            return 0;
    } else if (!memcmp(h, r->lead2, LEAD_LEN)) {
        if (get_u32(h + SUMS_OFF + 8) >= SUMS_PRIME || get_u32(h + SUMS_OFF + 12) >= SUMS_PRIME)
            return 0;
    } else {
        return 0;
    }
    /* The header checksum covers the header with its own field zeroed. */
    unsigned char copy[HEADER_SIZE];
    memcpy(copy, h, HEADER_SIZE);
    memset(copy + HCSUM_OFF, 0, 8);
    if (hash_one(copy, HEADER_SIZE) != get_u64(h + HCSUM_OFF))
        return 0;
    *csum = get_u64(h + CSUM_OFF);
    return 1;
}

/* Read and check block i (the GIL released). */
static int
read_block(Reads *r, Py_ssize_t i, unsigned char *header, unsigned char *probe)
{
    int fd = r->fds[i];
    while (fd < 0 && (fd = open(r->paths[i], O_RDONLY | O_CLOEXEC)) < 0 && errno == EINTR)
        ; /* as Python's os.open (PEP 475) */
    if (fd < 0) {
        r->err[i] = errno;
        return errno == ENOENT ? ST_ABSENT : ST_OSERROR;
    }
    struct iovec all[MAX_IOV + 2];
    int cnt = 0;
    all[cnt].iov_base = header;
    all[cnt++].iov_len = HEADER_SIZE;
    for (Py_ssize_t k = r->first[i]; k < r->first[i + 1]; k++) {
        all[cnt].iov_base = r->bufs[k].buf;
        all[cnt++].iov_len = (size_t)r->bufs[k].len;
    }
    all[cnt].iov_base = probe;
    all[cnt++].iov_len = (size_t)r->probe;

    size_t payload = (size_t)r->payload, need = HEADER_SIZE + payload;
    size_t stream = need + (size_t)r->probe;
    int want = r->want[i];
    XXH3_state_t st;
    XXH3_INITSTATE(&st);
    XXH3_64bits_reset(&st);
    long long n = 0;
    uint64_t sum = 0;
    int whole = 0; /* `sum` is the payload's digest (else `st` has it) */
    if (!want || payload <= ONE_READ_BYTES) {
        /* One transfer: the probe takes what the one that fills the payload brings. */
        n = fill(fd, all, cnt, 0, stream, need);
        if (n >= 0 && (size_t)n >= need && want) {
            if (r->first[i + 1] - r->first[i] == 1) {
                sum = hash_one(all[1].iov_base, payload);
                whole = 1;
            } else {
                hash_payload(r, i, &st, 0, payload);
            }
        }
    } else {
        /* Piece by piece, each hashed right after it lands; a piece not all in the page
         * cache (RWF_NOWAIT comes back short) and the rest in one transfer, hashed after: one
         * large request for the disk, as raw preadv makes. (Reading that rest in 1-4 MiB
         * transfers hashed as they land, with or without POSIX_FADV_WILLNEED, measured no
         * faster: 78-87 ms against 81 for read-then-hash of a cold 64 MiB file, raw read
         * 66-74 ms; one thread, 2-core VM, ext4 on a virtio disk, medians of 11.) */
        size_t pieces = (payload + HASH_PIECE - 1) / HASH_PIECE;
        for (size_t k = 0; k < pieces; k++) {
            size_t lo = k * HASH_PIECE, hi = lo + HASH_PIECE < payload ? lo + HASH_PIECE : payload;
            size_t a = k ? HEADER_SIZE + lo : 0, b = k + 1 == pieces ? stream : HEADER_SIZE + hi;
            size_t size = HEADER_SIZE + hi - a;
            long long got = -1;
#ifdef RWF_NOWAIT
            if (r->nowait) {
                Span s;
                span(&s, all, cnt, a, b);
                ssize_t g;
                do
                    g = preadv2(fd, s.v, s.cnt, (off_t)a, RWF_NOWAIT);
                while (g < 0 && errno == EINTR);
                if (g >= 0)
                    got = g;
                else if (errno == EAGAIN)
                    got = 0;
                else if (errno == EOPNOTSUPP || errno == EINVAL)
                    r->nowait = 0;
                else {
                    n = -1;
                    break;
                }
            }
#endif
            if (got >= 0 && (size_t)got < size) { /* the rest in one transfer */
                long long more = fill(fd, all, cnt, a + (size_t)got, stream,
                                      need - a - (size_t)got);
                if (more < 0) {
                    n = -1;
                    break;
                }
                n = (long long)a + got + more;
                if ((size_t)n >= need)
                    hash_payload(r, i, &st, lo, payload);
                break;
            }
            if (got < 0)
                got = fill(fd, all, cnt, a, b, size);
            if (got < 0) {
                n = -1;
                break;
            }
            n = (long long)a + got;
            if ((size_t)got < size)
                break; /* the file ends early */
            hash_payload(r, i, &st, lo, hi);
        }
    }
    int e = errno;
    if (r->fds[i] < 0)
        close(fd); /* a given fd stays the caller's */
    if (n < 0) {
        r->err[i] = e;
        return ST_OSERROR;
    }
    r->total[i] = n;
    uint64_t csum;
    if (n != r->file_size || !header_ok(r, header, r->hashes + 16 * i, &csum))
        return ST_RECHECK;
    if (want && (whole ? sum : XXH3_64bits_digest(&st)) != csum)
        return ST_RECHECK;
    return ST_OK;
}

static PyObject *
Reads_run(Reads *r, PyObject *Py_UNUSED(ignored))
{
    Py_BEGIN_ALLOW_THREADS
    unsigned char header[HEADER_SIZE], probe[MAX_PROBE];
    for (;;) {
        long k = atomic_fetch_add(&r->next, 1);
        if (k >= r->n)
            break;
        long i = (long)r->order[k];
        if (i > atomic_load(&r->end))
            continue; /* past a block that failed */
        int st = read_block(r, i, header, probe);
        r->status[i] = (unsigned char)st;
        if (st != ST_OK) {
            long e = atomic_load(&r->end);
            while (i < e && !atomic_compare_exchange_weak(&r->end, &e, i)) {
            }
        }
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *
Reads_results(Reads *r, PyObject *Py_UNUSED(ignored))
{
    PyObject *out = PyList_New(r->n);
    if (!out)
        return NULL;
    for (Py_ssize_t i = 0; i < r->n; i++) {
        PyObject *t = Py_BuildValue("(iLi)", r->status[i], r->total[i], r->err[i]);
        if (!t) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, t);
    }
    return out;
}

static void
Reads_dealloc(Reads *r)
{
    if (r->paths)
        for (Py_ssize_t i = 0; i < r->n; i++)
            PyMem_Free(r->paths[i]);
    for (Py_ssize_t k = 0; k < r->nbufs; k++)
        PyBuffer_Release(&r->bufs[k]);
    PyMem_Free(r->paths);
    PyMem_Free(r->fds);
    PyMem_Free(r->hashes);
    PyMem_Free(r->want);
    PyMem_Free(r->bufs);
    PyMem_Free(r->first);
    PyMem_Free(r->status);
    PyMem_Free(r->total);
    PyMem_Free(r->err);
    PyMem_Free(r->order);
    Py_TYPE(r)->tp_free((PyObject *)r);
}

static int
copy_fixed(unsigned char *dst, PyObject *src, Py_ssize_t len, const char *what)
{
    char *p;
    Py_ssize_t n;
    if (PyBytes_AsStringAndSize(src, &p, &n) < 0)
        return -1;
    if (n != len) {
        PyErr_Format(PyExc_ValueError, "%s is %zd bytes, expected %zd", what, n, len);
        return -1;
    }
    memcpy(dst, p, (size_t)len);
    return 0;
}

/* Reads(paths, dests, hashes, want, lead1, lead2, mid, payload, file_size) */
static PyObject *
Reads_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    PyObject *paths, *dests, *hashes, *want, *lead1, *lead2, *mid;
    Py_ssize_t payload, file_size;
    if (!PyArg_ParseTuple(args, "O!O!O!SSSSnn", &PyList_Type, &paths, &PyList_Type, &dests,
                          &PyList_Type, &hashes, &want, &lead1, &lead2, &mid, &payload,
                          &file_size))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(paths);
    if (PyList_GET_SIZE(dests) != n || PyList_GET_SIZE(hashes) != n ||
        PyBytes_GET_SIZE(want) != n) {
        PyErr_SetString(PyExc_ValueError, "paths, dests, hashes and want differ in length");
        return NULL;
    }
    Py_ssize_t probe = file_size - HEADER_SIZE - payload + 1;
    if (payload <= 0 || probe < 1 || probe > MAX_PROBE) {
        PyErr_SetString(PyExc_ValueError, "payload and file size do not fit the block format");
        return NULL;
    }
    Reads *r = (Reads *)type->tp_alloc(type, 0);
    if (!r)
        return NULL;
    Py_ssize_t nb = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *d = PyList_GET_ITEM(dests, i);
        if (!PyList_Check(d) || PyList_GET_SIZE(d) < 1 || PyList_GET_SIZE(d) > MAX_IOV) {
            PyErr_Format(PyExc_ValueError, "dests[%zd]: a list of 1 to %d buffers", i, MAX_IOV);
            Py_DECREF(r);
            return NULL;
        }
        nb += PyList_GET_SIZE(d);
    }
    r->n = n;
    r->paths = PyMem_Calloc((size_t)n + 1, sizeof(char *));
    r->fds = PyMem_Calloc((size_t)n + 1, sizeof(int));
    r->hashes = PyMem_Malloc(16 * (size_t)n + 1);
    r->want = PyMem_Malloc((size_t)n + 1);
    r->bufs = PyMem_Calloc((size_t)nb + 1, sizeof(Py_buffer));
    r->first = PyMem_Calloc((size_t)n + 1, sizeof(Py_ssize_t));
    r->status = PyMem_Calloc((size_t)n + 1, 1);
    r->total = PyMem_Calloc((size_t)n + 1, sizeof(long long));
    r->err = PyMem_Calloc((size_t)n + 1, sizeof(int));
    r->order = PyMem_Calloc((size_t)n + 1, sizeof(Py_ssize_t));
    if (!r->paths || !r->fds || !r->hashes || !r->want || !r->bufs || !r->first || !r->status ||
        !r->total || !r->err || !r->order) {
        Py_DECREF(r);
        return PyErr_NoMemory();
    }
    if (copy_fixed(r->lead1, lead1, LEAD_LEN, "lead1") < 0 ||
        copy_fixed(r->lead2, lead2, LEAD_LEN, "lead2") < 0 ||
        copy_fixed(r->mid, mid, sizeof r->mid, "mid") < 0) {
        Py_DECREF(r);
        return NULL;
    }
    memcpy(r->want, PyBytes_AS_STRING(want), (size_t)n);
    /* The blocks to checksum are taken first (each in index order): they take longest, and
     * the threads that finish them early take the others, so no thread is left with a hash
     * to do when the rest are done (a load returns when its last block is in; 4 MiB blocks,
     * one in 8 checksummed, 4 threads on 2 cores: 0-3% faster, measured interleaved). */
    Py_ssize_t taken = 0;
    for (int pass = 1; pass >= 0; pass--)
        for (Py_ssize_t i = 0; i < n; i++)
            if ((r->want[i] != 0) == pass)
                r->order[taken++] = i;
    r->payload = payload;
    r->file_size = file_size;
    r->probe = probe;
    atomic_init(&r->nowait, 1);
    atomic_init(&r->next, 0);
    atomic_init(&r->end, (long)n);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *p = NULL, *item = PyList_GET_ITEM(paths, i);
        r->fds[i] = -1;
        if (PyLong_Check(item)) { /* an open fd: read, never closed here */
            long fd = PyLong_AsLong(item);
            if (fd < 0 || fd > INT_MAX) {
                if (!PyErr_Occurred())
                    PyErr_Format(PyExc_ValueError, "paths[%zd]: a bad fd %ld", i, fd);
                Py_DECREF(r);
                return NULL;
            }
            r->fds[i] = (int)fd;
        } else if (!PyUnicode_FSConverter(item, &p)) {
            Py_DECREF(r);
            return NULL;
        }
        if (p) {
            r->paths[i] = PyMem_Malloc((size_t)PyBytes_GET_SIZE(p) + 1);
            if (r->paths[i])
                memcpy(r->paths[i], PyBytes_AS_STRING(p), (size_t)PyBytes_GET_SIZE(p) + 1);
            Py_DECREF(p);
        }
        if (r->fds[i] < 0 && !r->paths[i]) {
            Py_DECREF(r);
            return PyErr_NoMemory();
        }
        if (copy_fixed(r->hashes + 16 * i, PyList_GET_ITEM(hashes, i), 16, "a block hash") < 0) {
            Py_DECREF(r);
            return NULL;
        }
        PyObject *d = PyList_GET_ITEM(dests, i);
        Py_ssize_t sum = 0;
        r->first[i] = r->nbufs;
        for (Py_ssize_t k = 0; k < PyList_GET_SIZE(d); k++) {
            if (PyObject_GetBuffer(PyList_GET_ITEM(d, k), &r->bufs[r->nbufs],
                                   PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
                Py_DECREF(r);
                return NULL;
            }
            sum += r->bufs[r->nbufs++].len;
        }
        if (sum != payload) {
            PyErr_Format(PyExc_ValueError, "dests[%zd] hold %zd bytes, the payload is %zd", i,
                         sum, payload);
            Py_DECREF(r);
            return NULL;
        }
    }
    r->first[n] = r->nbufs;
    return (PyObject *)r;
}

static PyMethodDef Reads_methods[] = {
    {"run", (PyCFunction)Reads_run, METH_NOARGS,
     "Read and check blocks until none is left: call it from as many threads as wanted."},
    {"results", (PyCFunction)Reads_results, METH_NOARGS,
     "(status, bytes read, errno) of each block."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject ReadsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvfs.client._fastread.Reads",
    .tp_doc = "The reads of one load (a path, or an fd the caller holds open and closes): "
              "Reads(paths, dests, hashes, want, lead1, lead2, mid, "
              "payload, file_size).",
    .tp_basicsize = sizeof(Reads),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = Reads_new,
    .tp_dealloc = (destructor)Reads_dealloc,
    .tp_methods = Reads_methods,
};

static PyObject *
xxh3_64(PyObject *Py_UNUSED(self), PyObject *arg)
{
    Py_buffer b;
    if (PyObject_GetBuffer(arg, &b, PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    XXH64_hash_t h;
    Py_BEGIN_ALLOW_THREADS
    h = hash_one(b.buf, (size_t)b.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLongLong(h);
}

/* -- a save's writes -------------------------------------------------------------------- */

/* pwritev of `cnt` iovecs (none empty) at `off` until all are written; 0, or -1 (errno). */
static int
write_all(int fd, struct iovec *v, int cnt, off_t off)
{
    while (cnt > 0) {
        ssize_t got = pwritev(fd, v, cnt > MAX_IOV ? MAX_IOV : cnt, off);
        if (got < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        if (got == 0) {
            errno = EIO;
            return -1;
        }
        off += got;
        size_t n = (size_t)got;
        while (cnt > 0 && n >= v->iov_len) {
            n -= v->iov_len;
            v++;
            cnt--;
        }
        if (cnt > 0) {
            v->iov_base = (char *)v->iov_base + n;
            v->iov_len -= n;
        }
    }
    return 0;
}

/* Write one block file (the GIL released): `tmp` created (its directory too, if absent),
 * the payload hashed and written, the header with that checksum, the padding, fsync if
 * asked, closed, renamed to `final`. With `expect`, a payload whose checksum is not
 * `*expect` is not placed (EBADMSG): a copy written from memory that changed meanwhile.
 * Returns 0 with the payload checksum in `*csum`, or -1 with errno set and `tmp` removed. */
static int
write_file(const char *tmp, const char *final, unsigned char *h, struct iovec *pay, int cnt,
           size_t payload, size_t pad, int sync, uint64_t *csum, const uint64_t *expect)
{
    static const unsigned char zeros[HEADER_SIZE];
    int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0 && errno == ENOENT) { /* the fan-out directory is new: make it, once */
        char dir[4096];
        const char *slash = strrchr(tmp, '/');
        size_t len = slash ? (size_t)(slash - tmp) : 0;
        if (len && len < sizeof dir) {
            memcpy(dir, tmp, len);
            dir[len] = 0;
            if (mkdir(dir, 0777) == 0 || errno == EEXIST) /* else mkdir's errno */
                fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
        }
    }
    if (fd < 0)
        return -1;
    int rc = -1;
    XXH3_state_t st;
    XXH3_INITSTATE(&st);
    XXH3_64bits_reset(&st);
    struct iovec v[MAX_IOV + 2];
    if (payload <= ONE_READ_BYTES) {
        /* Hashed whole (it fits this core's cache), then one transfer. */
        if (cnt == 1) {
            *csum = hash_one(pay[0].iov_base, pay[0].iov_len);
        } else {
            for (int k = 0; k < cnt; k++)
                hash_update(&st, pay[k].iov_base, pay[k].iov_len);
            *csum = XXH3_64bits_digest(&st);
        }
    } else {
        /* Piece by piece, each hashed right before it is written (still in this core's
         * cache for the write's copy), as kvfs.client.transport.pwrite_hashed does. */
        for (size_t lo = 0; lo < payload; lo += HASH_PIECE) {
            size_t hi = lo + HASH_PIECE < payload ? lo + HASH_PIECE : payload;
            Span sp;
            span(&sp, pay, cnt, lo, hi);
            for (int k = 0; k < sp.cnt; k++)
                hash_update(&st, sp.v[k].iov_base, sp.v[k].iov_len);
            if (write_all(fd, sp.v, sp.cnt, (off_t)(HEADER_SIZE + lo)) < 0)
                goto out;
        }
        *csum = XXH3_64bits_digest(&st);
    }
    if (expect && *csum != *expect) {
        errno = EBADMSG;
        goto out;
    }
    memcpy(h + CSUM_OFF, csum, 8);
    memset(h + HCSUM_OFF, 0, 8);
    uint64_t hcsum = hash_one(h, HEADER_SIZE);
    memcpy(h + HCSUM_OFF, &hcsum, 8);
    int n = 0;
    v[n].iov_base = h;
    v[n++].iov_len = HEADER_SIZE;
    if (payload <= ONE_READ_BYTES) {
        for (int k = 0; k < cnt; k++)
            v[n++] = pay[k];
    }
    off_t end = HEADER_SIZE + (off_t)payload;
    if (pad && payload <= ONE_READ_BYTES) {
        v[n].iov_base = (void *)zeros;
        v[n++].iov_len = pad;
    } else if (pad) {
        struct iovec z = {(void *)zeros, pad};
        if (write_all(fd, &z, 1, end) < 0)
            goto out;
    }
    if (write_all(fd, v, n, 0) < 0)
        goto out;
    if (sync && fsync(fd) < 0)
        goto out;
    rc = 0;
out:;
    int e = errno;
    if (close(fd) < 0 && rc == 0) {
        e = errno;
        rc = -1;
    }
    if (rc == 0 && rename(tmp, final) < 0) {
        e = errno;
        rc = -1;
    }
    if (rc < 0)
        unlink(tmp);
    errno = e;
    return rc;
}

static PyObject *
write_block(PyObject *Py_UNUSED(self), PyObject *args)
{
    PyObject *tmp_o, *final_o, *seq;
    Py_buffer hb;
    Py_ssize_t pad;
    int sync;
    PyObject *expect_o = Py_None;
    if (!PyArg_ParseTuple(args, "O&O&y*Onp|O", PyUnicode_FSConverter, &tmp_o,
                          PyUnicode_FSConverter, &final_o, &hb, &seq, &pad, &sync, &expect_o))
        return NULL;
    uint64_t expect = 0;
    int has_expect = expect_o != Py_None;
    if (has_expect) {
        expect = PyLong_AsUnsignedLongLong(expect_o);
        if (expect == (uint64_t)-1 && PyErr_Occurred()) {
            Py_DECREF(tmp_o);
            Py_DECREF(final_o);
            PyBuffer_Release(&hb);
            return NULL;
        }
    }
    PyObject *ret = NULL, *fast = NULL;
    Py_buffer bufs[MAX_IOV];
    Py_ssize_t nb = 0;
    if (hb.len != HEADER_SIZE || pad < 0 || pad >= HEADER_SIZE) {
        PyErr_SetString(PyExc_ValueError, "write_block: a 4096-byte header and a padding "
                                          "below 4096 bytes");
        goto done;
    }
    fast = PySequence_Fast(seq, "write_block: the payload is a sequence of buffers");
    if (!fast)
        goto done;
    Py_ssize_t cnt = PySequence_Fast_GET_SIZE(fast);
    if (cnt < 1 || cnt > MAX_IOV) {
        PyErr_Format(PyExc_ValueError, "write_block: 1 to %d payload buffers, not %zd", MAX_IOV,
                     cnt);
        goto done;
    }
    struct iovec pay[MAX_IOV];
    int used = 0;
    size_t payload = 0;
    for (; nb < cnt; nb++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(fast, nb), &bufs[nb],
                               PyBUF_C_CONTIGUOUS) < 0)
            goto done;
        if (bufs[nb].len) {
            pay[used].iov_base = bufs[nb].buf;
            pay[used++].iov_len = (size_t)bufs[nb].len;
            payload += (size_t)bufs[nb].len;
        }
    }
    if (!used) {
        PyErr_SetString(PyExc_ValueError, "write_block: an empty payload");
        goto done;
    }
    unsigned char h[HEADER_SIZE];
    memcpy(h, hb.buf, HEADER_SIZE);
    const char *tmp = PyBytes_AS_STRING(tmp_o), *final = PyBytes_AS_STRING(final_o);
    uint64_t csum = 0;
    int rc, e;
    Py_BEGIN_ALLOW_THREADS
    rc = write_file(tmp, final, h, pay, used, payload, (size_t)pad, sync, &csum,
                    has_expect ? &expect : NULL);
    e = errno;
    Py_END_ALLOW_THREADS
    if (rc < 0) {
        errno = e;
        PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, tmp_o);
        goto done;
    }
    ret = PyLong_FromUnsignedLongLong(csum);
done:
    for (Py_ssize_t k = 0; k < nb; k++)
        PyBuffer_Release(&bufs[k]);
    Py_XDECREF(fast);
    PyBuffer_Release(&hb);
    Py_DECREF(tmp_o);
    Py_DECREF(final_o);
    return ret;
}

static PyMethodDef module_methods[] = {
    {"xxh3_64", xxh3_64, METH_O, "xxh3_64 (seed 0) of a buffer, as this module computes it."},
    {"write_block", write_block, METH_VARARGS,
     "write_block(tmp, final, header, payload_buffers, pad, fsync[, expect]) -> payload "
     "checksum: one block file written, checksummed, renamed into place, without the GIL; "
     "with expect, not placed (EBADMSG) unless the payload's checksum is expect."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvfs.client._fastread",
    "The host load path's per-block work without the GIL (see kvfs/client/load.py).", -1,
    module_methods,
};

PyMODINIT_FUNC
PyInit__fastread(void)
{
#ifdef KVFS_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f"))
        hash_update = update_avx512, hash_one = one_avx512;
    else if (__builtin_cpu_supports("avx2"))
        hash_update = update_avx2, hash_one = one_avx2;
#endif
    if (PyType_Ready(&ReadsType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    Py_INCREF(&ReadsType);
    if (PyModule_AddObject(m, "Reads", (PyObject *)&ReadsType) < 0) {
        Py_DECREF(&ReadsType);
        Py_DECREF(m);
        return NULL;
    }
    const char *kernel = hash_one == one_default ? "default" :
#ifdef KVFS_X86
                         hash_one == one_avx512 ? "avx512" : "avx2";
#else
                         "default";
#endif
    if (PyModule_AddIntConstant(m, "HEADER_SIZE", HEADER_SIZE) < 0 ||
        PyModule_AddIntConstant(m, "BHASH_OFF", BHASH_OFF) < 0 ||
        PyModule_AddIntConstant(m, "FP_OFF", FP_OFF) < 0 ||
        PyModule_AddIntConstant(m, "CSUM_OFF", CSUM_OFF) < 0 ||
        PyModule_AddIntConstant(m, "HCSUM_OFF", HCSUM_OFF) < 0 ||
        PyModule_AddIntConstant(m, "SUMS_OFF", SUMS_OFF) < 0 ||
        PyModule_AddIntConstant(m, "SUMS_END", SUMS_END) < 0 ||
        PyModule_AddIntConstant(m, "SUMS_PRIME", SUMS_PRIME) < 0 ||
        PyModule_AddIntConstant(m, "HASH_PIECE", HASH_PIECE) < 0 ||
        PyModule_AddIntConstant(m, "ONE_READ_BYTES", ONE_READ_BYTES) < 0 ||
        PyModule_AddIntConstant(m, "ST_NOT_READ", ST_NOT_READ) < 0 ||
        PyModule_AddIntConstant(m, "ST_OK", ST_OK) < 0 ||
        PyModule_AddIntConstant(m, "ST_ABSENT", ST_ABSENT) < 0 ||
        PyModule_AddIntConstant(m, "ST_OSERROR", ST_OSERROR) < 0 ||
        PyModule_AddIntConstant(m, "ST_RECHECK", ST_RECHECK) < 0 ||
        PyModule_AddStringConstant(m, "KERNEL", kernel) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
