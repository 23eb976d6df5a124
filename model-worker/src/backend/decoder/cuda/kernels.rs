//! The NVRTC kernels of the CUDA llama decoder (header-free f16 helpers from `encoder::cuda_f16`
//! are prepended at compile time).

pub(super) const KERNELS: &str = r#"
#define PAGE 16

__device__ float block_reduce(float v, float* buf, int is_max) {
  buf[threadIdx.x] = v;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) {
      float o = buf[threadIdx.x + s];
      buf[threadIdx.x] = is_max ? fmaxf(buf[threadIdx.x], o) : buf[threadIdx.x] + o;
    }
    __syncthreads();
  }
  float r = buf[0];
  __syncthreads();
  return r;
}

// x[r, :] = table[tokens[r], :] (f16 table, f32 residual stream).
extern "C" __global__ void embed_rows(float* x, const unsigned short* table,
    const unsigned* tokens, int rows, int h) {
  size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (size_t)rows * h) return;
  size_t r = i / h, c = i % h;
  x[i] = h2f(table[(size_t)tokens[r] * h + c]);
}

// out[b] = x[src] * rsqrt(mean(x[src]^2) + eps) * w as f16, src = rows ? rows[b] : b.
extern "C" __global__ void rms_norm(unsigned short* out, const float* x, const float* w,
    const int* rows, int h, float eps) {
  extern __shared__ float buf[];
  size_t b = blockIdx.x;
  const float* xr = x + (size_t)(rows ? rows[b] : (int)b) * h;
  float s = 0.f;
  for (int c = threadIdx.x; c < h; c += blockDim.x) s += xr[c] * xr[c];
  float inv = rsqrtf(block_reduce(s, buf, 0) / h + eps);
  for (int c = threadIdx.x; c < h; c += blockDim.x) out[b * h + c] = f2h(xr[c] * inv * w[c]);
}

// One block per row: rotates the consecutive pairs of every q and k head by the row's
// position, then stores the row's k and v into its cache slot. qkv rows are
// [q (heads*d) | k (kvh*d) | v (kvh*d)]; the caches hold slots of kvh*d.
extern "C" __global__ void rope_store(unsigned short* qkv, unsigned short* kc,
    unsigned short* vc, const int* pos, const int* slots, const float* cos_t,
    const float* sin_t, int heads, int kvh, int d) {
  int r = blockIdx.x, half = d / 2;
  int qw = heads * d, kw = kvh * d;
  unsigned short* row = qkv + (size_t)r * (qw + 2 * kw);
  const float* cs = cos_t + (size_t)pos[r] * half;
  const float* sn = sin_t + (size_t)pos[r] * half;
  for (int i = threadIdx.x; i < (heads + kvh) * half; i += blockDim.x) {
    int head = i / half, j = i % half;
    unsigned short* p = row + head * d + 2 * j;  // k heads follow the q heads
    float a = h2f(p[0]), b = h2f(p[1]);
    p[0] = f2h(a * cs[j] - b * sn[j]);
    p[1] = f2h(a * sn[j] + b * cs[j]);
  }
  __syncthreads();
  size_t slot = slots[r];
  for (int c = threadIdx.x; c < kw; c += blockDim.x) {
    kc[slot * kw + c] = row[qw + c];
    vc[slot * kw + c] = row[qw + kw + c];
  }
}

