//! The NVRTC kernels of the CUDA llama decoder (header-free f16 helpers from `cuda_half`
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
"#;
