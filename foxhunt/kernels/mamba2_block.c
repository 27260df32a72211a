/* The Mamba-2 block's CPU loops (foxhunt/kernels/mamba2_block.py loads them and checks them against the float64
   PyTorch recurrence in foxhunt/kernels/ssd_recurrence.py): the causal convolution with SiLU, the SSD step by step
   with its adjoint, and the norms. The block's shape is compiled in (-DSSD_H=.. etc.). */
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

/* The block's shape is compiled in (-D...): the short loops over channels and state unroll into vector registers.
   Every function checks the shape it is called with and returns 1 if it differs, 2 if memory runs out, else 0. */
typedef ptrdiff_t I;

/* Subnormal floats flushed to zero (and read as zero) while a loop runs, the caller's mode restored on return: an
   adjoint or gradient that decays through thousands of steps (the last layer's, whose output gradient is only its
   tail's) otherwise crosses into subnormals, which x86 cores handle in microcode at ~100x the cost of a normal
   operation. Values below 1.2e-38 next to the O(1) ones the sums hold change nothing at float32's precision. */
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
typedef unsigned int fpmode;
static inline fpmode flush_subnormals(void) { fpmode m = _mm_getcsr(); _mm_setcsr(m | 0x8040u); return m; } /* FTZ|DAZ */
static inline void restore_fpmode(fpmode m) { _mm_setcsr(m); }
#elif defined(__aarch64__)
typedef unsigned long fpmode;
static inline fpmode flush_subnormals(void) {
    fpmode m; __asm__ volatile("mrs %0, fpcr" : "=r"(m)); __asm__ volatile("msr fpcr, %0" : : "r"(m | (1ul << 24)));
    return m; /* FZ */
}
static inline void restore_fpmode(fpmode m) { __asm__ volatile("msr fpcr, %0" : : "r"(m)); }
#else
typedef int fpmode;
static inline fpmode flush_subnormals(void) { return 0; }
static inline void restore_fpmode(fpmode m) { (void)m; }
#endif
#define SHAPE_OK(H, P, G, N, C, W) ((H) == SSD_H && (P) == SSD_P && (G) == SSD_G && (N) == SSD_N \
                                    && (C) == CONV_C && (W) == CONV_W)

/* e^x for the SiLU, vectorisable: 2^k e^r with |r| <= ln2 / 2 and Cephes' degree-6 polynomial (~2e-7 relative) */
static inline float exp_approx(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    float k = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - k * 0.693359375f + k * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { float f; int i; } two;
    two.i = ((int)k + 127) << 23;
    return p * two.f;
}

/* pre[c] = bias[c] + sum_k wt[k, c] src[k, c]: the W taps of one output row of a padded sequence */
static inline void conv_row(const float *restrict src, const float *restrict wt, const float *restrict bias,
                            float *restrict pre) {
    for (I c = 0; c < CONV_C; c++) pre[c] = bias ? bias[c] : 0.0f;
    for (I k = 0; k < CONV_W; k++)
        for (I c = 0; c < CONV_C; c++) pre[c] += wt[k * CONV_C + c] * src[k * CONV_C + c];
}

/* The first W - 1 rows of a sequence's padded input (the W - 1 steps before it, then its own) read from head
   [2 (W - 1), C]: past (or zeros where there is none) followed by the sequence's first W - 1 rows (zeros past L);
   the other rows are read from the sequence itself, so the padded input is never built. */
#define HEAD_ROWS (CONV_W > 1 ? 2 * (CONV_W - 1) : 1)
static inline void conv_head(const float *restrict past, const float *restrict in, float *restrict head, I L) {
    for (I r = 0; r < CONV_W - 1; r++)
        for (I c = 0; c < CONV_C; c++) {
            head[r * CONV_C + c] = past ? past[r * CONV_C + c] : 0.0f;
            head[(CONV_W - 1 + r) * CONV_C + c] = r < L ? in[r * CONV_C + c] : 0.0f;
        }
}

/* out [nb, L, C] = silu(causal depthwise convolution) of in [nb, L, C] after past [nb, W - 1, C] (NULL: zeros);
   kernel wt [W, C], bias [C] or NULL */