// One block per (row, head) (the rows listed in `only`, or every row when it is null):
// causal attention of the row's query over positions 0..=pos[r] of its sequence, whose pages are tables[tstart[r]..]. Scores: a thread per
// position (its key row read in 16-byte loads), so a decode row's few hundred positions
// take a few iterations of independent loads. Weighted sum: each warp takes every nw-th
// position and its lanes hold two dims each of the value row (one coalesced 4-byte load per
// lane), partial sums combined through shared memory. The row's page numbers are staged in
// shared memory first, so no cache load waits on a page-table load. d is 64 or 128
// (checked at load). Shared memory, in floats: d + 32 + nw * d + the longest span of the
// batch + its pages.
extern "C" __global__ void attention(unsigned short* out, const unsigned short* qkv,
    const unsigned short* kc, const unsigned short* vc, const int* pos, const int* tstart,
    const int* tables, const int* only, int heads, int kvh, int d, float scale) {
  extern __shared__ float sh[];
  int r = only ? only[blockIdx.x / heads] : blockIdx.x / heads, head = blockIdx.x % heads;
  int kvhead = head / (heads / kvh);
  int qw = heads * d, kw = kvh * d;
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  float* q = sh;
  float* wred = q + d;
  float* part = wred + 32;
  float* sc = part + nw * d;
  int span = pos[r] + 1;
  int* pg = (int*)(sc + span);
  const unsigned short* qr = qkv + (size_t)r * (qw + 2 * kw) + head * d;
  for (int j = threadIdx.x; j < d; j += blockDim.x) q[j] = h2f(qr[j]) * scale;
  const int* table = tables + tstart[r];
  for (int i = threadIdx.x; i < (span + PAGE - 1) / PAGE; i += blockDim.x) pg[i] = table[i];
  __syncthreads();
  float mx = -1e30f;
  for (int p = threadIdx.x; p < span; p += blockDim.x) {
    size_t slot = (size_t)pg[p / PAGE] * PAGE + p % PAGE;
    const uint4* k = (const uint4*)(kc + slot * kw + kvhead * d);
    float s = 0.f;
    for (int c = 0; c < d / 8; c++) {
      uint4 u = k[c];
      unsigned w[4] = {u.x, u.y, u.z, u.w};
      for (int e = 0; e < 4; e++) {
        s += q[8 * c + 2 * e] * h2f((unsigned short)(w[e] & 0xffffu));
        s += q[8 * c + 2 * e + 1] * h2f((unsigned short)(w[e] >> 16));
      }
    }
    sc[p] = s;
    mx = fmaxf(mx, s);
  }
  for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  if (lane == 0) wred[warp] = mx;
  __syncthreads();
  mx = wred[0];
  for (int i = 1; i < nw; i++) mx = fmaxf(mx, wred[i]);
  __syncthreads();
  float sum = 0.f;
  for (int p = threadIdx.x; p < span; p += blockDim.x) {
    float e = __expf(sc[p] - mx);
    sc[p] = e;
    sum += e;
  }
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  if (lane == 0) wred[warp] = sum;
  __syncthreads();
  float total = 0.f;
  for (int i = 0; i < nw; i++) total += wred[i];
  int pairs = d / 64;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 8
  for (int p = warp; p < span; p += nw) {
    size_t slot = (size_t)pg[p / PAGE] * PAGE + p % PAGE;
    const unsigned* v = (const unsigned*)(vc + slot * kw + kvhead * d);
    float e = sc[p];
    for (int t = 0; t < pairs; t++) {
      unsigned u = v[lane + 32 * t];
      acc[2 * t] += e * h2f((unsigned short)(u & 0xffffu));
      acc[2 * t + 1] += e * h2f((unsigned short)(u >> 16));
    }
  }
  for (int t = 0; t < pairs; t++) {
    part[warp * d + 2 * (lane + 32 * t)] = acc[2 * t];
    part[warp * d + 2 * (lane + 32 * t) + 1] = acc[2 * t + 1];
  }
  __syncthreads();
  float inv = 1.f / total;
  for (int j = threadIdx.x; j < d; j += blockDim.x) {
    float a = 0.f;
    for (int i = 0; i < nw; i++) a += part[i * d + j];
    out[(size_t)r * qw + head * d + j] = f2h(a * inv);
  }
}

