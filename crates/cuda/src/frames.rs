// SPDX-License-Identifier: MPL-2.0
//! Preprocessing on the GPU: what the `preprocess` kernels (runtime/preprocess.cu) needs to turn one raw
//! video frame into the model's input. The frame's planes are uploaded as they are; colour
//! conversion, resampling, crop or letterbox, normalisation and layout happen in one kernel
//! pass, with the same geometry and filter as the CPU preprocessing (the engine's `preprocess`).

use super::abi::FrameLayout;
pub use super::abi::Pre;
use trtclassify_compiler::frame::{FrameFormat, PixelFormat};
use trtclassify_compiler::spec::{
    ChannelOrder, Crop, InputSpec, Layout, PreprocessOptions, crop_geometry,
};

impl Pre {
    /// Bytes from the frame's address to the end of its last plane: what the kernel may read.
    pub fn extent(&self) -> usize {
        let (h, chroma_h) = (self.size[1] as i64, (self.size[1] as i64 + 1) / 2);
        let planes: &[(usize, i64)] = match FrameLayout::from_id(self.format) {
            Some(FrameLayout::Packed) => &[(0, h)],
            Some(FrameLayout::Nv12 | FrameLayout::P010) => &[(0, h), (1, chroma_h)],
            Some(FrameLayout::I420) | None => &[(0, h), (1, chroma_h), (2, chroma_h)],
        };
        planes
            .iter()
            .map(|&(i, rows)| self.plane[i] + rows * i64::from(self.stride[i]))
            .max()
            .unwrap_or(0)
            .max(0) as usize
    }
}

/// A frame as the kernel reads it: its parameters and its planes.
pub type RawFrame<'a> = (Pre, Vec<&'a [u8]>);

/// The preprocessing settings of an engine, for building each frame's parameters.
pub struct FramePreprocess {
    base: Pre,
    resize: trtclassify_compiler::spec::ResizeMode,
}

impl FramePreprocess {
    /// `None` where the GPU path does not apply (one-channel models); the CPU path runs then.
    pub fn new(options: &PreprocessOptions, input: InputSpec) -> Result<Option<Self>, String> {
        if input.channels != 3 {
            return Ok(None);
        }
        let (mean, std) = options.per_channel(3)?;
        let norm = |c: usize, v: f32| (v * options.scale - mean[c]) / std[c];
        let base = Pre {
            out_w: input.width as i32,
            out_h: input.height as i32,
            nchw: i32::from(input.layout == Layout::Nchw),
            bgr: i32::from(options.channel_order == ChannelOrder::Bgr),
            scale: options.scale,
            mean: [mean[0], mean[1], mean[2]],
            std: [std[0], std[1], std[2]],
            // As the CPU path: the mean colour rounded to a pixel value, then normalised.
            border: std::array::from_fn(|c| norm(c, f32::from(options.border_value(mean[c])))),
            ..Default::default()
        };
        Ok(Some(FramePreprocess {
            base,
            resize: options.resize,
        }))
    }

    /// The kernel parameters for `crop` of a frame of `format` whose planes, rows `strides`
    /// bytes apart, are uploaded one after the other, each `plane_len` bytes; `None` for a
    /// format the kernel does not read, or a crop outside the frame.
    pub fn params(
        &self,
        format: &FrameFormat,
        strides: &[i32],
        plane_lens: &[usize],
        crop: Crop,
    ) -> Option<Pre> {
        let offsets: Vec<i64> = plane_lens
            .iter()
            .scan(0i64, |offset, len| {
                let start = *offset;
                *offset += *len as i64;
                Some(start)
            })
            .collect();
        self.params_at(format, &offsets, strides, crop)
    }

