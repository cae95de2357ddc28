// Decode attention over coded pages with the step tables in shared memory (loopvq_calib/decode_cuda.py
// compiles this text with NVRTC at first use; design in docs/quantized-cache.md).
//
// One block per (KV head, split of the coded tokens); it copies the head's key and value step tables
// ([K, D] each, channels in *slot order*: sorted by code, so a lane's RUN consecutive slots share one code)
// into shared memory once and loops over the batch. Per row, warp w takes a contiguous range of the split's
// tokens, U tokens per iteration; lane L owns slots [L*SPL, (L+1)*SPL): per token it reads the index byte of
// each of its runs, one RUN-wide vector of the table row, and multiplies by the query rotated to the
// token's position (RoPE on the query side: z = (q_a + i q_b) exp(-i theta t) advanced token by token,
// re-anchored from the cos/sin table at every iteration). The U partial dot products are reduce-scattered
// across the warp (U-1 + log2(32/U) shuffles), each lane then holds one token's logit; softmax base 2 with a
// lazily moved reference maximum (rescale only when a logit exceeds it by more than 8); the weights go
// through a small per-warp shared buffer (broadcast reads) and values accumulate per lane in slot order. Block 0 of every head also takes the full-precision sink/window tokens. Warps are
// merged through shared memory; the block writes (acc in channel order, max, sum) for the Triton merge.
//
// Constants defined before this text: D, SPL (D/32), RUNK, RUNV (slots per run), QG (query heads per KV
// head), U (tokens per iteration), WARPS, KCB (codebook size), TASQ, STEP, HAS_MASK, ACT (0 bf16, 1 fp16,
// 2 fp32: q and the full-precision keys/values), TAB32 (tables in fp32 instead of fp16).

typedef unsigned char u8;
typedef unsigned short u16;
typedef long long i64;

#define FULL 0xffffffffu
#define NRK (SPL / RUNK)
#define NRV (SPL / RUNV)
#define NEG_BIG (-1.0e30f)
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float h2f(u16 x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
    return f;
}

__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ float act(const void* p, i64 i) {
#if ACT == 0
    return __uint_as_float(((unsigned)((const u16*)p)[i]) << 16);
#elif ACT == 1
    return h2f(((const u16*)p)[i]);
#else
    return ((const float*)p)[i];
#endif
}

#if TAB32
typedef float tab_t;
#else
typedef u16 tab_t;
#endif

// R consecutive table values (one run) from shared memory, as floats
template <int R>
__device__ __forceinline__ void load_run(const tab_t* p, float* out) {
#if TAB32
    if (R == 4) {
        float4 w = *(const float4*)p;
        out[0] = w.x; out[1] = w.y; out[2] = w.z; out[3] = w.w;
    } else if (R == 2) {
        float2 w = *(const float2*)p;
        out[0] = w.x; out[1] = w.y;
    } else {
#pragma unroll
        for (int i = 0; i < R; ++i) out[i] = p[i];
    }
#else
    if (R == 4) {
        uint2 w = *(const uint2*)p;
        out[0] = h2f((u16)(w.x & 0xffff)); out[1] = h2f((u16)(w.x >> 16));
        out[2] = h2f((u16)(w.y & 0xffff)); out[3] = h2f((u16)(w.y >> 16));
    } else if (R == 2) {
        unsigned w = *(const unsigned*)p;
        out[0] = h2f((u16)(w & 0xffff)); out[1] = h2f((u16)(w >> 16));
    } else {
#pragma unroll
        for (int i = 0; i < R; ++i) out[i] = h2f(p[i]);
    }
#endif
}

// v[N] per lane -> sum over the warp of v[u] for u = lane / (32 / N)
template <int N, int LOGN>
__device__ __forceinline__ float reduce_scatter(float* v, int lane) {
#pragma unroll
    for (int step = 0; step < LOGN; ++step) {
        const int n = N >> step, o = 16 >> step;
        const bool up = lane & o;
#pragma unroll
        for (int i = 0; i < n / 2; ++i) {
            const float send = up ? v[i] : v[i + n / 2];
            const float keep = up ? v[i + n / 2] : v[i];
            v[i] = keep + __shfl_xor_sync(FULL, send, o);
        }
    }
    float r = v[0];
#pragma unroll
    for (int o = 16 / N; o >= 1; o >>= 1) r += __shfl_xor_sync(FULL, r, o);
    return r;
}

