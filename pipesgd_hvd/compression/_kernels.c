/* Fused host kernels for the byte codecs: one pass over memory per encode, decode or decode+sum.
 *
 * Framework-free: every function takes raw addresses of C-contiguous host buffers (PyTorch CPU
 * tensors and numpy arrays alike) and releases the GIL while it runs. pipesgd_hvd/compression/
 * kernels.py checks dtypes, shapes and contiguity before calling in; nothing here allocates
 * Python objects. The unfused tensor-op compositions in codecs.py are the reference: for nearest
 * rounding every byte and every float written here equals theirs (tests/test_codec_kernels.py).
 * That is why this file is compiled with -ffp-contract=off and never with -ffast-math: a fused
 * multiply-add, a reciprocal instead of a division or a reassociated sum would change bits.
 *
 * Layout (codecs.py, Quantize): a payload row is [nblocks float32 scales][codes], codes one per
 * byte at 8 bits, two per byte at 4 bits (even index in the low nibble), code = q + L + 1 for
 * q in [-L, L], L = 2^(bits-1) - 1. A block whose values are not all finite has a NaN scale.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

/* One clone per instruction set, picked at load time by the dynamic linker (GCC/clang ifunc):
 * the wheel stays portable and a current CPU still gets 8- or 16-wide division and rounding. */
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && \
    (!defined(__clang__) || __clang_major__ >= 14)
#define HOT __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define HOT
#endif
/* Helpers are inlined into the HOT drivers, so each clone compiles their loops for its own
 * instruction set and no call is made per block. */
#if defined(__GNUC__)
#define INLINE static inline __attribute__((always_inline))
#else
#define INLINE static inline
#endif

#define F32_ABS_MASK 0x7FFFFFFFu
#define F32_INF_BITS 0x7F800000u
#define F32_QNAN_BITS 0x7FC00000u /* what float('nan') is as float32: the reference's NaN */
#define DECODE_CHUNK 2048         /* values decoded per step of decode+sum: stays in L1 */

static inline uint32_t f32_bits(float v) { uint32_t u; memcpy(&u, &v, 4); return u; }
static inline float bits_f32(uint32_t u) { float v; memcpy(&v, &u, 4); return v; }

/* Round half to even for |v| < 2^22 (quantizer levels are within +-127): adding and subtracting
 * 1.5 * 2^23 leaves no fraction bits, so the FPU's default rounding (to nearest even) does it.
 * Unlike roundevenf/floorf this vectorizes on every instruction set (SSE2 has no round
 * instruction, GCC 12 no vector roundeven); -0 may come out as +0, which no code tells apart. */
static inline float round_even(float v) {
    const float magic = 12582912.0f; /* 1.5 * 2^23 */
    return (v + magic) - magic;
}

static inline float floor_small(float v) { /* floor for |v| < 2^22, the same way */
    float t = round_even(v);
    return t > v ? t - 1.0f : t;
}

/* ----------------------------------------------------------------------------------------------
 * Quantize: encode (optionally with error feedback), decode.
 * -------------------------------------------------------------------------------------------- */

/* max |y| of a block as float bits; >= F32_INF_BITS when an inf or NaN is there. */
INLINE uint32_t block_amax_bits(const float *y, int64_t n) {
    uint32_t m = 0;
    for (int64_t j = 0; j < n; j++) {
        uint32_t u = f32_bits(y[j]) & F32_ABS_MASK;
        m = u > m ? u : m;
    }
    return m;
}

/* y = x + r (the residual-corrected gradient, exactly the reference's ``x + residual``) and its
 * block_amax_bits, in one loop. */
INLINE uint32_t add_amax_bits(const float *x, const float *r, float *y, int64_t n) {
    uint32_t m = 0;
    for (int64_t j = 0; j < n; j++) {
        float v = x[j] + r[j];
        uint32_t u = f32_bits(v) & F32_ABS_MASK;
        y[j] = v;
        m = u > m ? u : m;
    }
    return m;
}

/* Codes of one finite block, and the new residual ``y - dequant(code)`` when r_out is set.
 * Same operations, in the same order, as TensorOps.to_levels / from_levels:
 * code = clip(round(y / safe * L) + off), dequant = (code - off) / L * scale. */
