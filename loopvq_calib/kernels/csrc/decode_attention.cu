extern "C" __global__ void __launch_bounds__(WARPS * 32, 1) loopvq_decode_split(
    const void* __restrict__ q, const u8* __restrict__ kidx, const u8* __restrict__ vidx,
    const u16* __restrict__ sig, const void* __restrict__ ktab_g, const void* __restrict__ vtab_g,
    const int* __restrict__ kcol_g, const int* __restrict__ vcol_g, const int* __restrict__ kch,
    const int* __restrict__ vch, const int* __restrict__ kpair, const int* __restrict__ p0,
    const float* __restrict__ cos_t, const float* __restrict__ sin_t, const void* __restrict__ fk, const void* __restrict__ fv,
    const int* __restrict__ fpos, const signed char* __restrict__ fmask, float* __restrict__ acc_out,
    float* __restrict__ ml_out, int* __restrict__ count, void* __restrict__ out, const int* __restrict__ n_live,
    int n_batch, int n_coded, int n_fp, int split_len, int qk_scale_bits,
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
    int fr[PPL];  // the cos/sin column (RoPE pair) of each of the lane's pairs
#pragma unroll
    for (int j = 0; j < PPL; ++j) fr[j] = PAIRS ? kpair[h * HD2 + l * PPL + j] : l * PPL + j;
    float cg2[PPL];  // 2 cos(GRP theta) of the lane's pairs (GRP positions: the step between a group's tokens)
    load_pairs(cos_t + GRP * HD2, fr, cg2);
#pragma unroll
    for (int j = 0; j < PPL; ++j) cg2[j] *= 2.0f;

#if LIVE
    n_coded = min(n_coded, *n_live);  // the valid count read on the device (a static cache under a CUDA graph)
#endif
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
            load_pairs(cos_t + pos * HD2, fr, cf);
            load_pairs(sin_t + pos * HD2, fr, sf);
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
                const i64 pos = pb + t0 + grp;  // < pb + n_coded + GRP - 1: inside the table (decode_cuda_plan.rope_rows)
                float cc[PPL], ss[PPL], cg[PPL], sg2[PPL];  // at the position; rotation by GRP positions
                load_pairs(cos_t + pos * HD2, fr, cc);
                load_pairs(sin_t + pos * HD2, fr, ss);
                load_pairs(cos_t + GRP * HD2, fr, cg);
                load_pairs(sin_t + GRP * HD2, fr, sg2);
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
                        const float c = 0.5f * cg2[j], sn = sin_t[GRP * HD2 + fr[j]];  // angle addition (exact halving)
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
