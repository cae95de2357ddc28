// Decode attention over coded pages with the step tables in shared memory (loopvq_calib/decode_cuda.py
// compiles this text with NVRTC at first use; design in docs/quantized-cache.md).
//
// One block per (KV head, split of the coded tokens); it copies the head's key and value step tables into
// shared memory once (in *lane order*, see decode_lanes.lane_tables) and loops over the batch. A token is
// served by a group of LPT lanes: lane l of the group owns CPL = D/LPT channels, the two channels of each of
// its PPL RoPE pairs for keys (so the query's rotation is lane-local) and CPL value channels. The channels a
// lane reads from one code form a *run* (RK key / RV value slots, one index byte and one vector load each;
// KG / VG index bytes of adjacent columns are read with one load). Per warp step each of the GRP = 32/LPT
// groups takes U tokens (interleaved: group j takes tokens GRP u + j), their index rows staged in shared
// memory by cp.async one step ahead. Keys: the query is rotated to the token's position on the query side
// (q . R(t) k = k . R(t)^T q), anchored from the cos/sin table every AE steps and advanced by GRP positions
// per token (CHEB: x(t+GRP) = 2 cos(GRP theta) x(t) - x(t-GRP), one FMA per channel; else angle addition);
// KH2: fp16 key table, the dot product in packed half2 FMAs. The U partial dot products are reduce-scattered
// over the group (each lane then holds one token's logit); softmax base 2 with a lazily moved reference
// maximum; values accumulate per lane (VH2: packed half2 FMAs over a step, added into float32 after it).
// Full-precision sink/window tokens are spread over every block's groups. Warps are merged through shared
// memory; the block writes its split's (acc in channel order, max, sum) and counts itself in for the (row, KV
// head); the split that arrives last merges every split's result by log-sum-exp, writes the output in q's dtype
// and resets the counter to zero for the next launch (one launch per call, no merge kernel).
//
// RPB batch rows are served at once (WARPS / RPB warps each), so that one row's latencies (its first index
// rows, the full-precision tokens, the merge) overlap another row's work.
//
// Constants defined before this text: D, LPT (8 or 16), RPB (rows per pass), QG (query heads per KV head), U, WARPS, KCB
// (codebook size), NKC / NVC (index bytes per token: key / value codes), RK / RV (run lengths), KMIX (key runs
// hold both channels of their pairs), KG / VG (runs whose index bytes are read together: 1, 2 or 4), KT32 /
// VT32 (key / value tables in fp32, else fp16), CHEB, TASQ, HAS_MASK, ACT (0 bf16, 1 fp16, 2 fp32: q
// and the full-precision keys/values, and the output), IDXVEC (bytes per cp.async: 4 or 16).

#ifndef RPB
#define RPB 1  // batch rows per pass (decode_cuda defines it; 1 for other builders)
#endif
#if RPB < 1 || WARPS % RPB != 0
#error "RPB (batch rows per pass) must divide WARPS: every row of a pass gets WARPS / RPB warps"
#endif

typedef unsigned char u8;
typedef unsigned short u16;
typedef long long i64;

#define FULL 0xffffffffu
#define NEG_BIG (-1.0e30f)
#define NEG_INF __int_as_float(0xff800000)
#define GRP (32 / LPT)           // tokens per warp and step index u
#define CPL (D / LPT)            // channels per lane
#define PPL (CPL / 2)            // RoPE pairs per lane
#define HD2 (D / 2)              // columns of the cos/sin table
#define NRK (CPL / RK)           // key runs per lane
#define NRV (CPL / RV)           // value runs per lane
#define TOK (GRP * U)            // tokens per warp step
#define SPREAD (LPT / U)         // lanes of a group that hold one token's logit after the reduction
#define LOGU (U == 16 ? 4 : U == 8 ? 3 : U == 4 ? 2 : U == 2 ? 1 : 0)
#define KH2 (!KT32 && RK % 2 == 0)
#define VH2 (!VT32 && RV % 2 == 0)
#define THR (VH2 ? 0.0f : 8.0f)  // packed half accumulation needs weights <= 1
#define AE (CHEB ? 4 : 1)        // warp steps between anchors of the rotation (CHEB: error ~ (GRP U AE)^2 ulp)
#define ALIGN16(x) (((x) + 15) / 16 * 16)
#define KT_BYTES (D * KCB * (KT32 ? 4 : 2))
#define VT_BYTES (D * KCB * (VT32 ? 4 : 2))
#define STAGE_WARP (2 * TOK * (NKC + NVC))
#define MRG_BYTES (WARPS * QG * (D + 2) * 4)
#define STAGE_BYTES ALIGN16(WARPS * STAGE_WARP > MRG_BYTES ? WARPS * STAGE_WARP : MRG_BYTES)
#define WPR (WARPS / RPB)        // warps per batch row of a pass
#define ROWK (LPT * RK * (KT32 ? 4 : 2))  // bytes of one codeword's row of one key run (all lanes)
#define ROWV (LPT * RV * (VT32 ? 4 : 2))
// register of key run r, position i: split runs hold only first or only second channels of pairs
#define REGK(r, i) (KMIX ? ((i) < RK / 2 ? (r) * (RK / 2) + (i) : PPL + (r) * (RK / 2) + (i) - RK / 2) : (r) * RK + (i))

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