INLINE void quantize_block(const float *y, const float *noise, uint8_t *codes, float *r_out,
                               int64_t n, float safe, float scale, float levels, float offset) {
    const float lo = offset - levels, hi = offset + levels;
    for (int64_t j = 0; j < n; j++) {
        float v = y[j] / safe * levels;
        v = noise ? floor_small(v + noise[j]) : round_even(v);
        v = v + offset;
        v = v < lo ? lo : v;
        v = v > hi ? hi : v;
        codes[j] = (uint8_t)(int32_t)v;
        /* finite here: |dequant| <= amax, so the reference's finite_or_zero has nothing to do */
        if (r_out) r_out[j] = y[j] - (v - offset) / levels * scale;
    }
}

/* Two codes per byte, even index in the low nibble (codes[2i] + 16 codes[2i+1]). */
INLINE void pack_nibbles(const uint8_t *codes, uint8_t *out, int64_t n) {
    for (int64_t i = 0; i < n / 2; i++) out[i] = (uint8_t)(codes[2 * i] | (codes[2 * i + 1] << 4));
}

HOT static int quantize_encode(const float *x, const float *r_in, float *r_out, const float *noise,
                           uint8_t *payload, int64_t rows, int64_t cols, int64_t width, int bits) {
    const int64_t nblocks = cols / width;
    const int64_t code_bytes = bits == 8 ? cols : cols / 2;
    const int64_t row_bytes = 4 * nblocks + code_bytes;
    const float levels = (float)((1 << (bits - 1)) - 1), offset = levels + 1.0f;
    /* scratch for one block: y = x + r (so r_out may alias r_in) and unpacked 4-bit codes */
    float *ybuf = r_in ? malloc((size_t)width * sizeof(float)) : NULL;
    uint8_t *cbuf = bits == 4 ? malloc((size_t)width) : NULL;
    if ((r_in && !ybuf) || (bits == 4 && !cbuf)) { free(ybuf); free(cbuf); return -1; }

    for (int64_t row = 0; row < rows; row++) {
        uint8_t *prow = payload + row * row_bytes;
        for (int64_t b = 0; b < nblocks; b++) {
            const int64_t at = row * cols + b * width;
            const float *y = x + at;
            uint32_t amax;
            if (r_in) {
                amax = add_amax_bits(y, r_in + at, ybuf, width);
                y = ybuf;
            } else {
                amax = block_amax_bits(y, width);
            }
            uint8_t *codes = bits == 8 ? prow + 4 * nblocks + b * width : cbuf;
            float *res = r_out ? r_out + at : NULL;
            if (amax >= F32_INF_BITS) {
                /* Non-finite block: NaN scale (decodes as all-NaN), residual 0 (the reference's
                 * NaN error dropped by finite_or_zero); the codes are unspecified: 0. */
                uint32_t nan = F32_QNAN_BITS;
                memcpy(prow + 4 * b, &nan, 4);
                memset(codes, 0, (size_t)width);
                if (res) memset(res, 0, (size_t)width * sizeof(float));
            } else {
                float scale = bits_f32(amax);
                memcpy(prow + 4 * b, &scale, 4);
                quantize_block(y, noise ? noise + at : NULL, codes, res, width,
                               amax ? scale : 1.0f, scale, levels, offset);
            }
            if (bits == 4) pack_nibbles(cbuf, prow + 4 * nblocks + b * width / 2, width);
        }
    }
    free(ybuf);
    free(cbuf);
    return 0;
}

/* (code - off) / L * scale for n codes; at 4 bits, n values from n/2 bytes. */
INLINE void dequantize(const uint8_t *codes, float *out, int64_t n, int bits, float scale) {
    const float levels = (float)((1 << (bits - 1)) - 1), offset = levels + 1.0f;
    if (bits == 8) {
        for (int64_t j = 0; j < n; j++) out[j] = ((float)codes[j] - offset) / levels * scale;
    } else {
        for (int64_t i = 0; i < n / 2; i++) {
            out[2 * i] = ((float)(codes[i] & 15) - offset) / levels * scale;
            out[2 * i + 1] = ((float)(codes[i] >> 4) - offset) / levels * scale;
        }
    }
}

/* ----------------------------------------------------------------------------------------------
 * Casts (float16 / bfloat16) and truncation (upper 2 or 3 bytes of each float32).
 * -------------------------------------------------------------------------------------------- */

/* numbered as pipesgd_hvd.compression.kernels.Kind (QUANTIZE = -1). KIND_FP16_SOFT is float16
 * through the portable bit manipulation below, which KIND_FP16 uses only on CPUs without F16C:
 * a kind of its own so that the tests check it on every machine. */
enum { KIND_FP16 = 0, KIND_BF16 = 1, KIND_TRUNC16 = 2, KIND_TRUNC24 = 3, KIND_FP16_SOFT = 4 };