// Causal attention of prompt rows in tiles: a block per (tile, head), a tile being up to
// `tile` (the host's choice, blockDim.x / (d / 16)) consecutive positions of one sequence (tiles[2t] = its first row, tiles[2t+1] = its
// row count), so each key and value row is read from the cache once per tile instead of
// once per row. d/16 threads per query row, each holding 16 of its dims (the query and the
// weighted sum in registers); a score is summed over the group by shuffles. Keys and values
// are staged KT positions at a time in shared memory as f32, each 16-dim part padded by one
// float (a row's parts fall in different banks). Softmax is computed online, four keys
// at a time.
// Threads: tile * d / 16. Shared memory, in floats: 2 * KT * (d + d / 16).
#define KT 32
extern "C" __global__ void attention_tiles(unsigned short* out, const unsigned short* qkv,
    const unsigned short* kc, const unsigned short* vc, const int* pos, const int* tstart,
    const int* tables, const int* tiles, int heads, int kvh, int d, float scale) {
  extern __shared__ float sh[];
  int parts = d / 16, stride = d + parts;
  float* ks = sh;
  float* vs = sh + KT * stride;
  int first = tiles[2 * blockIdx.x], count = tiles[2 * blockIdx.x + 1];
  int head = blockIdx.y, kvhead = head / (heads / kvh);
  int qw = heads * d, kw = kvh * d;
  int qi = threadIdx.x / parts, part = threadIdx.x % parts;
  bool live = qi < count;
  int r = first + (live ? qi : 0);
  int pq = live ? pos[r] : -1;
  int last = pos[first + count - 1];
  const int* table = tables + tstart[first];
  const unsigned short* qr = qkv + (size_t)r * (qw + 2 * kw) + head * d + part * 16;
  float q[16], acc[16];
#pragma unroll
  for (int j = 0; j < 16; j++) { q[j] = h2f(qr[j]) * scale; acc[j] = 0.f; }
  float m = -1e30f, l = 0.f;
  for (int k0 = 0; k0 <= last; k0 += KT) {
    int n = min(KT, last + 1 - k0), n4 = (n + 3) & ~3;
    __syncthreads();
    // Rows past the chunk's end (up to a multiple of four) are zeros: they are masked out
    // below, and must not hold NaNs from earlier data.
    // Eight halves (16 bytes) per load: a cache row's head slice is 16-byte aligned.
    int per_row = d / 8;
    for (int i = threadIdx.x; i < n4 * per_row; i += blockDim.x) {
      int kr = i / per_row, c = (i % per_row) * 8, p = k0 + kr;
      float* kd = ks + kr * stride + (c / 16) * 17 + c % 16;
      float* vd = vs + kr * stride + (c / 16) * 17 + c % 16;
      if (kr < n) {
        size_t src = ((size_t)table[p / PAGE] * PAGE + p % PAGE) * kw + kvhead * d + c;
        uint4 ku = *(const uint4*)(kc + src), vu = *(const uint4*)(vc + src);
        unsigned kw4[4] = {ku.x, ku.y, ku.z, ku.w}, vw4[4] = {vu.x, vu.y, vu.z, vu.w};
#pragma unroll
        for (int e = 0; e < 4; e++) {
          kd[2 * e] = h2f((unsigned short)(kw4[e] & 0xffffu));
          kd[2 * e + 1] = h2f((unsigned short)(kw4[e] >> 16));
          vd[2 * e] = h2f((unsigned short)(vw4[e] & 0xffffu));
          vd[2 * e + 1] = h2f((unsigned short)(vw4[e] >> 16));
        }
      } else {
#pragma unroll
        for (int e = 0; e < 8; e++) { kd[e] = 0.f; vd[e] = 0.f; }
      }
    }
    __syncthreads();
    // Four keys at a time: four independent dot products and shuffles in flight, then one
    // rescale of the running sum for the four.
    for (int kr = 0; kr < n; kr += 4) {
      float s[4];
#pragma unroll
      for (int u = 0; u < 4; u++) {
        const float* kk = ks + (kr + u) * stride + part * 17;
        float a = 0.f, b = 0.f;
#pragma unroll
        for (int j = 0; j < 16; j += 2) { a += q[j] * kk[j]; b += q[j + 1] * kk[j + 1]; }
        s[u] = a + b;
      }
      for (int o = 1; o < parts; o <<= 1) {
#pragma unroll
        for (int u = 0; u < 4; u++) s[u] += __shfl_xor_sync(0xffffffffu, s[u], o);
      }
      float mn = m;
#pragma unroll
      for (int u = 0; u < 4; u++) {
        if (kr + u >= n || k0 + kr + u > pq) s[u] = -1e30f;
        mn = fmaxf(mn, s[u]);
      }
      float corr = __expf(m - mn), e[4];
#pragma unroll
      for (int u = 0; u < 4; u++) e[u] = __expf(s[u] - mn);
      l = l * corr + (e[0] + e[1]) + (e[2] + e[3]);
      const float* vv = vs + kr * stride + part * 17;
#pragma unroll
      for (int j = 0; j < 16; j++)
        acc[j] = acc[j] * corr + e[0] * vv[j] + e[1] * vv[stride + j]
               + e[2] * vv[2 * stride + j] + e[3] * vv[3 * stride + j];
      m = mn;
    }
  }
  if (live) {
    unsigned short* o = out + (size_t)r * qw + head * d + part * 16;
    float inv = 1.f / l;
#pragma unroll
    for (int j = 0; j < 16; j++) o[j] = f2h(acc[j] * inv);
  }
}

