/*
 * kvfs.daemon._passthrough: the two FUSE replies that libfuse 3.14 cannot write for kvfs.
 *
 * FUSE passthrough (Linux 6.9 and later) lets the daemon hand the kernel an open backing file,
 * after which the kernel does that file's reads, writes and mmap itself: no byte crosses
 * /dev/fuse. It takes two things libfuse 3.14 (Debian 12) cannot say and pyfuse3 3.5 cannot
 * ask for:
 *   - the INIT reply's FUSE_PASSTHROUGH flag (bit 5 of flags2, which needs FUSE_INIT_EXT) and
 *     max_stack_depth (a u32 at byte 36 of fuse_init_out);
 *   - an OPEN or CREATE reply's FOPEN_PASSTHROUGH flag and backing id (fuse_open_out's
 *     open_flags and the i32 after them, which libfuse sends as zero padding).
 * libfuse writes every reply with one writev(2) on the session's fd. This module replaces
 * libfuse's own `writev` (the slot in libfuse3.so's global offset table, so nothing else in
 * the process is touched) with `reply_writev`, which passes every write through unchanged
 * except two: the first reply written after `hook` (the INIT reply, which the kernel waits
 * for before it sends anything else) and the next OPEN/CREATE reply on a thread that called
 * `arm(fh, backing_id)` just before its handler returned that `fh`. pyfuse3 sends a handler's
 * reply on the handler's own thread, right after it returns, with no await in between, so
 * the armed reply is the next one that thread writes; it is patched only if it is a success
 * of the right size that carries the armed fh, and disarmed either way (`state` counts the
 * misses). Backing files are registered and released by kvfs.daemon.passthrough with the
 * FUSE_DEV_IOC_BACKING_OPEN / _CLOSE ioctls.
 */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <elf.h>
#include <errno.h>
#include <link.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <sys/vfs.h>
#include <unistd.h>

/* The kernel's protocol (include/uapi/linux/fuse.h). */
#define OUT_HEADER 16           /* struct fuse_out_header: u32 len, i32 error, u64 unique */
#define INIT_OUT 64             /* struct fuse_init_out as libfuse 3.14 sends it */
#define INIT_FLAGS_OFF 12
#define INIT_FLAGS2_OFF 32
#define INIT_STACK_OFF 36
#define FUSE_WRITEBACK_CACHE (1u << 16)
#define FUSE_INIT_EXT (1u << 30)
#define FUSE_PASSTHROUGH_HI (1u << 5) /* bit 37 of the 64-bit flags */
#define ENTRY_OUT 128           /* struct fuse_entry_out */
#define OPEN_OUT 16             /* struct fuse_open_out: u64 fh, u32 open_flags, i32 backing_id */
#define FOPEN_DIRECT_IO (1u << 0)
#define FOPEN_KEEP_CACHE (1u << 1)
#define FOPEN_PARALLEL_DIRECT_WRITES (1u << 6)
#define FOPEN_PASSTHROUGH (1u << 7)
#define FOPEN_NOFLUSH (1u << 5)
/* What may stand beside FOPEN_PASSTHROUGH (the kernel refuses anything else with EINVAL). */
#define PASSTHROUGH_KEEP (FOPEN_PARALLEL_DIRECT_WRITES | FOPEN_NOFLUSH)

typedef ssize_t (*writev_fn)(int, const struct iovec *, int);

static writev_fn real_writev;   /* libc's, as libfuse had it */
static int fuse_fd = -1;        /* the session's /dev/fuse fd */
static int init_armed;          /* the next reply is the INIT reply: patch it */
static uint32_t stack_depth;    /* max_stack_depth to offer (1 or 2) */

/* Set by reply_writev on the event-loop thread, read by `state` on the same thread (every
 * FUSE reply of pyfuse3 is written there); the INIT fields once, before any open. */
static int init_seen, init_offered;
static uint32_t init_flags;
static unsigned long long opens_patched, opens_missed;

static __thread int armed;
static __thread uint64_t armed_fh;
static __thread int32_t armed_id;

