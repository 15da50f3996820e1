// ----- element access: T is unsigned short (fp16 bits), float or double -----
#ifdef __CUDACC__   // NVRTC, nvcc: the PTX conversions (cvt.rn: round to nearest even)
__device__ __forceinline__ float load(const unsigned short* p, long long i) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(p[i]));
    return f;
}
__device__ __forceinline__ void store(unsigned short* p, long long i, float v) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
    p[i] = h;
}
#else               // a host compiler (the tests' emulation): its IEEE binary16
__device__ __forceinline__ float load(const unsigned short* p, long long i) {
    _Float16 h;
    __builtin_memcpy(&h, p + i, 2);
    return (float)h;
}
__device__ __forceinline__ void store(unsigned short* p, long long i, float v) {
    const _Float16 h = (_Float16)v;
    __builtin_memcpy(p + i, &h, 2);
}
#endif
__device__ __forceinline__ float load(const float* p, long long i) { return p[i]; }
__device__ __forceinline__ double load(const double* p, long long i) { return p[i]; }
__device__ __forceinline__ void store(float* p, long long i, float v) { p[i] = v; }
__device__ __forceinline__ void store(double* p, long long i, double v) { p[i] = v; }

// The batch-norm output (x - mean) * scale + beta, as forward's store rounds it to T:
// one function, so that the backward kernels' ReLU masks compute the very value forward
// stored. relu_passes: whether a fused ReLU let it through (y > 0).
template <typename T, typename A>
__device__ __forceinline__ A bn_out(A x_minus_mean, A scale, A beta) {
    T t;
    store(&t, 0, x_minus_mean * scale + beta);
    return (A)load(&t, 0);
}
template <typename T, typename A>
__device__ __forceinline__ bool relu_passes(A x_minus_mean, A scale, A beta) {
    return bn_out<T, A>(x_minus_mean, scale, beta) > 0;
}

// V consecutive elements of T as one aligned access: 16 bytes when V * sizeof(T) == 16,
// so a warp's loads and stores of consecutive Packs are full 128-byte lines
template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
    T v[V];
};
template <typename T, int V>
__device__ __forceinline__ Pack<T, V> load_pack(const T* p, long long i) {
    return *reinterpret_cast<const Pack<T, V>*>(p + i);
}
template <typename T, int V>
__device__ __forceinline__ void store_pack(T* p, long long i, const Pack<T, V>& q) {
    *reinterpret_cast<Pack<T, V>*>(p + i) = q;
}

