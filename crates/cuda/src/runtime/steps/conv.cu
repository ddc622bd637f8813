// SPDX-License-Identifier: MPL-2.0
// The epilogue of a convolution (`Step::Conv`) that cuDNN's fused call cannot do; the
// convolution itself is cuDNN's. Launched by conv.rs's `bias_act`.

// y = act(y + bias[c] + z) over an NHWC tensor with c channels: the epilogue of a
// convolution that cuDNN's fused call cannot do.
extern "C" __global__ void bias_act(T *y, const T *bias, const T *z, long long n, int c,
                                    int act_id, float p0, float p1) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        float v = ld(y[i]) + ld(bias[i % c]);
        if (z) v += ld(z[i]);
        y[i] = st(act(act_id, v, p0, p1));
    }
}

// `bias_act` with 16-byte loads and stores, VEC channels per thread; the host checked that
// c is a multiple of VEC and that y, bias and z are 16-byte aligned.
extern "C" __global__ void bias_act_vec(T *y, const T *bias, const T *z, long long n, int c,
                                        int act_id, float p0, float p1) {
    const long long nv = n / VEC;
    const int cv = c / VEC;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < nv;
         i += (long long)gridDim.x * blockDim.x) {
        const int ch = (nv <= 0x7fffffffLL ? (int)i % cv : (int)(i % cv)) * VEC;
        Vec16 vy = reinterpret_cast<Vec16 *>(y)[i];
        const Vec16 vbias = *reinterpret_cast<const Vec16 *>(bias + ch);
        Vec16 vz = {0, 0, 0, 0};
        if (z) vz = reinterpret_cast<const Vec16 *>(z)[i];
        T *ey = reinterpret_cast<T *>(&vy);
        const T *eb = reinterpret_cast<const T *>(&vbias);
        const T *ez = reinterpret_cast<const T *>(&vz);
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
            float v = ld(ey[k]) + ld(eb[k]);
            if (z) v += ld(ez[k]);
            ey[k] = st(act(act_id, v, p0, p1));
        }
        reinterpret_cast<Vec16 *>(y)[i] = vy;
    }
}

