/*
 * kvfs.format._seal: AES-256-GCM of a sealed block's stored bytes in place, without the GIL.
 *
 * kvfs.format.seal seals every block that leaves the hot tier. The cryptography package's
 * AES-GCM holds the GIL for the whole of each call, so the pieces of a restore that land on
 * many threads (GETs from S3, files of a directory tier) are opened one at a time, on one core,
 * and each through a copy (it refuses to decrypt in place). Here a piece is transformed where
 * it lies, by the system's libcrypto (EVP, which picks AES-NI/VAES and carry-less multiply as
 * the CPU has them), and the xxh3 of what the buffer then holds (the plaintext when opening,
 * the ciphertext when sealing) is taken while it is in the core's cache, with the GIL released:
 * threads open their pieces in parallel.
 *
 *   Gcm(key, nonce, aad, decrypt)   a block's cipher: 32-byte key, 12-byte nonce, associated data
 *   .update(buf)                    transform the writable buffer in place, hash the result
 *   .finish(tag=None)               sealing: the 16-byte tag; opening: whether `tag` authenticates
 *   .digest()                       xxh3-64 of every byte the updates left
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <openssl/evp.h>
#include <stdint.h>
#include <string.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#define KEY_BYTES 32
#define NONCE_BYTES 12
#define TAG_BYTES 16
/* Pieces up to this size are transformed with the GIL held (releasing it costs more). */
#define NOGIL_BYTES (64 << 10)
/* EVP takes an int length: larger buffers go in steps of this. */
#define STEP (1 << 30)

typedef struct {
    PyObject_HEAD
    EVP_CIPHER_CTX *ctx;
    XXH3_state_t *hash;
    int decrypt;
    int finished;
} Gcm;

static void gcm_dealloc(Gcm *self)
{
    if (self->ctx)
        EVP_CIPHER_CTX_free(self->ctx);
    if (self->hash)
        XXH3_freeState(self->hash);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *crypto_error(const char *what)
{
    PyErr_Format(PyExc_RuntimeError, "libcrypto: %s failed", what);
    return NULL;
}

static int gcm_init(Gcm *self, PyObject *args, PyObject *kwds)
{
    static char *names[] = {"key", "nonce", "aad", "decrypt", NULL};
    Py_buffer key, nonce, aad;
    int decrypt;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "y*y*y*p", names, &key, &nonce, &aad,
                                     &decrypt))
        return -1;
    int rc = -1;
    if (key.len != KEY_BYTES || nonce.len != NONCE_BYTES || aad.len > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError,
                        "Gcm: a 32-byte key, a 12-byte nonce and associated data under 2 GiB");
        goto out;
    }
    if (self->ctx || self->hash) {
        PyErr_SetString(PyExc_RuntimeError, "Gcm: initialised once");
        goto out;
    }
    self->ctx = EVP_CIPHER_CTX_new();
    self->hash = XXH3_createState();
    if (!self->ctx || !self->hash) {
        PyErr_NoMemory();
        goto out;
    }
    XXH3_64bits_reset(self->hash);
    self->decrypt = decrypt;
    int outl;
    int ok = decrypt
        ? EVP_DecryptInit_ex(self->ctx, EVP_aes_256_gcm(), NULL, NULL, NULL) &&
          EVP_CIPHER_CTX_ctrl(self->ctx, EVP_CTRL_GCM_SET_IVLEN, NONCE_BYTES, NULL) &&
          EVP_DecryptInit_ex(self->ctx, NULL, NULL, key.buf, nonce.buf) &&
          (aad.len == 0 || EVP_DecryptUpdate(self->ctx, NULL, &outl, aad.buf, (int)aad.len))
        : EVP_EncryptInit_ex(self->ctx, EVP_aes_256_gcm(), NULL, NULL, NULL) &&
          EVP_CIPHER_CTX_ctrl(self->ctx, EVP_CTRL_GCM_SET_IVLEN, NONCE_BYTES, NULL) &&
          EVP_EncryptInit_ex(self->ctx, NULL, NULL, key.buf, nonce.buf) &&
          (aad.len == 0 || EVP_EncryptUpdate(self->ctx, NULL, &outl, aad.buf, (int)aad.len));
    if (!ok) {
        crypto_error("the cipher's set-up");
        goto out;
    }
    rc = 0;
out:
    PyBuffer_Release(&key);
    PyBuffer_Release(&nonce);
    PyBuffer_Release(&aad);
    return rc;
}

/* Transform `n` bytes at `p` in place (GCM is a stream: as many bytes out as in) and hash the
 * result; 0 on success. */
