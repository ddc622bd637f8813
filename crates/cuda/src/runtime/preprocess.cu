// SPDX-License-Identifier: MPL-2.0
// Frames to the model's input, on the GPU; launched by staging.rs (`flush_preprocess`).

// Frame preprocessing: one raw video frame to the model's normalised f32 input: colour
// conversion, antialiased bilinear resampling (the triangle filter widened by the downscale
// factor, as PIL, torchvision and the CPU backend resize), crop or letterbox, normalisation,
// channel order and layout. The filter is separable, so it runs in two passes: the source
// rows to the destination's width (`preprocess_rows`), then those to its height
// (`preprocess_cols`); each source pixel is converted to RGB once.
struct Pre {
    int format;                 // FRAME_*: abi.rs's `FrameLayout`
    int pixel_stride;           // bytes per pixel (packed)
    int off[3];                 // byte offsets of R, G, B in a pixel (packed)
    long long plane[3];         // byte offsets of the planes in the frame's data
    int stride[3];              // row strides of the planes
    int size[2];                // frame width and height
    int cosited[2];             // chroma sited on luma horizontally, vertically (else between)
    int crop[4];                // source rectangle: x, y, w, h
    int dst[4];                 // where it lands in the model input: x, y, w, h
    int out_w, out_h, nchw, bgr;
    float m[12];                // YUV to RGB (0..255): rgb = m[4c..4c+3] · (y, u, v, 1)
    float scale;
    float mean[3], std[3];
    float border[3];            // the normalised letterbox colour
};
// The size that frames.rs's `Pre` asserts too, with its fields' offsets.
static_assert(sizeof(Pre) == 216, "struct Pre no longer matches Pre (frames.rs)");

// One frame or crop of a launch (abi.rs's `PreJob`): the kernels take one per `blockIdx.z`,
// so that a batch's crops are preprocessed in one launch of each pass.
struct PreJob {
    Pre pre;
    unsigned long long src;     // the frame's device address
    unsigned long long rows;    // the first pass's output for this job ([crop h][dst w][3] f32)
    unsigned long long out;     // its frame of the model input
    int cols;                   // destination columns per block of the first pass
    int pad;
};
static_assert(sizeof(PreJob) == 248, "struct PreJob no longer matches PreJob (abi.rs)");

// The block's job, copied into shared memory by all its threads: its fields are read all
// through the passes.
__device__ __forceinline__ void load_job(const PreJob *__restrict__ jobs, PreJob *job) {
    const int *from = (const int *)&jobs[blockIdx.z];
    for (int i = threadIdx.x; i < (int)(sizeof(PreJob) / 4); i += blockDim.x) ((int *)job)[i] = from[i];
    __syncthreads();
}

// A 16-bit little-endian sample (P010: ten bits at the top) on the 8-bit scale: a 10-bit
// value v is 8-bit v / 4, as the standards (and GStreamer's converter, within half a level)
// read it. Read byte by byte: a frame in the staging buffer may start at an odd address.
__device__ __forceinline__ float sample16(const unsigned char *s) {
    return (float)(s[0] | (s[1] << 8)) * (1.f / 256.f);
}

__device__ __forceinline__ float sample(const unsigned char *s, bool wide) {
    return wide ? sample16(s) : (float)s[0];
}

// RGB in 0..255 from Y, U, V on the 8-bit scale, with the frame's matrix.
__device__ __forceinline__ void yuv_rgb(const Pre &p, float Y, float U, float V, float *rgb) {
    for (int c = 0; c < 3; c++) {
        float v = p.m[4 * c] * Y + p.m[4 * c + 1] * U + p.m[4 * c + 2] * V + p.m[4 * c + 3];
        rgb[c] = fminf(fmaxf(v, 0.f), 255.f);
    }
}

// Where a luma position falls among the chroma samples of 4:2:0 (sited on luma, or between).
__device__ __forceinline__ float chroma_pos(int v, int cosited) {
    return cosited ? v * 0.5f : (v - 0.5f) * 0.5f;
}

// The U and V samples of chroma column `cx` in chroma row `cy` (both clamped by the caller).
__device__ __forceinline__ void chroma_at(const Pre &p, const unsigned char *src, int cx, int cy,
                                          float *u, float *v) {
    if (p.format == FRAME_I420) {
        *u = src[p.plane[1] + (long long)cy * p.stride[1] + cx];
        *v = src[p.plane[2] + (long long)cy * p.stride[2] + cx];
    } else {
        bool wide = p.format == FRAME_P010;
        const unsigned char *uv = src + p.plane[1] + (long long)cy * p.stride[1] + cx * (wide ? 4 : 2);
        *u = sample(uv, wide);
        *v = sample(uv + (wide ? 2 : 1), wide);
    }
}