static int conv_silu_fwd_body(const float *restrict past, const float *restrict in, const float *restrict wt,
                  const float *restrict bias, float *restrict out, I nb, I L, I C, I W) {
    if (!SHAPE_OK(SSD_H, SSD_P, SSD_G, SSD_N, C, W)) return 1;
    float head[HEAD_ROWS * CONV_C];
    for (I i = 0; i < nb; i++) {
        const float *restrict seq = in + i * L * CONV_C;
        conv_head(past ? past + i * (CONV_W - 1) * CONV_C : NULL, seq, head, L);
        for (I t = 0; t < L; t++) {
            float *restrict o = out + (i * L + t) * CONV_C;
            conv_row(t < CONV_W - 1 ? head + t * CONV_C : seq + (t - (CONV_W - 1)) * CONV_C, wt, bias, o);
            for (I c = 0; c < CONV_C; c++) o[c] = o[c] / (1.0f + exp_approx(-o[c]));
        }
    }
    return 0;
}

/* its backward from the output gradient g [nb, L, C]: gin [nb, L, C] and gpast [nb, W - 1, C] (if not NULL), gwt
   [W, C] and gb [C] (this call's sums), all written; the convolution is recomputed row by row, not stored */
static int conv_silu_bwd_body(const float *restrict past, const float *restrict in, const float *restrict wt,
                  const float *restrict bias, const float *restrict g, float *restrict gpast, float *restrict gin,
                  float *restrict gwt, float *restrict gb, I nb, I L, I C, I W) {
    if (!SHAPE_OK(SSD_H, SSD_P, SSD_G, SSD_N, C, W)) return 1;
    float *pre = malloc(sizeof(float) * (2 + CONV_W + 1) * CONV_C);
    double *acc = calloc((CONV_W + 1) * CONV_C, sizeof(double));
    if (!pre || !acc) { free(pre); free(acc); return 2; }
    float *gp = pre + CONV_C, *part = gp + CONV_C;  /* part: one sequence's sums, added into acc in double */
    float head[HEAD_ROWS * CONV_C], ghead[HEAD_ROWS * CONV_C];
    memset(part, 0, sizeof(float) * (CONV_W + 1) * CONV_C);
    memset(gin, 0, sizeof(float) * (size_t)(nb * L * CONV_C));
    for (I i = 0; i < nb; i++) {
        const float *restrict seq = in + i * L * CONV_C;
        float *restrict gseq = gin + i * L * CONV_C;
        conv_head(past ? past + i * (CONV_W - 1) * CONV_C : NULL, seq, head, L);
        memset(ghead, 0, sizeof(ghead));
        for (I t = 0; t < L; t++) {
            const int early = t < CONV_W - 1;
            const float *restrict src = early ? head + t * CONV_C : seq + (t - (CONV_W - 1)) * CONV_C;
            float *restrict gi = early ? ghead + t * CONV_C : gseq + (t - (CONV_W - 1)) * CONV_C;
            const float *restrict gr = g + (i * L + t) * CONV_C;
            conv_row(src, wt, bias, pre);
            for (I c = 0; c < CONV_C; c++) {
                float s = 1.0f / (1.0f + exp_approx(-pre[c]));
                gp[c] = gr[c] * s * (1.0f + pre[c] * (1.0f - s));
                part[CONV_W * CONV_C + c] += gp[c];
            }
            for (I k = 0; k < CONV_W; k++)
                for (I c = 0; c < CONV_C; c++) {
                    gi[k * CONV_C + c] += wt[k * CONV_C + c] * gp[c];
                    part[k * CONV_C + c] += src[k * CONV_C + c] * gp[c];
                }
        }
        for (I r = 0; r < CONV_W - 1; r++)  /* the head's gradient: to past, and to the sequence's first rows */
            for (I c = 0; c < CONV_C; c++) {
                if (gpast) gpast[(i * (CONV_W - 1) + r) * CONV_C + c] = ghead[r * CONV_C + c];
                if (r < L) gseq[r * CONV_C + c] += ghead[(CONV_W - 1 + r) * CONV_C + c];
            }
        for (I j = 0; j < (CONV_W + 1) * CONV_C; j++) { acc[j] += part[j]; part[j] = 0.0f; }
    }
    for (I j = 0; j < CONV_W * CONV_C; j++) gwt[j] = (float)acc[j];
    for (I c = 0; c < CONV_C; c++) gb[c] = (float)acc[CONV_W * CONV_C + c];
    free(pre); free(acc);
    return 0;
}

#define HP (SSD_H * SSD_P)
#define WG (HP / SSD_G)          /* the channels of a group's heads, side by side */
#define GNW (SSD_G * SSD_N * WG) /* the state, [G, N, R P] */
#define ROW (HP + 2 * SSD_G * SSD_N)