    /// The kernel parameters for `crop` of a frame whose planes start `offsets` bytes after
    /// the address the kernel gets, with rows `strides` bytes apart; `None` for a format the
    /// kernel does not read, or a crop outside the frame (the kernel reads within the crop
    /// only, so a crop clipped to the frame keeps its reads inside the planes).
    pub fn params_at(
        &self,
        format: &FrameFormat,
        offsets: &[i64],
        strides: &[i32],
        crop: Crop,
    ) -> Option<Pre> {
        let mut p = self.base;
        let layout = match format.format {
            PixelFormat::Nv12 => FrameLayout::Nv12,
            PixelFormat::I420 => FrameLayout::I420,
            PixelFormat::P01010le => FrameLayout::P010,
            PixelFormat::Gray8 => return None,
            _ => FrameLayout::Packed,
        };
        p.format = layout.id();
        if let Some((pixel_stride, off)) = format.format.packed_rgb() {
            p.pixel_stride = pixel_stride as i32;
            p.off = off.map(|o| o as i32);
        } else {
            p.m = format.yuv_to_rgb();
            p.cosited = [
                i32::from(format.colour.h_cosited),
                i32::from(format.colour.v_cosited),
            ];
        }
        p.size = [format.width as i32, format.height as i32];
        for (i, (offset, stride)) in offsets.iter().zip(strides).enumerate().take(3) {
            p.plane[i] = *offset;
            p.stride[i] = *stride;
        }
        let (src, dst) = crop_geometry(
            (format.width, format.height),
            crop,
            (p.out_w, p.out_h),
            self.resize,
        )?;
        p.crop = [src.x, src.y, src.w, src.h];
        p.dst = [dst.x, dst.y, dst.w, dst.h];
        Some(p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(format: PixelFormat, width: u32, height: u32) -> FrameFormat {
        FrameFormat {
            format,
            width,
            height,
            colour: Default::default(),
        }
    }

    #[test]
    fn params_follow_format_and_geometry() {
        let input = InputSpec {
            layout: Layout::Nchw,
            channels: 3,
            height: 224,
            width: 224,
        };
        let options = PreprocessOptions {
            resize: trtclassify_compiler::spec::ResizeMode::Letterbox,
            ..Default::default()
        };
        let pre = FramePreprocess::new(&options, input).unwrap().unwrap();
        let bgrx = frame(PixelFormat::Bgrx, 1920, 1080);
        let p = pre
            .params(&bgrx, &[1920 * 4], &[1920 * 1080 * 4], Crop::Whole)
            .unwrap();
        assert_eq!((p.format, p.pixel_stride, p.off), (0, 4, [2, 1, 0]));
        assert_eq!(p.crop, [0, 0, 1920, 1080]);
        assert_eq!(p.dst, [0, 49, 224, 126]);
        // The border is the mean colour: about zero once normalised.
        assert!(p.border.iter().all(|v| v.abs() < 0.02), "{:?}", p.border);
        let i420 = frame(PixelFormat::I420, 64, 48);
        let p = pre
            .params(
                &i420,
                &[64, 32, 32],
                &[64 * 48, 32 * 24, 32 * 24],
                Crop::Whole,
            )
            .unwrap();
        assert_eq!(
            (p.format, p.plane, p.stride),
            (2, [0, 3072, 3840], [64, 32, 32])
        );
        // P010: NV12's layout with two bytes a sample.
        let p010 = frame(PixelFormat::P01010le, 64, 48);
        let p = pre
            .params(&p010, &[128, 128], &[64 * 48 * 2, 64 * 24 * 2], Crop::Whole)
            .unwrap();
        assert_eq!((p.format, p.plane[1], p.stride), (3, 6144, [128, 128, 0]));
        assert_eq!(p.extent(), 64 * 48 * 2 + 24 * 128);
        let gray = frame(PixelFormat::Gray8, 64, 48);
        assert!(pre.params(&gray, &[64], &[64 * 48], Crop::Whole).is_none());
        let grey_model = InputSpec {
            channels: 1,
            ..input
        };
        assert!(
            FramePreprocess::new(&options, grey_model)
                .unwrap()
                .is_none()
        );
    }
}
