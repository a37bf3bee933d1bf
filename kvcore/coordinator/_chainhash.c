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
 * sequence is read.  The digests come from OpenSSL's libcrypto (EVP).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <openssl/evp.h>
#include <string.h>

/* SHA-256 fetched once from the default library context, so a FIPS or
 * other provider configuration applies as it does to hashlib. */
static EVP_MD *sha256_md = NULL;

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
    if (PyBool_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "block_size must be an int, not bool");
        return NULL;
    }
    unsigned long long block = PyLong_AsUnsignedLongLong(args[1]);
    if (block == (unsigned long long)-1 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError)) {
            return NULL;
        }
        PyErr_Clear();
        block = 0;
    }
    if (block < 1 || block > 0xFFFFFFFFULL) {
        PyErr_SetString(PyExc_ValueError,
                        "block_size must be an int in [1, 2**32)");
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    Py_ssize_t bs = (unsigned long long)n < block ? n + 1 : (Py_ssize_t)block;
    Py_ssize_t full = n / bs;
    /* The chunk encodings side by side: each chunk's tokens are packed
     * straight into its encoding, and only the parent is filled in later.
     * A chunk is full only if it fits in the list, so these sizes are
     * bounded by the list's; the check guards the product. */
    unsigned long long enc_len = 40ULL + 4ULL * (unsigned long long)bs;
    if (full && (unsigned long long)full > (PY_SSIZE_T_MAX - 32) / enc_len) {
        return PyErr_NoMemory();
    }
    /* Every exit after this point goes through `done`, which frees what
     * was taken; `out` is the answer (None for a refused token). */
    PyObject *out = NULL;
    EVP_MD_CTX *ctx = NULL;
    unsigned char *enc = PyMem_Malloc(full ? (size_t)((unsigned long long)full * enc_len) : 1);
    unsigned char *digests = PyMem_Malloc(full ? (size_t)full * 32 : 1);
    if (enc == NULL || digests == NULL) {
        PyErr_NoMemory();
        goto done;
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
            size_t at = (size_t)((unsigned long long)chunk * enc_len);
            put_u32(enc + at + 40 + 4 * (size_t)(i % bs), v);
        }
    }
    static const unsigned char none_hash[32] = {0};
    const unsigned char *parent = none_hash;
    if (full && (ctx = EVP_MD_CTX_new()) == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t c = 0; c < full; c++) {
        unsigned char *e = enc + (size_t)((unsigned long long)c * enc_len);
        unsigned char *digest = digests + 32 * (size_t)c;
        put_u32(e, 32);
        memcpy(e + 4, parent, 32);
        put_u32(e + 36, (unsigned long)bs);
        if (!EVP_DigestInit_ex(ctx, sha256_md, NULL) ||
            !EVP_DigestUpdate(ctx, e, (size_t)enc_len) ||
            !EVP_DigestFinal_ex(ctx, digest, NULL)) {
            PyErr_SetString(PyExc_RuntimeError, "OpenSSL's sha256 failed");
            goto done;
        }
        parent = digest;
    }
    out = PyList_New(full);
    for (Py_ssize_t c = 0; out != NULL && c < full; c++) {
        PyObject *digest =
            PyBytes_FromStringAndSize((const char *)digests + 32 * (size_t)c, 32);
        if (digest == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, c, digest);
    }
    goto done;

refuse:
    out = Py_NewRef(Py_None);
done:
    EVP_MD_CTX_free(ctx);
    PyMem_Free(enc);
    PyMem_Free(digests);
    return out;
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
    if (sha256_md == NULL) {
        sha256_md = EVP_MD_fetch(NULL, "SHA256", NULL);
        if (sha256_md == NULL) {
            PyErr_SetString(PyExc_ImportError,
                            "OpenSSL offers no SHA256 in its default context");
            return NULL;
        }
    }
    return PyModule_Create(&module_def);
}
