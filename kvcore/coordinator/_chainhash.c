/* The chained sha256 of a new request's prompt, in one pass.
 *
 * chain_sha256(tokens, block_size) packs every token of a list or tuple as a
 * little-endian u32 and hashes each full chunk of block_size tokens as
 * kvcore.coordinator.hashing.encode_block lays it out, with no extra keys:
 *
 *     u32(32) || parent || u32(block_size) || token_0 .. token_{n-1}
 *
 * where parent is the previous chunk's digest (32 zero bytes for the
 * first).  It returns the list of digests, or None when a token is anything
 * but an int (exactly: no bool, no subclass, no numpy integer) in
 * [0, 2**32), the tail past the last full chunk included; the caller then
 * takes the Python path, which decides and names the token.  Every token is
 * read before any Python object is made, so no Python code runs while the
 * sequence is read.  The digests come from OpenSSL's libcrypto.
 */
#define PY_SSIZE_T_CLEAN
#define OPENSSL_SUPPRESS_DEPRECATED
#include <Python.h>
#include <openssl/sha.h>
#include <string.h>

static void
put_u32(unsigned char *p, unsigned long v)
{
    p[0] = (unsigned char)(v & 0xFF);
    p[1] = (unsigned char)((v >> 8) & 0xFF);
    p[2] = (unsigned char)((v >> 16) & 0xFF);
    p[3] = (unsigned char)((v >> 24) & 0xFF);
}

static PyObject *
chain_sha256(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError,
                        "chain_sha256(tokens, block_size) takes 2 arguments");
        return NULL;
    }
    PyObject *seq = args[0];
    if (!PyList_CheckExact(seq) && !PyTuple_CheckExact(seq)) {
        Py_RETURN_NONE;
    }
    Py_ssize_t bs = PyLong_AsSsize_t(args[1]);
    if (bs == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (bs < 1 || (unsigned long long)bs > 0xFFFFFFFFULL) {
        PyErr_SetString(PyExc_ValueError,
                        "block_size must be an int in [1, 2**32)");
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    Py_ssize_t full = n / bs;
    size_t width = 4 * (size_t)bs;
    size_t enc_len = 40 + width;
    /* The chunk encodings side by side: each chunk's tokens are packed
     * straight into its encoding, and only the parent is filled in later. */
    if ((size_t)full > (PY_SSIZE_T_MAX - 32) / enc_len) {
        return PyErr_NoMemory();
    }
    unsigned char *enc = PyMem_Malloc(full ? (size_t)full * enc_len : 1);
    unsigned char *digests = PyMem_Malloc(full ? (size_t)full * 32 : 1);
    if (enc == NULL || digests == NULL) {
        PyMem_Free(enc);
        PyMem_Free(digests);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = items[i];
        if (!PyLong_CheckExact(item)) {
            goto refuse;
        }
        unsigned long v = PyLong_AsUnsignedLong(item);
        if (v == (unsigned long)-1 && PyErr_Occurred()) {
            PyErr_Clear();
            goto refuse;
        }
        if (v > 0xFFFFFFFFUL) {
            goto refuse;
        }
        Py_ssize_t chunk = i / bs;
        if (chunk < full) {
            put_u32(enc + (size_t)chunk * enc_len + 40 + 4 * (size_t)(i % bs), v);
        }
    }
    static const unsigned char none_hash[32] = {0};
    const unsigned char *parent = none_hash;
    for (Py_ssize_t c = 0; c < full; c++) {
        unsigned char *e = enc + (size_t)c * enc_len;
        put_u32(e, 32);
        memcpy(e + 4, parent, 32);
        put_u32(e + 36, (unsigned long)bs);
        /* The low-level calls: the one-shot SHA256() of OpenSSL 3 looks
         * the algorithm up by name on every call. */
        SHA256_CTX ctx;
        SHA256_Init(&ctx);
        SHA256_Update(&ctx, e, enc_len);
        SHA256_Final(digests + 32 * (size_t)c, &ctx);
        parent = digests + 32 * (size_t)c;
    }
    PyMem_Free(enc);
    PyObject *out = PyList_New(full);
    if (out == NULL) {
        PyMem_Free(digests);
        return NULL;
    }
    for (Py_ssize_t c = 0; c < full; c++) {
        PyObject *digest =
            PyBytes_FromStringAndSize((const char *)digests + 32 * (size_t)c, 32);
        if (digest == NULL) {
            Py_DECREF(out);
            PyMem_Free(digests);
            return NULL;
        }
        PyList_SET_ITEM(out, c, digest);
    }
    PyMem_Free(digests);
    return out;

refuse:
    PyMem_Free(enc);
    PyMem_Free(digests);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"chain_sha256", (PyCFunction)(void (*)(void))chain_sha256, METH_FASTCALL,
     "The chained sha256 digests of a prompt's full chunks, or None when a "
     "token is not an int in [0, 2**32)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_chainhash",
    "kvcore's compiled prompt hashing (optional; kvcore runs without it).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__chainhash(void)
{
    return PyModule_Create(&module_def);
}