// The RGB of one pixel, read on its own (packed formats, and taps beyond what a block of
// `preprocess_rows` keeps).
__device__ __forceinline__ void rgb_at(const Pre &p, const unsigned char *src, int x, int y,
                                       float *rgb) {
    if (p.format == FRAME_PACKED) {
        const unsigned char *px = src + p.plane[0] + (long long)y * p.stride[0] + x * p.pixel_stride;
        rgb[0] = px[p.off[0]];
        rgb[1] = px[p.off[1]];
        rgb[2] = px[p.off[2]];
        return;
    }
    bool wide = p.format == FRAME_P010;
    float Y = sample(src + p.plane[0] + (long long)y * p.stride[0] + x * (wide ? 2 : 1), wide);
    // 4:2:0 chroma interpolated linearly at the luma position, as GStreamer's converter does.
    float cx = chroma_pos(x, p.cosited[0]), cy = chroma_pos(y, p.cosited[1]);
    int cw = (p.size[0] + 1) / 2, chh = (p.size[1] + 1) / 2;
    int x0 = (int)floorf(cx), y0 = (int)floorf(cy);
    float fx = cx - x0, fy = cy - y0;
    float U = 0.f, V = 0.f;
    for (int j = 0; j < 2; j++) {
        for (int i = 0; i < 2; i++) {
            float w = (j ? fy : 1.f - fy) * (i ? fx : 1.f - fx), u, v;
            chroma_at(p, src, min(max(x0 + i, 0), cw - 1), min(max(y0 + j, 0), chh - 1), &u, &v);
            U += w * u;
            V += w * v;
        }
    }
    yuv_rgb(p, Y, U, V, rgb);
}

// Taps of the filter for output position `i` (0-based in the destination rectangle): the
// first source index, how many, and the filter's half-width in source pixels.
__device__ __forceinline__ void taps(int i, int in_size, int out_size, float *center,
                                     float *support, int *first, int *count) {
    float scale = (float)in_size / out_size;
    float fs = fmaxf(scale, 1.f);
    *center = (i + 0.5f) * scale;
    *support = fs;
    int lo = max((int)floorf(*center - fs + 0.5f), 0);
    int hi = min((int)floorf(*center + fs + 0.5f), in_size);
    *first = lo;
    *count = hi - lo;
}

// The pixels of a source row that one block of `preprocess_rows` converts once and keeps:
// 24 KiB, a whole 1920-pixel row; wider rows are split over blocks by columns (see
// `Runtime::launch_preprocess`), and a tap outside what was kept is read directly.
// PRE_SPAN: abi.rs's, generated.

// Converts pixels x0 .. x0 + n - 1 of source row y to RGB into `px`, all threads of the block
// together. For YUV the row's chroma is first interpolated vertically into `uv` (U, V pairs,
// one per chroma column), so that each pixel then reads one luma sample from the frame.
__device__ void convert_span(const Pre &p, const unsigned char *__restrict__ src, int x0, int n,
                             int y, float *px, float *uv) {
    if (p.format == FRAME_PACKED) {
        for (int i = threadIdx.x; i < n; i += blockDim.x) rgb_at(p, src, x0 + i, y, &px[3 * i]);
        return;
    }
    int cw = (p.size[0] + 1) / 2, chh = (p.size[1] + 1) / 2;
    float cy = chroma_pos(y, p.cosited[1]);
    int cy0 = (int)floorf(cy);
    float fy = cy - cy0;
    int rows[2] = {min(max(cy0, 0), chh - 1), min(max(cy0 + 1, 0), chh - 1)};
    // Chroma columns from the left neighbour of the first pixel to the right one of the last.
    int c0 = (int)floorf(chroma_pos(x0, p.cosited[0]));
    int nc = (int)floorf(chroma_pos(x0 + n - 1, p.cosited[0])) + 2 - c0;
    for (int k = threadIdx.x; k < nc; k += blockDim.x) {
        int cx = min(max(c0 + k, 0), cw - 1);
        float u0, v0, u1, v1;
        chroma_at(p, src, cx, rows[0], &u0, &v0);
        chroma_at(p, src, cx, rows[1], &u1, &v1);
        uv[2 * k] = (1.f - fy) * u0 + fy * u1;
        uv[2 * k + 1] = (1.f - fy) * v0 + fy * v1;
    }
    __syncthreads();
    bool wide = p.format == FRAME_P010;
    const unsigned char *luma = src + p.plane[0] + (long long)y * p.stride[0];
#pragma unroll 4
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        int x = x0 + i;
        float cx = chroma_pos(x, p.cosited[0]);
        int k = (int)floorf(cx);
        float fx = cx - k;
        k -= c0;
        float U = (1.f - fx) * uv[2 * k] + fx * uv[2 * k + 2];
        float V = (1.f - fx) * uv[2 * k + 1] + fx * uv[2 * k + 3];
        yuv_rgb(p, sample(luma + x * (wide ? 2 : 1), wide), U, V, &px[3 * i]);
    }
}