__device__ __forceinline__ long long first_index() {
    return (long long)blockIdx.x * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ long long grid_stride() {
    return (long long)gridDim.x * blockDim.x;
}

// ----- batch norm -----

// Partial sums over chunks of rows of the (M, C) activations; chunk p is rows
// [p*rows, min(M, (p+1)*rows)), blockIdx.y = p, and part is (P, 2, C):
//   grads == 0:  part[p][0][c] = sum (x[r][c] - k_c),  part[p][1][c] = sum (x[r][c] - k_c)^2,
//                with the shift k_c = x[0][c] (a sample of the channel, so the squares
//                do not cancel when |mean| >> std)
//   grads == 1:  part[p][0][c] = sum g[r][c],
//                part[p][1][c] = sum g[r][c] (x[r][c] - mean_c)
//                g = dy, or with relu (a fused ReLU): dy where forward's y > 0, else 0,
//                y recomputed from x, mean, scale and beta (bn_out)
// A thread takes V consecutive channels (one Pack; C a multiple of V), blockDim.x threads
// consecutive packs (coalesced), and blockDim.y (a power of 2) threads every blockDim.y-th
// row; a fixed tree in shared memory adds those.
template <typename T, typename A, int V, int B>
__device__ __forceinline__ void bn_add_rows(const T* x, const T* dy, int grads, int relu,
                                            long long r, int TY, int C, int c, const A* k,
                                            const A* sc, const A* be, A* u, A* v) {
    // B of the thread's rows, r, r + TY, ..., added into u and v in that order (the sums
    // of a row at a time); their loads come first, so that B reads are in flight at once
    // (one at a time, the forward's single read waits on memory's latency)
    Pack<T, V> xs[B], gs[B];
    for (int q = 0; q < B; ++q) {
        xs[q] = load_pack<T, V>(x, (r + (long long)q * TY) * C + c);
        if (grads)
            gs[q] = load_pack<T, V>(dy, (r + (long long)q * TY) * C + c);
    }
    for (int q = 0; q < B; ++q) {
        for (int j = 0; j < V; ++j) {
            const A xc = (A)load(xs[q].v, j) - k[j];
            if (grads) {
                const A g = relu && !relu_passes<T, A>(xc, sc[j], be[j]) ? (A)0
                                                                         : (A)load(gs[q].v, j);
                u[j] += g;
                v[j] += g * xc;
            } else {
                u[j] += xc;
                v[j] += xc * xc;
            }
        }
    }
}
template <typename T, typename A, int V>
__global__ void bn_partial_sums(const T* x, const T* dy, const A* mean, const A* scale,
                                const A* beta, int grads, int relu, long long M, int C,
                                long long rows, A* part) {
    __shared__ A su[ROW_THREADS * V];
    __shared__ A sv[ROW_THREADS * V];
    const int tx = threadIdx.x, ty = threadIdx.y, TX = blockDim.x, TY = blockDim.y;
    const int c = (blockIdx.x * TX + tx) * V;
    const long long r0 = (long long)blockIdx.y * rows;
    const long long r1 = r0 + rows < M ? r0 + rows : M;
    A u[V], v[V], k[V], sc[V], be[V];
    for (int j = 0; j < V; ++j)
        u[j] = v[j] = 0;
    if (c < C) {
        for (int j = 0; j < V; ++j) {
            k[j] = grads ? mean[c + j] : (A)load(x, c + j);
            sc[j] = relu ? scale[c + j] : (A)0;
            be[j] = relu ? beta[c + j] : (A)0;
        }
        long long r = r0 + ty;
        if (grads)              // two arrays: 2 rows of each in flight
            for (; r + TY < r1; r += 2 * TY)
                bn_add_rows<T, A, V, 2>(x, dy, grads, relu, r, TY, C, c, k, sc, be, u, v);
        else
            for (; r + 3 * TY < r1; r += 4 * TY)
                bn_add_rows<T, A, V, 4>(x, dy, grads, relu, r, TY, C, c, k, sc, be, u, v);
        for (; r < r1; r += TY)
            bn_add_rows<T, A, V, 1>(x, dy, grads, relu, r, TY, C, c, k, sc, be, u, v);
    }
    const int t = (ty * TX + tx) * V;
    for (int j = 0; j < V; ++j) {
        su[t + j] = u[j];
        sv[t + j] = v[j];
    }
    __syncthreads();
    for (int h = TY / 2; h > 0; h /= 2) {
        if (ty < h) {
            for (int j = 0; j < V; ++j) {
                su[t + j] += su[t + h * TX * V + j];
                sv[t + j] += sv[t + h * TX * V + j];
            }
        }
        __syncthreads();
    }
    if (ty == 0 && c < C) {
        for (int j = 0; j < V; ++j) {
            part[((long long)blockIdx.y * 2) * C + c + j] = su[t + j];
            part[((long long)blockIdx.y * 2 + 1) * C + c + j] = sv[t + j];
        }
    }
}

// out[j][c] = sum over p < P of part[p][j][c], added in double; one block per column
// j*C + c (blockIdx.x), its FOLD threads take every FOLD-th p, then a fixed tree.
template <typename A>
__global__ void bn_fold(const A* part, int P, int C, A* out) {
    __shared__ double s[FOLD];
    const int col = blockIdx.x;
    double a = 0;
    for (int p = threadIdx.x; p < P; p += FOLD)
        a += part[(long long)p * 2 * C + col];
    s[threadIdx.x] = a;
    __syncthreads();
    for (int h = FOLD / 2; h > 0; h /= 2) {
        if (threadIdx.x < h)
            s[threadIdx.x] += s[threadIdx.x + h];
        __syncthreads();
    }
    if (threadIdx.x == 0)
        out[col] = (A)s[0];
}

// Per channel c (one thread each), in double, from the mode's statistics:
//   mode 0 (train, shifted sums s of bn_partial_sums, k_c = x[0][c]):
//          mean = k_c + s[0][c] / count,  var = s[1][c] / count - (s[0][c] / count)^2
//   mode 1 (train, s = (sum x, sum (x - mean)^2) over a group):
//          mean = s[0][c] / count,        var = s[1][c] / count
//   mode 2 (eval): mean = running_mean[c], var = running_var[c]
// then invstd = 1 / sqrt(var + eps), scale = gamma * invstd, and in modes 0 and 1
//   running_mean = (1 - m) running_mean + m mean
//   running_var  = (1 - m) running_var  + m var count / (count - 1)
template <typename T, typename A>
__global__ void bn_finalize(const A* s, const T* x, int mode, double count, int C,
                            const A* gamma, double eps, double m,
                            A* running_mean, A* running_var, A* mean_out, A* invstd_out,
                            A* scale_out) {
    const int c = (int)first_index();
    if (c >= C)
        return;
    double mean, var;
    if (mode == 2) {
        mean = running_mean[c];
        var = running_var[c];
    } else {
        const double a = s[c] / count, b = s[C + c] / count;
        if (mode == 0) {
            mean = (double)load(x, c) + a;
            var = b - a * a;
        } else {
            mean = a;
            var = b;
        }
        var = var > 0 ? var : 0;
        running_mean[c] = (A)((1 - m) * running_mean[c] + m * mean);
        running_var[c] = (A)((1 - m) * running_var[c] + m * var * (count / (count - 1)));
    }
    const double invstd = 1 / sqrt(var + eps);
    mean_out[c] = (A)mean;
    invstd_out[c] = (A)invstd;
    scale_out[c] = (A)(gamma[c] * invstd);
}

// The element passes over (M, C) take the threads as the partial sums do: a thread keeps
// V consecutive channels (one Pack) and their coefficients in registers, and walks the
// rows blockIdx.y * blockDim.y + threadIdx.y, then every gridDim.y * blockDim.y-th.

// y[r][c] = (x[r][c] - mean[c]) * scale[c] + beta[c], rounded to T; then with a residual
// (with_r) max(y[r][c] + res[r][c], 0), the sum in A rounded once (the bits of a separate
// add); else with relu max(y[r][c], 0). NaN stays NaN.
template <typename T, typename A, int V>
__global__ void bn_affine(const T* x, const A* mean, const A* scale, const A* beta, int relu,
                          const T* res, int with_r, long long M, int C, T* y) {
    const int c = (blockIdx.x * blockDim.x + threadIdx.x) * V;
    if (c >= C)
        return;
    A mu[V], sc[V], be[V];
    for (int j = 0; j < V; ++j) {
        mu[j] = mean[c + j];
        sc[j] = scale[c + j];
        be[j] = beta[c + j];
    }
    const long long step = (long long)gridDim.y * blockDim.y;
    for (long long r = (long long)blockIdx.y * blockDim.y + threadIdx.y; r < M; r += step) {
        const long long i = r * C + c;
        const Pack<T, V> xs = load_pack<T, V>(x, i);
        const Pack<T, V> rs = with_r ? load_pack<T, V>(res, i) : xs;
        Pack<T, V> ys;
        for (int j = 0; j < V; ++j) {
            A v = bn_out<T, A>((A)load(xs.v, j) - mu[j], sc[j], be[j]);
            if (with_r)
                v += (A)load(rs.v, j);
            store(ys.v, j, (relu || with_r) && v < 0 ? (A)0 : v);
        }
        store_pack<T, V>(y, i, ys);
    }
}

// Per channel c, from the local sums sl = (sum dy, sum dy (x - mean)) and the sums sg
// used for dx (the group's in distributed BN, else sl):
//   grad_beta = sl[0][c],  grad_gamma = sl[1][c] * invstd    (this rank's own share)
//   dx = a dy + b (x - mean) + d  with  a = gamma invstd, and in train mode
//   b = -a invstd (sg[1][c] invstd) / count,  d = -a sg[0][c] / count  (eval: b = d = 0)
// coef is (3, C): a, b, d.
template <typename A>
__global__ void bn_backward_coefficients(const A* sl, const A* sg, const A* gamma,
                                         const A* invstd, double count, int train, int C,
                                         A* grad_gamma, A* grad_beta, A* coef) {
    const int c = (int)first_index();
    if (c >= C)
        return;
    const double is = invstd[c], a = gamma[c] * is;
    grad_beta[c] = sl[c];
    grad_gamma[c] = (A)(sl[C + c] * is);
    coef[c] = (A)a;
    coef[C + c] = train ? (A)(-a * is * (sg[C + c] * is) / count) : (A)0;
    coef[2 * C + c] = train ? (A)(-a * sg[c] / count) : (A)0;
}

// dx[r][c] = a[c] g[r][c] + b[c] (x[r][c] - mean[c]) + d[c],  coef = (a, b, d),
// g = dy, or with relu dy where forward's y > 0, else 0 (as in bn_partial_sums)
template <typename T, typename A, int V>
__global__ void bn_backward_dx(const T* dy, const T* x, const A* mean, const A* coef,
                               const A* scale, const A* beta, int relu, long long M, int C,
                               T* dx) {
    const int c = (blockIdx.x * blockDim.x + threadIdx.x) * V;
    if (c >= C)
        return;
    A mu[V], ca[V], cb[V], cd[V], sc[V], be[V];
    for (int j = 0; j < V; ++j) {
        mu[j] = mean[c + j];
        ca[j] = coef[c + j];
        cb[j] = coef[C + c + j];
        cd[j] = coef[2 * C + c + j];
        sc[j] = relu ? scale[c + j] : (A)0;
        be[j] = relu ? beta[c + j] : (A)0;
    }
    const long long step = (long long)gridDim.y * blockDim.y;
    for (long long r = (long long)blockIdx.y * blockDim.y + threadIdx.y; r < M; r += step) {
        const long long i = r * C + c;
        const Pack<T, V> xs = load_pack<T, V>(x, i), gs = load_pack<T, V>(dy, i);
        Pack<T, V> ds;
        for (int j = 0; j < V; ++j) {
            const A xc = (A)load(xs.v, j) - mu[j];
            const A g = relu && !relu_passes<T, A>(xc, sc[j], be[j]) ? (A)0 : (A)load(gs.v, j);
            store(ds.v, j, ca[j] * g + cb[j] * xc + cd[j]);
        }
        store_pack<T, V>(dx, i, ds);
    }
}

// ----- pooling (NHWC; window of output (oh, ow): rows oh*s - p + [0, k), columns
// ow*s - p + [0, k), clipped to the image; p <= k/2, so never empty) -----

// The (n, h, w, c) of flat index i of an (N, Hd, Wd, C) array; I is int where the array
// has fewer than 2^31 elements (32-bit division is several times cheaper than 64-bit)
template <typename I>
__device__ __forceinline__ void split_nhwc(I i, int Hd, int Wd, int C,
                                           int* n, int* h, int* w, int* c) {
    *c = (int)(i % C);
    i /= C;
    *w = (int)(i % Wd);
    i /= Wd;
    *h = (int)(i % Hd);
    *n = (int)(i / Hd);
}
__device__ __forceinline__ void split_nhwc(long long i, long long total, int Hd, int Wd, int C,
                                           int* n, int* h, int* w, int* c) {
    if (total <= 0x7fffffffLL)
        split_nhwc<int>((int)i, Hd, Wd, C, n, h, w, c);
    else
        split_nhwc<long long>(i, Hd, Wd, C, n, h, w, c);
}

// A thread takes V consecutive channels (one Pack; C a multiple of V) of one output pixel:
// avg == 0: y[n][oh][ow][c] = max over the window, arg = i*k + j, the maximum's place in
//           the window (a byte: k <= 16), the first in row-major window order, or the
//           first NaN (as the CPU kernel)
// avg == 1: y[n][oh][ow][c] = (sum of x over the window, padding as zeros) / k^2
template <typename T, typename A, int V>
__global__ void pool_forward(const T* x, int avg, int N, int H, int W, int C, int Ho, int Wo,
                             int k, int s, int p, T* y, unsigned char* arg) {
    const int CP = C / V;
    const long long total = (long long)N * Ho * Wo * CP;
    for (long long o = first_index(); o < total; o += grid_stride()) {
        int n, oh, ow, cp;
        split_nhwc(o, total, Ho, Wo, CP, &n, &oh, &ow, &cp);
        const int c = cp * V;
        const int ih0 = oh * s - p, iw0 = ow * s - p;
        const int i0 = ih0 < 0 ? -ih0 : 0, i1 = H - ih0 < k ? H - ih0 : k;
        const int j0 = iw0 < 0 ? -iw0 : 0, j1 = W - iw0 < k ? W - iw0 : k;
        const long long image = (long long)n * H * W;
        const int first = (ih0 + i0) * W + iw0 + j0;
        const Pack<T, V> f = load_pack<T, V>(x, (image + first) * C + c);
        A acc[V];
        Pack<unsigned char, V> pos;
        for (int v = 0; v < V; ++v) {
            acc[v] = avg ? (A)0 : (A)load(f.v, v);
            pos.v[v] = (unsigned char)(i0 * k + j0);
        }
        for (int i = i0; i < i1; ++i) {
            for (int j = j0; j < j1; ++j) {
                const int q = (ih0 + i) * W + iw0 + j;
                const Pack<T, V> xs = load_pack<T, V>(x, (image + q) * C + c);
                for (int v = 0; v < V; ++v) {
                    const A a = (A)load(xs.v, v);
                    if (avg) {
                        acc[v] += a;
                    } else if (a > acc[v] || (a != a && acc[v] == acc[v])) {   // first NaN
                        acc[v] = a;
                        pos.v[v] = (unsigned char)(i * k + j);
                    }
                }
            }
        }
        Pack<T, V> ys;
        for (int v = 0; v < V; ++v)
            store(ys.v, v, avg ? acc[v] / (k * k) : acc[v]);
        store_pack<T, V>(y, o * V, ys);
        if (!avg)
            store_pack<unsigned char, V>(arg, o * V, pos);
    }
}

// The outputs whose windows cover input row ih: oh in [lo, hi] (likewise for columns).
__device__ __forceinline__ void covering(int ih, int k, int s, int p, int Ho, int* lo, int* hi) {
    *lo = ih + p < k ? 0 : (ih + p - k) / s + 1;
    *hi = (ih + p) / s < Ho - 1 ? (ih + p) / s : Ho - 1;
}

// dx[n][ih][iw][c] = sum of dy[n][oh][ow][c] over the covering windows whose arg is this
// pixel's place in them, (ih - oh*s + p)*k + iw - ow*s + p (or, avg == 1: sum of dy over
// the covering windows / k^2); a thread takes V consecutive channels of one input pixel,
// so no two threads add into one value
template <typename T, typename A, int V>
__global__ void pool_backward(const T* dy, const unsigned char* arg, int avg, int N, int H,
                              int W, int C, int Ho, int Wo, int k, int s, int p, T* dx) {
    const int CP = C / V;
    const long long total = (long long)N * H * W * CP;
    for (long long i = first_index(); i < total; i += grid_stride()) {
        int n, ih, iw, cp;
        split_nhwc(i, total, H, W, CP, &n, &ih, &iw, &cp);
        const int c = cp * V;
        int oh0, oh1, ow0, ow1;
        covering(ih, k, s, p, Ho, &oh0, &oh1);
        covering(iw, k, s, p, Wo, &ow0, &ow1);
        A acc[V];
        for (int v = 0; v < V; ++v)
            acc[v] = 0;
        for (int oh = oh0; oh <= oh1; ++oh) {
            for (int ow = ow0; ow <= ow1; ++ow) {
                const long long o = (((long long)n * Ho + oh) * Wo + ow) * C + c;
                const Pack<T, V> ds = load_pack<T, V>(dy, o);
                const int me = (ih - oh * s + p) * k + iw - ow * s + p;
                Pack<unsigned char, V> at;
                if (!avg)
                    at = load_pack<unsigned char, V>(arg, o);
                for (int v = 0; v < V; ++v)
                    if (avg || at.v[v] == me)
                        acc[v] += (A)load(ds.v, v);
            }
        }
        Pack<T, V> xs;
        for (int v = 0; v < V; ++v)
            store(xs.v, v, avg ? acc[v] / (k * k) : acc[v]);
        store_pack<T, V>(dx, i * V, xs);
    }
}

// ----- the ReLU's gradient -----

// dx[i] = dy[i] where y[i] > 0, else 0; V elements a Pack
template <typename T, typename A, int V>
__global__ void relu_grad(const T* dy, const T* y, long long n, T* dx) {
    for (long long b = first_index(); b * V < n; b += grid_stride()) {
        const Pack<T, V> gs = load_pack<T, V>(dy, b * V), ys = load_pack<T, V>(y, b * V);
        Pack<T, V> ds;
        for (int j = 0; j < V; ++j)
            store(ds.v, j, (A)load(ys.v, j) > 0 ? (A)load(gs.v, j) : (A)0);
        store_pack<T, V>(dx, b * V, ds);
    }
}

// a[i] += b[i], the sum rounded to T once; V elements a Pack
template <typename T, typename A, int V>
__global__ void add_into(T* a, const T* b, long long n) {
    for (long long q = first_index(); q * V < n; q += grid_stride()) {
        Pack<T, V> as = load_pack<T, V>(a, q * V);
        const Pack<T, V> bs = load_pack<T, V>(b, q * V);
        for (int j = 0; j < V; ++j)
            store(as.v, j, (A)load(as.v, j) + (A)load(bs.v, j));
        store_pack<T, V>(a, q * V, as);
    }
}

// y[i] = max(x[i], 0) (NaN stays NaN, as NumPy's maximum); V elements a Pack
template <typename T, typename A, int V>
__global__ void relu(const T* x, long long n, T* y) {
    for (long long q = first_index(); q * V < n; q += grid_stride()) {
        const Pack<T, V> xs = load_pack<T, V>(x, q * V);
        Pack<T, V> ys;
        for (int j = 0; j < V; ++j) {
            const A a = (A)load(xs.v, j);
            store(ys.v, j, a < (A)0 ? (A)0 : a);
        }
        store_pack<T, V>(y, q * V, ys);
    }
}

// ----- dropout -----

// Philox4x32-10 (Salmon et al., SC 2011): ten rounds on the 128-bit counter c under the
// 64-bit key (k0, k1), the key bumped by the Weyl constants between rounds
__device__ __forceinline__ void philox4x32(unsigned int c[4], unsigned int k0, unsigned int k1) {
    for (int r = 0; r < 10; ++r) {
        if (r) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        const unsigned int hi0 = __umulhi(0xD2511F53u, c[0]), lo0 = 0xD2511F53u * c[0];
        const unsigned int hi1 = __umulhi(0xCD9E8D57u, c[2]), lo1 = 0xCD9E8D57u * c[2];
        const unsigned int n0 = hi1 ^ c[1] ^ k0, n2 = hi0 ^ c[3] ^ k1;
        c[0] = n0;
        c[1] = lo1;
        c[2] = n2;
        c[3] = lo0;
    }
}

// y[i] = x[i] * scale where word (i mod 4) of philox4x32((i / 4, 0), (k0, k1)), shifted
// right by 8, is >= threshold (keep), else 0; key = k0 + 2^32 k1 is read from device memory
// (key[0] = k0, key[1] = k1), so that a CUDA graph's replay draws the mask of the key written
// before it. dropout(x) and its backward are both this map.
template <typename T, typename A>
__global__ void dropout(const T* x, long long n, const unsigned int* key,
                        unsigned int threshold, A scale, T* y) {
    const unsigned int k0 = key[0], k1 = key[1];
    for (long long b = first_index(); b * 4 < n; b += grid_stride()) {
        unsigned int c[4] = {(unsigned int)b, (unsigned int)(b >> 32), 0u, 0u};
        philox4x32(c, k0, k1);
        for (int j = 0; j < 4; ++j) {
            const long long i = b * 4 + j;
            if (i < n)
                store(y, i, (c[j] >> 8) >= threshold ? (A)load(x, i) * scale : (A)0);
        }
    }
}
