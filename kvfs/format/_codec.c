/*
 * kvfs.format._codec: the lossless block codec's inner loops, without the GIL (kvfs/format/codec.py).
 *
 * "planes": a payload of k-byte elements (k = 2 for bfloat16/float16) is stored as k byte
 * planes (plane p holds byte p of every element), in chunks of CHUNK elements. A plane is
 * either stored as is or as a run of standard zstd frames, one frame per chunk (nvCOMP and
 * any zstd library read them). The high byte of a 16-bit float (sign, exponent) compresses
 * well; its low byte (mantissa) barely does and is usually kept as is.
 *
 * Stored bytes (docs/format.md, "Encodings"): k little-endian u64 plane words, then the
 * planes back to back. A plane word's bit 63 says the plane is zstd frames; its low 48 bits
 * are the plane's stored length.
 *
 * decode() works chunk by chunk: each plane's chunk lands in a small scratch (cache-resident),
 * the chunk is interleaved into the destination and hashed (xxh3_64) right there, so the
 * destination is written once and the decoded payload's checksum costs no second pass.
 *
 * "int8" (further below): a lossy codec for namespaces that chose it, one scale per group.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define XXH_INLINE_ALL
#include <xxhash.h>
#include <zstd.h>

#define MAX_PLANES 8
#define ZSTD_BIT (1ULL << 63)
#define LEN_MASK ((1ULL << 48) - 1)
/* The encoder's match table: 2^6 entries (zstd's least). A plane of KV bytes is literals
 * for Huffman coding with few repeats worth a match (hence the 7-byte minimum match below);
 * level 1's own table (2^13 and up) finds more short matches, which cost more than the
 * literals they replace. Measured on one core (libzstd 1.5.4, 2-core Xeon VM) against level
 * 1's own table, on the high plane of 1 Mi normal bfloat16 values in 64 Ki frames: encoding
 * 3.6 -> 1.2 ms, 35.9 % -> 34.5 % of the plane stored, decoding 1.12 -> 0.81 ms; whole
 * blocks, the probe below included: docs/bench/codec-table.notes.md. */
#define HASH_LOG 6

static void split(const uint8_t *src, size_t elems, int k, uint8_t **planes) {
    if (k == 2) {
        uint8_t *a = planes[0], *b = planes[1];
        for (size_t i = 0; i < elems; i++) {
            a[i] = src[2 * i];
            b[i] = src[2 * i + 1];
        }
        return;
    }
    for (size_t i = 0; i < elems; i++)
        for (int p = 0; p < k; p++) planes[p][i] = src[(size_t)k * i + p];
}

static void merge(uint8_t *dst, size_t elems, int k, const uint8_t *const *planes) {
    if (k == 2) {
        const uint8_t *a = planes[0], *b = planes[1];
        for (size_t i = 0; i < elems; i++) {
            dst[2 * i] = a[i];
            dst[2 * i + 1] = b[i];
        }
        return;
    }
    for (size_t i = 0; i < elems; i++)
        for (int p = 0; p < k; p++) dst[(size_t)k * i + p] = planes[p][i];
}

static void put_u64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static uint64_t get_u64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) v |= (uint64_t)p[i] << (8 * i);
    return v;
}

/* encode(payload, k, chunk, level, keep) -> bytes | None
 * None: the payload does not shrink below keep (a fraction, e.g. 0.95) of its size. A plane is
 * stored compressed only where that makes it smaller than keep of its raw length. */