struct State {
    float m[QG], l[QG], acc[QG][SPL];
};

// fold logit sc (this lane's token; -inf when masked) into the warp's state; returns p for this lane
__device__ __forceinline__ void softmax_step(State& st, const float* sc, float* p, int lanes_per_token, int lane) {
#pragma unroll
    for (int g = 0; g < QG; ++g) {
        float mx = sc[g];
        for (int o = lanes_per_token; o < 32; o <<= 1) mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, o));
        if (mx > st.m[g] + 8.0f) {  // warp-uniform: move the reference maximum, rescale
            const float alpha = ex2(st.m[g] - mx);
            st.l[g] *= alpha;
#pragma unroll
            for (int i = 0; i < SPL; ++i) st.acc[g][i] *= alpha;
            st.m[g] = mx;
        }
        p[g] = ex2(sc[g] - st.m[g]);
        if (lane % lanes_per_token == 0) st.l[g] += p[g];
    }
}

extern "C" __global__ void __launch_bounds__(WARPS * 32, 1) loopvq_decode_split(
    const void* __restrict__ q, const u8* __restrict__ kidx, const u8* __restrict__ vidx,
    const u16* __restrict__ sig, const tab_t* __restrict__ ktab_g, const tab_t* __restrict__ vtab_g,
    const int* __restrict__ kcode, const int* __restrict__ vcode, const int* __restrict__ kch,
    const int* __restrict__ kpart, const int* __restrict__ kfreq, const float* __restrict__ ksign,
    const int* __restrict__ vch, const int* __restrict__ p0, const float* __restrict__ cos_t,
    const float* __restrict__ sin_t, const void* __restrict__ fk, const void* __restrict__ fv,
    const int* __restrict__ fpos, const signed char* __restrict__ fmask, float* __restrict__ acc_out,
    float* __restrict__ ml_out, int n_batch, int n_coded, int n_fp, int split_len, int qk_scale_bits,
    int s_kib, int s_kit, int s_kih, int s_vib, int s_vit, int s_vih, int s_sb, int s_st,
    int s_fkb, int s_fkt, int s_fkh, int s_fvb, int s_fvt, int s_fvh, int s_fpb) {
    extern __shared__ __align__(16) unsigned char smem[];
    tab_t* ktab = (tab_t*)smem;
    tab_t* vtab = ktab + KCB * D;
    float* mrg = (float*)(vtab + KCB * D);  // [WARPS][QG][D + 2]
    float* pbuf = mrg + WARPS * QG * (D + 2);  // [WARPS][QG][U]: the iteration's softmax weights
    const int h = blockIdx.x, s = blockIdx.y, heads = gridDim.x, splits = gridDim.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int D2 = D / 2, slot0 = lane * SPL;
    const float scale = __int_as_float(qk_scale_bits);  // passed as bits: no float ABI to agree on

    {  // the head's step tables into shared memory, 16 bytes at a time
        const uint4* sk = (const uint4*)(ktab_g + (i64)h * KCB * D);
        const uint4* sv = (const uint4*)(vtab_g + (i64)h * KCB * D);
        const int n16 = KCB * D * (int)sizeof(tab_t) / 16;
        for (int i = threadIdx.x; i < n16; i += blockDim.x) {
            ((uint4*)ktab)[i] = sk[i];
            ((uint4*)vtab)[i] = sv[i];
        }
    }
    int kcd[NRK], vcd[NRV], kf[SPL];  // channels are re-read where needed (registers are the warps' limit)
    float ksg[SPL], c1[SPL], s1[SPL];
#pragma unroll
    for (int r = 0; r < NRK; ++r) kcd[r] = kcode[h * (D / RUNK) + slot0 / RUNK + r];
#pragma unroll
    for (int r = 0; r < NRV; ++r) vcd[r] = vcode[h * (D / RUNV) + slot0 / RUNV + r];
#pragma unroll
    for (int i = 0; i < SPL; ++i) {
        kf[i] = kfreq[h * D + slot0 + i];
        ksg[i] = ksign[h * D + slot0 + i];
        c1[i] = cos_t[D2 + kf[i]];  // one position's rotation
        s1[i] = ksg[i] * sin_t[D2 + kf[i]];
    }
    __syncthreads();

    const int start = s * split_len, end = min(start + split_len, n_coded);
    const int per_warp = ((max(end - start, 0) + WARPS - 1) / WARPS + U - 1) / U * U;
    const int w_begin = start + warp * per_warp, w_end = min(w_begin + per_warp, end);
    const int lanes_per_token = 32 / U, my_u = lane / lanes_per_token;

    for (int b = 0; b < n_batch; ++b) {
        float qs[QG][SPL], qp[QG][SPL];
#pragma unroll
        for (int g = 0; g < QG; ++g) {
            const i64 row = ((i64)b * heads * QG + h * QG + g) * D;
#pragma unroll
            for (int i = 0; i < SPL; ++i) {
                qs[g][i] = act(q, row + kch[h * D + slot0 + i]) * scale;
                qp[g][i] = act(q, row + kpart[h * D + slot0 + i]) * scale;
            }
        }
        State st;
#pragma unroll
        for (int g = 0; g < QG; ++g) {
            st.m[g] = NEG_BIG;
            st.l[g] = 0.0f;
#pragma unroll
            for (int i = 0; i < SPL; ++i) st.acc[g][i] = 0.0f;
        }
        const i64 pb = p0[b];
        const u8* krow = kidx + (i64)b * s_kib + (i64)h * s_kih;
        const u8* vrow = vidx + (i64)b * s_vib + (i64)h * s_vih;
        const u16* srow = sig + (i64)b * s_sb;
        int ki[U][NRK], vi[U][NRV];
#pragma unroll
        for (int u = 0; u < U; ++u) {  // the first iteration's indices
                const int t = min(w_begin + u, max(w_end - 1, 0));  // offsets inside one row fit 32 bits
#pragma unroll
            for (int r = 0; r < NRK; ++r) ki[u][r] = w_begin < w_end ? krow[t * s_kit + kcd[r]] : 0;
#pragma unroll
            for (int r = 0; r < NRV; ++r) vi[u][r] = w_begin < w_end ? vrow[t * s_vit + vcd[r]] : 0;
        }
        for (int t0 = w_begin; t0 < w_end; t0 += U) {
            int kn[U][NRK], vn[U][NRV];  // the next iteration's indices, loaded ahead
            const bool more = t0 + U < w_end;
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int t = min(t0 + U + u, w_end - 1);
#pragma unroll
                for (int r = 0; r < NRK; ++r) kn[u][r] = more ? krow[t * s_kit + kcd[r]] : 0;
#pragma unroll
                for (int r = 0; r < NRV; ++r) vn[u][r] = more ? vrow[t * s_vit + vcd[r]] : 0;
            }
            float x[QG][SPL], y[QG][SPL];  // the query rotated back to the current token, and its partner
#pragma unroll
            for (int i = 0; i < SPL; ++i) {
                const i64 pos = pb + t0;
                const float c = cos_t[pos * D2 + kf[i]], sn = ksg[i] * sin_t[pos * D2 + kf[i]];
#pragma unroll
                for (int g = 0; g < QG; ++g) {
                    x[g][i] = qs[g][i] * c + qp[g][i] * sn;
                    y[g][i] = qp[g][i] * c - qs[g][i] * sn;
                }
            }
            float part[QG][U];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                float kv[SPL];
#pragma unroll
                for (int r = 0; r < NRK; ++r) load_run<RUNK>(ktab + ki[u][r] * D + slot0 + r * RUNK, kv + r * RUNK);
                float sg = 1.0f;
#if TASQ
                sg = h2f(srow[min(t0 + u, w_end - 1) * s_st + STEP]);
#endif
#pragma unroll
                for (int g = 0; g < QG; ++g) {
                    float a = 0.0f;
#pragma unroll
                    for (int i = 0; i < SPL; ++i) a += kv[i] * x[g][i];
                    part[g][u] = a * sg;
#pragma unroll
                    for (int i = 0; i < SPL; ++i) {  // advance the rotation by one position
                        const float xn = x[g][i] * c1[i] + y[g][i] * s1[i];
                        y[g][i] = y[g][i] * c1[i] - x[g][i] * s1[i];
                        x[g][i] = xn;
                    }
                }
            }
            float sc[QG], p[QG];
#pragma unroll
            for (int g = 0; g < QG; ++g) {
                sc[g] = reduce_scatter<U, (U == 32 ? 5 : U == 16 ? 4 : U == 8 ? 3 : U == 4 ? 2 : 1)>(part[g], lane);
                if (t0 + my_u >= w_end) sc[g] = NEG_INF;
            }
            softmax_step(st, sc, p, lanes_per_token, lane);
            float* pw = pbuf + warp * QG * U;
            if (lane % lanes_per_token == 0) {
#pragma unroll
                for (int g = 0; g < QG; ++g) pw[g * U + my_u] = p[g];
            }
            __syncwarp();
#pragma unroll
            for (int u = 0; u < U; ++u) {
                float vv[SPL];
#pragma unroll
                for (int r = 0; r < NRV; ++r) load_run<RUNV>(vtab + vi[u][r] * D + slot0 + r * RUNV, vv + r * RUNV);
#pragma unroll
                for (int g = 0; g < QG; ++g) {
                    const float pu = pw[g * U + u];  // a broadcast read
#pragma unroll
                    for (int i = 0; i < SPL; ++i) st.acc[g][i] += pu * vv[i];
                }
            }
            __syncwarp();
#pragma unroll
            for (int u = 0; u < U; ++u) {
#pragma unroll
                for (int r = 0; r < NRK; ++r) ki[u][r] = kn[u][r];
#pragma unroll
                for (int r = 0; r < NRV; ++r) vi[u][r] = vn[u][r];
            }
        }
        if (s == 0) {  // the full-precision sink and window tokens, pre-RoPE at their own positions
            for (int t = warp; t < n_fp; t += WARPS) {
                const i64 pos = fpos[(i64)b * s_fpb + t];
                const i64 krw = (i64)b * s_fkb + (i64)t * s_fkt + (i64)h * s_fkh;
                const i64 vrw = (i64)b * s_fvb + (i64)t * s_fvt + (i64)h * s_fvh;
                float sc[QG], p[QG];
#pragma unroll
                for (int g = 0; g < QG; ++g) sc[g] = 0.0f;
#pragma unroll
                for (int i = 0; i < SPL; ++i) {
                    const float c = cos_t[pos * D2 + kf[i]], sn = ksg[i] * sin_t[pos * D2 + kf[i]];
                    const float k = act(fk, krw + kch[h * D + slot0 + i]);
#pragma unroll
                    for (int g = 0; g < QG; ++g) sc[g] += k * (qs[g][i] * c + qp[g][i] * sn);
                }
                bool ok = true;
#if HAS_MASK
                ok = fmask[(i64)b * s_fpb + t] != 0;
#endif
#pragma unroll
                for (int g = 0; g < QG; ++g) {
#pragma unroll
                    for (int o = 16; o >= 1; o >>= 1) sc[g] += __shfl_xor_sync(FULL, sc[g], o);
                    if (!ok) sc[g] = NEG_INF;
                }
                softmax_step(st, sc, p, 32, lane);
#pragma unroll
                for (int i = 0; i < SPL; ++i) {
                    const float v = act(fv, vrw + vch[h * D + slot0 + i]);
#pragma unroll
                    for (int g = 0; g < QG; ++g) st.acc[g][i] += p[g] * v;
                }
            }
        }
        // merge the warps of the block, write this split's (acc, max, sum)