/* float32 -> IEEE half, round to nearest even; overflow to inf, NaN stays NaN (quiet). */
static inline uint16_t f32_to_f16(float v) {
    uint32_t u = f32_bits(v);
    uint32_t sign = (u >> 16) & 0x8000u, a = u & F32_ABS_MASK;
    if (a > F32_INF_BITS) return (uint16_t)(sign | 0x7E00u | ((a >> 13) & 0x1FFu));
    if (a >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u); /* rounds to >= 65520: inf */
    if (a < 0x38800000u) {                                   /* half subnormal or zero */
        /* adding 0.5 makes the FPU's own round-to-nearest-even do the subnormal rounding */
        float f = bits_f32(a) + 0.5f;
        return (uint16_t)(sign | (f32_bits(f) - 0x3F000000u));
    }
    uint32_t mant_odd = (a >> 13) & 1u;
    a += 0xC8000FFFu + mant_odd; /* rebias exponent (-112 << 23) and round to nearest even */
    return (uint16_t)(sign | (a >> 13));
}

static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    if (e == 0x1F) return bits_f32(sign | F32_INF_BITS | (m << 13));
    if (e == 0) { /* zero or subnormal: m * 2^-24, exact in float32 */
        float f = (float)m * 5.9604644775390625e-08f;
        return bits_f32(sign | f32_bits(f));
    }
    return bits_f32(sign | ((e + 112) << 23) | (m << 13));
}

/* bfloat16 round to nearest even, NaN -> 0x7FC0: c10::BFloat16's own rule (round_to_nearest_even). */
static inline uint16_t f32_to_bf16(float v) {
    uint32_t u = f32_bits(v);
    if ((u & F32_ABS_MASK) > F32_INF_BITS) return 0x7FC0u;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* F16C converts 8 values per instruction with the same IEEE rounding (to nearest even, overflow
 * to inf, subnormals exact); the portable loop above does not vectorize (it branches). */
#if defined(__x86_64__) && defined(__GNUC__)
#define HAVE_F16C_PATH 1
static int cpu_has_f16c;

__attribute__((target("avx,f16c"))) static void fp16_encode_f16c(const float *x, uint16_t *o, int64_t n) {
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
        _mm_storeu_si128((__m128i *)(o + j),
                         _mm256_cvtps_ph(_mm256_loadu_ps(x + j), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    for (; j < n; j++) o[j] = f32_to_f16(x[j]);
}

__attribute__((target("avx,f16c"))) static void fp16_decode_f16c(const uint16_t *h, float *out, int64_t n) {
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) _mm256_storeu_ps(out + j, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + j))));
    for (; j < n; j++) out[j] = f16_to_f32(h[j]);
}
#endif

HOT static void cast_encode(const float *x, uint8_t *out, int64_t n, int kind) {
#ifdef HAVE_F16C_PATH
    if (kind == KIND_FP16 && cpu_has_f16c) {
        fp16_encode_f16c(x, (uint16_t *)out, n);
        return;
    }
#endif
    if (kind == KIND_FP16 || kind == KIND_FP16_SOFT) {
        uint16_t *o = (uint16_t *)out;
        for (int64_t j = 0; j < n; j++) o[j] = f32_to_f16(x[j]);
    } else if (kind == KIND_BF16) {
        uint16_t *o = (uint16_t *)out;
        for (int64_t j = 0; j < n; j++) o[j] = f32_to_bf16(x[j]);
    } else if (kind == KIND_TRUNC16) {
        /* any NaN becomes the canonical quiet NaN first: a payload only in the low bits would
         * otherwise truncate to inf */
        uint16_t *o = (uint16_t *)out;
        for (int64_t j = 0; j < n; j++) {
            uint32_t u = f32_bits(x[j]);
            o[j] = (uint16_t)(((u & F32_ABS_MASK) > F32_INF_BITS ? F32_QNAN_BITS : u) >> 16);
        }
    } else {
        for (int64_t j = 0; j < n; j++) {
            uint32_t u = f32_bits(x[j]);
            u = (u & F32_ABS_MASK) > F32_INF_BITS ? F32_QNAN_BITS : u;
            out[3 * j] = (uint8_t)(u >> 8);
            out[3 * j + 1] = (uint8_t)(u >> 16);
            out[3 * j + 2] = (uint8_t)(u >> 24);
        }
    }
}

