/*
 * kvfs.daemon._passthrough: what libfuse 3.14 and pyfuse3 3.5 cannot do for kvfs's mount door.
 *
 * 1. Two replies libfuse cannot write. FUSE passthrough (Linux 6.9 and later) lets the daemon
 *    hand the kernel an open backing file, after which the kernel does that file's reads,
 *    writes and mmap itself: no byte crosses /dev/fuse. It takes
 *      - the INIT reply's FUSE_PASSTHROUGH flag (bit 5 of flags2, which needs FUSE_INIT_EXT)
 *        and max_stack_depth (a u32 at byte 36 of fuse_init_out); and its
 *        FUSE_HANDLE_KILLPRIV_V2 flag, which libfuse 3.14 does not ask for either (without
 *        it the kernel asks GETXATTR security.capability before every write(2));
 *      - an OPEN or CREATE reply's FOPEN_PASSTHROUGH flag and backing id (fuse_open_out's
 *        open_flags and the i32 after them, which libfuse sends as zero padding), and the
 *        FOPEN_NOFLUSH flag (no FLUSH request at each close of a read-only open, which has
 *        nothing to flush; pyfuse3 3.5's FileInfo cannot set it).
 *    libfuse writes every reply with one writev(2) on the session's fd. This module replaces
 *    libfuse's own `writev` (the slot in libfuse3.so's global offset table, so nothing else in
 *    the process is touched) with `reply_writev`, which passes every write through unchanged
 *    except two: the first reply written after `hook` (the INIT reply, which the kernel waits
 *    for before it sends anything else) and the next OPEN/CREATE reply on a thread that called
 *    `arm(fh, backing_id)` just before its handler returned that `fh`. pyfuse3 sends a
 *    handler's reply on the handler's own thread, right after it returns, with no await in
 *    between, so the armed reply is the next one that thread writes; it is patched only if it
 *    is a success of the right size that carries the armed fh, and disarmed either way
 *    (`state` counts the misses). Backing files are registered and released by
 *    kvfs.daemon.passthrough with the FUSE_DEV_IOC_BACKING_OPEN / _CLOSE ioctls.
 *
 * 2. The requests that need no Python (with `hook(..., route=True)`). Once the bytes pass
 *    through, what is left of a file is its namespace requests, each a round trip through
 *    pyfuse3's loop and trio's scheduler. A request thread of this module reads /dev/fuse
 *    itself (the session's fd number now names one end of a SOCK_SEQPACKET pair, the device
 *    moved to another number) and answers in C what the daemon has already decided:
 *      - OPEN (read-only) of an inode the daemon put in the *ready table* (`ready_put`: a
 *        complete hot file it opened for passthrough reading, its backing id and attributes):
 *        a passthrough open with the same backing id, the handle numbered C_FH | inode;
 *      - RELEASE, FLUSH and FSYNC of those handles (nothing to do: the file is read-only to
 *        them and the kernel holds its backing file), and READ (EIO: the kernel asks only to
 *        fill the FUSE inode's own pages ahead, which passthrough reads never use);
 *      - GETATTR of an inode in the ready table (a file, or a directory whose attributes the
 *        daemon put after changing it): the attributes the daemon put, a file's access time
 *        moved to its last open;
 *      - LOOKUP of a delegated file's name in its directory: its entry (the daemon adds the
 *        lookups to its count, `ready_lookups`, before it counts a FORGET);
 *      - GETXATTR of a name outside the `user.` namespace: EOPNOTSUPP, as the daemon answers
 *        (the kernel asks `security.capability` before a file's first write);
 *      - LOOKUP of a name missing from a directory the daemon handed over (`dir_put`: one
 *        whose every indexed name has its backing entry, given as an fd of the backing
 *        directory; where lower tiers may hold blocks, but for names of blocks and fan-out
 *        directories): ENOENT when the backing directory has no entry of that name, counted
 *        as a miss once per name within the daemon's window (`dir_harvest`; `miss_take`
 *        gives back the miss of a name then created). Any name the backing directory has
 *        is the daemon's to answer. The kernel sends no LOOKUP into a directory while it
 *        changes it (it holds the directory's lock), so no create races these answers.
 *    Every other request is sent whole to the socket, where libfuse reads it (`request_read`)
 *    and pyfuse3 serves it as before; replies written on the socket's number go to the
 *    device. The daemon takes an inode out of the table (`ready_drop`) before anything about
 *    it changes; the opens the thread gave out are counted (`ready_outstanding`) until the
 *    kernel releases them, and their number and last time are collected by `ready_harvest`
 *    (hits, bytes and access times, as the daemon counts an open it serves).
 */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <elf.h>
#include <errno.h>
#include <fcntl.h>
#include <link.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <sys/vfs.h>
#include <time.h>
#include <unistd.h>

/* The kernel's protocol (include/uapi/linux/fuse.h). */
#define IN_HEADER 40            /* struct fuse_in_header */
#define OUT_HEADER 16           /* struct fuse_out_header: u32 len, i32 error, u64 unique */
#define INIT_OUT 64             /* struct fuse_init_out as libfuse 3.14 sends it */
#define INIT_FLAGS_OFF 12
#define INIT_FLAGS2_OFF 32
#define INIT_STACK_OFF 36
#define FUSE_WRITEBACK_CACHE (1u << 16)
/* The daemon clears set-user-ID, set-group-ID and security.capability where a write, truncate
 * or chown must (kvfs keeps none on files: kvfs.daemon.tree FILE_SXID, and no xattr outside
 * user.); the kernel then marks the superblock SB_NOSEC and asks GETXATTR security.capability
 * once per inode instead of before every write(2). */
#define FUSE_HANDLE_KILLPRIV_V2 (1u << 28)
#define FUSE_INIT_EXT (1u << 30)
#define FUSE_PASSTHROUGH_HI (1u << 5) /* bit 37 of the 64-bit flags */
#define ENTRY_OUT 128           /* struct fuse_entry_out */
#define OPEN_OUT 16             /* struct fuse_open_out: u64 fh, u32 open_flags, i32 backing_id */
#define ATTR 88                 /* struct fuse_attr */
#define ATTR_OUT (16 + ATTR)    /* struct fuse_attr_out: u64 valid, u32 nsec, u32 dummy, attr */
#define FOPEN_DIRECT_IO (1u << 0)
#define FOPEN_KEEP_CACHE (1u << 1)
#define FOPEN_NOFLUSH (1u << 5)
#define FOPEN_PARALLEL_DIRECT_WRITES (1u << 6)
#define FOPEN_PASSTHROUGH (1u << 7)
/* What may stand beside FOPEN_PASSTHROUGH (the kernel refuses anything else with EINVAL). */
#define PASSTHROUGH_KEEP (FOPEN_PARALLEL_DIRECT_WRITES | FOPEN_NOFLUSH)
enum { OP_LOOKUP = 1, OP_GETATTR = 3, OP_RENAME = 12, OP_OPEN = 14, OP_READ = 15,
       OP_RELEASE = 18, OP_FSYNC = 20, OP_GETXATTR = 22, OP_FLUSH = 25, OP_CREATE = 35,
       OP_RENAME2 = 45, N_OPS = 64 };
/* The daemon's entry and attribute timeout (kvfs.daemon.tree ENTRY_TIMEOUT), in seconds. */
#define TIMEOUT_S 10
#define NAME_MAX_ 255
/* Handles the request thread gives out: this bit and the inode (inodes stay below it). */
#define C_FH (1ull << 63)
/* The largest request the kernel sends (a 1 MiB write and its headers), with room to spare. */
#define REQUEST_BUF ((256 + 4) * 4096)

typedef ssize_t (*writev_fn)(int, const struct iovec *, int);
typedef ssize_t (*read_fn)(int, void *, size_t);

static writev_fn real_writev;   /* libc's, as libfuse had it */
static read_fn real_read;
static int fuse_fd = -1;        /* the fd number libfuse and pyfuse3 use for the session */
static int dev_fd = -1;         /* /dev/fuse itself: fuse_fd, or another number when routed */
static int init_armed;          /* the next reply is the INIT reply: patch it */
static uint32_t stack_depth;    /* max_stack_depth to offer (1 or 2) */

/* Set by reply_writev on the event-loop thread (every FUSE reply of pyfuse3 is written
 * there), read by `state` on the same thread and by the request thread (atomically); the
 * INIT fields once, before any open. */
static int init_seen, init_offered;
static uint32_t init_flags, init_minor;
static unsigned long long opens_patched, opens_missed;

static __thread int armed;
static __thread uint64_t armed_fh;
static __thread int32_t armed_id;
static __thread int armed_noflush;