// x[b] += y[b] (the residual add), then out[b] = RMSNorm(x[b]) * w as f16: one launch for
// what add_rows and rms_norm did in two, with the same arithmetic in the same order.
extern "C" __global__ void add_rms_norm(unsigned short* out, float* x, const unsigned short* y,
    const float* w, int h, float eps) {
  extern __shared__ float buf[];
  size_t b = blockIdx.x;
  float* xr = x + b * h;
  const unsigned short* yr = y + b * h;
  float s = 0.f;
  for (int c = threadIdx.x; c < h; c += blockDim.x) {
    float v = xr[c] + h2f(yr[c]);
    xr[c] = v;
    s += v * v;
  }
  float inv = rsqrtf(block_reduce(s, buf, 0) / h + eps);
  for (int c = threadIdx.x; c < h; c += blockDim.x) out[b * h + c] = f2h(xr[c] * inv * w[c]);
}

// x += y (f32 += f16).
extern "C" __global__ void add_rows(float* x, const unsigned short* y, int n) {
  size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < (size_t)n) x[i] += h2f(y[i]);
}

// out[r, i] = silu(gu[r, i]) * gu[r, inter + i] (gate and up stacked per row).
extern "C" __global__ void silu_mul(unsigned short* out, const unsigned short* gu, int rows,
    int inter) {
  size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (size_t)rows * inter) return;
  size_t r = i / inter, c = i % inter;
  float g = h2f(gu[r * 2 * inter + c]), u = h2f(gu[r * 2 * inter + inter + c]);
  out[i] = f2h(g / (1.f + __expf(-g)) * u);
}

// One block per wanted row of logits: the row's log-softmax at one token (temperature 1),
// either targets[b] or, without targets or where targets[b] is 0xffffffff, the greedy
// token: the first of the largest logits, as the CPU's argmax picks it (a NaN logit is never
// picked). A greedy decode step or a
// scoring call then copies two numbers per row back instead of the vocabulary's logits.
// Shared memory: 2 * blockDim.x words.
extern "C" __global__ void pick_rows(const float* logits, int vocab, const unsigned* targets,
    unsigned* tokens, float* logprobs) {
  extern __shared__ float sh[];
  int* bi = (int*)(sh + blockDim.x);
  const float* l = logits + (size_t)blockIdx.x * vocab;
  const int none = 0x7fffffff;
  float best = __int_as_float(0xff800000);  // -inf
  int idx = none;
  for (int c = threadIdx.x; c < vocab; c += blockDim.x) {
    float v = l[c];
    if (v > best) { best = v; idx = c; }  // each thread's columns rise: the first max stays
  }
  sh[threadIdx.x] = best;
  bi[threadIdx.x] = idx;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) {
      float v = sh[threadIdx.x + s];
      int j = bi[threadIdx.x + s];
      if (v > sh[threadIdx.x] || (v == sh[threadIdx.x] && j < bi[threadIdx.x])) {
        sh[threadIdx.x] = v;
        bi[threadIdx.x] = j;
      }
    }
    __syncthreads();
  }
  best = sh[0];
  idx = bi[0] == none ? 0 : bi[0];
  __syncthreads();
  float sum = 0.f;
  for (int c = threadIdx.x; c < vocab; c += blockDim.x) sum += expf(l[c] - best);
  sum = block_reduce(sum, sh, 0);
  if (threadIdx.x == 0) {
    unsigned t = targets ? targets[blockIdx.x] : 0xffffffffu;
    if (t == 0xffffffffu) t = (unsigned)idx;
    tokens[blockIdx.x] = t;
    logprobs[blockIdx.x] = (l[t] - best) - logf(sum);
  }
}

// ---- sample_rows: a sampled row's token drawn on the device (backend/sampling.rs's rule).
#define SAMPLE_CAP 4096

// Prefix sums of one value per thread: returns the thread's exclusive prefix and sets
// *incl (its inclusive one) and *total. Adjacent threads' [exclusive, inclusive) tile exactly.
template <typename T>
__device__ T scan_excl(T v, T* buf, T* incl, T* total) {
  int t = threadIdx.x;
  buf[t] = v;
  __syncthreads();
  for (int off = 1; off < blockDim.x; off <<= 1) {
    T add = t >= off ? buf[t - off] : (T)0;
    __syncthreads();
    buf[t] += add;
    __syncthreads();
  }
  T excl = t > 0 ? buf[t - 1] : (T)0;
  *incl = buf[t];
  *total = buf[blockDim.x - 1];
  __syncthreads();
  return excl;
}