/* RMS normalisation of rows of C channels, gated or not: g = y silu(z) (z NULL: g = y), out = g w / rms(g), with
   rms(g) = sqrt(mean(g^2) + eps); rinv [rows] keeps 1 / rms for the backward. Compiled for the residual stream's
   RMSNorm (C = NORM_D, not gated) and the block's gated norm (C = H P), so the loops over a row unroll. */
static inline void norm_fwd_rows(const float *restrict y, const float *restrict z, const float *restrict w,
                                 float *restrict out, float *restrict rinv, I rows, const I C, float eps,
                                 const int gated) {
    for (I r = 0; r < rows; r++) {
        const float *restrict yr = y + r * C, *restrict zr = gated ? z + r * C : yr;
        float *restrict o = out + r * C;
        float ss = 0.0f;
        for (I c = 0; c < C; c++) {
            float g = gated ? yr[c] * zr[c] / (1.0f + exp_approx(-zr[c])) : yr[c];
            o[c] = g;
            ss += g * g;
        }
        float ri = 1.0f / sqrtf(ss / (float)C + eps);
        rinv[r] = ri;
        for (I c = 0; c < C; c++) o[c] = o[c] * ri * w[c];
    }
}

/* its backward from gout: gy, gz (if z) and gw (this call's sums, written) */
static inline int norm_bwd_rows(const float *restrict y, const float *restrict z, const float *restrict w,
                                const float *restrict rinv, const float *restrict gout, float *restrict gy,
                                float *restrict gz, float *restrict gw, I rows, const I C, const int gated) {
    double *acc = calloc(C, sizeof(double));
    float *part = calloc(C, sizeof(float)), *n = malloc(sizeof(float) * 2 * C);
    if (!acc || !part || !n) { free(acc); free(part); free(n); return 2; }
    float *sg = n + C;
    for (I r = 0; r < rows; r++) {
        const float *restrict yr = y + r * C, *restrict zr = gated ? z + r * C : yr, *restrict go = gout + r * C;
        const float ri = rinv[r];
        float dot = 0.0f;
        for (I c = 0; c < C; c++) {
            float s = gated ? 1.0f / (1.0f + exp_approx(-zr[c])) : 1.0f;
            float g = gated ? yr[c] * zr[c] * s : yr[c];
            sg[c] = s;
            n[c] = g * ri;
            part[c] += go[c] * n[c];
            dot += go[c] * w[c] * n[c];
        }
        dot /= (float)C;
        float *restrict gyr = gy + r * C;
        for (I c = 0; c < C; c++) {
            float gg = ri * (go[c] * w[c] - n[c] * dot);
            if (gated) {
                gyr[c] = gg * zr[c] * sg[c];
                gz[r * C + c] = gg * yr[c] * sg[c] * (1.0f + zr[c] * (1.0f - sg[c]));
            } else {
                gyr[c] = gg;
            }
        }
        if ((r & 255) == 255 || r == rows - 1)
            for (I c = 0; c < C; c++) { acc[c] += part[c]; part[c] = 0.0f; }
    }
    for (I c = 0; c < C; c++) gw[c] = (float)acc[c];
    free(acc); free(part); free(n);
    return 0;
}

static int norm_fwd_body(const float *restrict y, const float *restrict z, const float *restrict w, float *restrict out,
             float *restrict rinv, I rows, I C, float eps) {
    if (C == NORM_D && !z) norm_fwd_rows(y, z, w, out, rinv, rows, NORM_D, eps, 0);
    else if (C == HP && z) norm_fwd_rows(y, z, w, out, rinv, rows, HP, eps, 1);
    else return 1;
    return 0;
}

static int norm_bwd_body(const float *restrict y, const float *restrict z, const float *restrict w, const float *restrict rinv,
             const float *restrict gout, float *restrict gy, float *restrict gz, float *restrict gw, I rows, I C) {
    if (C == NORM_D && !z) return norm_bwd_rows(y, z, w, rinv, gout, gy, gz, gw, rows, NORM_D, 0);
    if (C == HP && z) return norm_bwd_rows(y, z, w, rinv, gout, gy, gz, gw, rows, HP, 1);
    return 1;
}

