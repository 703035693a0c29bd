/* The passes of _cupdate.c for each element type: NAME_copy (copy and sum the squares moved),
 * NAME_diff (sum the squares of a - b), NAME_chain (NAME_diff's sum, and NAME_copy's of a moved
 * into b, in one read of each) and NAME_norm (sum the squares), each in LANES float64
 * partial sums that the compiler turns into vectors. Included once, after LANES and CLONES. */

static inline double from_f16(uint16_t h) { /* exact: every float16 is a float64 */
    uint32_t exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
    double magnitude;
    if (exponent == 0) magnitude = ldexp((double)mantissa, -24);
    else if (exponent == 31) magnitude = mantissa ? NAN : INFINITY;
    else magnitude = ldexp((double)(mantissa | 0x400), (int)exponent - 25);
    return (h & 0x8000) ? -magnitude : magnitude;
}

static inline double from_bf16(uint16_t b) {
    uint32_t bits = (uint32_t)b << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return (double)f;
}

#define F32_OF(v) ((double)(v))
#define F64_OF(v) (v)
#define F16_OF(v) from_f16(v)
#define BF16_OF(v) from_bf16(v)

/* The passes' lanes: over k in [from, to) (a multiple of LANES long), each value's square into its
 * lane's float64 sum acc[j]; every pass sums in this order, so a fused pass gives the same sums. */
#define LANES_DIFF(OF, a, b, from, to, acc)                                                          \
    for (int64_t k_ = (from); k_ < (to); k_ += LANES)                                                \
        for (int j_ = 0; j_ < LANES; j_++) {                                                         \
            double d_ = OF((a)[k_ + j_]) - OF((b)[k_ + j_]);                                         \
            (acc)[j_] += d_ * d_;                                                                    \
        }
#define LANES_COPY(T, OF, x, y, from, to, acc) /* x into y, the squares moved */                     \
    for (int64_t k_ = (from); k_ < (to); k_ += LANES)                                                \
        for (int j_ = 0; j_ < LANES; j_++) {                                                         \
            T v_ = (x)[k_ + j_];                                                                     \
            (y)[k_ + j_] = v_;                                                                       \
            double d_ = OF(v_);                                                                      \
            (acc)[j_] += d_ * d_;                                                                    \
        }
#define LANES_NORM(OF, x, from, to, acc)                                                             \
    for (int64_t k_ = (from); k_ < (to); k_ += LANES)                                                \
        for (int j_ = 0; j_ < LANES; j_++) {                                                         \
            double d_ = OF((x)[k_ + j_]);                                                            \
            (acc)[j_] += d_ * d_;                                                                    \
        }

static inline double lanes_sum(const double *acc) {
    double s = 0;
    for (int j = 0; j < LANES; j++) s += acc[j];
    return s;
}

/* For one element type T widened by OF: the four passes over n values, each returning its sum. */
#define PASSES(NAME, T, OF)                                                                            \
    CLONES static double NAME##_copy(T *restrict y, const T *restrict x, int64_t n) {                   \
        double acc[LANES] = {0};                                                                     \
        int64_t i = n - n % LANES;                                                                   \
        LANES_COPY(T, OF, x, y, 0, i, acc);                                                          \
        for (; i < n; i++) {                                                                         \
            y[i] = x[i];                                                                             \
            double d = OF(x[i]);                                                                     \
            acc[0] += d * d;                                                                         \
        }                                                                                            \
        return lanes_sum(acc);                                                                       \
    }                                                                                                \
    CLONES static double NAME##_diff(const T *restrict a, const T *restrict b, int64_t n) {            \
        double acc[LANES] = {0};                                                                     \
        int64_t i = n - n % LANES;                                                                   \
        LANES_DIFF(OF, a, b, 0, i, acc);                                                             \
        for (; i < n; i++) {                                                                         \
            double d = OF(a[i]) - OF(b[i]);                                                          \
            acc[0] += d * d;                                                                         \
        }                                                                                            \
        return lanes_sum(acc);                                                                       \
    }                                                                                                \
    CLONES static double NAME##_chain(const T *restrict a, T *restrict b, int64_t n, double *moved) {   \
        double acc[LANES] = {0}, sq[LANES] = {0};                                                    \
        int64_t i = 0;                                                                               \
        while (i + LANES <= n) { /* a block at a time: the second loop finds it in the L1 cache */  \
            int64_t end = i + BLOCK < n ? i + BLOCK : n - (n - i) % LANES;                           \
            LANES_DIFF(OF, a, b, i, end, acc);    /* NAME_diff's sums */                             \
            LANES_COPY(T, OF, a, b, i, end, sq);  /* NAME_copy's, of a into b */                     \
            i = end;                                                                                 \
        }                                                                                            \
        for (; i < n; i++) {                                                                         \
            T v = a[i];                                                                              \
            double w = OF(v), d = w - OF(b[i]);                                                      \
            b[i] = v;                                                                                \
            acc[0] += d * d;                                                                         \
            sq[0] += w * w;                                                                          \
        }                                                                                            \
        *moved = lanes_sum(sq);                                                                      \
        return lanes_sum(acc);                                                                       \
    }                                                                                                \
    CLONES static double NAME##_norm(const T *restrict x, int64_t n) {                                \
        double acc[LANES] = {0};                                                                     \
        int64_t i = n - n % LANES;                                                                   \
        LANES_NORM(OF, x, 0, i, acc);                                                                \
        for (; i < n; i++) {                                                                         \
            double d = OF(x[i]);                                                                     \
            acc[0] += d * d;                                                                         \
        }                                                                                            \
        return lanes_sum(acc);                                                                       \
    }

PASSES(f32, float, F32_OF)
PASSES(f64, double, F64_OF)
PASSES(f16, uint16_t, F16_OF)
PASSES(bf16, uint16_t, BF16_OF)