static uint32_t get32(const unsigned char *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static void put32(unsigned char *p, uint32_t v) { memcpy(p, &v, 4); }

/* Patch an OPEN (fuse_open_out alone) or CREATE (fuse_entry_out + fuse_open_out) reply in
 * `buf` for the armed fh; 1 if patched. */
static int patch_open(unsigned char *buf, size_t len)
{
    int32_t error;
    uint64_t fh;
    memcpy(&error, buf + 4, 4);
    if (error != 0 || (len != OUT_HEADER + OPEN_OUT && len != OUT_HEADER + ENTRY_OUT + OPEN_OUT))
        return 0;
    unsigned char *open_out = buf + len - OPEN_OUT;
    memcpy(&fh, open_out, 8);
    if (fh != armed_fh)
        return 0;
    uint32_t flags = get32(open_out + 8);
    put32(open_out + 8, (flags & PASSTHROUGH_KEEP) | FOPEN_PASSTHROUGH);
    memcpy(open_out + 12, &armed_id, 4);
    return 1;
}

/* The INIT reply: offer passthrough unless the write-back cache was negotiated (the kernel
 * turns passthrough off then anyway). */
static void patch_init(unsigned char *buf, size_t len)
{
    init_seen = 1;
    if (len != OUT_HEADER + INIT_OUT || get32(buf + OUT_HEADER) != 7)
        return;
    unsigned char *out = buf + OUT_HEADER;
    uint32_t flags = get32(out + INIT_FLAGS_OFF);
    init_flags = flags;
    if (flags & FUSE_WRITEBACK_CACHE)
        return;
    put32(out + INIT_FLAGS_OFF, flags | FUSE_INIT_EXT);
    put32(out + INIT_FLAGS2_OFF, get32(out + INIT_FLAGS2_OFF) | FUSE_PASSTHROUGH_HI);
    put32(out + INIT_STACK_OFF, stack_depth);
    init_offered = 1;
}

static ssize_t reply_writev(int fd, const struct iovec *iov, int count)
{
    if (fd != fuse_fd || !(init_armed || armed) || count < 1 || iov[0].iov_len < OUT_HEADER)
        return real_writev(fd, iov, count);
    uint64_t unique;
    memcpy(&unique, (const unsigned char *)iov[0].iov_base + 8, 8);
    if (unique == 0)  /* a notification, not a reply */
        return real_writev(fd, iov, count);
    unsigned char buf[OUT_HEADER + ENTRY_OUT + OPEN_OUT];
    size_t len = 0;
    int fits = 1;
    for (int i = 0; i < count; i++) {
        if (iov[i].iov_len > sizeof(buf) - len) { fits = 0; break; }
        memcpy(buf + len, iov[i].iov_base, iov[i].iov_len);
        len += iov[i].iov_len;
    }
    int patched = 0;
    if (init_armed) {
        init_armed = 0;
        if (fits) {
            patch_init(buf, len);
            patched = init_offered;
        } else {
            init_seen = 1;
        }
    } else {
        armed = 0;
        patched = fits && patch_open(buf, len);
        if (patched)
            opens_patched++;
        else
            opens_missed++;
    }
    if (!patched)
        return real_writev(fd, iov, count);
    struct iovec one = {buf, len};
    return real_writev(fd, &one, 1);
}

/* -- the slot in libfuse3.so's global offset table ------------------------------------- */

struct found { void **slot; int matched; };

static uintptr_t dyn_ptr(uintptr_t base, uintptr_t p) { return p < base ? p + base : p; }

static int find_slot(struct dl_phdr_info *info, size_t size, void *data)
{
    struct found *f = data;
    if (!info->dlpi_name || !strstr(info->dlpi_name, "libfuse3.so"))
        return 0;
    f->matched = 1;
    uintptr_t base = info->dlpi_addr;
    for (int i = 0; i < info->dlpi_phnum; i++) {
        if (info->dlpi_phdr[i].p_type != PT_DYNAMIC)
            continue;
        ElfW(Dyn) *dyn = (ElfW(Dyn) *)(base + info->dlpi_phdr[i].p_vaddr);
        ElfW(Sym) *symtab = NULL;
        const char *strtab = NULL;
        ElfW(Rela) *rel[2] = {NULL, NULL};
        size_t relsz[2] = {0, 0};
        for (; dyn->d_tag != DT_NULL; dyn++) {
            switch (dyn->d_tag) {
            case DT_SYMTAB: symtab = (ElfW(Sym) *)dyn_ptr(base, dyn->d_un.d_ptr); break;
            case DT_STRTAB: strtab = (const char *)dyn_ptr(base, dyn->d_un.d_ptr); break;
            case DT_JMPREL: rel[0] = (ElfW(Rela) *)dyn_ptr(base, dyn->d_un.d_ptr); break;
            case DT_PLTRELSZ: relsz[0] = dyn->d_un.d_val; break;
            case DT_RELA: rel[1] = (ElfW(Rela) *)dyn_ptr(base, dyn->d_un.d_ptr); break;
            case DT_RELASZ: relsz[1] = dyn->d_un.d_val; break;
            }
        }
        if (!symtab || !strtab)
            return 1;
        for (int t = 0; t < 2; t++) {
            for (size_t k = 0; rel[t] && k < relsz[t] / sizeof(ElfW(Rela)); k++) {
                ElfW(Rela) *r = &rel[t][k];
#if defined(__x86_64__)
                unsigned type = ELF64_R_TYPE(r->r_info);
                if (type != R_X86_64_JUMP_SLOT && type != R_X86_64_GLOB_DAT)
                    continue;
#elif defined(__aarch64__)
                unsigned type = ELF64_R_TYPE(r->r_info);
                if (type != R_AARCH64_JUMP_SLOT && type != R_AARCH64_GLOB_DAT)
                    continue;
#endif
                const char *name = strtab + symtab[ELF64_R_SYM(r->r_info)].st_name;
                if (strcmp(name, "writev") == 0) {
                    f->slot = (void **)(base + r->r_offset);
                    return 1;
                }
            }
        }
    }
    return 1;
}

static int write_slot(void **slot, void *value)
{
    long page = sysconf(_SC_PAGESIZE);
    uintptr_t start = (uintptr_t)slot & ~(uintptr_t)(page - 1);
    size_t span = ((uintptr_t)(slot + 1) - start + page - 1) & ~(uintptr_t)(page - 1);
    /* Full RELRO makes the table read-only after loading: open it for this one store. */
    if (mprotect((void *)start, span, PROT_READ | PROT_WRITE) != 0)
        return -1;
    __atomic_store_n(slot, value, __ATOMIC_SEQ_CST);
    mprotect((void *)start, span, PROT_READ);
    return 0;
}

static void **hooked_slot;

static PyObject *py_hook(PyObject *self, PyObject *args)
{
    int fd;
    unsigned int depth;
    if (!PyArg_ParseTuple(args, "iI", &fd, &depth))
        return NULL;
    if (depth < 1 || depth > 2) {
        PyErr_SetString(PyExc_ValueError, "max_stack_depth must be 1 or 2");
        return NULL;
    }
    if (!hooked_slot) {
        struct found f = {NULL, 0};
        dl_iterate_phdr(find_slot, &f);
        if (!f.slot) {
            PyErr_SetString(PyExc_OSError, f.matched ? "libfuse3 has no writev slot to hook"
                                                     : "libfuse3 is not loaded");
            return NULL;
        }
        real_writev = (writev_fn)*f.slot;
        if (write_slot(f.slot, (void *)reply_writev) != 0)
            return PyErr_SetFromErrno(PyExc_OSError);
        hooked_slot = f.slot;
    }
    fuse_fd = fd;
    stack_depth = depth;
    init_seen = init_offered = 0;
    init_flags = 0;
    init_armed = 1;
    Py_RETURN_NONE;
}

static PyObject *py_unhook(PyObject *self, PyObject *noargs)
{
    if (hooked_slot) {
        if (write_slot(hooked_slot, (void *)real_writev) != 0)
            return PyErr_SetFromErrno(PyExc_OSError);
        hooked_slot = NULL;
    }
    fuse_fd = -1;
    init_armed = armed = 0;
    Py_RETURN_NONE;
}

static PyObject *py_arm(PyObject *self, PyObject *args)
{
    unsigned long long fh;
    int id;
    if (!PyArg_ParseTuple(args, "Ki", &fh, &id))
        return NULL;
    armed_fh = fh;
    armed_id = id;
    armed = 1;
    Py_RETURN_NONE;
}

static PyObject *py_state(PyObject *self, PyObject *noargs)
{
    return Py_BuildValue("{s:O,s:O,s:I,s:K,s:K}", "init_seen", init_seen ? Py_True : Py_False,
                         "init_offered", init_offered ? Py_True : Py_False,
                         "init_flags", init_flags, "opens_patched", opens_patched,
                         "opens_missed", opens_missed);
}

static PyObject *py_fstype(PyObject *self, PyObject *args)
{
    PyObject *path;
    struct statfs st;
    if (!PyArg_ParseTuple(args, "O&", PyUnicode_FSConverter, &path))
        return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = statfs(PyBytes_AS_STRING(path), &st);
    Py_END_ALLOW_THREADS
    Py_DECREF(path);
    if (rc != 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    return PyLong_FromUnsignedLong((unsigned long)st.f_type);
}

static PyMethodDef methods[] = {
    {"hook", py_hook, METH_VARARGS,
     "hook(fuse_fd, max_stack_depth): route libfuse's replies on fuse_fd through kvfs; the "
     "next reply (INIT) offers passthrough"},
    {"unhook", py_unhook, METH_NOARGS, "unhook(): give libfuse its own writev back"},
    {"arm", py_arm, METH_VARARGS,
     "arm(fh, backing_id): this thread's next OPEN/CREATE reply of fh passes through"},
    {"state", py_state, METH_NOARGS, "state(): what the hook has seen and done"},
    {"fstype", py_fstype, METH_VARARGS, "fstype(path): statfs(2)'s f_type"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvfs.daemon._passthrough",
    "The FUSE passthrough fields of the INIT and OPEN/CREATE replies (see the C source).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__passthrough(void)
{
    return PyModule_Create(&module);
}
