// Decode attention over coded pages with the step tables in shared memory (loopvq_calib/kernels/decode_cuda.py
// compiles this text with NVRTC at first use; design in docs/serving.md).
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
// KH2: fp16 key table, the dot product in packed half2 FMAs. A lane's pairs read their cos/sin columns through
// a pair map (PAIRS: a channels layout's pairs in code order), else consecutive columns. The U partial dot
// products are reduce-scattered over the group (each lane then holds one token's logit); softmax base 2 with a
// lazily moved reference maximum; values accumulate per lane (VH2: packed half2 FMAs over a step, added into
// float32 after it).
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
// VT32 (key / value tables in fp32, else fp16), CHEB, TASQ, PAIRS (read the pair map kpair), HAS_MASK, LIVE (the
// coded count is min(n_coded, *n_live): read on the device), ACT (0 bf16, 1 fp16, 2 fp32: q and the full-precision
// keys/values, and the output), IDXVEC (bytes per cp.async: 4 or 16).

#ifndef RPB
#define RPB 1  // batch rows per pass (decode_cuda defines it; 1 for other builders)
#endif
#ifndef PAIRS
#define PAIRS 0  // the lane's pairs are consecutive cos/sin columns (decode_cuda defines it)
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

__device__ __forceinline__ float sum_halves(unsigned w) {  // lower + upper half of a packed f16x2, in float32
    float lo, hi;
    floats_of(w, lo, hi);
    return lo + hi;
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

// the cos/sin values of a lane's PPL pairs in one table row: columns fr[j] (PAIRS), else the consecutive columns
// from fr[0] (vector loads)
__device__ __forceinline__ void load_pairs(const float* row, const int* fr, float* o) {
#if PAIRS
#pragma unroll
    for (int j = 0; j < PPL; ++j) o[j] = row[fr[j]];
#else
    load_floats<PPL>(row + fr[0], o);
#endif
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