// Pass 1: each source row of the crop filtered horizontally into the destination rectangle's
// columns, as RGB in 0..255, into `rows` ([crop h][dst w][3]). A block takes `cols` columns
// of one row at a time: its threads convert the pixels those columns read into shared memory,
// then each thread filters one column. Job `blockIdx.z` of `jobs`; a block beyond its job's
// columns or rows (the grid fits the largest job of the launch) has nothing to do.
extern "C" __global__ void preprocess_rows(const PreJob *__restrict__ jobs) {
    __shared__ float px[PRE_SPAN * 3];
    __shared__ float uv[PRE_SPAN + 8];
    __shared__ PreJob job;
    load_job(jobs, &job);
    const Pre &p = job.pre;
    const unsigned char *src = (const unsigned char *)job.src;
    float *rows = (float *)job.rows;
    int c0 = blockIdx.x * job.cols, c1 = min(c0 + job.cols, p.dst[2]);
    if (c0 >= c1) return;
    float cx, sx;
    int lo, n, last, last_n;
    taps(c0, p.crop[2], p.dst[2], &cx, &sx, &lo, &n);
    taps(c1 - 1, p.crop[2], p.dst[2], &cx, &sx, &last, &last_n);
    int span = min(last + last_n - lo, PRE_SPAN);
    for (int row = blockIdx.y; row < p.crop[3]; row += gridDim.y) {
        int y = p.crop[1] + row;
        __syncthreads();  // the last row's pixels are no longer read
        convert_span(p, src, p.crop[0] + lo, span, y, px, uv);
        __syncthreads();
        for (int dx = c0 + threadIdx.x; dx < c1; dx += blockDim.x) {
            int x0, nx;
            taps(dx, p.crop[2], p.dst[2], &cx, &sx, &x0, &nx);
            float acc[3] = {0.f, 0.f, 0.f}, wsum = 0.f, inv = 1.f / sx;
            for (int x = x0; x < x0 + nx; x++) {
                float w = fmaxf(1.f - fabsf((x + 0.5f - cx) * inv), 0.f);
                if (w == 0.f) continue;
                float direct[3];
                const float *rgb = &px[3 * (x - lo)];
                if (x - lo >= span) {
                    rgb_at(p, src, p.crop[0] + x, y, direct);
                    rgb = direct;
                }
                for (int c = 0; c < 3; c++) acc[c] += w * rgb[c];
                wsum += w;
            }
            float *o = rows + ((long long)row * p.dst[2] + dx) * 3;
            for (int c = 0; c < 3; c++) o[c] = acc[c] / wsum;
        }
    }
}

// Pass 2: the filtered rows filtered vertically into each output pixel, normalised, in the
// model's channel order and layout; the letterbox colour around the destination rectangle.
// One thread per output pixel.
extern "C" __global__ void preprocess_cols(const PreJob *__restrict__ jobs) {
    __shared__ PreJob job;
    load_job(jobs, &job);
    const Pre &p = job.pre;
    const float *rows = (const float *)job.rows;
    float *out = (float *)job.out;
    int n = p.out_w * p.out_h;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        int dx = i % p.out_w - p.dst[0], dy = i / p.out_w - p.dst[1];
        bool inside = dx >= 0 && dy >= 0 && dx < p.dst[2] && dy < p.dst[3];
        float acc[3] = {0.f, 0.f, 0.f};
        if (inside) {
            float cy, sy;
            int y0, ny;
            taps(dy, p.crop[3], p.dst[3], &cy, &sy, &y0, &ny);
            float wsum = 0.f;
            for (int y = y0; y < y0 + ny; y++) {
                float w = fmaxf(1.f - fabsf((y + 0.5f - cy) / sy), 0.f);
                if (w == 0.f) continue;
                const float *r = rows + ((long long)y * p.dst[2] + dx) * 3;
                for (int c = 0; c < 3; c++) acc[c] += w * r[c];
                wsum += w;
            }
            for (int c = 0; c < 3; c++) acc[c] /= wsum;
        }
        for (int c = 0; c < 3; c++) {
            float v = inside ? (acc[p.bgr ? 2 - c : c] * p.scale - p.mean[c]) / p.std[c] : p.border[c];
            long long o = p.nchw ? (long long)c * n + i : (long long)i * 3 + c;
            out[o] = v;
        }
    }
}