static uint32_t get32(const unsigned char *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static uint64_t get64(const unsigned char *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static void put32(unsigned char *p, uint32_t v) { memcpy(p, &v, 4); }
static void put64(unsigned char *p, uint64_t v) { memcpy(p, &v, 8); }

/* -- 1. the replies libfuse writes ----------------------------------------------------- */

/* Patch an OPEN (fuse_open_out alone) or CREATE (fuse_entry_out + fuse_open_out) reply in
 * `buf` for the armed fh; 1 if patched. */
static int patch_open(unsigned char *buf, size_t len)
{
    int32_t error;
    memcpy(&error, buf + 4, 4);
    if (error != 0 || (len != OUT_HEADER + OPEN_OUT && len != OUT_HEADER + ENTRY_OUT + OPEN_OUT))
        return 0;
    unsigned char *open_out = buf + len - OPEN_OUT;
    if (get64(open_out) != armed_fh)
        return 0;
    uint32_t flags = get32(open_out + 8);
    if (armed_noflush && init_minor >= 31)  /* FOPEN_NOFLUSH: protocol 7.31 */
        flags |= FOPEN_NOFLUSH;
    if (armed_id > 0) {
        put32(open_out + 8, (flags & PASSTHROUGH_KEEP) | FOPEN_PASSTHROUGH);
        memcpy(open_out + 12, &armed_id, 4);
    } else {
        put32(open_out + 8, flags);
    }
    return 1;
}

/* The INIT reply: take FUSE_HANDLE_KILLPRIV_V2; offer passthrough (hooked with a stack depth
 * of 1 or 2) unless the write-back cache was negotiated (the kernel
 * turns passthrough off then anyway). */
static int patch_init(unsigned char *buf, size_t len)
{
    int patched = 0;
    if (len == OUT_HEADER + INIT_OUT && get32(buf + OUT_HEADER) == 7) {
        unsigned char *out = buf + OUT_HEADER;
        uint32_t flags = get32(out + INIT_FLAGS_OFF);
        init_flags = flags;
        init_minor = get32(out + 4);
        flags |= FUSE_HANDLE_KILLPRIV_V2;
        put32(out + INIT_FLAGS_OFF, flags);
        patched = 1;
        if (stack_depth && !(flags & FUSE_WRITEBACK_CACHE)) {
            put32(out + INIT_FLAGS_OFF, flags | FUSE_INIT_EXT);
            put32(out + INIT_FLAGS2_OFF, get32(out + INIT_FLAGS2_OFF) | FUSE_PASSTHROUGH_HI);
            put32(out + INIT_STACK_OFF, stack_depth);
            init_offered = 1;
        }
    }
    __atomic_store_n(&init_seen, 1, __ATOMIC_RELEASE);
    return patched;
}

static ssize_t reply_writev(int fd, const struct iovec *iov, int count)
{
    if (fd != fuse_fd)
        return real_writev(fd, iov, count);
    fd = dev_fd;  /* routed: the session's number names the socket, replies go to the device */
    if (!(init_armed || armed) || count < 1 || iov[0].iov_len < OUT_HEADER)
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
            patched = patch_init(buf, len);
        } else {
            __atomic_store_n(&init_seen, 1, __ATOMIC_RELEASE);
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

/* -- 2. the ready table ------------------------------------------------------------------ */

/* An inode whose read-only opens the request thread answers (`live`), or that the daemon took
 * out of the table while opens it gave out are still open (`dropped`, until they are
 * released). Open addressing by inode; a slot whose entry went is a tombstone. */
enum { EMPTY = 0, LIVE = 1, DROPPED = 2, TOMB = 3 };

struct entry {
    uint64_t ino;
    uint64_t parent;        /* its directory, where its name is in the names table */
    int64_t last_ns;        /* the last open the thread answered (CLOCK_REALTIME) */
    uint32_t opens;         /* the thread's handles of it the kernel has not released */
    uint32_t new_opens;     /* opens since the last harvest */
    uint32_t lookups;       /* LOOKUPs answered since the daemon last took them */
    int32_t backing_id;     /* 0: attributes only (a directory): no open, no lookup */
    uint8_t state;
    uint8_t name_len;
    char name[NAME_MAX_];
    unsigned char attr[ATTR];
};

/* (directory, name) -> inode of the files whose LOOKUP the thread answers: open addressing
 * by a hash of both; a slot names an inode whose entry holds the name itself. */
struct name_slot { uint64_t ino; uint8_t state; };

static pthread_mutex_t table_lock = PTHREAD_MUTEX_INITIALIZER;
static struct entry *table;     /* guarded by table_lock (like everything in this section) */
static size_t table_slots;      /* a power of two */
static size_t table_used;       /* slots not EMPTY (tombstones count: they lengthen probes) */
static size_t table_live;
static struct name_slot *names; /* table_slots of them */
static size_t names_used;

static uint64_t name_hash(uint64_t parent, const char *name, size_t len)
{
    uint64_t h = parent * 0x9E3779B97F4A7C15ull ^ 0xCBF29CE484222325ull;
    for (size_t i = 0; i < len; i++)
        h = (h ^ (unsigned char)name[i]) * 0x100000001B3ull;
    return h;
}

/* The slot of `ino` (state LIVE or DROPPED), or NULL; `free_slot` gets where it would go. */
static struct entry *find(uint64_t ino, struct entry **free_slot)
{
    if (!table)
        return NULL;
    size_t mask = table_slots - 1, i = (size_t)(ino * 0x9E3779B97F4A7C15ull) & mask;
    struct entry *tomb = NULL;
    for (size_t n = 0; n < table_slots; n++, i = (i + 1) & mask) {
        struct entry *e = &table[i];
        if (e->state == EMPTY) {
            if (free_slot)
                *free_slot = tomb ? tomb : e;
            return NULL;
        }
        if (e->state == TOMB) {
            if (!tomb)
                tomb = e;
        } else if (e->ino == ino) {
            return e;
        }
    }
    if (free_slot)
        *free_slot = tomb;
    return NULL;
}

/* The live entry named `name` in directory `parent`, or NULL. */
static struct entry *find_name(uint64_t parent, const char *name, size_t len)
{
    if (!names || !len || len > NAME_MAX_)
        return NULL;
    size_t mask = table_slots - 1, i = (size_t)name_hash(parent, name, len) & mask;
    for (size_t n = 0; n < table_slots; n++, i = (i + 1) & mask) {
        struct name_slot *ns = &names[i];
        if (ns->state == EMPTY)
            return NULL;
        if (ns->state != LIVE)
            continue;
        struct entry *e = find(ns->ino, NULL);
        if (e && e->state == LIVE && e->parent == parent && e->name_len == len &&
            memcmp(e->name, name, len) == 0)
            return e;
    }
    return NULL;
}

/* Enter entry `e`'s name (it has one), or take it out. */
static void name_set(const struct entry *e, int present)
{
    if (!names || !e->name_len)
        return;
    size_t mask = table_slots - 1, i = (size_t)name_hash(e->parent, e->name, e->name_len) & mask;
    struct name_slot *tomb = NULL;
    for (size_t n = 0; n < table_slots; n++, i = (i + 1) & mask) {
        struct name_slot *ns = &names[i];
        if (ns->state == EMPTY) {
            if (present) {
                if (!tomb) {
                    if (names_used + 1 > table_slots * 3 / 4)
                        return;  /* full of tombstones: the name is simply not answered */
                    names_used++;
                }
                ns = tomb ? tomb : ns;
                ns->ino = e->ino;
                ns->state = LIVE;
            }
            return;
        }
        if (ns->state == TOMB) {
            if (!tomb)
                tomb = ns;
        } else if (ns->ino == e->ino) {
            if (!present)
                ns->state = TOMB;
            return;
        }
    }
}

/* Rebuild the names table without its tombstones. */
static void compact_names(void)
{
    memset(names, 0, table_slots * sizeof(*names));
    names_used = 0;
    for (size_t i = 0; i < table_slots; i++)
        if (table[i].state == LIVE)
            name_set(&table[i], 1);
}

/* Rebuild the table without its tombstones (when they fill it). */
static void compact(void)
{
    struct entry *old = table;
    size_t slots = table_slots;
    table = calloc(slots, sizeof(*table));
    if (!table) {
        table = old;
        return;
    }
    table_used = 0;
    for (size_t i = 0; i < slots; i++) {
        if (old[i].state != LIVE && old[i].state != DROPPED)
            continue;
        struct entry *slot = NULL;
        find(old[i].ino, &slot);
        *slot = old[i];
        table_used++;
    }
    free(old);
}

static void forget_entry(struct entry *e)
{
    if (e->state == LIVE) {
        table_live--;
        name_set(e, 0);
    }
    e->state = TOMB;
}

/* -- 2. the request thread ----------------------------------------------------------------- */

static int thread_fd = -1;      /* the request thread's end of the socket pair */
static pthread_t thread;
static int thread_running, thread_stop;
static int route_signal;        /* interrupts the thread's read of the device at unhook */
static unsigned long long answered[N_OPS], forwarded;  /* guarded by table_lock */

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static int reply(uint64_t unique, int error, const void *body, size_t len)
{
    unsigned char head[OUT_HEADER];
    put32(head, (uint32_t)(OUT_HEADER + len));
    int32_t err = -error;
    memcpy(head + 4, &err, 4);
    put64(head + 8, unique);
    struct iovec iov[2] = {{head, OUT_HEADER}, {(void *)body, len}};
    return real_writev(dev_fd, iov, len ? 2 : 1) < 0 ? -1 : 0;
}

/* The directories whose missing names the thread answers: open addressing by inode with
 * backward-shift deletion (no tombstones), DIR_SLOTS slots, at most half of them used (the
 * daemon takes back the oldest first). Each holds an fd of its backing directory. */
#define DIR_SLOTS 4096
/* Names missed recently: one slot per hash of (directory, name), the newest kept. */
#define RECENT_SLOTS 4096

/* `tenant`: creates in it may be answered here while that tenant's grant is on (section 3);
 * 0: they are the daemon's. */
struct dir { uint64_t ino; int64_t misses; int fd; int used; int below; uint64_t tenant; };
struct recent { uint64_t hash; int64_t first_ns; uint32_t count; };

static struct dir dirs[DIR_SLOTS];  /* guarded by table_lock */
static size_t dirs_used;
static struct recent recent[RECENT_SLOTS];
static int64_t miss_window_ns = 60ll * 1000000000;

static void dirs_reset(void)
{
    for (size_t i = 0; i < DIR_SLOTS; i++)
        if (dirs[i].used)
            close(dirs[i].fd);
    memset(dirs, 0, sizeof(dirs));
    memset(recent, 0, sizeof(recent));
    dirs_used = 0;
}

#define DIR_MASK (DIR_SLOTS - 1)
static size_t dir_home(uint64_t ino) { return (size_t)(ino * 0x9E3779B97F4A7C15ull) & DIR_MASK; }

/* `ino`'s slot, or NULL; `free_slot` gets where it would go. */
static struct dir *dir_find(uint64_t ino, struct dir **free_slot)
{
    for (size_t n = 0, i = dir_home(ino); n < DIR_SLOTS; n++, i = (i + 1) & DIR_MASK) {
        if (!dirs[i].used) {
            if (free_slot)
                *free_slot = &dirs[i];
            return NULL;
        }
        if (dirs[i].ino == ino)
            return &dirs[i];
    }
    return NULL;
}

/* The fd the request thread is looking a name up in, without the lock, and whether the
 * daemon took its directory back meanwhile (then the thread closes it when done). */
static int busy_fd = -1, busy_closed;

static void dir_close(struct dir *d)
{
    if (d->fd == busy_fd)
        busy_closed = 1;
    else
        close(d->fd);
}

/* Take `d` out (its fd closed), moving back each later entry of the run that may fill the
 * gap (one whose home slot is no nearer to it than the gap is). */
static void dir_remove(struct dir *d)
{
    size_t i = (size_t)(d - dirs);
    dir_close(d);
    dirs_used--;
    for (size_t j = (i + 1) & DIR_MASK; dirs[j].used; j = (j + 1) & DIR_MASK) {
        if (((j - dir_home(dirs[j].ino)) & DIR_MASK) >= ((j - i) & DIR_MASK)) {
            dirs[i] = dirs[j];
            i = j;
        }
    }
    memset(&dirs[i], 0, sizeof(dirs[i]));
}

static int lower_hex(const char *p, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (!((p[i] >= '0' && p[i] <= '9') || (p[i] >= 'a' && p[i] <= 'f')))
            return 0;
    return 1;
}

/* Whether a lower tier may hold `name`: a block file's name (32 lowercase hex digits and
 * ".kv", kvfs.format.hashing) or a fan-out directory's (2 of them). */
static int may_be_below(const char *name, size_t len)
{
    return (len == 2 && lower_hex(name, 2)) ||
           (len == 35 && memcmp(name + 32, ".kv", 3) == 0 && lower_hex(name, 32));
}

/* A LOOKUP of `name` in directory `ino` that the ready table cannot answer: ENOENT if `ino` is
 * a handed-over directory whose backing directory has no such entry (1), else the daemon's
 * (0). Called with the lock, which it lets go during the fstatat: a directory block read
 * from the disk must not hold up the daemon's own calls into this module. */
static int lookup_missing(uint64_t unique, uint64_t ino, const char *name, size_t len)
{
    if (!len || len > NAME_MAX_ || (name[0] == '.' && (len == 1 || (len == 2 && name[1] == '.'))))
        return 0;
    struct dir *d = dir_find(ino, NULL);
    if (!d || (d->below && may_be_below(name, len)))
        return 0;
    busy_fd = d->fd;
    busy_closed = 0;
    pthread_mutex_unlock(&table_lock);
    struct stat st;
    int missing = fstatat(busy_fd, name, &st, AT_SYMLINK_NOFOLLOW) != 0 && errno == ENOENT;
    pthread_mutex_lock(&table_lock);
    if (busy_closed)
        close(busy_fd);
    busy_fd = -1;
    if (!missing)
        return 0;
    d = dir_find(ino, NULL);  /* (taken back meanwhile: a miss all the same, not counted) */
    uint64_t h = name_hash(ino, name, len);
    struct recent *r = &recent[h & (RECENT_SLOTS - 1)];
    int64_t t = now_ns();
    if (r->hash == h && r->count && t - r->first_ns <= miss_window_ns) {
        r->count++;
    } else if (d) {
        r->hash = h;
        r->first_ns = t;
        r->count = 1;
        d->misses++;
    }
    reply(unique, ENOENT, NULL, 0);
    return 1;
}

/* -- 3. creates, their flushes, releases and renames ---------------------------------------------------------- */

/* With the bytes passing through, what a new file costs is its CREATE and the FLUSH at its
 * close, each a round trip through pyfuse3's loop. In a directory the daemon handed over
 * with its tenant (`dir_put`) and while that tenant's *grant* is on (`grant_add`), the
 * thread answers both:
 *   - CREATE of a name the backing directory lacks (a writable regular file): the backing
 *     file is made O_EXCL relative to the directory's fd, owned by the caller, registered as
 *     a backing file, and numbered from inodes the daemon leased it from the index's
 *     sequence (`lease`); the handle is C_MADE | a generation | a slot of the `made` table.
 *   - FLUSH of such a handle, while nothing but the thread has settled its file (`solo`):
 *     its growth since it was last settled is taken from the tenant's grant (bytes the daemon
 *     reserved for it against the tenant's quota and the mount's capacity); a growth the
 *     grant cannot cover is the daemon's, which makes room or refuses as before.
 * Before it replies, the thread appends a record of what it did to the *journal* (a file of
 * the daemon's state directory) and queues it for the daemon (`made_harvest`), which indexes
 * the file, registers the handle and counts the growth before it serves any other request,
 * then trims the journal. The daemon starts by replaying what a journal holds beyond its
 * last harvest (kvfs.daemon.made): a daemon killed between the reply and the harvest leaves
 * no file the index does not know. The RELEASE of a handle whose file the thread settled at
 * its last flush, unchanged since, is answered too (the fd goes to the daemon with the
 * record), and so is a RENAME of a regular file to a name its directory lacks
 * (`rename_file`: the engines' temporaries renamed into place); any other RELEASE, FSYNC and
 * everything else about the file stay the daemon's, which drops the handle from the table
 * (`made_drop`) before it closes the fd. */
#define C_MADE (1ull << 62)
#define MADE_SLOTS 4096         /* handles of created files open at once */
#define GRANT_SLOTS 256         /* tenants with a grant */
#define MAX_EVENTS 65536        /* queued for the daemon: beyond, creates are the daemon's */
#define JOURNAL_MAX (64ll << 20)
#define JOURNAL_MAGIC 0x6b76666au  /* "jfvk" */
#define FUSE_DEV_IOC_BACKING_OPEN _IOW(229, 1, struct backing_map)
#define FUSE_DEV_IOC_BACKING_CLOSE _IOW(229, 2, uint32_t)
enum { EV_CREATE = 1, EV_FLUSH = 2, EV_RELEASE = 3, EV_RENAME = 4 };

struct backing_map { int32_t fd; uint32_t flags; uint64_t padding; };

/* One journal record; also what the daemon harvests (kvfs.daemon.made RECORD). */
struct record {
    uint32_t magic, kind;
    uint64_t seq, ino, parent, backing_ino, size;
    int64_t time_ns, growth;
    uint32_t mode, uid, gid, name_len, name2_len, pad;
    char name[NAME_MAX_ + 1], name2[NAME_MAX_ + 1];  /* name2: a rename's new name */
};
_Static_assert(sizeof(struct record) == 600, "kvfs.daemon.made RECORD");

struct event { struct record r; uint64_t fh; int32_t fd, backing_id; uint32_t pid, pad; };

struct made { uint64_t fh, ino, tenant; int64_t settled; int fd; int solo; int used; int flushed; };
struct grant { uint64_t tenant; int64_t left; };

static struct made made[MADE_SLOTS];  /* guarded by table_lock, like all of this section */
static int made_free[MADE_SLOTS], made_free_n;
static struct grant grants[GRANT_SLOTS];
static int64_t cap_left = -1;         /* bytes of the capacity granted; -1: no capacity */
static uint64_t ino_next, ino_end;    /* inode numbers leased */
static struct event *events;
static size_t n_events, events_room;
static int journal_fd = -1;
static int64_t journal_size;
static uint64_t journal_seq;
static int creating;                  /* the thread is between its create and its record */
static unsigned long long made_creates, made_flushes, made_releases, made_renames, made_refused;
static uint64_t made_gen;         /* numbers the handles: a slot's next handle differs */

static void made_reset(void)
{
    for (int i = 0; i < MADE_SLOTS; i++) {
        memset(&made[i], 0, sizeof(made[i]));
        made_free[i] = MADE_SLOTS - 1 - i;
    }
    made_free_n = MADE_SLOTS;
    memset(grants, 0, sizeof(grants));
    cap_left = -1;
    ino_next = ino_end = 0;
    free(events);
    events = NULL;
    n_events = events_room = 0;
    if (journal_fd >= 0)
        close(journal_fd);
    journal_fd = -1;
    journal_size = 0;
    made_creates = made_flushes = made_releases = made_renames = made_refused = 0;
}

static struct grant *grant_find(uint64_t tenant, int add)
{
    struct grant *free_g = NULL;
    for (int i = 0; i < GRANT_SLOTS; i++) {
        if (grants[i].tenant == tenant)
            return &grants[i];
        if (!grants[i].tenant && !free_g)
            free_g = &grants[i];
    }
    if (add && free_g) {
        free_g->tenant = tenant;
        free_g->left = -1;  /* off */
        return free_g;
    }
    return NULL;
}

/* Queue and journal `ev` (its record filled but for magic and seq): 0, or -1 (nothing kept). */
static int record(struct event *ev)
{
    if (n_events == events_room) {
        size_t room = events_room ? events_room * 2 : 256;
        struct event *more = realloc(events, room * sizeof(*events));
        if (!more)
            return -1;
        events = more;
        events_room = room;
    }
    ev->r.magic = JOURNAL_MAGIC;
    ev->r.seq = journal_seq + 1;
    ssize_t n = write(journal_fd, &ev->r, sizeof(ev->r));
    if (n != (ssize_t)sizeof(ev->r)) {
        if (n > 0)  /* a torn record: cut off, so that the journal stays whole records */
            ftruncate(journal_fd, journal_size);
        return -1;
    }
    journal_seq++;
    journal_size += n;
    events[n_events++] = *ev;
    return 0;
}

static int valid_name(const char *name, size_t n)
{
    return n && n <= NAME_MAX_ && !(name[0] == '.' && (n == 1 || (n == 2 && name[1] == '.'))) &&
           !memchr(name, '/', n);
}

/* Directory `dino`'s entries changed at `t`: the mtime and ctime the thread answers for it
 * follow (the daemon's index takes the same time at the harvest). */
static void dir_touched(uint64_t dino, int64_t t)
{
    struct entry *pe = find(dino, NULL);
    if (pe && pe->state == LIVE && !pe->backing_id) {
        for (int i = 1; i < 3; i++) {  /* mtime, ctime */
            put64(pe->attr + 24 + 8 * i, (uint64_t)(t / 1000000000));
            put32(pe->attr + 48 + 4 * i, (uint32_t)(t % 1000000000));
        }
    }
}

/* A CREATE in directory `dino` answered here (1), or left to the daemon (0). Called with the
 * lock, which it lets go during the backing file's creation. */
static int create_file(uint64_t unique, uint64_t dino, const unsigned char *req, size_t len)
{
    const unsigned char *in = req + IN_HEADER;  /* fuse_create_in {flags, mode, umask, open_flags} */
    if (journal_fd < 0 || len < IN_HEADER + 16 + 2 || journal_size >= JOURNAL_MAX)
        return 0;
    uint32_t flags = get32(in), mode = get32(in + 4), umask_ = get32(in + 8);
    const char *name = (const char *)in + 16;
    size_t room = len - IN_HEADER - 16, n = strnlen(name, room);
    if (n == room || !valid_name(name, n) || (flags & O_ACCMODE) == O_RDONLY || !S_ISREG(mode))
        return 0;
    struct dir *d = dir_find(dino, NULL);
    if (!d || !d->tenant || (d->below && may_be_below(name, n)))
        return 0;
    struct grant *g = grant_find(d->tenant, 0);
    if (!g || g->left < 0 || ino_next >= ino_end || n_events >= MAX_EVENTS || !made_free_n)
        return 0;
    uint32_t uid = get32(req + 24), gid = get32(req + 28), pid = get32(req + 32);
    uint32_t perm = mode & 01777 & ~umask_;  /* no set-user/group-ID (kvfs.daemon.tree FILE_SXID) */
    uint64_t ino = ino_next++, tenant = d->tenant;  /* a number lost if this fails: never reused */
    int slot = made_free[--made_free_n];
    /* As the daemon opens a backing file for writing (kvfs.daemon.openfiles backing_flags):
     * read-write, O_DIRECT not passed on. */
    int bflags = (int)(flags & (O_SYNC | O_DSYNC)) | O_RDWR;
    int dfd = busy_fd = d->fd;
    busy_closed = 0;
    creating = 1;
    pthread_mutex_unlock(&table_lock);
    int64_t t = now_ns();
    struct stat st;
    int32_t id = -1;
    int fd = openat(dfd, name, bflags | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK,
                    perm);
    if (fd >= 0) {
        struct backing_map map = {fd, 0, 0};
        if (fcntl(fd, F_SETFL, bflags & ~O_ACCMODE) == 0 && fchown(fd, uid, gid) == 0 &&
            fchmod(fd, perm) == 0 && fstat(fd, &st) == 0)
            id = ioctl(dev_fd, FUSE_DEV_IOC_BACKING_OPEN, &map);
    }
    pthread_mutex_lock(&table_lock);
    struct event ev;
    memset(&ev, 0, sizeof(ev));
    if (id > 0) {
        ev.r.kind = EV_CREATE;
        ev.r.ino = ino;
        ev.r.parent = dino;
        ev.r.backing_ino = st.st_ino;
        ev.r.time_ns = t;
        ev.r.mode = S_IFREG | perm;
        ev.r.uid = uid;
        ev.r.gid = gid;
        ev.r.name_len = (uint32_t)n;
        memcpy(ev.r.name, name, n);
        ev.fh = C_MADE | ((++made_gen & 0xFFFFFFFFFFull) << 12) | (uint64_t)slot;
        ev.fd = fd;
        ev.backing_id = id;
        ev.pid = pid;
        if (record(&ev) != 0) {
            uint32_t bid = (uint32_t)id;
            ioctl(dev_fd, FUSE_DEV_IOC_BACKING_CLOSE, &bid);
            id = -1;
        }
    }
    if (id <= 0 && fd >= 0) {  /* made but not handed out: gone again, the daemon's to try */
        unlinkat(dfd, name, 0);
        close(fd);
    }
    if (busy_closed)
        close(busy_fd);
    busy_fd = -1;
    creating = 0;
    if (id <= 0) {
        made_free[made_free_n++] = slot;
        if (fd >= 0)
            made_refused++;
        return 0;
    }
    made[slot] = (struct made){ev.fh, ino, tenant, 0, fd, 1, 1, 0};
    made_creates++;
    dir_touched(dino, t);
    /* fuse_entry_out (nodeid, generation, entry_valid, attr_valid, their nsec, fuse_attr),
     * then fuse_open_out: as the daemon answers a create (kvfs.daemon.tree attrs). */
    unsigned char out[ENTRY_OUT + OPEN_OUT];
    memset(out, 0, sizeof(out));
    put64(out, ino);
    put64(out + 16, TIMEOUT_S);
    put64(out + 24, TIMEOUT_S);
    unsigned char *a = out + 40;
    put64(a, ino);
    for (int i = 0; i < 3; i++) {  /* atime, mtime, ctime */
        put64(a + 24 + 8 * i, (uint64_t)(t / 1000000000));
        put32(a + 48 + 4 * i, (uint32_t)(t % 1000000000));
    }
    put32(a + 60, S_IFREG | perm);
    put32(a + 64, 1);
    put32(a + 68, uid);
    put32(a + 72, gid);
    put32(a + 80, 128 * 1024);  /* kvfs.daemon.tree BLKSIZE */
    put64(out + ENTRY_OUT, ev.fh);
    put32(out + ENTRY_OUT + 8, FOPEN_PASSTHROUGH);
    memcpy(out + ENTRY_OUT + 12, &id, 4);
    reply(unique, 0, out, sizeof(out));
    return 1;
}

/* The record of a flush or release of handle `m`, its file as `st` says. */
static void file_event(struct event *ev, uint32_t kind, const struct made *m,
                       const struct stat *st)
{
    memset(ev, 0, sizeof(*ev));
    ev->r.kind = kind;
    ev->r.ino = m->ino;
    ev->r.size = (uint64_t)st->st_size;
    ev->r.time_ns = (int64_t)st->st_mtim.tv_sec * 1000000000 + st->st_mtim.tv_nsec;
    ev->fh = m->fh;
    ev->fd = m->fd;
}

/* A FLUSH of a handle the thread created, answered here (1) when its growth fits the
 * tenant's grant (and the capacity's), or left to the daemon (0). */
static int flush_made(uint64_t unique, uint64_t fh)
{
    struct made *m = &made[fh & (MADE_SLOTS - 1)];
    if (!m->used || m->fh != fh || !m->solo)
        return 0;
    if (journal_fd < 0 || n_events >= MAX_EVENTS) {
        m->solo = 0;  /* the daemon settles it, and from now on every flush of it */
        return 0;
    }
    struct grant *g = grant_find(m->tenant, 0);
    struct stat st;
    int64_t growth = 0;
    if (!g || fstat(m->fd, &st) != 0 ||
        ((growth = (int64_t)st.st_size - m->settled) > 0 &&
         (growth > g->left || (cap_left >= 0 && growth > cap_left)))) {
        m->solo = 0;  /* the daemon settles this one: its later flushes are the daemon's too */
        return 0;
    }
    struct event ev;
    file_event(&ev, EV_FLUSH, m, &st);
    ev.r.growth = growth;
    if (record(&ev) != 0) {
        m->solo = 0;
        return 0;
    }
    if (growth > 0) {
        g->left -= growth;
        if (cap_left >= 0)
            cap_left -= growth;
    }
    m->settled = st.st_size;
    m->flushed = 1;
    made_flushes++;
    reply(unique, 0, NULL, 0);
    return 1;
}

/* The RELEASE of a handle the thread created, answered here (1) when the thread settled its
 * file and nothing changed it since its last flush; else the daemon's (0). Its fd goes to
 * the daemon with the record (which closes it), its slot is free again. */
static int release_made(uint64_t unique, uint64_t fh)
{
    int slot = (int)(fh & (MADE_SLOTS - 1));
    struct made *m = &made[slot];
    struct stat st;
    if (!m->used || m->fh != fh || !m->solo || !m->flushed || journal_fd < 0 ||
        n_events >= MAX_EVENTS || fstat(m->fd, &st) != 0 || st.st_size != m->settled)
        return 0;
    struct event ev;
    file_event(&ev, EV_RELEASE, m, &st);
    if (record(&ev) != 0)
        return 0;
    memset(m, 0, sizeof(*m));
    made_free[made_free_n++] = slot;
    made_releases++;
    reply(unique, 0, NULL, 0);
    return 1;
}

/* A RENAME (or RENAME2 with at most RENAME_NOREPLACE) of a regular file to a new name in
 * the same directory, one handed over with a tenant that holds a grant, answered here (1):
 * renameat2(RENAME_NOREPLACE) relative to the directory's fd, so a name the backing
 * directory has (a file to replace, a stray) is the daemon's, as is any other rename (0).
 * Not onto a name the ready table answers LOOKUPs for, nor into or out of the name of a
 * block or a fan-out directory (the daemon checks a block renamed into place before the
 * rename returns); a file the thread opens keeps its entry, under the new name. The engines' temporaries
 * renamed into place (vLLM's file tier, SGLang's HiCacheFile). */
static int rename_file(uint64_t unique, uint64_t dino, uint32_t opcode,
                       const unsigned char *req, size_t len)
{
    const unsigned char *in = req + IN_HEADER;  /* fuse_rename_in {newdir}, fuse_rename2_in
                                                 * {newdir, flags, padding}; then the names */
    size_t head = opcode == OP_RENAME2 ? 16 : 8;
    if (journal_fd < 0 || len < IN_HEADER + head + 4 || n_events >= MAX_EVENTS ||
        journal_size >= JOURNAL_MAX)
        return 0;
    uint32_t flags = opcode == OP_RENAME2 ? get32(in + 8) : 0;
    if (get64(in) != dino || (flags & ~(uint32_t)RENAME_NOREPLACE))
        return 0;
    const char *old = (const char *)in + head;
    size_t room = len - IN_HEADER - head, n1 = strnlen(old, room);
    if (n1 >= room - 1)
        return 0;
    const char *new_ = old + n1 + 1;
    size_t room2 = room - n1 - 1, n2 = strnlen(new_, room2);
    if (n2 == room2 || !valid_name(old, n1) || !valid_name(new_, n2))
        return 0;
    struct dir *d = dir_find(dino, NULL);
    if (!d || !d->tenant || may_be_below(old, n1) || may_be_below(new_, n2))
        return 0;
    struct grant *g = grant_find(d->tenant, 0);
    if (!g || g->left < 0 || find_name(dino, new_, n2))
        return 0;
    int dfd = busy_fd = d->fd;
    busy_closed = 0;
    creating = 1;
    pthread_mutex_unlock(&table_lock);
    struct stat st;
    int done = fstatat(dfd, old, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISREG(st.st_mode) &&
               renameat2(dfd, old, dfd, new_, RENAME_NOREPLACE) == 0;
    int64_t t = now_ns();
    pthread_mutex_lock(&table_lock);
    if (done) {
        struct event ev;
        memset(&ev, 0, sizeof(ev));
        ev.r.kind = EV_RENAME;
        ev.r.parent = dino;
        ev.r.backing_ino = st.st_ino;
        ev.r.time_ns = t;
        ev.r.uid = get32(req + 24);
        ev.r.gid = get32(req + 28);
        ev.r.name_len = (uint32_t)n1;
        memcpy(ev.r.name, old, n1);
        ev.r.name2_len = (uint32_t)n2;
        memcpy(ev.r.name2, new_, n2);
        ev.pid = get32(req + 32);
        if (record(&ev) != 0) {  /* not kept: put back, the daemon's to do */
            renameat2(dfd, new_, dfd, old, RENAME_NOREPLACE);
            done = 0;
        }
    }
    if (busy_closed)
        close(busy_fd);
    busy_fd = -1;
    creating = 0;
    if (!done)
        return 0;
    made_renames++;
    struct entry *e = find_name(dino, old, n1);
    if (e) {  /* a file the thread opens: its LOOKUPs answered under the new name, and its
               * ctime is the rename's */
        name_set(e, 0);
        memcpy(e->name, new_, n2);
        e->name_len = (uint8_t)n2;
        name_set(e, 1);
        put64(e->attr + 40, (uint64_t)(t / 1000000000));
        put32(e->attr + 56, (uint32_t)(t % 1000000000));
    }
    dir_touched(dino, t);
    reply(unique, 0, NULL, 0);
    return 1;
}

/* The request in `req` answered here (1), or left to the daemon (0). Called with the lock. */
static int answer(const unsigned char *req, size_t len)
{
    uint32_t opcode = get32(req + 4);
    uint64_t unique = get64(req + 8), ino = get64(req + 16);
    const unsigned char *in = req + IN_HEADER;
    switch (opcode) {
    case OP_GETXATTR: {  /* fuse_getxattr_in {u32 size, u32 padding}, then the name */
        if (len < IN_HEADER + 8 + 1)
            return 0;
        const char *name = (const char *)in + 8;
        size_t room = len - IN_HEADER - 8;
        if (strnlen(name, room) == room || strncmp(name, "user.", 5) == 0)
            return 0;
        reply(unique, EOPNOTSUPP, NULL, 0);
        return 1;
    }
    case OP_LOOKUP: {  /* the name, NUL-terminated */
        size_t room = len - IN_HEADER, n = strnlen((const char *)in, room);
        if (n == room)
            return 0;
        struct entry *e = find_name(ino, (const char *)in, n);
        if (!e || !e->backing_id)
            return lookup_missing(unique, ino, (const char *)in, n);
        /* fuse_entry_out: nodeid, generation, entry_valid, attr_valid, their nsec, attr */
        unsigned char out[ENTRY_OUT];
        memset(out, 0, 40);
        put64(out, e->ino);
        put64(out + 16, TIMEOUT_S);
        put64(out + 24, TIMEOUT_S);
        memcpy(out + 40, e->attr, ATTR);
        e->lookups++;  /* the kernel holds one more: the daemon adds it to its count */
        reply(unique, 0, out, sizeof(out));
        return 1;
    }
    case OP_GETATTR: {  /* fuse_getattr_in {u32 flags, u32 dummy, u64 fh} */
        struct entry *e = find(ino, NULL);
        if (!e || e->state != LIVE)
            return 0;
        unsigned char out[ATTR_OUT];
        memset(out, 0, 16);
        put64(out, TIMEOUT_S);  /* attr_valid: the daemon's attribute timeout */
        memcpy(out + 16, e->attr, ATTR);
        reply(unique, 0, out, sizeof(out));
        return 1;
    }
    case OP_OPEN: {  /* fuse_open_in {u32 flags, u32 open_flags} */
        if (len < IN_HEADER + 8)
            return 0;
        uint32_t flags = get32(in);
        if ((flags & O_ACCMODE) != O_RDONLY || (flags & O_TRUNC))
            return 0;
        struct entry *e = find(ino, NULL);
        if (!e || e->state != LIVE || !e->backing_id)
            return 0;
        int64_t t = now_ns();
        e->opens++;
        e->new_opens++;
        e->last_ns = t;
        put64(e->attr + 24, (uint64_t)(t / 1000000000));  /* atime: the last open */
        put32(e->attr + 48, (uint32_t)(t % 1000000000));
        unsigned char out[OPEN_OUT];
        put64(out, C_FH | ino);
        put32(out + 8, FOPEN_PASSTHROUGH | FOPEN_NOFLUSH);
        memcpy(out + 12, &e->backing_id, 4);
        reply(unique, 0, out, sizeof(out));
        return 1;
    }
    case OP_CREATE:
        return create_file(unique, ino, req, len);
    case OP_RENAME:
    case OP_RENAME2:
        return rename_file(unique, ino, opcode, req, len);
    case OP_RELEASE:  /* fuse_release_in {u64 fh, ...}; the others: {u64 fh, ...} too */
    case OP_FLUSH:
    case OP_FSYNC:
    case OP_READ: {
        if (len < IN_HEADER + 8)
            return 0;
        uint64_t fh = get64(in);
        if (opcode == OP_FLUSH && (fh & C_MADE) && !(fh & C_FH))
            return flush_made(unique, fh);
        if (opcode == OP_RELEASE && (fh & C_MADE) && !(fh & C_FH))
            return release_made(unique, fh);
        if (!(fh & C_FH))
            return 0;
        if (opcode == OP_READ) {
            /* The kernel reads a passthrough file from its backing file; it sends READ only
             * to fill the FUSE inode's own pages ahead (posix_fadvise WILLNEED,
             * readahead(2)), which no passthrough read uses. Refused: no page is cached. */
            reply(unique, EIO, NULL, 0);
            return 1;
        }
        if (opcode == OP_RELEASE) {
            struct entry *e = find(fh & ~C_FH, NULL);
            if (e && e->opens && --e->opens == 0 && e->state == DROPPED)
                forget_entry(e);
        }
        reply(unique, 0, NULL, 0);
        return 1;
    }
    }
    return 0;
}

static void interrupted(int sig) { (void)sig; }

static void *serve(void *unused)
{
    (void)unused;
    sigset_t one;  /* created with every signal blocked; this one interrupts its read */
    sigemptyset(&one);
    sigaddset(&one, route_signal);
    pthread_sigmask(SIG_UNBLOCK, &one, NULL);
    unsigned char *buf = malloc(REQUEST_BUF);
    while (buf && !__atomic_load_n(&thread_stop, __ATOMIC_ACQUIRE)) {
        ssize_t n = real_read(dev_fd, buf, REQUEST_BUF);
        if (n < 0) {
            if (errno == EINTR || errno == EAGAIN || errno == ENOENT)  /* ENOENT: interrupted */
                continue;
            break;  /* ENODEV: unmounted, or the connection aborted */
        }
        if ((size_t)n < IN_HEADER)
            break;
        /* Until the INIT reply is out, every request is the daemon's. */
        int ready = __atomic_load_n(&init_seen, __ATOMIC_ACQUIRE);
        uint32_t op = get32(buf + 4);
        pthread_mutex_lock(&table_lock);
        int done = ready && answer(buf, (size_t)n);
        if (done && op < N_OPS)
            answered[op]++;
        else if (!done)
            forwarded++;
        pthread_mutex_unlock(&table_lock);
        if (done)
            continue;
        ssize_t sent;
        do
            sent = send(thread_fd, buf, (size_t)n, MSG_NOSIGNAL);
        while (sent < 0 && errno == EINTR && !__atomic_load_n(&thread_stop, __ATOMIC_ACQUIRE));
        if (sent < 0)
            break;  /* the daemon closed its end: the session is over */
    }
    free(buf);
    /* libfuse reads the end of the socket as an unmounted device (`request_read`) and ends
     * the session; the device fd is closed by `unhook` (libfuse may still write replies to
     * its number until then), which ends the connection as closing libfuse's fd would. */
    shutdown(thread_fd, SHUT_RDWR);
    return NULL;
}

/* libfuse's read of the session's fd: routed, that is the socket; its end (the request
 * thread is gone) reads as the device's ENODEV, after which libfuse ends the session. */
static ssize_t request_read(int fd, void *buf, size_t size)
{
    ssize_t n = real_read(fd, buf, size);
    if (n == 0 && fd == fuse_fd && dev_fd != fuse_fd) {
        errno = ENODEV;
        return -1;
    }
    return n;
}

/* Move the device to another fd number, put one end of a socket pair at the session's number
 * and start the thread that reads the device. 0, or -1 with errno (nothing changed). */
static int start_routing(int fd)
{
    int sv[2];
    int moved = fcntl(fd, F_DUPFD_CLOEXEC, 3);
    if (moved < 0)
        return -1;
    if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) != 0)
        goto fail_moved;
    /* One message is one request, up to REQUEST_BUF: the socket must take it whole. Only a
     * privileged daemon may raise the limit past net.core.wmem_max (as it may register
     * backing files: the same daemon). */
    int size = 4 * REQUEST_BUF, got = 0;
    socklen_t sl = sizeof(got);
    if (setsockopt(sv[1], SOL_SOCKET, SO_SNDBUFFORCE, &size, sizeof(size)) != 0 ||
        setsockopt(sv[0], SOL_SOCKET, SO_RCVBUFFORCE, &size, sizeof(size)) != 0 ||
        getsockopt(sv[1], SOL_SOCKET, SO_SNDBUF, &got, &sl) != 0 || got < 2 * REQUEST_BUF)
        goto fail_pair;
    if (dup3(sv[0], fd, O_CLOEXEC) < 0)
        goto fail_pair;
    close(sv[0]);
    dev_fd = moved;
    thread_fd = sv[1];
    thread_stop = 0;
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = interrupted;  /* no SA_RESTART: the thread's read returns EINTR */
    route_signal = SIGRTMIN + 7;
    sigaction(route_signal, &sa, NULL);
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);  /* the thread takes no process signal */
    int rc = pthread_create(&thread, NULL, serve, NULL);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc != 0) {  /* the socket stands at fd now: put the device back there */
        dup3(moved, fd, O_CLOEXEC);
        close(moved);
        close(sv[1]);
        dev_fd = fd;
        thread_fd = -1;
        errno = rc;
        return -1;
    }
    thread_running = 1;
    return 0;
fail_pair:
    close(sv[0]);
    close(sv[1]);
fail_moved:
    close(moved);
    return -1;
}