/* u = dt x and the decay per channel of one row (and D x if Dx) */
static inline void ssd_inputs(const float *restrict row, const float *restrict dt, const float *restrict decay,
                              const float *restrict D, float *restrict u, float *restrict a, float *restrict Dx) {
    for (I h = 0; h < SSD_H; h++)
        for (I p = 0; p < SSD_P; p++) {
            u[h * SSD_P + p] = dt[h] * row[h * SSD_P + p];
            a[h * SSD_P + p] = decay[h];
            if (Dx) Dx[h * SSD_P + p] = D ? D[h] * row[h * SSD_P + p] : 0.0f;
        }
}

/* one step: S <- a S + B u (per group, over its heads' channels); and if y: y = S^T C + D x */
static inline void ssd_row(float *restrict S, const float *restrict row, const float *restrict u,
                           const float *restrict a, const float *restrict Dx, float *restrict y) {
    for (I g = 0; g < SSD_G; g++) {
        const float *restrict B = row + HP + g * SSD_N, *restrict Cm = row + HP + SSD_G * SSD_N + g * SSD_N;
        const float *restrict ug = u + g * WG, *restrict ag = a + g * WG;
        if (y) for (I w = 0; w < WG; w++) y[g * WG + w] = Dx[g * WG + w];
        for (I n = 0; n < SSD_N; n++) {
            float *restrict s = S + (g * SSD_N + n) * WG;
            float b = B[n];
            for (I w = 0; w < WG; w++) s[w] = ag[w] * s[w] + b * ug[w];
            if (y) {
                float c = Cm[n];
                for (I w = 0; w < WG; w++) y[g * WG + w] += c * s[w];
            }
        }
    }
}

/* the module's state layout [H, P, N] to and from the loops' [G, N, R P] (st NULL: zeros) */
static void state_in(float *restrict S, const float *restrict st) {
    const I R = SSD_H / SSD_G;
    for (I h = 0; h < SSD_H; h++)
        for (I p = 0; p < SSD_P; p++)
            for (I n = 0; n < SSD_N; n++)
                S[((h / R) * SSD_N + n) * WG + (h % R) * SSD_P + p] = st ? st[(h * SSD_P + p) * SSD_N + n] : 0.0f;
}
static void state_out(const float *restrict S, float *restrict st) {
    const I R = SSD_H / SSD_G;
    for (I h = 0; h < SSD_H; h++)
        for (I p = 0; p < SSD_P; p++)
            for (I n = 0; n < SSD_N; n++)
                st[(h * SSD_P + p) * SSD_N + n] = S[((h / R) * SSD_N + n) * WG + (h % R) * SSD_P + p];
}

/* The SSD over nb sequences, step by step. xbc [nb, L, H P + 2 G N] (x, B, C per row), dt and decay = exp(dt A)
   [nb, L, H], D [H] or NULL, init [nb, H, P, N] or NULL -> y [nb, L - y0, H P] (the outputs of steps y0.. only: a
   forecaster's last layer reads its last rows), final [nb, H, P, N], and ckpt [nb, ceil(L / Q), G N R P]: the state
   entering steps 0, Q, 2Q, .. (where the backward restarts). */
static int ssd_fwd_body(const float *restrict xbc, const float *restrict dt, const float *restrict decay,
            const float *restrict D, const float *restrict init, float *restrict y, float *restrict final,
            float *restrict ckpt, I nb, I L, I H, I P, I G, I N, I Q, I y0) {
    if (!SHAPE_OK(H, P, G, N, CONV_C, CONV_W) || Q < 1 || y0 < 0 || y0 >= L) return 1;
    const I nck = (L + Q - 1) / Q, ny = L - y0;
    float *S = malloc(sizeof(float) * (GNW + 3 * HP));
    if (!S) return 2;
    float *u = S + GNW, *a = u + HP, *Dx = a + HP;
    for (I i = 0; i < nb; i++) {
        state_in(S, init ? init + i * HP * SSD_N : NULL);
        for (I t = 0; t < L; t++) {
            const I it = i * L + t;
            if (t % Q == 0) memcpy(ckpt + (i * nck + t / Q) * GNW, S, sizeof(float) * GNW);
            if (t < y0) {  /* the state only */
                ssd_inputs(xbc + it * ROW, dt + it * SSD_H, decay + it * SSD_H, NULL, u, a, NULL);
                ssd_row(S, xbc + it * ROW, u, a, NULL, NULL);
            } else {
                ssd_inputs(xbc + it * ROW, dt + it * SSD_H, decay + it * SSD_H, D, u, a, Dx);
                ssd_row(S, xbc + it * ROW, u, a, Dx, y + (i * ny + t - y0) * HP);
            }
        }
        state_out(S, final + i * HP * SSD_N);
    }
    free(S);
    return 0;
}