static PyObject *encode(PyObject *self, PyObject *args) {
    Py_buffer src;
    int k, level;
    Py_ssize_t chunk;
    double keep;
    if (!PyArg_ParseTuple(args, "y*inid", &src, &k, &chunk, &level, &keep)) return NULL;
    PyObject *result = NULL;
    uint8_t *work = NULL;
    if (k < 1 || k > MAX_PLANES || chunk < 1 || src.len % k) {
        PyErr_SetString(PyExc_ValueError, "payload is not whole elements of 1..8 bytes");
        goto out;
    }
    size_t n = (size_t)src.len, elems = n / (size_t)k, nchunks = (elems + chunk - 1) / chunk;
    size_t bound = nchunks * ZSTD_compressBound((size_t)chunk);
    /* raw planes (n bytes), then one compressed area per plane */
    work = malloc(n + (size_t)k * bound + 1);
    if (!work) {
        PyErr_NoMemory();
        goto out;
    }
    uint8_t *planes[MAX_PLANES], *zbuf[MAX_PLANES];
    size_t zlen[MAX_PLANES], stored = 8 * (size_t)k;
    int compressed[MAX_PLANES];
    for (int p = 0; p < k; p++) {
        planes[p] = work + (size_t)p * elems;
        zbuf[p] = work + n + (size_t)p * bound;
    }
    int failed = 0;
    Py_BEGIN_ALLOW_THREADS
    split(src.buf, elems, k, planes);
    ZSTD_CCtx *cctx = ZSTD_createCCtx();
    if (!cctx) failed = 1;
    else {
        ZSTD_CCtx_setParameter(cctx, ZSTD_c_compressionLevel, level);
        /* Matches of 7+ bytes only: the planes are mostly literals for Huffman coding, which
         * decodes faster than short matches interleaved with literals (docs/format.md). */
        ZSTD_CCtx_setParameter(cctx, ZSTD_c_minMatch, 7);
        ZSTD_CCtx_setParameter(cctx, ZSTD_c_hashLog, HASH_LOG);
    }
    for (int p = 0; p < k && !failed; p++) {
        size_t off = 0;
        int probe_failed = 0;
        for (size_t c = 0; c < nchunks; c++) {
            size_t first = c * (size_t)chunk, len = elems - first < (size_t)chunk ? elems - first : (size_t)chunk;
            size_t r = ZSTD_compress2(cctx, zbuf[p] + off, bound - off, planes[p] + first, len);
            if (ZSTD_isError(r)) {
                failed = 1;
                break;
            }
            off += r;
            /* The plane's first chunk is its probe: one that does not shrink below keep says
             * the plane is near-random (a 16-bit float's low byte, or bytes that are random
             * outright), and the plane is stored as is without compressing the rest. */
            if (c == 0 && nchunks > 1 && (double)r >= keep * (double)len) {
                probe_failed = 1;
                break;
            }
        }
        zlen[p] = off;
        compressed[p] = !probe_failed && (double)off < keep * (double)elems;
        stored += compressed[p] ? off : elems;
    }
    ZSTD_freeCCtx(cctx);
    Py_END_ALLOW_THREADS
    if (failed) {
        PyErr_SetString(PyExc_RuntimeError, "zstd compression failed");
        goto out;
    }
    if ((double)stored >= keep * (double)n) {
        result = Py_None;
        Py_INCREF(result);
        goto out;
    }
    result = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)stored);
    if (!result) goto out;
    uint8_t *o = (uint8_t *)PyBytes_AS_STRING(result);
    size_t at = 8 * (size_t)k;
    for (int p = 0; p < k; p++) {
        size_t len = compressed[p] ? zlen[p] : elems;
        put_u64(o + 8 * p, (compressed[p] ? ZSTD_BIT : 0) | len);
        memcpy(o + at, compressed[p] ? zbuf[p] : planes[p], len);
        at += len;
    }
out:
    free(work);
    PyBuffer_Release(&src);
    return result;
}

/* The decoder's verdicts: 0 sound, else a reason for kvfs.format.codec. */
enum { OK = 0, BAD_TABLE = 1, BAD_FRAME = 2, BAD_LENGTH = 3, NO_MEMORY = 4 };

/* The destination: one buffer, or parts filled in order (a block's pages or layers). */
typedef struct {
    int nparts;
    uint8_t **buf;
    size_t *len;
    int part;   /* the part being filled */
    size_t off; /* bytes of it filled */
} Dest;

static void dest_write(Dest *d, const uint8_t *src, size_t n) {
    while (n) {
        size_t room = d->len[d->part] - d->off, m = n < room ? n : room;
        memcpy(d->buf[d->part] + d->off, src, m);
        src += m;
        n -= m;
        d->off += m;
        if (d->off == d->len[d->part] && d->part + 1 < d->nparts) {
            d->part++;
            d->off = 0;
        }
    }
}

/* The caller's destination as a Python object (a writable buffer, or a list or tuple of them
 * filled in order), held as a Dest while the decoder runs without the GIL. */