/* -- the slots in libfuse3.so's global offset table ---------------------------------------- */

struct found { const char *name; void **slot; int matched; };

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
                if (strcmp(name, f->name) == 0) {
                    f->slot = (void **)(base + r->r_offset);
                    return 1;
                }
            }
        }
    }
    return 1;
}

static void **slot_of(const char *name, int *matched)
{
    struct found f = {name, NULL, 0};
    dl_iterate_phdr(find_slot, &f);
    *matched = f.matched;
    return f.slot;
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

static void **writev_slot, **read_slot;

/* -- the module's functions -------------------------------------------------------------- */

static PyObject *py_hook(PyObject *self, PyObject *args)
{
    int fd, route = 0;
    unsigned int depth;
    Py_ssize_t slots = 1 << 15;
    double window = 60.0;
    if (!PyArg_ParseTuple(args, "iI|pnd", &fd, &depth, &route, &slots, &window))
        return NULL;
    if (depth > 2 || (depth == 0 && route)) {
        PyErr_SetString(PyExc_ValueError, "max_stack_depth must be 1 or 2 (0: no passthrough "
                        "offered, the INIT reply's FUSE_HANDLE_KILLPRIV_V2 alone, no route)");
        return NULL;
    }
    if (slots < 64 || (slots & (slots - 1))) {
        PyErr_SetString(PyExc_ValueError, "ready table slots: a power of two >= 64");
        return NULL;
    }
    if (thread_running) {
        PyErr_SetString(PyExc_RuntimeError, "already hooked with a request thread");
        return NULL;
    }
    int matched;
    if (!writev_slot) {
        void **slot = slot_of("writev", &matched);
        if (!slot) {
            PyErr_SetString(PyExc_OSError, matched ? "libfuse3 has no writev slot to hook"
                                                   : "libfuse3 is not loaded");
            return NULL;
        }
        real_writev = (writev_fn)*slot;
        if (write_slot(slot, (void *)reply_writev) != 0)
            return PyErr_SetFromErrno(PyExc_OSError);
        writev_slot = slot;
    }
    fuse_fd = dev_fd = fd;
    stack_depth = depth;
    init_seen = init_offered = 0;
    init_flags = init_minor = 0;
    init_armed = 1;
    if (!route)
        return PyLong_FromLong(dev_fd);
    if (!read_slot) {
        void **slot = slot_of("read", &matched);
        if (!slot) {
            PyErr_SetString(PyExc_OSError, "libfuse3 has no read slot to hook");
            return NULL;
        }
        real_read = (read_fn)*slot;
        if (write_slot(slot, (void *)request_read) != 0)
            return PyErr_SetFromErrno(PyExc_OSError);
        read_slot = slot;
    }
    pthread_mutex_lock(&table_lock);
    free(table);
    free(names);
    table = calloc((size_t)slots, sizeof(*table));
    names = calloc((size_t)slots, sizeof(*names));
    if (!table || !names) {
        free(table);
        free(names);
        table = NULL;
        names = NULL;
    }
    table_slots = table ? (size_t)slots : 0;
    table_used = table_live = names_used = 0;
    memset(answered, 0, sizeof(answered));
    forwarded = 0;
    dirs_reset();
    made_reset();
    miss_window_ns = (int64_t)(window * 1e9);
    pthread_mutex_unlock(&table_lock);
    if (!table)
        return PyErr_NoMemory();
    if (start_routing(fd) != 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    return PyLong_FromLong(dev_fd);
}

static PyObject *py_unhook(PyObject *self, PyObject *noargs)
{
    if (thread_running) {
        __atomic_store_n(&thread_stop, 1, __ATOMIC_RELEASE);
        pthread_kill(thread, route_signal);
        Py_BEGIN_ALLOW_THREADS
        pthread_join(thread, NULL);
        Py_END_ALLOW_THREADS
        thread_running = 0;
        close(thread_fd);
        thread_fd = -1;
        if (dev_fd >= 0 && dev_fd != fuse_fd)
            close(dev_fd);  /* the connection ends with it (the session's fd is closed) */
    }
    if (writev_slot) {
        if (write_slot(writev_slot, (void *)real_writev) != 0)
            return PyErr_SetFromErrno(PyExc_OSError);
        writev_slot = NULL;
    }
    if (read_slot) {
        if (write_slot(read_slot, (void *)real_read) != 0)
            return PyErr_SetFromErrno(PyExc_OSError);
        read_slot = NULL;
    }
    pthread_mutex_lock(&table_lock);
    free(table);
    free(names);
    table = NULL;
    names = NULL;
    table_slots = table_used = table_live = names_used = 0;
    dirs_reset();
    made_reset();
    pthread_mutex_unlock(&table_lock);
    fuse_fd = dev_fd = -1;
    init_armed = armed = 0;
    Py_RETURN_NONE;
}

static PyObject *py_arm(PyObject *self, PyObject *args)
{
    unsigned long long fh;
    int id, noflush = 0;
    if (!PyArg_ParseTuple(args, "Ki|p", &fh, &id, &noflush))
        return NULL;
    armed_fh = fh;
    armed_id = id;
    armed_noflush = noflush;
    armed = 1;
    Py_RETURN_NONE;
}

static PyObject *py_ready_put(PyObject *self, PyObject *args)
{
    unsigned long long ino, parent = 0;
    int backing_id;
    Py_buffer attr, name = {0};
    if (!PyArg_ParseTuple(args, "Kiy*|Ky*", &ino, &backing_id, &attr, &parent, &name))
        return NULL;
    if (attr.len != ATTR || ino & C_FH || backing_id < 0 || name.len > NAME_MAX_ ||
        (name.len && (!backing_id || memchr(name.buf, 0, (size_t)name.len)))) {
        PyBuffer_Release(&attr);
        if (name.obj)
            PyBuffer_Release(&name);
        PyErr_SetString(PyExc_ValueError, "ready_put(inode, backing_id >= 0, 88-byte fuse_attr"
                        "[, parent, name]): a name only with a backing id");
        return NULL;
    }
    int put = 0;
    pthread_mutex_lock(&table_lock);
    struct entry *slot = NULL, *e = find(ino, &slot);
    if (e && e->state == LIVE) {
        /* One backing file per inode, as the kernel wants; its name as it was put. */
        put = e->backing_id == backing_id && e->parent == parent &&
              e->name_len == name.len && memcmp(e->name, name.buf, (size_t)name.len) == 0;
        if (put)
            memcpy(e->attr, attr.buf, ATTR);
    } else if (!e && slot && table_live < table_slots / 2) {
        if (table_used + 1 > table_slots * 3 / 4) {
            compact();
            slot = NULL;
            find(ino, &slot);
        }
        if (slot) {
            if (slot->state == EMPTY)
                table_used++;
            memset(slot, 0, sizeof(*slot));
            slot->ino = ino;
            slot->backing_id = backing_id;
            slot->state = LIVE;
            slot->parent = parent;
            slot->name_len = (uint8_t)name.len;
            memcpy(slot->name, name.buf, (size_t)name.len);
            memcpy(slot->attr, attr.buf, ATTR);
            table_live++;
            if (names_used + 1 > table_slots * 3 / 4)
                compact_names();
            name_set(slot, 1);
            put = 1;
        }
    }
    pthread_mutex_unlock(&table_lock);
    PyBuffer_Release(&attr);
    if (name.obj)
        PyBuffer_Release(&name);
    return PyBool_FromLong(put);
}

static PyObject *py_ready_drop(PyObject *self, PyObject *args)
{
    /* (opens the thread gave out still open, LOOKUPs it answered, opens it answered and
     * the last one's time, since the last harvest), or None */
    unsigned long long ino;
    if (!PyArg_ParseTuple(args, "K", &ino))
        return NULL;
    long opens = -1, lookups = 0, new_opens = 0;
    long long last_ns = 0;
    pthread_mutex_lock(&table_lock);
    struct entry *e = find(ino, NULL);
    if (e && e->state == LIVE) {
        opens = e->opens;
        lookups = e->lookups;
        new_opens = e->new_opens;
        last_ns = e->last_ns;
        e->lookups = e->new_opens = 0;
        name_set(e, 0);
        table_live--;
        e->state = e->opens ? DROPPED : TOMB;
    }
    pthread_mutex_unlock(&table_lock);
    if (opens < 0)
        Py_RETURN_NONE;
    return Py_BuildValue("(lllL)", opens, lookups, new_opens, last_ns);
}

static PyObject *py_ready_lookups(PyObject *self, PyObject *args)
{
    unsigned long long ino;
    if (!PyArg_ParseTuple(args, "K", &ino))
        return NULL;
    pthread_mutex_lock(&table_lock);
    struct entry *e = find(ino, NULL);
    long n = 0;
    if (e) {
        n = e->lookups;
        e->lookups = 0;
    }
    pthread_mutex_unlock(&table_lock);
    return PyLong_FromLong(n);
}

static PyObject *py_ready_outstanding(PyObject *self, PyObject *args)
{
    unsigned long long ino;
    if (!PyArg_ParseTuple(args, "K", &ino))
        return NULL;
    pthread_mutex_lock(&table_lock);
    struct entry *e = find(ino, NULL);
    long opens = e ? (long)e->opens : 0;
    pthread_mutex_unlock(&table_lock);
    return PyLong_FromLong(opens);
}

static PyObject *py_ready_harvest(PyObject *self, PyObject *noargs)
{
    /* [(inode, opens since the last harvest, last open ns, LOOKUPs answered)] of every entry
     * with new opens or lookups */
    PyObject *out = PyList_New(0);
    if (!out)
        return NULL;
    pthread_mutex_lock(&table_lock);
    size_t n = 0;
    for (size_t i = 0; i < table_slots; i++)
        n += (table[i].state == LIVE || table[i].state == DROPPED) &&
             (table[i].new_opens || table[i].lookups);
    unsigned long long (*got)[4] = n ? malloc(n * sizeof(*got)) : NULL;
    size_t k = 0;
    for (size_t i = 0; got && i < table_slots; i++) {
        struct entry *e = &table[i];
        if ((e->state == LIVE || e->state == DROPPED) && (e->new_opens || e->lookups)) {
            got[k][0] = e->ino;
            got[k][1] = e->new_opens;
            got[k][2] = (unsigned long long)e->last_ns;
            got[k][3] = e->lookups;
            e->new_opens = e->lookups = 0;
            k++;
        }
    }
    pthread_mutex_unlock(&table_lock);
    if (n && !got) {
        Py_DECREF(out);
        return PyErr_NoMemory();
    }
    for (size_t i = 0; i < k; i++) {
        PyObject *t = Py_BuildValue("(KKLK)", got[i][0], got[i][1], (long long)got[i][2],
                                    got[i][3]);
        if (!t || PyList_Append(out, t) != 0) {
            Py_XDECREF(t);
            Py_DECREF(out);
            free(got);
            return NULL;
        }
        Py_DECREF(t);
    }
    free(got);
    return out;
}

static PyObject *py_dir_put(PyObject *self, PyObject *args)
{
    /* True: the thread answers missing names of directory `ino` from now on and owns `fd` */
    unsigned long long ino, tenant = 0;
    int fd, below = 0;
    if (!PyArg_ParseTuple(args, "Ki|pK", &ino, &fd, &below, &tenant))
        return NULL;
    int put = 0;
    pthread_mutex_lock(&table_lock);
    struct dir *slot = NULL;
    if (thread_running && fd >= 0 && !dir_find(ino, &slot) && slot &&
        dirs_used < DIR_SLOTS / 2) {
        slot->ino = ino;
        slot->fd = fd;
        slot->misses = 0;
        slot->used = 1;
        slot->below = below;
        slot->tenant = tenant;
        dirs_used++;
        put = 1;
    }
    pthread_mutex_unlock(&table_lock);
    return PyBool_FromLong(put);
}

static PyObject *py_dir_drop(PyObject *self, PyObject *args)
{
    /* the misses counted in `ino` since the last harvest (its fd closed), or None */
    unsigned long long ino;
    if (!PyArg_ParseTuple(args, "K", &ino))
        return NULL;
    long long misses = -1;
    pthread_mutex_lock(&table_lock);
    struct dir *d = dir_find(ino, NULL);
    if (d) {
        misses = d->misses;
        dir_remove(d);
    }
    pthread_mutex_unlock(&table_lock);
    if (misses < 0)
        Py_RETURN_NONE;
    return PyLong_FromLongLong(misses);
}

static PyObject *py_dir_harvest(PyObject *self, PyObject *noargs)
{
    /* [(directory inode, misses counted since the last harvest)] */
    unsigned long long got[DIR_SLOTS / 2][2];
    size_t k = 0;
    pthread_mutex_lock(&table_lock);
    for (size_t i = 0; i < DIR_SLOTS && k < DIR_SLOTS / 2; i++) {
        if (dirs[i].used && dirs[i].misses) {
            got[k][0] = dirs[i].ino;
            got[k][1] = (unsigned long long)dirs[i].misses;
            dirs[i].misses = 0;
            k++;
        }
    }
    pthread_mutex_unlock(&table_lock);
    PyObject *out = PyList_New((Py_ssize_t)k);
    for (size_t i = 0; out && i < k; i++) {
        PyObject *t = Py_BuildValue("(KL)", got[i][0], (long long)got[i][1]);
        if (!t) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, (Py_ssize_t)i, t);
    }
    return out;
}

static PyObject *py_miss_take(PyObject *self, PyObject *args)
{
    /* (seconds since the first, LOOKUPs) of the thread's recent misses of `name` in `parent`,
     * forgotten; or None */
    unsigned long long parent;
    Py_buffer name;
    if (!PyArg_ParseTuple(args, "Ky*", &parent, &name))
        return NULL;
    uint64_t h = name_hash(parent, name.buf, (size_t)name.len);
    double age = -1;
    unsigned long count = 0;
    pthread_mutex_lock(&table_lock);
    struct recent *r = &recent[h & (RECENT_SLOTS - 1)];
    if (r->count && r->hash == h) {
        age = (double)(now_ns() - r->first_ns) / 1e9;
        count = r->count;
        memset(r, 0, sizeof(*r));
    }
    pthread_mutex_unlock(&table_lock);
    PyBuffer_Release(&name);
    if (age < 0)
        Py_RETURN_NONE;
    return Py_BuildValue("(dk)", age, count);
}

static PyObject *py_miss_put(PyObject *self, PyObject *args)
{
    /* The daemon's recent misses of `name` in `parent` (seconds since the first, LOOKUPs),
     * counted by it already: the thread goes on from there. */
    unsigned long long parent;
    Py_buffer name;
    double age;
    unsigned long count;
    if (!PyArg_ParseTuple(args, "Ky*dk", &parent, &name, &age, &count))
        return NULL;
    uint64_t h = name_hash(parent, name.buf, (size_t)name.len);
    pthread_mutex_lock(&table_lock);
    struct recent *r = &recent[h & (RECENT_SLOTS - 1)];
    r->hash = h;
    r->first_ns = now_ns() - (int64_t)(age * 1e9);
    r->count = (uint32_t)(count ? count : 1);
    pthread_mutex_unlock(&table_lock);
    PyBuffer_Release(&name);
    Py_RETURN_NONE;
}

static PyObject *py_made_start(PyObject *self, PyObject *args)
{
    /* made_start(journal_fd, seq): the thread may answer creates, journaling them on
     * journal_fd (the module's from now on), their records numbered after seq */
    int fd;
    unsigned long long seq;
    if (!PyArg_ParseTuple(args, "iK", &fd, &seq))
        return NULL;
    struct stat st;
    if (fstat(fd, &st) != 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    pthread_mutex_lock(&table_lock);
    if (journal_fd >= 0)
        close(journal_fd);
    journal_fd = fd;
    journal_size = st.st_size;
    journal_seq = seq;
    pthread_mutex_unlock(&table_lock);
    Py_RETURN_NONE;
}

static PyObject *py_lease(PyObject *self, PyObject *args)
{
    /* lease(first, end): inode numbers [first, end) are the thread's to give new files */
    unsigned long long first, end;
    if (!PyArg_ParseTuple(args, "KK", &first, &end))
        return NULL;
    pthread_mutex_lock(&table_lock);
    ino_next = first;
    ino_end = end;
    pthread_mutex_unlock(&table_lock);
    Py_RETURN_NONE;
}

/* Add `delta` to a grant (`*left`, -1: off, turned on at 0 first); what was added (less than a
 * negative delta where less was left). */
static long long add_to(int64_t *left, long long delta)
{
    if (*left < 0)
        *left = 0;
    if (delta < -*left)
        delta = -*left;
    *left += delta;
    return delta;
}

static PyObject *py_grant_add(PyObject *self, PyObject *args)
{
    /* grant_add(tenant, delta) -> added: creates of tenant may be answered (turned on), and
     * its flushes grow files by up to the grant's bytes; a negative delta takes back */
    unsigned long long tenant;
    long long delta, added = 0;
    if (!PyArg_ParseTuple(args, "KL", &tenant, &delta))
        return NULL;
    pthread_mutex_lock(&table_lock);
    struct grant *g = tenant ? grant_find(tenant, 1) : NULL;
    if (g)
        added = add_to(&g->left, delta);
    pthread_mutex_unlock(&table_lock);
    if (!g)
        return PyErr_Format(PyExc_ValueError, "no grant slot for tenant %llu", tenant);
    return PyLong_FromLongLong(added);
}

static PyObject *py_grant_off(PyObject *self, PyObject *args)
{
    /* grant_off(tenant) -> bytes taken back: no more creates or flushes of tenant here */
    unsigned long long tenant;
    if (!PyArg_ParseTuple(args, "K", &tenant))
        return NULL;
    long long left = 0;
    pthread_mutex_lock(&table_lock);
    struct grant *g = grant_find(tenant, 0);
    if (g) {
        left = g->left > 0 ? g->left : 0;
        g->left = -1;
    }
    pthread_mutex_unlock(&table_lock);
    return PyLong_FromLongLong(left);
}

static PyObject *py_cap_add(PyObject *self, PyObject *args)
{
    /* cap_add(delta) -> added: the mount has a capacity, of which flushes here may take the
     * grant's bytes (without a call, they are not limited by one) */
    long long delta, added;
    if (!PyArg_ParseTuple(args, "L", &delta))
        return NULL;
    pthread_mutex_lock(&table_lock);
    added = add_to(&cap_left, delta);
    pthread_mutex_unlock(&table_lock);
    return PyLong_FromLongLong(added);
}

static PyObject *py_made_harvest(PyObject *self, PyObject *noargs)
{
    /* ([(kind, seq, fh, inode, parent, name, mode, uid, gid, pid, fd, backing_id, backing
     * inode, size, time_ns, growth, new name)], last seq, inodes left in the lease) */
    pthread_mutex_lock(&table_lock);
    struct event *got = events;
    size_t n = n_events;
    unsigned long long seq = journal_seq, left = ino_end - ino_next;
    events = NULL;
    n_events = events_room = 0;
    pthread_mutex_unlock(&table_lock);
    PyObject *out = PyList_New((Py_ssize_t)n);
    for (size_t i = 0; out && i < n; i++) {
        struct record *r = &got[i].r;
        PyObject *t = Py_BuildValue("(IKKKKy#IIIIiiKKLLy#)", r->kind, r->seq, got[i].fh,
                                    r->ino, r->parent, r->name, (Py_ssize_t)r->name_len,
                                    r->mode, r->uid, r->gid, got[i].pid, got[i].fd,
                                    got[i].backing_id, r->backing_ino, r->size,
                                    (long long)r->time_ns, (long long)r->growth, r->name2,
                                    (Py_ssize_t)r->name2_len);
        if (!t)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, (Py_ssize_t)i, t);
    }
    free(got);
    if (!out)
        return NULL;
    return Py_BuildValue("(NKK)", out, seq, left);
}

static PyObject *py_made_trim(PyObject *self, PyObject *args)
{
    /* made_trim(seq) -> bool: the journal emptied, if nothing was recorded after seq */
    unsigned long long seq;
    if (!PyArg_ParseTuple(args, "K", &seq))
        return NULL;
    int trimmed = 0;
    pthread_mutex_lock(&table_lock);
    if (journal_fd >= 0 && !creating && !n_events && journal_seq == seq && journal_size &&
        ftruncate(journal_fd, 0) == 0) {
        journal_size = 0;
        trimmed = 1;
    }
    pthread_mutex_unlock(&table_lock);
    return PyBool_FromLong(trimmed);
}

static PyObject *py_made_drop(PyObject *self, PyObject *args)
{
    /* made_drop(fh, unsolo_only=False) -> bool: the daemon settles fh's flushes from now on
     * (unsolo_only), or fh is released (its slot free; the daemon closes the fd after) */
    unsigned long long fh;
    int only = 0;
    if (!PyArg_ParseTuple(args, "K|p", &fh, &only))
        return NULL;
    int found = 0;
    pthread_mutex_lock(&table_lock);
    struct made *m = &made[fh & (MADE_SLOTS - 1)];
    if ((fh & C_MADE) && m->used && m->fh == fh) {
        found = 1;
        m->solo = 0;
        if (!only) {
            memset(m, 0, sizeof(*m));
            made_free[made_free_n++] = (int)(fh & (MADE_SLOTS - 1));
        }
    }
    pthread_mutex_unlock(&table_lock);
    return PyBool_FromLong(found);
}

static PyObject *py_state(PyObject *self, PyObject *noargs)
{
    PyObject *ops = PyDict_New();
    if (!ops)
        return NULL;
    static const struct { int op; const char *name; } names[] = {
        {OP_GETATTR, "getattr"}, {OP_OPEN, "open"}, {OP_RELEASE, "release"},
        {OP_FSYNC, "fsync"}, {OP_GETXATTR, "getxattr"}, {OP_FLUSH, "flush"},
        {OP_READ, "read"}, {OP_LOOKUP, "lookup"}, {OP_CREATE, "create"},
        {OP_RENAME, "rename"}, {OP_RENAME2, "rename2"}};
    enum { N = sizeof(names) / sizeof(names[0]) };
    pthread_mutex_lock(&table_lock);
    unsigned long long counts[N], fwd = forwarded;
    size_t live = table_live;
    unsigned long long creates = made_creates, flushes = made_flushes, refused = made_refused;
    unsigned long long releases = made_releases, renames = made_renames;
    unsigned long long leased = ino_end - ino_next;
    for (int i = 0; i < N; i++)
        counts[i] = answered[names[i].op];
    pthread_mutex_unlock(&table_lock);
    for (int i = 0; i < N; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(counts[i]);
        if (!v || PyDict_SetItemString(ops, names[i].name, v) != 0) {
            Py_XDECREF(v);
            Py_DECREF(ops);
            return NULL;
        }
        Py_DECREF(v);
    }
    return Py_BuildValue("{s:O,s:O,s:I,s:I,s:K,s:K,s:O,s:N,s:K,s:n,s:K,s:K,s:K,s:K,s:K,s:K}",
                         "init_seen", init_seen ? Py_True : Py_False,
                         "init_offered", init_offered ? Py_True : Py_False,
                         "init_flags", init_flags, "init_minor", init_minor,
                         "opens_patched", opens_patched, "opens_missed", opens_missed,
                         "routed", thread_running ? Py_True : Py_False,
                         "answered", ops, "forwarded", fwd, "ready", (Py_ssize_t)live,
                         "made_creates", creates, "made_flushes", flushes,
                         "made_refused", refused, "leased", leased,
                         "made_releases", releases, "made_renames", renames);
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
     "hook(fuse_fd, max_stack_depth, route=False, slots=32768, miss_window=60.0) -> device "
     "fd: route libfuse's "
     "replies on fuse_fd through kvfs (the next reply, INIT, offers passthrough, or with a "
     "max_stack_depth of 0 only takes FUSE_HANDLE_KILLPRIV_V2); with route, "
     "a request thread reads the device and answers what it can (see the C source)"},
    {"unhook", py_unhook, METH_NOARGS,
     "unhook(): stop the request thread, give libfuse its own writev and read back"},
    {"arm", py_arm, METH_VARARGS,
     "arm(fh, backing_id, noflush=False): this thread's next OPEN/CREATE reply of fh passes "
     "through (backing_id > 0), and with noflush its close sends no FLUSH"},
    {"ready_put", py_ready_put, METH_VARARGS,
     "ready_put(inode, backing_id, attr, parent=0, name=b'') -> bool: the request thread may "
     "answer GETATTR of inode with attr (88 bytes of fuse_attr); with a backing id, its "
     "read-only opens; with a name, its LOOKUP in parent"},
    {"ready_drop", py_ready_drop, METH_VARARGS,
     "ready_drop(inode) -> (opens still open, lookups answered, opens answered, last open "
     "ns) or None: no more"},
    {"ready_lookups", py_ready_lookups, METH_VARARGS,
     "ready_lookups(inode) -> int: the LOOKUPs of inode the thread answered since last asked"},
    {"ready_outstanding", py_ready_outstanding, METH_VARARGS,
     "ready_outstanding(inode) -> int: the thread's opens of inode the kernel holds"},
    {"ready_harvest", py_ready_harvest, METH_NOARGS,
     "ready_harvest() -> [(inode, opens, last_ns, lookups)]: the thread's answers since the "
     "last call"},
    {"dir_put", py_dir_put, METH_VARARGS,
     "dir_put(inode, fd, below=False, tenant=0) -> bool: (with tenant: its creates may be "
     "answered too, section 3) the thread answers LOOKUPs of names missing "
     "from directory inode (fd: its backing directory, the module's to close from then on); "
     "with below, not of names a lower tier may hold (blocks', fan-out directories')"},
    {"dir_drop", py_dir_drop, METH_VARARGS,
     "dir_drop(inode) -> misses not harvested, or None: no more (its fd closed)"},
    {"dir_harvest", py_dir_harvest, METH_NOARGS,
     "dir_harvest() -> [(inode, misses)]: the misses counted in each directory since the last "
     "call (one per name within the miss window)"},
    {"miss_take", py_miss_take, METH_VARARGS,
     "miss_take(parent, name) -> (seconds since its first miss, LOOKUPs) or None: the "
     "thread's recent misses of name, forgotten"},
    {"miss_put", py_miss_put, METH_VARARGS,
     "miss_put(parent, name, seconds, lookups): the daemon's recent misses of name, counted "
     "by it: the thread's count goes on from them"},
    {"made_start", py_made_start, METH_VARARGS,
     "made_start(journal_fd, seq): the thread may answer creates (see section 3 of the C "
     "source), journaled on journal_fd (the module's from then on) after record seq"},
    {"lease", py_lease, METH_VARARGS, "lease(first, end): inode numbers for new files"},
    {"grant_add", py_grant_add, METH_VARARGS,
     "grant_add(tenant, delta) -> bytes added: the tenant's creates may be answered, and "
     "its flushes grow files by what the grant has left"},
    {"grant_off", py_grant_off, METH_VARARGS,
     "grant_off(tenant) -> bytes taken back: none of the tenant's creates or flushes here"},
    {"cap_add", py_cap_add, METH_VARARGS,
     "cap_add(delta) -> bytes added: flushes here take their growth from this grant too"},
    {"made_harvest", py_made_harvest, METH_NOARGS,
     "made_harvest() -> (records, last seq, inodes left in the lease): the creates and "
     "flushes answered since the last call"},
    {"made_trim", py_made_trim, METH_VARARGS,
     "made_trim(seq) -> bool: empty the journal if nothing was recorded after seq"},
    {"made_drop", py_made_drop, METH_VARARGS,
     "made_drop(fh, unsolo_only=False) -> bool: fh's flushes are the daemon's from now on; "
     "without unsolo_only, fh is released"},
    {"state", py_state, METH_NOARGS, "state(): what the hooks and the thread have seen and done"},
    {"fstype", py_fstype, METH_VARARGS, "fstype(path): statfs(2)'s f_type"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvfs.daemon._passthrough",
    "The FUSE passthrough fields of the INIT and OPEN/CREATE replies, and the requests "
    "answered without Python (see the C source).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__passthrough(void)
{
    return PyModule_Create(&module);
}