/* One step of the backward (see ssd_bwd), with or without an output gradient gyr at this step (with_y is a
   constant where it is inlined, so each form compiles without the other's work). */
static inline void ssd_bwd_row(float *restrict dS, const float *restrict hcur, const float *restrict hprev,
                               const float *restrict row, const float *restrict dtr, const float *restrict decr,
                               const float *restrict D, const float *restrict gyr, float *restrict grow,
                               float *restrict gdtr, float *restrict gdecr, double *restrict gDacc, float *restrict u,
                               float *restrict a, float *restrict gu, float *restrict ga, const int with_y) {
    ssd_inputs(row, dtr, decr, NULL, u, a, NULL);
    for (I w = 0; w < HP; w++) { gu[w] = 0.0f; ga[w] = 0.0f; }
    for (I g = 0; g < SSD_G; g++) {
        const float *restrict B = row + HP + g * SSD_N, *restrict Cm = row + HP + SSD_G * SSD_N + g * SSD_N;
        const float *restrict ug = u + g * WG, *restrict ag = a + g * WG, *restrict gyg = with_y ? gyr + g * WG : NULL;
        float *restrict gug = gu + g * WG, *restrict gag = ga + g * WG;
        for (I n = 0; n < SSD_N; n++) {
            const I o = (g * SSD_N + n) * WG;
            float *restrict d = dS + o;
            const float *restrict sc = hcur + o, *restrict sp = hprev + o;
            float b = B[n], c = Cm[n], gc = 0.0f, gb = 0.0f;
            for (I w = 0; w < WG; w++) {
                float dv = with_y ? d[w] + c * gyg[w] : d[w];
                if (with_y) gc += sc[w] * gyg[w];
                gb += dv * ug[w];
                gug[w] += dv * b;
                gag[w] += dv * sp[w];
                d[w] = dv * ag[w];
            }
            grow[HP + g * SSD_N + n] = gb;
            grow[HP + SSD_G * SSD_N + g * SSD_N + n] = gc;
        }
    }
    for (I h = 0; h < SSD_H; h++) {
        float sa = 0.0f, sx = 0.0f, sd = 0.0f, dd = D ? D[h] : 0.0f;
        for (I p = 0; p < SSD_P; p++) {
            const I w = h * SSD_P + p;
            sa += ga[w];
            sx += gu[w] * row[w];
            if (with_y) sd += gyr[w] * row[w];
            grow[w] = with_y ? gu[w] * dtr[h] + dd * gyr[w] : gu[w] * dtr[h];
        }
        gdtr[h] = sx;
        gdecr[h] = sa;
        if (with_y) gDacc[h] += sd;
    }
}

/* Its backward, from gy [nb, L - y0, H P] (steps y0..) and gfinal (or NULL): gxbc [nb, L, H P + 2 G N] (x, B, C),
   gdt [nb, L, H] (through u = dt x), gdecay [nb, L, H], gD [H] (this call's sum), ginit [nb, H, P, N] (or NULL).
   Each chunk of Q steps is recomputed from its checkpoint, then run backwards: with dS the gradient of the state
   after step t,
       dS += C gy^T;  gC = S_t^T gy;  gB = dS u;  gu = dS^T B;  gdecay = <dS, S_{t-1}>;  dS <- a dS
   (before step y0 there is no gy: gC = 0 and dS only decays and feeds gB, gu, gdecay). */
