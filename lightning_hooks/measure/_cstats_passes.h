/* The vectorised passes of _cstats.c, for one vector width: included once with W = 4 (SSE2 on
 * x86-64, NEON on arm64, scalar elsewhere) and, on x86-64, once more with W = 8 and TARGET
 * set to AVX2, chosen at run time by the CPU. Names get the suffix _w<W>. */
#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)
#define NAME(name) CAT(CAT(name, _w), W)

typedef float NAME(vf) __attribute__((vector_size(4 * W)));
typedef int32_t NAME(vi) __attribute__((vector_size(4 * W)));
typedef float NAME(half) __attribute__((vector_size(2 * W)));
typedef double NAME(vd) __attribute__((vector_size(4 * W))); /* W / 2 doubles */

static inline __attribute__((always_inline)) TARGET NAME(vi) NAME(finite_mask)(NAME(vf) v) {
    const NAME(vi) e = (NAME(vi)){0} + EXPONENT;
    return ((NAME(vi))v & e) != e; /* -1 where finite, 0 where Inf or NaN */
}

static inline __attribute__((always_inline)) TARGET NAME(vf) NAME(pick)(NAME(vi) mask, NAME(vf) a, NAME(vf) b) {
    return (NAME(vf))(((NAME(vi))a & mask) | ((NAME(vi))b & ~mask));
}

/* Pass 1 over a block: how many finite values, their sum (a float estimate, corrected in pass
 * 3), extremes and zeros. Returns the finite count. */
TARGET static int64_t NAME(block_moments)(const float *x, int64_t n, float *sum, Totals *t) {
    const NAME(vf) zero = {0}, inf = zero + INFINITY;
    NAME(vf) s = zero, lo = inf, hi = -inf;
    NAME(vi) finite = {0}, zeros = {0};
    int64_t i = 0;
    for (; i + W <= n; i += W) {
        NAME(vf) v;
        memcpy(&v, x + i, sizeof v);
        NAME(vi) ok = NAME(finite_mask)(v);
        s += NAME(pick)(ok, v, zero);
        NAME(vf) low = NAME(pick)(ok, v, inf), high = NAME(pick)(ok, v, -inf);
        lo = NAME(pick)(low < lo, low, lo);
        hi = NAME(pick)(high > hi, high, hi);
        finite -= ok;
        zeros -= (v == zero);
    }
    float total = 0.0f;
    int64_t n_finite = 0;
    for (int j = 0; j < W; j++) {
        total += s[j], n_finite += finite[j], t->zeros += zeros[j];
        t->lo = lo[j] < t->lo ? lo[j] : t->lo;
        t->hi = hi[j] > t->hi ? hi[j] : t->hi;
    }
    for (; i < n; i++) {
        uint32_t b;
        memcpy(&b, x + i, sizeof b);
        t->zeros += (x[i] == 0.0f);
        if (!IS_FINITE(b)) continue;
        total += x[i], n_finite++;
        t->lo = x[i] < t->lo ? x[i] : t->lo;
        t->hi = x[i] > t->hi ? x[i] : t->hi;
    }
    *sum = total;
    return n_finite;
}

/* Pass 3: sum and sum of squares of the deviations from an estimate of the block's mean, in
 * float64: exact however far the mean is from zero. Non-finite values count as the estimate. */
TARGET static void NAME(block_deviations)(const float *x, int64_t n, double estimate, double *dev,
                                          double *dev_sq) {
    const NAME(vf) ef = (NAME(vf)){0} + (float)estimate; /* equal to estimate */
    const NAME(vd) ed = (NAME(vd)){0} + estimate;
    NAME(vd) d = {0}, q = {0};
    int64_t i = 0;
    for (; i + W <= n; i += W) {
        NAME(vf) v;
        memcpy(&v, x + i, sizeof v);
        v = NAME(pick)(NAME(finite_mask)(v), v, ef);
        NAME(half) low, high;
        memcpy(&low, &v, sizeof low);
        memcpy(&high, (const char *)&v + sizeof low, sizeof high);
        NAME(vd) a = __builtin_convertvector(low, NAME(vd)) - ed, b = __builtin_convertvector(high, NAME(vd)) - ed;
        d += a + b;
        q += a * a + b * b;
    }
    *dev = 0.0, *dev_sq = 0.0;
    for (int j = 0; j < W / 2; j++) *dev += d[j], *dev_sq += q[j];
    for (; i < n; i++) {
        uint32_t b;
        memcpy(&b, x + i, sizeof b);
        if (!IS_FINITE(b)) continue;
        double a = (double)x[i] - estimate;
        *dev += a, *dev_sq += a * a;
    }
}

#undef NAME
#undef CAT
#undef CAT_
#undef W
#undef TARGET
