// SPDX-License-Identifier: MPL-2.0
// The engine's own depthwise convolution (`Step::Conv` with a group a channel), its bias and
// activation applied as each output is written, and the activation of the step before
// (`ConvStep::act_in`) as each input is read. cuDNN's fused call takes ReLU or nothing, so
// MobileNet's clipped and EfficientNet's SiLU depthwise convolutions ran as cuDNN's
// convolution and then conv.cu's `bias_act`, a second pass over the output; this writes each
// output once. The build times it beside cuDNN's algorithms and keeps the faster. Launched
// by depthwise.rs's `depthwise_conv`.

// What depthwise.rs's `DepthwiseParams` holds.
struct DepthwiseConv {
    int n, h, w, c;  // the input, NHWC; the output has c channels too
    int oh, ow;      // output height and width
    int r, s;        // kernel height and width (r·s taps, at most DW_MAX_TAPS)
    int sh, sw, ph, pw;
    int group;  // channel vectors (VEC channels each) a block takes: 1, 2, 4 or 8
    int act_id;  // the output's activation
    float p0, p1;
    int act_in_id;  // the activation of each input value as it is read (the padding stays 0)
    float q0, q1;
};
static_assert(sizeof(DepthwiseConv) == 76, "abi.rs's DepthwiseParams");

// A block of DW_THREADS threads takes `p.group` channel vectors (blockIdx.y says which) of
// DW_THREADS / group output pixels at a time, a thread one vector of one pixel, so that a
// warp reads whole 16-byte vectors of neighbouring pixels. The block first lays its
// channels' weights out tap by tap in shared memory, in f32, so that a tap's weights for a
// thread are two 16-byte loads (one in f32 plans) whatever the kernel's size.
template <int ACT_IN, int ACT>
__device__ __forceinline__ void depthwise_body(const DepthwiseConv &p, const T *x, const T *weight,
                                               const T *bias, T *y) {
    float *const taps = reinterpret_cast<float *>(dynamic_shared());
    const int lanes = p.group * VEC;  // channels of the block
    const int c0 = blockIdx.y * lanes;
    const int ntaps = p.r * p.s;
    // KRSC with one input channel a filter: channel c's taps lie together, r·s apart.
    for (int i = threadIdx.x; i < ntaps * lanes; i += DW_THREADS) {
        const int tap = i / lanes, ch = i % lanes;
        taps[i] = ld(weight[(long long)(c0 + ch) * ntaps + tap]);
    }
    __syncthreads();

    const int v = threadIdx.x % p.group;
    const int ch = c0 + v * VEC;
    float b[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) b[j] = ld(bias[ch + j]);
    const int slots = DW_THREADS / p.group;
    const int pixels = p.n * p.oh * p.ow;
    const long long image = (long long)p.h * p.w * p.c;
    for (int px = blockIdx.x * slots + threadIdx.x / p.group; px < pixels;
         px += gridDim.x * slots) {
        const int ox = px % p.ow, rest = px / p.ow;
        const int oy = rest % p.oh, img = rest / p.oh;
        const T *xi = x + img * image + ch;
        float acc[VEC];
#pragma unroll
        for (int j = 0; j < VEC; ++j) acc[j] = 0.f;
        for (int ky = 0; ky < p.r; ++ky) {
            const int iy = oy * p.sh - p.ph + ky;
            if (iy < 0 || iy >= p.h) continue;
            for (int kx = 0; kx < p.s; ++kx) {
                const int ix = ox * p.sw - p.pw + kx;
                if (ix < 0 || ix >= p.w) continue;
                const Vec16 pixel = *reinterpret_cast<const Vec16 *>(xi + (iy * p.w + ix) * p.c);
                const T *e = reinterpret_cast<const T *>(&pixel);
                const float *t = taps + (ky * p.s + kx) * lanes + v * VEC;
#pragma unroll
                for (int j = 0; j < VEC; ++j) {
                    float in = ld(e[j]);
                    if (ACT_IN != ACT_NONE)
                        in = act(ACT_IN < 0 ? p.act_in_id : ACT_IN, in, p.q0, p.q1);
                    acc[j] += in * t[j];
                }
            }
        }
        Vec16 out;
        T *o = reinterpret_cast<T *>(&out);
#pragma unroll
        for (int j = 0; j < VEC; ++j)
            o[j] = st(act(ACT < 0 ? p.act_id : ACT, acc[j] + b[j], p.p0, p.p1));
        T *at = y + (long long)px * p.c + ch;
        WROTE(at);
        *reinterpret_cast<Vec16 *>(at) = out;
    }
}

// An instance for each pair of activations depthwise convolutions have (fixed at compile
// time, as the stem's): none on the input and any of the common ones on the output, or the
// same on both (MobileNet's clip: the expansion's and its own); the rest chosen as it runs.
extern "C" __global__ void __launch_bounds__(DW_THREADS)
    depthwise_conv(const DepthwiseConv p, const T *x, const T *weight, const T *bias, T *y) {
    if (p.act_in_id == ACT_NONE) {
        switch (p.act_id) {
        case ACT_NONE: return depthwise_body<ACT_NONE, ACT_NONE>(p, x, weight, bias, y);
        case ACT_RELU: return depthwise_body<ACT_NONE, ACT_RELU>(p, x, weight, bias, y);
        case ACT_CLIP: return depthwise_body<ACT_NONE, ACT_CLIP>(p, x, weight, bias, y);
        case ACT_SILU: return depthwise_body<ACT_NONE, ACT_SILU>(p, x, weight, bias, y);
        }
    } else if (p.act_in_id == p.act_id) {
        switch (p.act_id) {
        case ACT_RELU: return depthwise_body<ACT_RELU, ACT_RELU>(p, x, weight, bias, y);
        case ACT_CLIP: return depthwise_body<ACT_CLIP, ACT_CLIP>(p, x, weight, bias, y);
        }
    }
    depthwise_body<-1, -1>(p, x, weight, bias, y);
}