static int transform(Gcm *self, unsigned char *p, Py_ssize_t n)
{
    for (Py_ssize_t at = 0; at < n;) {
        int len = (int)(n - at < STEP ? n - at : STEP), outl = 0;
        int ok = self->decrypt ? EVP_DecryptUpdate(self->ctx, p + at, &outl, p + at, len)
                               : EVP_EncryptUpdate(self->ctx, p + at, &outl, p + at, len);
        if (!ok || outl != len)
            return -1;
        XXH3_64bits_update(self->hash, p + at, (size_t)len);
        at += len;
    }
    return 0;
}

static PyObject *gcm_update(Gcm *self, PyObject *arg)
{
    if (!self->ctx || self->finished) {
        PyErr_SetString(PyExc_ValueError, "Gcm: not initialised, or finished");
        return NULL;
    }
    Py_buffer buf;
    if (PyObject_GetBuffer(arg, &buf, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0)
        return NULL;
    int rc;
    if (buf.len >= NOGIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        rc = transform(self, buf.buf, buf.len);
        Py_END_ALLOW_THREADS
    } else {
        rc = transform(self, buf.buf, buf.len);
    }
    PyBuffer_Release(&buf);
    if (rc != 0)
        return crypto_error("a cipher update");
    Py_RETURN_NONE;
}

static PyObject *gcm_finish(Gcm *self, PyObject *args)
{
    Py_buffer tag = {0};
    if (!PyArg_ParseTuple(args, "|y*", &tag))
        return NULL;
    if (!self->ctx || self->finished) {
        if (tag.obj)
            PyBuffer_Release(&tag);
        PyErr_SetString(PyExc_ValueError, "Gcm: not initialised, or finished");
        return NULL;
    }
    self->finished = 1;
    unsigned char last[16];
    int outl = 0;
    if (self->decrypt) {
        if (!tag.obj || tag.len != TAG_BYTES) {
            if (tag.obj)
                PyBuffer_Release(&tag);
            PyErr_SetString(PyExc_ValueError, "Gcm.finish: opening takes the 16-byte tag");
            return NULL;
        }
        int ok = EVP_CIPHER_CTX_ctrl(self->ctx, EVP_CTRL_GCM_SET_TAG, TAG_BYTES, tag.buf);
        PyBuffer_Release(&tag);
        if (!ok)
            return crypto_error("setting the tag");
        /* 0: the tag does not authenticate what was opened */
        return PyBool_FromLong(EVP_DecryptFinal_ex(self->ctx, last, &outl) == 1);
    }
    if (tag.obj) {
        PyBuffer_Release(&tag);
        PyErr_SetString(PyExc_ValueError, "Gcm.finish: sealing makes the tag, takes none");
        return NULL;
    }
    unsigned char out[TAG_BYTES];
    if (EVP_EncryptFinal_ex(self->ctx, last, &outl) != 1 ||
        EVP_CIPHER_CTX_ctrl(self->ctx, EVP_CTRL_GCM_GET_TAG, TAG_BYTES, out) != 1)
        return crypto_error("making the tag");
    return PyBytes_FromStringAndSize((const char *)out, TAG_BYTES);
}

static PyObject *gcm_digest(Gcm *self, PyObject *noargs)
{
    if (!self->hash) {
        PyErr_SetString(PyExc_ValueError, "Gcm: not initialised");
        return NULL;
    }
    return PyLong_FromUnsignedLongLong(XXH3_64bits_digest(self->hash));
}

static PyMethodDef gcm_methods[] = {
    {"update", (PyCFunction)gcm_update, METH_O,
     "update(buf): transform the writable buffer in place (GIL released for large ones) and "
     "hash what it then holds"},
    {"finish", (PyCFunction)gcm_finish, METH_VARARGS,
     "finish(tag=None): sealing, the 16-byte tag; opening, whether `tag` authenticates "
     "everything updated (and the associated data)"},
    {"digest", (PyCFunction)gcm_digest, METH_NOARGS,
     "digest(): xxh3-64 of the bytes the updates left (plaintext opening, ciphertext sealing)"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject GcmType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvfs.format._seal.Gcm",
    .tp_doc = "Gcm(key, nonce, aad, decrypt): AES-256-GCM of one block, in place",
    .tp_basicsize = sizeof(Gcm),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)gcm_init,
    .tp_dealloc = (destructor)gcm_dealloc,
    .tp_methods = gcm_methods,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvfs.format._seal",
    "AES-256-GCM of sealed blocks in place, without the GIL (see the C source).",
    -1, NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__seal(void)
{
    if (PyType_Ready(&GcmType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    Py_INCREF(&GcmType);
    if (PyModule_AddObject(m, "Gcm", (PyObject *)&GcmType) < 0) {
        Py_DECREF(&GcmType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