typedef struct {
    PyObject *seq;     /* the list or tuple, or NULL for one buffer */
    Py_buffer *views;
    uint8_t **bufs;
    size_t *lens;
    int nparts, held;  /* parts, and how many of their buffers are held */
    size_t total;      /* their bytes in all */
} Target;

/* Hold every part of `target`: 0, or -1 with an exception set (target_release still due). */
static int target_get(PyObject *target, Target *t) {
    memset(t, 0, sizeof *t);
    t->nparts = 1;
    if (PyList_Check(target) || PyTuple_Check(target)) {
        t->seq = PySequence_Fast(target, "dest");
        if (!t->seq) return -1;
        t->nparts = (int)PySequence_Fast_GET_SIZE(t->seq);
        if (t->nparts < 1) {
            PyErr_SetString(PyExc_ValueError, "dest has no parts");
            return -1;
        }
    }
    t->views = calloc((size_t)t->nparts, sizeof *t->views);
    t->bufs = calloc((size_t)t->nparts, sizeof *t->bufs);
    t->lens = calloc((size_t)t->nparts, sizeof *t->lens);
    if (!t->views || !t->bufs || !t->lens) {
        PyErr_NoMemory();
        return -1;
    }
    for (; t->held < t->nparts; t->held++) {
        int i = t->held;
        PyObject *o = t->seq ? PySequence_Fast_GET_ITEM(t->seq, i) : target;
        if (PyObject_GetBuffer(o, &t->views[i], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
            return -1;
        t->bufs[i] = t->views[i].buf;
        t->lens[i] = (size_t)t->views[i].len;
        t->total += t->lens[i];
    }
    return 0;
}

static void target_release(Target *t) {
    for (int i = 0; i < t->held; i++) PyBuffer_Release(&t->views[i]);
    free(t->views);
    free(t->bufs);
    free(t->lens);
    Py_XDECREF(t->seq);
}

static int run_decode(const uint8_t *s, size_t slen, int k, size_t chunk, Dest *dest,
                      size_t n, uint64_t *digest, int merging) {
    uint8_t *dst = dest->nparts == 1 ? dest->buf[0] : NULL;
    size_t elems = n / (size_t)k;
    if (n % (size_t)k || slen < 8 * (size_t)k) return BAD_TABLE;
    const uint8_t *pos[MAX_PLANES], *end[MAX_PLANES];
    int z[MAX_PLANES];
    size_t at = 8 * (size_t)k;
    for (int p = 0; p < k; p++) {
        uint64_t w = get_u64(s + 8 * p), len = w & LEN_MASK;
        if ((w & ~(ZSTD_BIT | LEN_MASK)) || len > slen - at) return BAD_TABLE;
        z[p] = (w & ZSTD_BIT) != 0;
        if (!z[p] && len != elems) return BAD_TABLE;
        pos[p] = s + at;
        end[p] = s + at + len;
        at += len;
    }
    if (at != slen) return BAD_TABLE;
    /* per plane one chunk, and (several parts) one merged chunk */
    uint8_t *scratch = malloc((size_t)k * chunk * (dst ? 1 : 2) + 1);
    ZSTD_DCtx *dctx = ZSTD_createDCtx();
    XXH3_state_t *xs = XXH3_createState();
    int rc = OK;
    if (!scratch || !dctx || !xs) {
        rc = NO_MEMORY;
        goto done;
    }
    XXH3_64bits_reset(xs);
    for (size_t first = 0; first < elems; first += chunk) {
        size_t len = elems - first < chunk ? elems - first : chunk;
        const uint8_t *src[MAX_PLANES];
        for (int p = 0; p < k; p++) {
            if (!z[p]) {
                src[p] = pos[p] + first;
                continue;
            }
            size_t fl = ZSTD_findFrameCompressedSize(pos[p], (size_t)(end[p] - pos[p]));
            if (ZSTD_isError(fl)) {
                rc = BAD_FRAME;
                goto done;
            }
            uint8_t *into = scratch + (size_t)p * chunk;
            size_t got = ZSTD_decompressDCtx(dctx, into, chunk, pos[p], fl);
            if (ZSTD_isError(got)) {
                rc = BAD_FRAME;
                goto done;
            }
            if (got != len) {
                rc = BAD_LENGTH;
                goto done;
            }
            pos[p] += fl;
            src[p] = into;
        }
        if (!merging) continue; /* the zstd frames alone: the library's bound */
        uint8_t *out = dst ? dst + first * (size_t)k : scratch + (size_t)k * chunk;
        merge(out, len, k, src);
        XXH3_64bits_update(xs, out, len * (size_t)k);
        if (!dst) dest_write(dest, out, len * (size_t)k);
    }
    for (int p = 0; p < k; p++)
        if (z[p] && pos[p] != end[p]) rc = BAD_LENGTH;
    *digest = XXH3_64bits_digest(xs);
done:
    free(scratch);
    ZSTD_freeDCtx(dctx);
    XXH3_freeState(xs);
    return rc;
}

/* decode(stored, k, chunk, dest, merge=True) -> (verdict, xxh3_64 of what was written to dest)
 * merge False: decompress the zstd frames only (into scratch), write nothing to dest and hash
 * nothing: the zstd library's own time on these frames, for kvfs bench codec.
 * dest: a writable buffer, or a list or tuple of them filled in order, exactly the decoded
 * payload's size in all; on a verdict other than 0 its bytes are undefined (the caller reports
 * a miss and never serves them). */
static PyObject *decode(PyObject *self, PyObject *args) {
    Py_buffer s;
    PyObject *target;
    int k;
    Py_ssize_t chunk;
    int merging = 1;
    if (!PyArg_ParseTuple(args, "y*inO|p", &s, &k, &chunk, &target, &merging)) return NULL;
    PyObject *result = NULL;
    Target t;
    memset(&t, 0, sizeof t);
    if (k < 1 || k > MAX_PLANES || chunk < 1) {
        PyErr_SetString(PyExc_ValueError, "element size must be 1..8 and chunk positive");
        goto out;
    }
    if (target_get(target, &t) < 0) goto out;
    {
        Dest d = {t.nparts, t.bufs, t.lens, 0, 0};
        uint64_t digest = 0;
        int rc;
        Py_BEGIN_ALLOW_THREADS
        rc = run_decode(s.buf, (size_t)s.len, k, (size_t)chunk, &d, t.total, &digest, merging);
        Py_END_ALLOW_THREADS
        if (rc == NO_MEMORY) PyErr_NoMemory();
        else result = Py_BuildValue("iK", rc, (unsigned long long)digest);
    }
out:
    target_release(&t);
    PyBuffer_Release(&s);
    return result;
}

/* ---- "int8": lossy, one scale per group (a (token, head) row of head_dim values) ---------
 * Stored bytes: n int8 codes, then n / group little-endian float32 scales. Element i decodes to
 * dtype(code[i] * scale[s(i)]), the product in float32, converted to bfloat16 by rounding
 * to nearest even, to float16 by IEEE conversion (also to nearest even), or kept as float32.
 * Encoding picks scale = max |x| / 127 per group and code = round(x / scale) in -127..127.
 *
 * Which scale (docs/format.md, "Codec 2"): with tiles 0, s(i) = i / group (a group is a run of
 * `group` elements). Otherwise tiles = w | n << 16 | mask << 24 cuts the payload into tiles of
 * group * w elements; tile t is of kind t % n. A row tile is w runs of `group` (s(i) = i / group
 * as before); a column tile is a row-major matrix of `group` rows by w columns whose groups are
 * its columns: s(i) = t * w + (i - t * group * w) % w. (An engine that keeps a head's keys
 * transposed, as vLLM's CPU attention does, stores a token's keys down a column.) */

enum { DT_BF16 = 1, DT_F16 = 2, DT_F32 = 3 };
#define QSTEP 4096 /* elements decoded (and hashed) per step when the destination has parts */

static int dt_size(int dt) { return dt == DT_F32 ? 4 : 2; }

static float load_elem(const uint8_t *p, int dt) {
    if (dt == DT_BF16) {
        uint32_t u = (uint32_t)(p[0] | (p[1] << 8)) << 16;
        float f;
        memcpy(&f, &u, 4);
        return f;
    }
    if (dt == DT_F16) {
        _Float16 h;
        memcpy(&h, p, 2);
        return (float)h;
    }
    float f;
    memcpy(&f, p, 4);
    return f;
}

static void store_elem(uint8_t *p, float f, int dt) {
    if (dt == DT_BF16) {
        uint32_t u;
        memcpy(&u, &f, 4);
        u += 0x7fffu + ((u >> 16) & 1u); /* finite values only: round to nearest even */
        p[0] = (uint8_t)(u >> 16);
        p[1] = (uint8_t)(u >> 24);
    } else if (dt == DT_F16) {
        _Float16 h = (_Float16)f;
        memcpy(p, &h, 2);
    } else {
        memcpy(p, &f, 4);
    }
}

/* Decode codes[first .. first+len) into out (len elements of dt): one loop per dtype, each
 * simple enough for the compiler to vectorize. */
static void dequant_run(const int8_t *codes, const uint8_t *scales, size_t first, size_t len,
                        size_t group, int dt, uint8_t *out) {
    int es = dt_size(dt);
    size_t i = first, end = first + len;
    while (i < end) {
        size_t g = i / group, stop = (g + 1) * group < end ? (g + 1) * group : end;
        float sc;
        memcpy(&sc, scales + 4 * g, 4);
        uint8_t *o = out + (i - first) * es;
        const int8_t *c = codes + i;
        size_t m = stop - i;
        if (dt == DT_BF16) {
            uint16_t tmp[256];
            for (size_t a = 0; a < m; a += 256) {
                size_t b = m - a < 256 ? m - a : 256;
                for (size_t j = 0; j < b; j++) {
                    float f = (float)c[a + j] * sc;
                    uint32_t u;
                    memcpy(&u, &f, 4);
                    tmp[j] = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
                }
                memcpy(o + 2 * a, tmp, 2 * b); /* little-endian hosts, as the format */
            }
        } else {
            for (size_t j = 0; j < m; j++) store_elem(o + j * es, (float)c[j] * sc, dt);
        }
        i = stop;
    }
}

/* Decode a column tile (rows x w codes, row-major; scale c for column c) into out. */
static void dequant_cols(const int8_t *codes, const uint8_t *scales, size_t rows, size_t w,
                         int dt, uint8_t *out) {
    int es = dt_size(dt);
    float sc[256];
    for (size_t c0 = 0; c0 < w; c0 += 256) {
        size_t cw = w - c0 < 256 ? w - c0 : 256;
        memcpy(sc, scales + 4 * c0, 4 * cw);
        for (size_t r = 0; r < rows; r++) {
            const int8_t *c = codes + r * w + c0;
            uint8_t *o = out + (r * w + c0) * es;
            if (dt == DT_BF16) {
                uint16_t tmp[256];
                for (size_t j = 0; j < cw; j++) {
                    float f = (float)c[j] * sc[j];
                    uint32_t u;
                    memcpy(&u, &f, 4);
                    tmp[j] = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
                }
                memcpy(o, tmp, 2 * cw);
            } else {
                for (size_t j = 0; j < cw; j++) store_elem(o + j * es, (float)c[j] * sc[j], dt);
            }
        }
    }
}

/* The layout a tiles word names (w 0: plain groups); 0 where it is not one. */
typedef struct {
    size_t w, n;
    unsigned mask;
} Tiles;

static int parse_tiles(unsigned long tiles, Tiles *t) {
    t->w = tiles & 0xffffu;
    t->n = (tiles >> 16) & 0xffu;
    t->mask = (unsigned)(tiles >> 24) & 0xffu;
    if (tiles > 0xffffffffUL) return 0;
    if (tiles == 0) return 1;
    return t->w >= 1 && t->n >= 1 && t->n <= 8 && (t->mask >> t->n) == 0;
}

static int is_col(const Tiles *t, size_t tile) {
    return t->w && ((t->mask >> (tile % t->n)) & 1u);
}

/* Quantize elements fx[0 .. rows * w) (a row-major tile) into codes and scales: one scale per
 * column (cols) or per run of `w` (a row); 0 where a value is not finite. */
static int quant_tile(const float *fx, size_t rows, size_t w, int cols, int8_t *codes,
                      uint8_t *scales, float *amax) {
    size_t groups = cols ? w : rows;
    for (size_t g = 0; g < groups; g++) amax[g] = 0.0f;
    int finite = 1;
    for (size_t r = 0; r < rows; r++)
        for (size_t c = 0; c < w; c++) {
            float a = fabsf(fx[r * w + c]);
            if (!(a <= 3.0e38f)) finite = 0; /* NaN or infinite */
            size_t g = cols ? c : r;
            amax[g] = a > amax[g] ? a : amax[g];
        }
    if (!finite) return 0;
    for (size_t g = 0; g < groups; g++) {
        float sc = amax[g] / 127.0f;
        memcpy(scales + 4 * g, &sc, 4);
        amax[g] = sc;
    }
    for (size_t r = 0; r < rows; r++)
        for (size_t c = 0; c < w; c++) {
            float sc = amax[cols ? c : r];
            float v = sc > 0 ? fx[r * w + c] / sc : 0.0f;
            v = v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v;
            /* to nearest even, as torch.round: adding and taking away 1.5 * 2^23 leaves
             * the integer the float unit rounds to (|v| <= 127 is well inside) */
            float q = v + 12582912.0f; /* (not folded away: no -ffast-math) */
            codes[r * w + c] = (int8_t)(q - 12582912.0f);
        }
    return 1;
}

/* quantize(payload, dtype, group, tiles=0) -> (stored bytes, xxh3_64 of the decoded payload),
 * or None where the payload holds a value that is not finite (it is then stored as is). */
static PyObject *quantize(PyObject *self, PyObject *args) {
    Py_buffer src;
    int dt;
    Py_ssize_t group;
    unsigned long tiles = 0;
    if (!PyArg_ParseTuple(args, "y*in|k", &src, &dt, &group, &tiles)) return NULL;
    PyObject *result = NULL, *stored = NULL;
    uint8_t *scratch = NULL;
    int es = dt_size(dt);
    Tiles tl;
    if (!parse_tiles(tiles, &tl)) {
        PyErr_SetString(PyExc_ValueError, "tiles: w 1..65535, n 1..8, mask below 1 << n");
        goto out;
    }
    /* a unit is a tile, or (no tiles) a group: `rows` runs of `w` elements */
    size_t w = (size_t)group, rows = tl.w ? tl.w : 1;
    if (dt < DT_BF16 || dt > DT_F32 || group < 1 || src.len % es
        || (src.len / es) % (rows * w)) {
        PyErr_SetString(PyExc_ValueError, "payload is not whole groups (tiles) of bf16/f16/f32 "
                        "values");
        goto out;
    }
    size_t n = (size_t)src.len / es, unit = rows * w, units = n / unit;
    stored = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(n + 4 * (n / (size_t)group)));
    /* the decoded unit, its floats, its scales */
    scratch = malloc(unit * (es + 4) + 4 * (rows > w ? rows : w) + 1);
    if (!stored || !scratch) {
        if (stored) PyErr_NoMemory();
        goto out;
    }
    int8_t *codes = (int8_t *)PyBytes_AS_STRING(stored);
    uint8_t *scales = (uint8_t *)PyBytes_AS_STRING(stored) + n;
    const uint8_t *x = src.buf;
    int finite = 1;
    uint64_t digest = 0;
    Py_BEGIN_ALLOW_THREADS
    XXH3_state_t *xs = XXH3_createState();
    if (xs) XXH3_64bits_reset(xs);
    float *fx = (float *)(scratch + unit * es), *amax = fx + unit;
    for (size_t u = 0; u < units && finite && xs; u++) {
        size_t at = u * unit;
        if (dt == DT_BF16) {
            for (size_t i = 0; i < unit; i++) {
                uint32_t v = (uint32_t)(x[2 * (at + i)] | (x[2 * (at + i) + 1] << 8)) << 16;
                memcpy(&fx[i], &v, 4);
            }
        } else {
            for (size_t i = 0; i < unit; i++) fx[i] = load_elem(x + (at + i) * es, dt);
        }
        int cols = is_col(&tl, u);
        /* a column tile is `group` rows of w; a row tile w rows of `group` */
        size_t r = cols ? (size_t)group : rows, c = cols ? tl.w : w;
        uint8_t *sc = scales + 4 * (at / (size_t)group);
        finite = quant_tile(fx, r, c, cols, codes + at, sc, amax);
        if (!finite) break;
        if (cols) dequant_cols(codes + at, sc, r, c, dt, scratch);
        else dequant_run(codes, scales, at, unit, (size_t)group, dt, scratch);
        XXH3_64bits_update(xs, scratch, unit * es);
    }
    if (xs) {
        digest = XXH3_64bits_digest(xs);
        XXH3_freeState(xs);
    } else finite = -1;
    Py_END_ALLOW_THREADS
    if (finite < 0) PyErr_NoMemory();
    else if (!finite) {
        result = Py_None;
        Py_INCREF(result);
    } else result = Py_BuildValue("OK", stored, (unsigned long long)digest);
out:
    Py_XDECREF(stored);
    free(scratch);
    PyBuffer_Release(&src);
    return result;
}

static int run_dequant(const uint8_t *s, size_t slen, int dt, size_t group, const Tiles *tl,
                       Dest *dest, size_t n, uint64_t *digest) {
    int es = dt_size(dt);
    if (n % (size_t)es) return BAD_LENGTH;
    size_t elems = n / es, step = tl->w ? group * tl->w : QSTEP;
    if (elems % group || (tl->w && elems % step) || slen != elems + 4 * (elems / group))
        return BAD_LENGTH;
    const int8_t *codes = (const int8_t *)s;
    const uint8_t *scales = s + elems;
    uint8_t *dst = dest->nparts == 1 ? dest->buf[0] : NULL;
    uint8_t *scratch = dst ? NULL : malloc(step * es);
    XXH3_state_t *xs = XXH3_createState();
    int rc = OK;
    if ((!dst && !scratch) || !xs) {
        rc = NO_MEMORY;
        goto done;
    }
    XXH3_64bits_reset(xs);
    for (size_t first = 0, u = 0; first < elems; first += step, u++) {
        size_t len = elems - first < step ? elems - first : step;
        uint8_t *out = dst ? dst + first * es : scratch;
        if (is_col(tl, u)) dequant_cols(codes + first, scales + 4 * (first / group), group,
                                        tl->w, dt, out);
        else dequant_run(codes, scales, first, len, group, dt, out);
        XXH3_64bits_update(xs, out, len * es);
        if (!dst) dest_write(dest, out, len * es);
    }
    *digest = XXH3_64bits_digest(xs);
done:
    free(scratch);
    XXH3_freeState(xs);
    return rc;
}

/* dequantize(stored, dtype, group, dest, tiles=0) -> (verdict, xxh3_64 of what was written to
 * dest); dest as for decode(). */
static PyObject *dequantize(PyObject *self, PyObject *args) {
    Py_buffer s;
    PyObject *target;
    int dt;
    Py_ssize_t group;
    unsigned long tiles = 0;
    if (!PyArg_ParseTuple(args, "y*inO|k", &s, &dt, &group, &target, &tiles)) return NULL;
    PyObject *result = NULL;
    Target t;
    memset(&t, 0, sizeof t);
    Tiles tl;
    if (dt < DT_BF16 || dt > DT_F32 || group < 1 || !parse_tiles(tiles, &tl)) {
        PyErr_SetString(PyExc_ValueError, "dtype must be 1..3, group positive, tiles sound");
        goto out;
    }
    if (target_get(target, &t) < 0) goto out;
    {
        Dest d = {t.nparts, t.bufs, t.lens, 0, 0};
        uint64_t digest = 0;
        int rc;
        Py_BEGIN_ALLOW_THREADS
        rc = run_dequant(s.buf, (size_t)s.len, dt, (size_t)group, &tl, &d, t.total, &digest);
        Py_END_ALLOW_THREADS
        if (rc == NO_MEMORY) PyErr_NoMemory();
        else result = Py_BuildValue("iK", rc, (unsigned long long)digest);
    }
out:
    target_release(&t);
    PyBuffer_Release(&s);
    return result;
}

static PyMethodDef methods[] = {
    {"encode", encode, METH_VARARGS,
     "encode(payload, k, chunk, level, keep) -> stored bytes, or None where it does not pay."},
    {"decode", decode, METH_VARARGS,
     "decode(stored, k, chunk, dest) -> (verdict, xxh3_64 of dest); verdict 0 is sound."},
    {"quantize", quantize, METH_VARARGS,
     "quantize(payload, dtype, group, tiles=0) -> (stored, xxh3_64 of the decoded payload) "
     "or None."},
    {"dequantize", dequantize, METH_VARARGS,
     "dequantize(stored, dtype, group, dest, tiles=0) -> (verdict, xxh3_64 of dest)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvfs.format._codec", NULL, -1, methods};

PyMODINIT_FUNC PyInit__codec(void) {
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddStringConstant(m, "zstd_version", ZSTD_versionString()) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