__device__ __forceinline__ float ldcg(const float* p) {  // from L2, not L1: another block wrote it
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void store_act(void* p, i64 i, float x) {  // x in q's dtype (round to nearest)
#if ACT == 0
    u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
    ((u16*)p)[i] = h;
#elif ACT == 1
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    ((u16*)p)[i] = h;
#else
    ((float*)p)[i] = x;
#endif
}

__device__ __forceinline__ unsigned hfma2(unsigned a, unsigned b, unsigned c) {
    unsigned d;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

__device__ __forceinline__ unsigned half2_of(float x) {  // (x, x) as packed f16x2
    unsigned d;
    asm("{\n\t.reg .b16 h;\n\tcvt.rn.f16.f32 h, %1;\n\tmov.b32 %0, {h, h};\n\t}" : "=r"(d) : "f"(x));
    return d;
}

__device__ __forceinline__ unsigned pack_half2(float lo, float hi) {  // lo in the lower half (lower address)
    unsigned d;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}

__device__ __forceinline__ float sum_halves(unsigned w) {  // lower + upper half of a packed f16x2, in float32
    float lo, hi;
    asm("{\n\t.reg .b16 a, b;\n\tmov.b32 {a, b}, %2;\n\tcvt.f32.f16 %0, a;\n\tcvt.f32.f16 %1, b;\n\t}"
        : "=f"(lo), "=f"(hi) : "r"(w));
    return lo + hi;
}

__device__ __forceinline__ unsigned lds8u(unsigned a) {
    unsigned v;
    asm("ld.shared.u8 %0, [%1];" : "=r"(v) : "r"(a));
    return v;
}

__device__ __forceinline__ unsigned lds16w(unsigned a) {
    unsigned v;
    asm("ld.shared.u16 %0, [%1];" : "=r"(v) : "r"(a));
    return v;
}

__device__ __forceinline__ void floats_of(unsigned w, float& lo, float& hi) {
    asm("{\n\t.reg .b16 a, b;\n\tmov.b32 {a, b}, %2;\n\tcvt.f32.f16 %0, a;\n\tcvt.f32.f16 %1, b;\n\t}"
        : "=f"(lo), "=f"(hi) : "r"(w));
}

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    unsigned a;
    asm("{\n\t.reg .u64 t;\n\tcvta.to.shared.u64 t, %1;\n\tcvt.u32.u64 %0, t;\n\t}" : "=r"(a) : "l"(p));
    return a;
}

__device__ __forceinline__ void cp_async(unsigned dst, const void* src, int valid) {  // zero-fills when !valid
#if IDXVEC == 16
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid) : "memory");
#else
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(valid) : "memory");
#endif
}

__device__ __forceinline__ void cp_async16(unsigned dst, const void* src) {  // 16 bytes, L2 only
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}

__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// N consecutive floats from global memory (vector loads where the count allows; rows are 16-byte aligned)
template <int N>
__device__ __forceinline__ void load_floats(const float* p, float* o) {
    if (N % 4 == 0) {
#pragma unroll
        for (int i = 0; i < N / 4; ++i) {
            const float4 w = ((const float4*)p)[i];
            o[4 * i] = w.x; o[4 * i + 1] = w.y; o[4 * i + 2] = w.z; o[4 * i + 3] = w.w;
        }
    } else if (N % 2 == 0) {
#pragma unroll
        for (int i = 0; i < N / 2; ++i) {
            const float2 w = ((const float2*)p)[i];
            o[2 * i] = w.x; o[2 * i + 1] = w.y;
        }
    } else {
#pragma unroll
        for (int i = 0; i < N; ++i) o[i] = p[i];
    }
}