INLINE void cast_decode(const uint8_t *in, float *out, int64_t n, int kind) {
    const uint16_t *h = (const uint16_t *)in;
#ifdef HAVE_F16C_PATH
    if (kind == KIND_FP16 && cpu_has_f16c) {
        fp16_decode_f16c(h, out, n);
        return;
    }
#endif
    if (kind == KIND_FP16 || kind == KIND_FP16_SOFT) {
        for (int64_t j = 0; j < n; j++) out[j] = f16_to_f32(h[j]);
    } else if (kind == KIND_BF16 || kind == KIND_TRUNC16) {
        for (int64_t j = 0; j < n; j++) out[j] = bits_f32((uint32_t)h[j] << 16);
    } else {
        for (int64_t j = 0; j < n; j++)
            out[j] = bits_f32(((uint32_t)in[3 * j] << 8) | ((uint32_t)in[3 * j + 1] << 16) |
                              ((uint32_t)in[3 * j + 2] << 24));
    }
}

/* ----------------------------------------------------------------------------------------------
 * Decode and decode+sum, shared by every codec: a codec is a row layout plus a chunk decoder.
 * -------------------------------------------------------------------------------------------- */

typedef struct {
    int kind;        /* KIND_* for casts and truncation, or -1 for Quantize */
    int bits;        /* Quantize: 8 or 4 */
    int64_t cols;    /* values per row */
    int64_t width;   /* Quantize: values per block */
    int64_t row_bytes;
} Layout;

INLINE int64_t bytes_per_value_x2(const Layout *L) { /* twice the bytes per value */
    if (L->kind < 0) return L->bits == 8 ? 2 : 1;
    return L->kind == KIND_TRUNC24 ? 6 : 4; /* 16-bit kinds: 2 bytes */
}

/* Decode values [start, start + n) of one payload row into out (n within one block for Quantize). */
INLINE void decode_span(const Layout *L, const uint8_t *row, int64_t start, int64_t n, float *out) {
    if (L->kind < 0) {
        int64_t nblocks = L->cols / L->width;
        float scale;
        memcpy(&scale, row + 4 * (start / L->width), 4);
        const uint8_t *codes = row + 4 * nblocks + (L->bits == 8 ? start : start / 2);
        dequantize(codes, out, n, L->bits, scale);
    } else {
        cast_decode(row + start * bytes_per_value_x2(L) / 2, out, n, L->kind);
    }
}

INLINE void add_into(float *acc, const float *v, int64_t n) {
    for (int64_t j = 0; j < n; j++) acc[j] = acc[j] + v[j];
}

INLINE void zero_plus(float *acc, int64_t n) { /* 0 + v: the sum starts at +0, as torch's does */
    for (int64_t j = 0; j < n; j++) acc[j] = 0.0f + acc[j];
}

INLINE void scale_by(float *acc, float s, int64_t n) {
    for (int64_t j = 0; j < n; j++) acc[j] = acc[j] * s;
}

/* The span of values decoded per step: one block for Quantize (its scale), else a chunk. */
INLINE int64_t step_len(const Layout *L) {
    return L->kind < 0 ? L->width : DECODE_CHUNK;
}

HOT static void decode_rows(const Layout *L, const uint8_t *payload, int64_t rows, float *out) {
    const int64_t step = step_len(L);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t s = 0; s < L->cols; s += step) {
            int64_t n = L->cols - s < step ? L->cols - s : step;
            decode_span(L, payload + r * L->row_bytes, s, n, out + r * L->cols + s);
        }
}

/* out[j] = ((0 + row0[j]) + row1[j]) + ... (rank order), then * scale unless scale == 1: the
 * same bits on every rank and for every call, whatever the row count. */
HOT static int decode_sum_rows(const Layout *L, const uint8_t *payload, int64_t rows, float *out, float scale) {
    const int64_t step = step_len(L);
    float *tmp = malloc((size_t)step * sizeof(float));
    if (!tmp) return -1;
    for (int64_t s = 0; s < L->cols; s += step) {
        int64_t n = L->cols - s < step ? L->cols - s : step;
        decode_span(L, payload, s, n, out + s);
        zero_plus(out + s, n);
        for (int64_t r = 1; r < rows; r++) {
            decode_span(L, payload + r * L->row_bytes, s, n, tmp);
            add_into(out + s, tmp, n);
        }
        if (scale != 1.0f) scale_by(out + s, scale, n);
    }
    free(tmp);
    return 0;
}

/* ----------------------------------------------------------------------------------------------
 * Python bindings: addresses as unsigned ints, sizes as Py_ssize_t; the GIL is released.
 * -------------------------------------------------------------------------------------------- */