// Weight of element i: a stored candidate's, or exp((l - best) * inv_t) from the row.
__device__ __forceinline__ float sample_w(int i, const float* cw, const float* l, float best,
    float inv_t) {
  return cw ? cw[i] : __expf((l[i] - best) * inv_t);
}

// One block (blockDim.x a power of two, <= 1024) per row whose draws[4b] (1/temperature) is
// positive; other rows keep what pick_rows wrote. draws[4b..4b+3] = 1/T, top-p (>= 1: no
// cut-off), u in [0, 1). The rule is the host's (sampling.rs): weights exp((l - max) / T);
// the nucleus is the shortest run of the heaviest tokens (ties by id) whose mass reaches
// top-p; the token is where u * (the nucleus' mass) falls walking it in token-id order.
// The search runs over the tokens above 1e-3 or 1e-6 of the top weight when they already
// hold the target and fit in shared memory (usually a few dozen), else over the row. Up to
// blockDim.x candidates, each thread sums the mass that sorts before its own (heavier, or as
// heavy with a lower id): in the nucleus when that is short of the target. Beyond that, the
// nucleus' lightest weight t* is found by bisection on the float's bits (the largest t with
// mass(w >= t) >= target) and its ties join by id. The log-probability reported is at
// temperature 1, as for every other row. Shared memory: 2 * blockDim.x + 2 * SAMPLE_CAP
// words; 1024 threads at most (the launch bound keeps registers within an SM's file).
extern "C" __global__ void __launch_bounds__(1024) sample_rows(const float* logits, int vocab, const float* draws,
    unsigned* tokens, float* logprobs) {
  const int b = blockIdx.x, t = threadIdx.x, nt = blockDim.x;
  const float inv_t = draws[4 * b], top_p = draws[4 * b + 1], u = draws[4 * b + 2];
  if (!(inv_t > 0.f)) return;
  extern __shared__ float sh[];
  float* red = sh;
  int* ired = (int*)(sh + nt);
  float* cwbuf = sh + 2 * nt;
  int* cid = (int*)(cwbuf + SAMPLE_CAP);
  __shared__ int chosen;
  const float* l = logits + (size_t)b * vocab;
  const int none = 0x7fffffff;

  // The first largest logit (the greedy fallback) and the row's maximum.
  float best = __int_as_float(0xff800000);
  int idx = none;
  for (int c = t; c < vocab; c += nt) {
    float v = l[c];
    if (v > best) { best = v; idx = c; }
  }
  red[t] = best;
  ired[t] = idx;
  __syncthreads();
  for (int s = nt / 2; s > 0; s >>= 1) {
    if (t < s) {
      float v = red[t + s];
      int j = ired[t + s];
      if (v > red[t] || (v == red[t] && j < ired[t])) { red[t] = v; ired[t] = j; }
    }
    __syncthreads();
  }
  best = red[0];
  idx = ired[0] == none ? 0 : ired[0];
  __syncthreads();

  // Temperature-1 normaliser (log-probability), the tempered mass, and the mass and count
  // above the two candidate thresholds.
  float s1 = 0.f, z = 0.f, m3 = 0.f, m6 = 0.f, c3 = 0.f, c6 = 0.f;
  for (int c = t; c < vocab; c += nt) {
    float x = l[c];
    s1 += expf(x - best);
    float w = __expf((x - best) * inv_t);
    z += w;
    if (w >= 1e-3f) { m3 += w; c3 += 1.f; }
    if (w >= 1e-6f) { m6 += w; c6 += 1.f; }
  }
  s1 = block_reduce(s1, red, 0);
  z = block_reduce(z, red, 0);
  m3 = block_reduce(m3, red, 0);
  m6 = block_reduce(m6, red, 0);
  c3 = block_reduce(c3, red, 0);
  c6 = block_reduce(c6, red, 0);

  if (t == 0) chosen = idx;
  __syncthreads();
  const float inf = __int_as_float(0x7f800000);
  bool usable = fabsf(best) < inf && z < inf && z > 0.f;
  if (usable) {
    // The elements walked: the stored candidates (cw, ids in cid) or the whole row.
    const float* cw = 0;
    int n = vocab;
    float ts = 0.f;       // the nucleus' lightest weight (0: every token)
    float k_tied = 0.f;   // how many tokens of weight ts join, by id (with ts > 0)
    if (top_p < 1.f) {
      float target = top_p * z;
      float thr = -1.f;
      if (m3 >= target && c3 <= (float)SAMPLE_CAP) thr = 1e-3f;
      else if (m6 >= target && c6 <= (float)SAMPLE_CAP) thr = 1e-6f;
      unsigned lo = 0u, hi = 0x3f800000u;  // weights lie in [0, 1]
      if (thr > 0.f) {
        // Compact the candidates in token-id order: each thread owns a contiguous chunk.
        int chunk = (vocab + nt - 1) / nt, c0 = min(t * chunk, vocab), c1 = min(c0 + chunk, vocab);
        int mine = 0;
        for (int c = c0; c < c1; c++) mine += __expf((l[c] - best) * inv_t) >= thr;
        int total, end;
        int at = scan_excl<int>(mine, ired, &end, &total);
        for (int c = c0; c < c1; c++) {
          float w = __expf((l[c] - best) * inv_t);
          if (w >= thr) { cwbuf[at] = w; cid[at] = c; at++; }
        }
        __syncthreads();
        cw = cwbuf;
        n = total;
        lo = __float_as_uint(thr);
      }
      if (cw && n <= nt) {
        // Each candidate's mass sorted before it, against all the others (broadcast reads).
        bool member = false;
        float wi = 0.f;
        if (t < n) {
          wi = cw[t];
          float ahead = 0.f;
          for (int j = 0; j < n; j++) {
            float wj = cw[j];
            if (wj > wi || (wj == wi && j < t)) ahead += wj;
          }
          member = ahead < target;
        }
        ts = -block_reduce(member ? -wi : -3.0e38f, red, 1);
        k_tied = block_reduce(member && wi == ts ? 1.f : 0.f, red, 0);
      } else {
        while (lo < hi) {
          unsigned mid = lo + (hi - lo + 1u) / 2u;
          float tm = __uint_as_float(mid), m = 0.f;
          for (int i = t; i < n; i += nt) {
            float w = sample_w(i, cw, l, best, inv_t);
            if (w >= tm) m += w;
          }
          if (block_reduce(m, red, 0) >= target) lo = mid; else hi = mid - 1u;
        }
        ts = __uint_as_float(lo);
        float above = 0.f;
        for (int i = t; i < n; i += nt) {
          float w = sample_w(i, cw, l, best, inv_t);
          if (w > ts) above += w;
        }
        above = block_reduce(above, red, 0);
        // Tied tokens join while the mass before them is short of the target.
        k_tied = ts > 0.f ? fmaxf(1.f, ceilf((target - above) / ts)) : 3.0e38f;
      }
    }
    // Walk in token-id order over contiguous chunks: tied tokens' ranks first, then the
    // included mass per chunk, then the chunk holding u * mass walks itself.
    int chunk = (n + nt - 1) / nt, c0 = min(t * chunk, n), c1 = min(c0 + chunk, n);
    int ties = 0;
    if (ts > 0.f)
      for (int i = c0; i < c1; i++) ties += sample_w(i, cw, l, best, inv_t) == ts;
    int tie_total, tie_end;
    int tie_at = scan_excl<int>(ties, ired, &tie_end, &tie_total);
    float mass = 0.f;
    {
      int r = tie_at;
      for (int i = c0; i < c1; i++) {
        float w = sample_w(i, cw, l, best, inv_t);
        bool in = w > ts || (w == ts && (float)(r++) < k_tied);
        if (in) mass += w;
      }
    }
    float all, through;
    float before = scan_excl<float>(mass, red, &through, &all);
    // The last chunk with any mass takes a draw that rounding leaves past the end.
    float last = block_reduce(mass > 0.f ? (float)t : -1.f, red, 1);
    float r = u * all;
    if (mass > 0.f && r >= before && (r < through || (float)t == last)) {
      float acc = before;
      int pick = -1, lastin = -1, rank = tie_at;
      for (int i = c0; i < c1; i++) {
        float w = sample_w(i, cw, l, best, inv_t);
        bool in = w > ts || (w == ts && (float)(rank++) < k_tied);
        if (!in || !(w > 0.f)) continue;
        lastin = i;
        acc += w;
        if (r < acc) { pick = i; break; }
      }
      if (pick < 0) pick = lastin;
      chosen = cw ? cid[pick] : pick;
    }
    __syncthreads();
  }
  if (t == 0) {
    unsigned tok = (unsigned)chosen;
    tokens[b] = tok;
    logprobs[b] = (l[tok] - best) - logf(s1);
  }
}
"#;