static int ssd_bwd_body(const float *restrict xbc, const float *restrict dt, const float *restrict decay,
            const float *restrict D, const float *restrict ckpt, const float *restrict gy,
            const float *restrict gfinal, float *restrict gxbc, float *restrict gdt, float *restrict gdecay,
            float *restrict gD, float *restrict ginit, I nb, I L, I H, I P, I G, I N, I Q, I y0) {
    if (!SHAPE_OK(H, P, G, N, CONV_C, CONV_W) || Q < 1 || y0 < 0 || y0 >= L) return 1;
    const I nck = (L + Q - 1) / Q, ny = L - y0, SW = GNW + 48; /* states' stride off multiples of 4 KiB (no 4K aliasing) */
    float *buf = malloc(sizeof(float) * ((Q + 2) * SW + 4 * HP));
    double *gDacc = calloc(SSD_H, sizeof(double));
    if (!buf || !gDacc) { free(buf); free(gDacc); return 2; }
    float *dS = buf + (Q + 1) * SW, *u = dS + GNW, *a = u + HP, *gu = a + HP, *ga = gu + HP;
    for (I i = 0; i < nb; i++) {
        state_in(dS, gfinal ? gfinal + i * HP * SSD_N : NULL);
        for (I k = nck - 1; k >= 0; k--) {
            const I t0 = k * Q, t1 = t0 + Q < L ? t0 + Q : L;
            memcpy(buf, ckpt + (i * nck + k) * GNW, sizeof(float) * GNW);
            for (I t = t0; t < t1; t++) {
                const I it = i * L + t;
                float *next = buf + (t - t0 + 1) * SW;
                memcpy(next, next - SW, sizeof(float) * GNW);
                ssd_inputs(xbc + it * ROW, dt + it * SSD_H, decay + it * SSD_H, NULL, u, a, NULL);
                ssd_row(next, xbc + it * ROW, u, a, NULL, NULL);
            }
            for (I t = t1 - 1; t >= t0; t--) {
                const I it = i * L + t;
                const float *restrict hcur = buf + (t - t0 + 1) * SW, *restrict hprev = buf + (t - t0) * SW;
                if (t >= y0)
                    ssd_bwd_row(dS, hcur, hprev, xbc + it * ROW, dt + it * SSD_H, decay + it * SSD_H, D,
                                gy + (i * ny + t - y0) * HP, gxbc + it * ROW, gdt + it * SSD_H, gdecay + it * SSD_H,
                                gDacc, u, a, gu, ga, 1);
                else
                    ssd_bwd_row(dS, hcur, hprev, xbc + it * ROW, dt + it * SSD_H, decay + it * SSD_H, D, NULL,
                                gxbc + it * ROW, gdt + it * SSD_H, gdecay + it * SSD_H, gDacc, u, a, gu, ga, 0);
            }
        }
        if (ginit) state_out(dS, ginit + i * HP * SSD_N);
    }
    for (I h = 0; h < SSD_H; h++) gD[h] = (float)gDacc[h];
    free(buf); free(gDacc);
    return 0;
}

/* The exported entry points: each loop under flush_subnormals, the caller's mode restored on return. */
#define FLUSHED(name, params, ...) \
    int name params { fpmode m = flush_subnormals(); int status = name##_body(__VA_ARGS__); restore_fpmode(m); return status; }
FLUSHED(conv_silu_fwd, (const float *restrict past, const float *restrict in, const float *restrict wt, const float *restrict bias, float *restrict out, I nb, I L, I C, I W),
        past, in, wt, bias, out, nb, L, C, W)
FLUSHED(conv_silu_bwd, (const float *restrict past, const float *restrict in, const float *restrict wt, const float *restrict bias, const float *restrict g, float *restrict gpast, float *restrict gin, float *restrict gwt, float *restrict gb, I nb, I L, I C, I W),
        past, in, wt, bias, g, gpast, gin, gwt, gb, nb, L, C, W)
FLUSHED(norm_fwd, (const float *restrict y, const float *restrict z, const float *restrict w, float *restrict out, float *restrict rinv, I rows, I C, float eps),
        y, z, w, out, rinv, rows, C, eps)
FLUSHED(norm_bwd, (const float *restrict y, const float *restrict z, const float *restrict w, const float *restrict rinv, const float *restrict gout, float *restrict gy, float *restrict gz, float *restrict gw, I rows, I C),
        y, z, w, rinv, gout, gy, gz, gw, rows, C)
FLUSHED(ssd_fwd, (const float *restrict xbc, const float *restrict dt, const float *restrict decay, const float *restrict D, const float *restrict init, float *restrict y, float *restrict final, float *restrict ckpt, I nb, I L, I H, I P, I G, I N, I Q, I y0),
        xbc, dt, decay, D, init, y, final, ckpt, nb, L, H, P, G, N, Q, y0)
FLUSHED(ssd_bwd, (const float *restrict xbc, const float *restrict dt, const float *restrict decay, const float *restrict D, const float *restrict ckpt, const float *restrict gy, const float *restrict gfinal, float *restrict gxbc, float *restrict gdt, float *restrict gdecay, float *restrict gD, float *restrict ginit, I nb, I L, I H, I P, I G, I N, I Q, I y0),
        xbc, dt, decay, D, ckpt, gy, gfinal, gxbc, gdt, gdecay, gD, ginit, nb, L, H, P, G, N, Q, y0)