static int make_layout(Layout *L, int kind, int bits, Py_ssize_t cols, Py_ssize_t width) {
    L->kind = kind; L->bits = bits; L->cols = cols; L->width = width;
    if (cols < 1) { PyErr_SetString(PyExc_ValueError, "cols must be >= 1"); return -1; }
    if (kind < 0) {
        if ((bits != 8 && bits != 4) || width < 2 || width % 2 || cols % width) {
            PyErr_SetString(PyExc_ValueError, "quantize layout: bits 8/4, even width dividing cols");
            return -1;
        }
        L->row_bytes = 4 * (cols / width) + (bits == 8 ? cols : cols / 2);
    } else {
        if (kind > KIND_FP16_SOFT) { PyErr_SetString(PyExc_ValueError, "unknown cast kind"); return -1; }
        L->row_bytes = cols * bytes_per_value_x2(L) / 2;
    }
    return 0;
}

#define PTR(T, v) ((T *)(uintptr_t)(v))

static PyObject *py_quantize_encode(PyObject *self, PyObject *args) {
    unsigned long long x, r_in, r_out, noise, payload;
    Py_ssize_t rows, cols, width;
    int bits, rc;
    Layout L;
    if (!PyArg_ParseTuple(args, "KKKKKnnni", &x, &r_in, &r_out, &noise, &payload, &rows, &cols, &width, &bits))
        return NULL;
    if (make_layout(&L, -1, bits, cols, width) < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS
    rc = quantize_encode(PTR(const float, x), PTR(const float, r_in), PTR(float, r_out), PTR(const float, noise),
                         PTR(uint8_t, payload), rows, cols, width, bits);
    Py_END_ALLOW_THREADS
    if (rc < 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* decode(kind, bits, payload, rows, cols, width, out); kind -1 = Quantize */
static PyObject *py_decode(PyObject *self, PyObject *args) {
    int kind, bits;
    unsigned long long payload, out;
    Py_ssize_t rows, cols, width;
    Layout L;
    if (!PyArg_ParseTuple(args, "iiKnnnK", &kind, &bits, &payload, &rows, &cols, &width, &out)) return NULL;
    if (make_layout(&L, kind, bits, cols, width) < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS
    decode_rows(&L, PTR(const uint8_t, payload), rows, PTR(float, out));
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* decode_sum(kind, bits, payload, rows, cols, width, out, scale) */
static PyObject *py_decode_sum(PyObject *self, PyObject *args) {
    int kind, bits, rc;
    unsigned long long payload, out;
    Py_ssize_t rows, cols, width;
    double scale;
    Layout L;
    if (!PyArg_ParseTuple(args, "iiKnnnKd", &kind, &bits, &payload, &rows, &cols, &width, &out, &scale))
        return NULL;
    if (make_layout(&L, kind, bits, cols, width) < 0) return NULL;
    if (rows < 1) { PyErr_SetString(PyExc_ValueError, "decode_sum needs at least one row"); return NULL; }
    Py_BEGIN_ALLOW_THREADS
    rc = decode_sum_rows(&L, PTR(const uint8_t, payload), rows, PTR(float, out), (float)scale);
    Py_END_ALLOW_THREADS
    if (rc < 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* cast_encode(kind, x, n, out) */
static PyObject *py_cast_encode(PyObject *self, PyObject *args) {
    int kind;
    unsigned long long x, out;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "iKnK", &kind, &x, &n, &out)) return NULL;
    if (kind < KIND_FP16 || kind > KIND_FP16_SOFT) { PyErr_SetString(PyExc_ValueError, "unknown cast kind"); return NULL; }
    Py_BEGIN_ALLOW_THREADS
    cast_encode(PTR(const float, x), PTR(uint8_t, out), n, kind);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"quantize_encode", py_quantize_encode, METH_VARARGS,
     "quantize_encode(x, r_in, r_out, noise, payload, rows, cols, width, bits): addresses (0 = none)"},
    {"decode", py_decode, METH_VARARGS, "decode(kind, bits, payload, rows, cols, width, out)"},
    {"decode_sum", py_decode_sum, METH_VARARGS, "decode_sum(kind, bits, payload, rows, cols, width, out, scale)"},
    {"cast_encode", py_cast_encode, METH_VARARGS, "cast_encode(kind, x, n, out)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels",
                                    "Fused host kernels of pipesgd_hvd's byte codecs.", -1, methods};

PyMODINIT_FUNC PyInit__kernels(void) {
#ifdef HAVE_F16C_PATH
    __builtin_cpu_init();
    cpu_has_f16c = __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
#endif
    return PyModule_Create(&module);
}