#pragma unroll
        for (int g = 0; g < QG; ++g) {
            float lt = st.l[g];
#pragma unroll
            for (int o = 16; o >= 1; o >>= 1) lt += __shfl_xor_sync(FULL, lt, o);
            float* mw = mrg + (warp * QG + g) * (D + 2);
#pragma unroll
            for (int i = 0; i < SPL; ++i) mw[slot0 + i] = st.acc[g][i];
            if (lane == 0) {
                mw[D] = st.m[g];
                mw[D + 1] = lt;
            }
        }
        __syncthreads();
        for (int e = threadIdx.x; e < QG * D; e += blockDim.x) {
            const int g = e / D, slot = e % D;
            float mx = NEG_BIG;
            for (int w = 0; w < WARPS; ++w) mx = fmaxf(mx, mrg[(w * QG + g) * (D + 2) + D]);
            float a = 0.0f, l = 0.0f;
            for (int w = 0; w < WARPS; ++w) {
                const float* mw = mrg + (w * QG + g) * (D + 2);
                const float f = ex2(mw[D] - mx);
                a += mw[slot] * f;
                l += mw[D + 1] * f;
            }
            const i64 row = ((i64)b * heads * QG + h * QG + g) * splits + s;
            acc_out[row * D + vch[h * D + slot]] = a;
            if (slot == 0) {
                ml_out[row * 2] = mx;
                ml_out[row * 2 + 1] = l;
            }
        }
        __syncthreads();
    }
}