// shared-memory loads at 32-bit shared addresses (one address add per load instead of two)
__device__ __forceinline__ float4 lds128f(unsigned a) {
    float4 v;
    asm("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(a));
    return v;
}
__device__ __forceinline__ uint2 lds64u(unsigned a) {
    uint2 v;
    asm("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(a));
    return v;
}
__device__ __forceinline__ unsigned lds32u(unsigned a) {
    unsigned v;
    asm("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(a));
    return v;
}
__device__ __forceinline__ u16 lds16u(unsigned a) {
    u16 v;
    asm("ld.shared.u16 %0, [%1];" : "=h"(v) : "r"(a));
    return v;
}

// R table values (one run) at shared address a as floats: fp32 (F32) or fp16 bits
template <int R, bool F32>
__device__ __forceinline__ void load_run(unsigned a, float* o) {
    if (F32 && R % 4 == 0) {
#pragma unroll
        for (int i = 0; i < R / 4; ++i) {
            const float4 w = lds128f(a + 16 * i);
            o[4 * i] = w.x; o[4 * i + 1] = w.y; o[4 * i + 2] = w.z; o[4 * i + 3] = w.w;
        }
    } else if (F32 && R % 2 == 0) {
#pragma unroll
        for (int i = 0; i < R / 2; ++i) {
            const uint2 w = lds64u(a + 8 * i);
            o[2 * i] = __uint_as_float(w.x); o[2 * i + 1] = __uint_as_float(w.y);
        }
    } else if (F32) {
#pragma unroll
        for (int i = 0; i < R; ++i) o[i] = __uint_as_float(lds32u(a + 4 * i));
    } else if (R % 4 == 0) {
#pragma unroll
        for (int i = 0; i < R / 4; ++i) {
            const uint2 w = lds64u(a + 8 * i);
            o[4 * i] = h2f((u16)(w.x & 0xffff)); o[4 * i + 1] = h2f((u16)(w.x >> 16));
            o[4 * i + 2] = h2f((u16)(w.y & 0xffff)); o[4 * i + 3] = h2f((u16)(w.y >> 16));
        }
    } else if (R % 2 == 0) {
#pragma unroll
        for (int i = 0; i < R / 2; ++i) {
            const unsigned w = lds32u(a + 4 * i);
            o[2 * i] = h2f((u16)(w & 0xffff)); o[2 * i + 1] = h2f((u16)(w >> 16));
        }
    } else {
#pragma unroll
        for (int i = 0; i < R; ++i) o[i] = h2f(lds16u(a + 2 * i));
    }
}

// R fp16 table values (R even) at shared address a as R/2 packed words
template <int R>
__device__ __forceinline__ void load_words(unsigned a, unsigned* o) {
    if (R % 4 == 0) {
#pragma unroll
        for (int i = 0; i < R / 4; ++i) {
            const uint2 w = lds64u(a + 8 * i);
            o[2 * i] = w.x; o[2 * i + 1] = w.y;
        }
    } else {
#pragma unroll
        for (int i = 0; i < R / 2; ++i) o[i] = lds32u(a + 4 * i);
    }
}

// v[N] per lane -> sum over the LPT lanes of a group of v[u], u = l / (LPT / N), held by lane l
template <int N, int LOGN>
__device__ __forceinline__ float reduce_scatter(float* v, int l) {
#pragma unroll
    for (int step = 0; step < LOGN; ++step) {
        const int n = N >> step, o = (LPT / 2) >> step;
        const bool up = l & o;
#pragma unroll
        for (int i = 0; i < N / 2; ++i) {  // a constant trip count: with n / 2 (constant only once the step loop is
            // unrolled) nvcc left this loop rolled at N = 16 and moved v to local memory
            if (i < n / 2) {
                const float send = up ? v[i] : v[i + n / 2];
                const float keep = up ? v[i + n / 2] : v[i];
                v[i] = keep + __shfl_xor_sync(FULL, send, o);
            }
        }
    }
    float r = v[0];
#pragma unroll
    for (int o = LPT / N / 2; o >= 1; o >>= 1) r += __shfl_xor_sync(FULL, r, o);
    return r;
}

// the index bytes of G runs with adjacent index columns (the first at shared address a) of a staged row
template <int G>
__device__ __forceinline__ void index_bytes(unsigned a, int* idx) {
    if (G == 1) {
        idx[0] = (int)lds8u(a);
        return;
    }
    const unsigned w = G == 4 ? lds32u(a) : lds16w(a);
#pragma unroll
    for (int i = 0; i < G; ++i) {  // byte i alone (one PRMT)
        unsigned b;
        asm("prmt.b32 %0, %1, 0, %2;" : "=r"(b) : "r"(w), "r"(0x4440 | i));
        idx[i] = (int)b;
    }
}

// move the reference maximum of query head g to the warp's largest logit when it exceeds it by more than THR
__device__ __forceinline__ void lift_max(float& m, float& l, float* acc, float sc) {
    float mx = sc;
#pragma unroll
    for (int o = 16; o >= 1; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, o));
    if (mx > m + THR) {  // warp-uniform
        const float alpha = ex2(m - mx);
        l *= alpha;
#pragma unroll
        for (int j = 0; j < CPL; ++j) acc[j] *= alpha;
        m = mx;
    }
}

extern "C" __global__ void __launch_bounds__(WARPS * 32, 1) loopvq_decode_split(
    const void* __restrict__ q, const u8* __restrict__ kidx, const u8* __restrict__ vidx,
    const u16* __restrict__ sig, const void* __restrict__ ktab_g, const void* __restrict__ vtab_g,
    const int* __restrict__ kcol_g, const int* __restrict__ vcol_g, const int* __restrict__ kch,
    const int* __restrict__ vch, const int* __restrict__ p0, const float* __restrict__ cos_t,
    const float* __restrict__ sin_t, const void* __restrict__ fk, const void* __restrict__ fv,
    const int* __restrict__ fpos, const signed char* __restrict__ fmask, float* __restrict__ acc_out,
    float* __restrict__ ml_out, int* __restrict__ count, void* __restrict__ out, int n_batch, int n_coded, int n_fp, int split_len, int qk_scale_bits,
    int s_kib, int s_kih, int s_vib, int s_vih, int s_sb, int s_st,
    int s_fkb, int s_fkt, int s_fkh, int s_fvb, int s_fvt, int s_fvh, int s_fpb) {
    extern __shared__ __align__(16) unsigned char smem[];
    unsigned char* ktab = smem;
    unsigned char* vtab = ktab + KT_BYTES;
    unsigned char* stage = vtab + VT_BYTES;     // [WARPS][2 buffers][TOK key rows, TOK value rows]
    float* mrg = (float*)stage;                 // [WARPS][QG][D + 2], only while merging (stage is idle then)
    float* qs = (float*)(stage + STAGE_BYTES);  // [RPB][QG][D]: the scaled queries in lane order
    float* pbuf = qs + RPB * QG * D;            // [WARPS][QG][GRP][U]: the step's softmax weights
    int* chans = (int*)(pbuf + WARPS * QG * TOK);  // [2][D]: the head's key and value channel of every lane slot
    const int h = blockIdx.x, s = blockIdx.y, heads = gridDim.x, splits = gridDim.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, grp = lane / LPT, l = lane % LPT;
    const int rsub = warp / WPR, wr = warp % WPR;  // this warp's row of the pass, and its place among that row's warps
    const float scale = __int_as_float(qk_scale_bits);  // passed as bits: no float ABI to agree on

    {  // the head's step tables into shared memory, 16 bytes at a time
        const uint4* sk = (const uint4*)((const unsigned char*)ktab_g + (i64)h * KT_BYTES);
        const uint4* sv = (const uint4*)((const unsigned char*)vtab_g + (i64)h * VT_BYTES);
        // every copy in flight at once (cp.async), not a few loads per thread at a time
        const unsigned kt = smem_addr(ktab), vt = smem_addr(vtab);
        for (int i = threadIdx.x; i < KT_BYTES / 16; i += blockDim.x) cp_async16(kt + 16 * i, sk + i);
        for (int i = threadIdx.x; i < VT_BYTES / 16; i += blockDim.x) cp_async16(vt + 16 * i, sv + i);
        cp_commit();
        for (int i = threadIdx.x; i < D; i += blockDim.x) {
            chans[i] = kch[h * D + i];
            chans[D + i] = vch[h * D + i];
        }
        cp_wait<0>();
    }
    __syncthreads();  // the tables (cp_wait above) and the channel maps are complete for every thread from here on
    const int* kchan = chans;  // shared copies: the full-precision tokens and the merge read them per row
    const int* vchan = chans + D;
    // per run of the lane: its index column and the shared address of its values in codeword 0 (+ index * row bytes)
    const unsigned sm = smem_addr(smem);
    unsigned kofs[NRK], vofs[NRV];
    int kcol[NRK], vcol[NRV];
#pragma unroll
    for (int r = 0; r < NRK; ++r) {
        kcol[r] = kcol_g[(h * LPT + l) * NRK + r];
        kofs[r] = sm + (r * KCB * LPT + l) * RK * (KT32 ? 4 : 2);
    }
#pragma unroll
    for (int r = 0; r < NRV; ++r) {
        vcol[r] = vcol_g[(h * LPT + l) * NRV + r];
        vofs[r] = sm + KT_BYTES + (r * KCB * LPT + l) * RV * (VT32 ? 4 : 2);
    }
    float cg2[PPL];  // 2 cos(GRP theta) of the lane's pairs (GRP positions: the step between a group's tokens)
    load_floats<PPL>(cos_t + GRP * HD2 + l * PPL, cg2);
#pragma unroll
    for (int j = 0; j < PPL; ++j) cg2[j] *= 2.0f;

    const int start = s * split_len, end = min(start + split_len, n_coded);
    const int per_warp = ((max(end - start, 0) + WPR - 1) / WPR + TOK - 1) / TOK * TOK;
    const int w_begin = start + wr * per_warp, w_last = min(w_begin + per_warp, end);
    unsigned char* st = stage + warp * STAGE_WARP;
    const unsigned stage_addr = smem_addr(st);

    for (int b0 = 0; b0 < n_batch; b0 += RPB) {
        for (int e = threadIdx.x; e < RPB * QG * D; e += blockDim.x) {
            const int r = e / (QG * D), g = e / D % QG, slot = e % D;
            if (b0 + r < n_batch) qs[e] = act(q, ((i64)(b0 + r) * heads * QG + h * QG + g) * D + kchan[slot]) * scale;
        }
        const bool live = b0 + rsub < n_batch;  // warp-uniform: the last pass may have fewer rows
        const int b = live ? b0 + rsub : n_batch - 1, w_end = live ? w_last : w_begin, n_fp_row = live ? n_fp : 0;
        const i64 pb = p0[b];
        const u8* krow = kidx + (i64)b * s_kib + (i64)h * s_kih;  // token t's key bytes at krow + t * NKC
        const u8* vrow = vidx + (i64)b * s_vib + (i64)h * s_vih;
        const u16* srow = sig + (i64)b * s_sb;

        // one warp step's index rows into stage buffer `buf` (rows past the warp's range are zero-filled)
        auto issue = [&](int t0, int buf) {
            const unsigned base = stage_addr + buf * TOK * (NKC + NVC);
#pragma unroll
            for (int c = lane; c < TOK * NKC / IDXVEC; c += 32) {
                const bool ok = t0 + c * IDXVEC / NKC < w_end;
                cp_async(base + c * IDXVEC, krow + (ok ? t0 * NKC + c * IDXVEC : 0), ok ? IDXVEC : 0);
            }
#pragma unroll
            for (int c = lane; c < TOK * NVC / IDXVEC; c += 32) {
                const bool ok = t0 + c * IDXVEC / NVC < w_end;
                cp_async(base + TOK * NKC + c * IDXVEC, vrow + (ok ? t0 * NVC + c * IDXVEC : 0), ok ? IDXVEC : 0);
            }
            cp_commit();
        };
        if (w_begin < w_end) issue(w_begin, 0);
        __syncthreads();  // qs written

        float m[QG], ls[QG], acc[QG][CPL];
#pragma unroll
        for (int g = 0; g < QG; ++g) {
            m[g] = NEG_BIG;
            ls[g] = 0.0f;
#pragma unroll
            for (int j = 0; j < CPL; ++j) acc[g][j] = 0.0f;
        }

        // the full-precision sink and window tokens (pre-RoPE, at their own positions), spread over all blocks
        for (int base = (s * WPR + wr) * GRP; base < n_fp_row; base += splits * WPR * GRP) {
            const int t = min(base + grp, n_fp - 1);
            const i64 pos = fpos[(i64)b * s_fpb + t];
            const i64 krw = (i64)b * s_fkb + (i64)t * s_fkt + (i64)h * s_fkh;
            const i64 vrw = (i64)b * s_fvb + (i64)t * s_fvt + (i64)h * s_fvh;
            float cf[PPL], sf[PPL], kf[CPL];
            load_floats<PPL>(cos_t + pos * HD2 + l * PPL, cf);
            load_floats<PPL>(sin_t + pos * HD2 + l * PPL, sf);
#pragma unroll
            for (int j = 0; j < CPL; ++j) kf[j] = act(fk, krw + kchan[l * CPL + j]);
            bool ok = base + grp < n_fp;
#if HAS_MASK
            ok = ok && fmask[(i64)b * s_fpb + t] != 0;
#endif
#pragma unroll
            for (int g = 0; g < QG; ++g) {
                const float* qv = qs + (rsub * QG + g) * D + l * CPL;
                float a = 0.0f;
#pragma unroll
                for (int j = 0; j < PPL; ++j) {
                    const float qa = qv[j], qb = qv[PPL + j];
                    a += kf[j] * (qa * cf[j] + qb * sf[j]) + kf[PPL + j] * (qb * cf[j] - qa * sf[j]);
                }
#pragma unroll
                for (int o = LPT / 2; o >= 1; o >>= 1) a += __shfl_xor_sync(FULL, a, o);
                const float sc = ok ? a : NEG_INF;
                lift_max(m[g], ls[g], acc[g], sc);
                const float p = ex2(sc - m[g]);
                if (l == 0) ls[g] += p;
#pragma unroll
                for (int j = 0; j < CPL; ++j) acc[g][j] += p * act(fv, vrw + vchan[l * CPL + j]);
            }
        }

        // the query rotated to the group's next token (xc) and GRP positions before it (xp); the recurrence runs
        // on from step to step and is re-anchored from the cos/sin table every AE steps
        float xc[QG][CPL], xp[QG][CPL];
        int buf = 0, since = 0;
        for (int t0 = w_begin; t0 < w_end; t0 += TOK, buf ^= 1, since = since + 1 == AE ? 0 : since + 1) {
            if (since == 0) {  // warp-uniform
                const i64 pos = pb + t0 + grp;  // < pb + n_coded + GRP - 1: inside the table (decode_cuda.rope_rows)
                float cc[PPL], ss[PPL], cg[PPL], sg2[PPL];  // at the position; rotation by GRP positions
                load_floats<PPL>(cos_t + pos * HD2 + l * PPL, cc);
                load_floats<PPL>(sin_t + pos * HD2 + l * PPL, ss);
                load_floats<PPL>(cos_t + GRP * HD2 + l * PPL, cg);
                load_floats<PPL>(sin_t + GRP * HD2 + l * PPL, sg2);
#pragma unroll
                for (int g = 0; g < QG; ++g) {
                    const float* qv = qs + (rsub * QG + g) * D + l * CPL;
#pragma unroll
                    for (int j = 0; j < PPL; ++j) {
                        const float qa = qv[j], qb = qv[PPL + j];
                        const float xa = qa * cc[j] + qb * ss[j], xb = qb * cc[j] - qa * ss[j];
                        xc[g][j] = xa;
                        xc[g][PPL + j] = xb;
#if CHEB
                        xp[g][j] = cg[j] * xa - sg2[j] * xb;
                        xp[g][PPL + j] = cg[j] * xb + sg2[j] * xa;
#endif
                    }
                }
            }
            if (t0 + TOK < w_end) {  // the next step's index rows, in flight during this one
                issue(t0 + TOK, buf ^ 1);
            } else {
                cp_commit();  // an empty group: wait_group 1 below then waits for this step's rows
            }
#if TASQ
            const int my_t = min(t0 + GRP * (l / SPREAD) + grp, w_end - 1);  // this lane's token after the reduction
            const float sgm = h2f(srow[(i64)my_t * s_st]);  // sig points at the step's column
#endif
            cp_wait<1>();
            __syncwarp();
            // row of token GRP u + grp at ks + GRP u NKC
            const unsigned ks = stage_addr + buf * TOK * (NKC + NVC) + grp * NKC;
            const unsigned vs = stage_addr + buf * TOK * (NKC + NVC) + TOK * NKC + grp * NVC;

            float part[QG][U];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                int idx[NRK];
#pragma unroll
                for (int r = 0; r < NRK; r += KG) index_bytes<KG>(ks + GRP * u * NKC + kcol[r], idx + r);
#if KH2
                unsigned kw[CPL / 2];  // run r's words: positions (2i, 2i + 1) as packed halves
#pragma unroll
                for (int r = 0; r < NRK; ++r) load_words<RK>(kofs[r] + idx[r] * ROWK, kw + r * (RK / 2));
#pragma unroll
                for (int g = 0; g < QG; ++g) {
                    unsigned a2 = 0u;
#pragma unroll
                    for (int r = 0; r < NRK; ++r) {
#pragma unroll
                        for (int i = 0; i < RK / 2; ++i)
                            a2 = hfma2(kw[r * (RK / 2) + i], pack_half2(xc[g][REGK(r, 2 * i)], xc[g][REGK(r, 2 * i + 1)]), a2);
                    }
                    part[g][u] = sum_halves(a2);
                }
#else
                float kv[CPL];
#pragma unroll
                for (int r = 0; r < NRK; ++r) {
                    float t[RK];
                    load_run<RK, KT32>(kofs[r] + idx[r] * ROWK, t);
#pragma unroll
                    for (int i = 0; i < RK; ++i) kv[REGK(r, i)] = t[i];
                }
#pragma unroll
                for (int g = 0; g < QG; ++g) {
                    float a = 0.0f;
#pragma unroll
                    for (int j = 0; j < CPL; ++j) a = fmaf(kv[j], xc[g][j], a);
                    part[g][u] = a;
                }
#endif
#pragma unroll
                for (int g = 0; g < QG; ++g) {  // advance the rotation by GRP positions
#pragma unroll
                    for (int j = 0; j < PPL; ++j) {
#if CHEB
                        const float na = fmaf(cg2[j], xc[g][j], -xp[g][j]);
                        const float nb = fmaf(cg2[j], xc[g][PPL + j], -xp[g][PPL + j]);
                        xp[g][j] = xc[g][j];
                        xp[g][PPL + j] = xc[g][PPL + j];
#else
                        const float c = 0.5f * cg2[j], sn = sin_t[GRP * HD2 + l * PPL + j];  // angle addition (exact halving)
                        const float na = c * xc[g][j] + sn * xc[g][PPL + j];
                        const float nb = c * xc[g][PPL + j] - sn * xc[g][j];
#endif
                        xc[g][j] = na;
                        xc[g][PPL + j] = nb;
                    }
                }
            }
            const int my_u = l / SPREAD;  // the token (GRP my_u + grp of the step) whose logit this lane holds
            float p[QG];
#pragma unroll
            for (int g = 0; g < QG; ++g) {
                float sc = reduce_scatter<U, LOGU>(part[g], l);
#if TASQ
                sc *= sgm;
#endif
                if (t0 + GRP * my_u + grp >= w_end) sc = NEG_INF;
                lift_max(m[g], ls[g], acc[g], sc);
                p[g] = ex2(sc - m[g]);
                if (l % SPREAD == 0) ls[g] += p[g];
            }
            float* pw = pbuf + (warp * QG * GRP + grp) * U;  // query head g's weights at pw + g GRP U
            if (l % SPREAD == 0) {
#pragma unroll
                for (int g = 0; g < QG; ++g) {
#if VH2
                    ((unsigned*)pw)[g * GRP * U + my_u] = half2_of(p[g]);
#else
                    pw[g * GRP * U + my_u] = p[g];
#endif
                }
            }
            __syncwarp();
#if VH2
            unsigned acch[QG][CPL / 2];
#pragma unroll
            for (int g = 0; g < QG; ++g) {
#pragma unroll
                for (int w = 0; w < CPL / 2; ++w) acch[g][w] = 0u;
            }
#endif
#pragma unroll
            for (int u = 0; u < U; ++u) {
                int idx[NRV];
#pragma unroll
                for (int r = 0; r < NRV; r += VG) index_bytes<VG>(vs + GRP * u * NVC + vcol[r], idx + r);
#if VH2
                unsigned vw[CPL / 2];
#pragma unroll
                for (int r = 0; r < NRV; ++r) load_words<RV>(vofs[r] + idx[r] * ROWV, vw + r * (RV / 2));
#pragma unroll
                for (int g = 0; g < QG; ++g) {
                    const unsigned pp = ((const unsigned*)pw)[g * GRP * U + u];  // a broadcast read
#pragma unroll
                    for (int w = 0; w < CPL / 2; ++w) acch[g][w] = hfma2(vw[w], pp, acch[g][w]);
                }
#else
                float vv[CPL];
#pragma unroll
                for (int r = 0; r < NRV; ++r) load_run<RV, VT32>(vofs[r] + idx[r] * ROWV, vv + r * RV);
#pragma unroll
                for (int g = 0; g < QG; ++g) {
                    const float pp = pw[g * GRP * U + u];
#pragma unroll
                    for (int j = 0; j < CPL; ++j) acc[g][j] = fmaf(pp, vv[j], acc[g][j]);
                }
#endif
            }
#if VH2
#pragma unroll
            for (int g = 0; g < QG; ++g) {
#pragma unroll
                for (int w = 0; w < CPL / 2; ++w) {
                    float lo, hi;
                    floats_of(acch[g][w], lo, hi);
                    acc[g][2 * w] += lo;
                    acc[g][2 * w + 1] += hi;
                }
            }
#endif
            __syncwarp();  // this step's buffer and weights are read: the next step may refill them
        }
        cp_wait<0>();
        __syncthreads();  // every warp is done with its stage buffers: the merge area may overwrite them

        // merge the warps of the block (the groups hold the same channels), write this split's (acc, max, sum)
#pragma unroll
        for (int g = 0; g < QG; ++g) {
            float lt = ls[g];
#pragma unroll
            for (int o = 16; o >= 1; o >>= 1) lt += __shfl_xor_sync(FULL, lt, o);
            float* mw = mrg + (warp * QG + g) * (D + 2);
#pragma unroll
            for (int j = 0; j < CPL; ++j) {
                float a = acc[g][j];
#pragma unroll
                for (int o = LPT; o < 32; o <<= 1) a += __shfl_xor_sync(FULL, a, o);
                if (grp == 0) mw[l * CPL + j] = a;
            }
            if (lane == 0) {
                mw[D] = m[g];
                mw[D + 1] = lt;
            }
        }
        __syncthreads();
        for (int e = threadIdx.x; e < RPB * QG * D; e += blockDim.x) {
            const int r = e / (QG * D), g = e / D % QG, slot = e % D;
            if (b0 + r >= n_batch) continue;
            const int b = b0 + r;
            float mx = NEG_BIG;
            for (int w = r * WPR; w < (r + 1) * WPR; ++w) mx = fmaxf(mx, mrg[(w * QG + g) * (D + 2) + D]);
            float a = 0.0f, lsum = 0.0f;
            for (int w = r * WPR; w < (r + 1) * WPR; ++w) {
                const float* mw = mrg + (w * QG + g) * (D + 2);
                const float f = ex2(mw[D] - mx);
                a += mw[slot] * f;
                lsum += mw[D + 1] * f;
            }
            const i64 row = ((i64)b * heads * QG + h * QG + g) * splits + s;
            acc_out[row * D + vchan[slot]] = a;
            if (slot == 0) {
                ml_out[row * 2] = mx;
                ml_out[row * 2 + 1] = lsum;
            }
        }
        // count this split in for each row of the pass; the last split of a (row, head) merges them all
        __threadfence();  // this block's partial results are visible device-wide before its arrival counts
        __syncthreads();
        int* last = (int*)pbuf;  // [RPB] (the weights are idle now): whether this block arrived last for row r
        if (threadIdx.x < RPB) {
            const int b = b0 + threadIdx.x;
            int arrived = 0;
            if (b < n_batch) {
                int* c = count + (i64)b * heads + h;
                arrived = atomicAdd(c, 1) == splits - 1;
                if (arrived) *c = 0;  // every split of this launch has counted: ready for the next launch
                __threadfence();      // the other splits' results are read after their arrivals
            }
            last[threadIdx.x] = arrived;
        }
        __syncthreads();
        for (int e = threadIdx.x; e < RPB * QG * D; e += blockDim.x) {
            const int r = e / (QG * D), g = e / D % QG, c = e % D;  // channel c of query head g
            if (b0 + r >= n_batch || !last[r]) continue;
            const i64 row = ((i64)(b0 + r) * heads * QG + h * QG + g);
            const float* mls = ml_out + row * splits * 2;
            float mx = NEG_BIG;
            for (int j = 0; j < splits; ++j) mx = fmaxf(mx, ldcg(mls + 2 * j));
            float a = 0.0f, lsum = 0.0f;
            for (int j = 0; j < splits; ++j) {  // other blocks wrote these: read from L2
                const float f = ex2(ldcg(mls + 2 * j) - mx);
                a += ldcg(acc_out + (row * splits + j) * D + c) * f;
                lsum += ldcg(mls + 2 * j + 1) * f;
            }
            store_act(out, row * D + c, a / lsum);
        }
        __syncthreads();
    }
}
