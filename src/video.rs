// SPDX-License-Identifier: MPL-2.0
//! GStreamer's video frames as the engines read them (`engine::frame`): the format and
//! colorimetry of a `VideoInfo`, the planes of a mapped frame, and GStreamer's own converter
//! for the CPU preprocessing's colour conversion.

use std::any::Any;

use gst_video::prelude::*;

use crate::engine::frame::{Colour, FrameFormat, FrameView, PackedSource, PixelFormat};

/// The engines' name of a GStreamer video format; `None` for one the element does not take.
pub fn pixel_format(format: gst_video::VideoFormat) -> Option<PixelFormat> {
    use gst_video::VideoFormat as F;
    Some(match format {
        F::Rgb => PixelFormat::Rgb,
        F::Bgr => PixelFormat::Bgr,
        F::Rgba => PixelFormat::Rgba,
        F::Bgra => PixelFormat::Bgra,
        F::Rgbx => PixelFormat::Rgbx,
        F::Bgrx => PixelFormat::Bgrx,
        F::Xrgb => PixelFormat::Xrgb,
        F::Xbgr => PixelFormat::Xbgr,
        F::Nv12 => PixelFormat::Nv12,
        F::I420 => PixelFormat::I420,
        F::P01010le => PixelFormat::P01010le,
        F::Gray8 => PixelFormat::Gray8,
        _ => return None,
    })
}

/// GStreamer's video format of one of the engines' pixel formats.
pub fn video_format(format: PixelFormat) -> gst_video::VideoFormat {
    use gst_video::VideoFormat as F;
    match format {
        PixelFormat::Rgb => F::Rgb,
        PixelFormat::Bgr => F::Bgr,
        PixelFormat::Rgba => F::Rgba,
        PixelFormat::Bgra => F::Bgra,
        PixelFormat::Rgbx => F::Rgbx,
        PixelFormat::Bgrx => F::Bgrx,
        PixelFormat::Xrgb => F::Xrgb,
        PixelFormat::Xbgr => F::Xbgr,
        PixelFormat::Nv12 => F::Nv12,
        PixelFormat::I420 => F::I420,
        PixelFormat::P01010le => F::P01010le,
        PixelFormat::Gray8 => F::Gray8,
    }
}

/// The format, size and colorimetry of frames of `info`, or why the engines cannot read them.
pub fn frame_format(info: &gst_video::VideoInfo) -> Result<FrameFormat, String> {
    let format = pixel_format(info.format())
        .ok_or_else(|| format!("the engines do not read {:?} frames", info.format()))?;
    let colorimetry = info.colorimetry();
    let site = info.chroma_site();
    Ok(FrameFormat {
        format,
        width: info.width(),
        height: info.height(),
        colour: Colour {
            kr_kb: colorimetry.matrix().kr_kb().ok(),
            full_range: colorimetry.range() == gst_video::VideoColorRange::Range0_255,
            h_cosited: site.contains(gst_video::VideoChromaSite::H_COSITED),
            v_cosited: site.contains(gst_video::VideoChromaSite::V_COSITED),
        },
    })
}

/// A mapped frame as the engines read it: its planes where they are, and GStreamer's
/// converter for the CPU preprocessing.
pub fn view<'a>(
    frame: &'a gst_video::VideoFrameRef<&'a gst::BufferRef>,
) -> Result<FrameView<'a>, String> {
    let format = frame_format(frame.info())?;
    let planes = (0..frame.n_planes())
        .map(|p| frame.plane_data(p))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("cannot read a frame: {e}"))?;
    Ok(FrameView {
        format,
        planes,
        strides: frame.plane_stride().to_vec(),
        packed: Some(Box::new(Converted(frame))),
    })
}

/// A frame that GStreamer's converter (the code behind `videoconvert`) packs: it reads every
/// raw format with its strides and colorimetry.
struct Converted<'a>(&'a gst_video::VideoFrameRef<&'a gst::BufferRef>);

/// The converter for one input format and size and one packed format, with the buffer it
/// writes; made again when the caps change.
struct Converter {
    in_info: gst_video::VideoInfo,
    to: PixelFormat,
    converter: gst_video::VideoConverter,
    packed_info: gst_video::VideoInfo,
    packed: gst::Buffer,
}

impl Converter {
    fn new(in_info: &gst_video::VideoInfo, to: PixelFormat) -> Result<Self, String> {
        let (width, height) = (in_info.width(), in_info.height());
        let channels = if to == PixelFormat::Gray8 { 1 } else { 3 };
        // Rows without padding, as the engine's resize reads them; the same rate, aspect and
        // interlacing as the input: the converter only changes colour, and at the frame's
        // own size it is exact (no resampling).
        let packed_info = gst_video::VideoInfo::builder(video_format(to), width, height)
            .fps(in_info.fps())
            .par(in_info.par())
            .interlace_mode(in_info.interlace_mode())
            .stride(&[width as i32 * channels])
            .build()
            .map_err(|e| e.to_string())?;
        let mut config = gst_video::VideoConverterConfig::new();
        config.set_dither_method(gst_video::VideoDitherMethod::None);
        config.set_threads(1);
        let converter = gst_video::VideoConverter::new(in_info, &packed_info, Some(config))
            .map_err(|e| e.to_string())?;
        let packed = gst::Buffer::with_size(packed_info.size()).map_err(|e| e.to_string())?;
        Ok(Converter {
            in_info: in_info.clone(),
            to,
            converter,
            packed_info,
            packed,
        })
    }
}

impl PackedSource for Converted<'_> {
    fn with_packed(
        &self,
        to: PixelFormat,
        cache: &mut Option<Box<dyn Any + Send>>,
        f: &mut dyn FnMut(&[u8]),
    ) -> Result<(), String> {
        let info = self.0.info();
        let fits = |c: &Converter| &c.in_info == info && c.to == to;
        let cached = cache.as_mut().and_then(|c| c.downcast_mut::<Converter>());
        let converter = match cached {
            Some(c) if fits(c) => c,
            _ => {
                let made = cache.insert(Box::new(Converter::new(info, to)?));
                made.downcast_mut::<Converter>().expect("just made")
            }
        };
        let packed = converter.packed.make_mut();
        let mut dest =
            gst_video::VideoFrameRef::from_buffer_ref_writable(packed, &converter.packed_info)
                .map_err(|e| e.to_string())?;
        converter.converter.frame_ref(self.0, &mut dest);
        drop(dest);
        let pixels = converter.packed.map_readable().map_err(|e| e.to_string())?;
        f(pixels.as_slice());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::preprocess::{
        ChannelOrder, Crop, InputSpec, Layout, PreprocessOptions, Preprocessor, Rect, ResizeMode,
        geometry,
    };

    /// The engines' table of packed formats (bytes per pixel, where R, G and B are) is
    /// GStreamer's, and every format of the element's caps has a name there.
    #[test]
    fn packed_formats_match_gstreamer() {
        gst::init().unwrap();
        for format in PixelFormat::ALL {
            let info = gst_video::VideoFormatInfo::from_format(video_format(format));
            assert_eq!(pixel_format(info.format()), Some(format));
            assert_eq!(format.planes(), info.n_planes() as usize, "{format:?}");
            match format.packed_rgb() {
                Some((stride, offsets)) => {
                    assert_eq!(stride as i32, info.pixel_stride()[0], "{format:?}");
                    let poffset = info.poffset();
                    assert_eq!(
                        offsets,
                        [0, 1, 2].map(|c| poffset[c] as usize),
                        "{format:?}"
                    );
                }
                None => assert!(info.is_yuv() || info.is_gray(), "{format:?}"),
            }
        }
    }

    // The CPU preprocessing of GStreamer frames: colour through GStreamer's converter, then
    // the engine's resize and normalisation.

    /// An RGB frame of `width × height` with the pixel `pixel(x, y)` at each place.
    fn drawn(
        width: u32,
        height: u32,
        pixel: impl Fn(usize, usize) -> [u8; 3],
    ) -> (gst::Buffer, gst_video::VideoInfo) {
        gst::init().unwrap();
        let info = gst_video::VideoInfo::builder(gst_video::VideoFormat::Rgb, width, height)
            .build()
            .unwrap();
        let mut buf = gst::Buffer::with_size(info.size()).unwrap();
        {
            let mut f =
                gst_video::VideoFrameRef::from_buffer_ref_writable(buf.make_mut(), &info).unwrap();
            let stride = f.plane_stride()[0] as usize;
            let data = f.plane_data_mut(0).unwrap();
            for y in 0..height as usize {
                for x in 0..width as usize {
                    data[y * stride + x * 3..][..3].copy_from_slice(&pixel(x, y));
                }
            }
        }
        (buf, info)
    }

    /// A frame converted to `format` by GStreamer's converter, as `videoconvert` would.
    fn convert(
        buf: &gst::Buffer,
        info: &gst_video::VideoInfo,
        format: gst_video::VideoFormat,
    ) -> (gst::Buffer, gst_video::VideoInfo) {
        let out_info = gst_video::VideoInfo::builder(format, info.width(), info.height())
            .build()
            .unwrap();
        let mut out = gst::Buffer::with_size(out_info.size()).unwrap();
        let conv = gst_video::VideoConverter::new(info, &out_info, None).unwrap();
        let src = gst_video::VideoFrameRef::from_buffer_ref_readable(buf, info).unwrap();
        let mut dst =
            gst_video::VideoFrameRef::from_buffer_ref_writable(out.make_mut(), &out_info).unwrap();
        conv.frame_ref(&src, &mut dst);
        drop(dst);
        (out, out_info)
    }

    /// A solid frame in `format` converted and normalised; returns the NCHW output.
    fn solid(
        format: gst_video::VideoFormat,
        rgb: [u8; 3],
        options: PreprocessOptions,
        layout: Layout,
    ) -> Vec<f32> {
        // Draw the colour in RGB, then let a converter produce the test format, as upstream would.
        let (rgb_buf, rgb_info) = drawn(64, 48, |_, _| rgb);
        let (buf, info) = convert(&rgb_buf, &rgb_info, format);
        let input = InputSpec {
            layout,
            channels: 3,
            height: 8,
            width: 8,
        };
        let mut pre = Preprocessor::new(options, input).unwrap();
        let frame = gst_video::VideoFrameRef::from_buffer_ref_readable(&buf, &info).unwrap();
        let mut out = vec![f32::NAN; input.frame_len()];
        pre.run(&view(&frame).unwrap(), &[Crop::Whole], &mut out)
            .unwrap();
        out
    }

    #[test]
    fn every_format_normalises_to_the_same_values() {
        let expected = [
            (200.0 / 255.0 - 0.485) / 0.229,
            (100.0 / 255.0 - 0.456) / 0.224,
            (50.0 / 255.0 - 0.406) / 0.225,
        ];
        use gst_video::VideoFormat::*;
        for format in [Rgb, Bgr, Rgba, Bgra, Rgbx, Bgrx, Xrgb, Xbgr, Nv12, I420] {
            let out = solid(
                format,
                [200, 100, 50],
                PreprocessOptions::default(),
                Layout::Nchw,
            );
            // RGB formats are exact; YUV formats go through a lossy 8-bit 4:2:0 round trip.
            let levels = if matches!(format, Nv12 | I420) {
                4.0
            } else {
                0.5
            };
            let tol = levels / 255.0 / 0.224;
            for c in 0..3 {
                for v in &out[c * 64..(c + 1) * 64] {
                    assert!(
                        (v - expected[c]).abs() < tol,
                        "{format:?} channel {c}: {v} vs {}",
                        expected[c]
                    );
                }
            }
        }
    }

    /// A picture of smooth gradients as `format`, converted from RGB by GStreamer as an
    /// upstream `videoconvert` would; the RGB picture too.
    fn gradient(
        format: gst_video::VideoFormat,
        width: u32,
        height: u32,
    ) -> [(gst::Buffer, gst_video::VideoInfo); 2] {
        let (w, h) = (width as usize, height as usize);
        let (rgb, rgb_info) = drawn(width, height, |x, y| {
            [
                (x * 255 / w) as u8,
                (y * 255 / h) as u8,
                (255 - (x + y) * 255 / (w + h)) as u8,
            ]
        });
        let (buf, info) = convert(&rgb, &rgb_info, format);
        [(buf, info), (rgb, rgb_info)]
    }

    /// NV12 and I420 frames, resized in YUV and converted at the model's size, are as close
    /// to the RGB picture they were made of as when GStreamer's converter makes RGB of the
    /// whole frame first (the way before): within two 8-bit levels on average and no
    /// farther than that way (to a tenth of a level), at CCTV's frame sizes as at small ones,
    /// whole and in regions.
    #[test]
    fn yuv_frames_are_as_close_to_the_picture_as_through_the_converter() {
        let input = InputSpec {
            layout: Layout::Nchw,
            channels: 3,
            height: 32,
            width: 32,
        };
        let level = 1.0 / 255.0 / 0.225;
        let mut pre = Preprocessor::new(PreprocessOptions::default(), input).unwrap();
        let run = |pre: &mut Preprocessor, frame: &FrameView, crop: Crop| {
            let mut out = vec![f32::NAN; input.frame_len()];
            pre.run(frame, &[crop], &mut out).unwrap();
            out
        };
        let mean_off = |a: &[f32], b: &[f32]| {
            a.iter().zip(b).map(|(a, b)| (a - b).abs()).sum::<f32>() / a.len() as f32 / level
        };
        let region = Crop::Region(Rect {
            x: 101,
            y: 37,
            w: 61,
            h: 45,
        });
        for format in [gst_video::VideoFormat::Nv12, gst_video::VideoFormat::I420] {
            for (width, height) in [(1280, 720), (320, 240)] {
                let [(yuv, yuv_info), (rgb, rgb_info)] = gradient(format, width, height);
                let yuv_frame =
                    gst_video::VideoFrameRef::from_buffer_ref_readable(&yuv, &yuv_info).unwrap();
                let rgb_frame =
                    gst_video::VideoFrameRef::from_buffer_ref_readable(&rgb, &rgb_info).unwrap();
                // GStreamer's converter back to RGB, as the CPU path converted before.
                let (back, back_info) = convert(&yuv, &yuv_info, gst_video::VideoFormat::Rgb);
                let back_frame =
                    gst_video::VideoFrameRef::from_buffer_ref_readable(&back, &back_info).unwrap();
                for crop in [Crop::Whole, region] {
                    let what = format!("{format:?} {width}x{height} {crop:?}");
                    let truth = run(&mut pre, &view(&rgb_frame).unwrap(), crop);
                    let ours = run(&mut pre, &view(&yuv_frame).unwrap(), crop);
                    let before = run(&mut pre, &view(&back_frame).unwrap(), crop);
                    let (ours, before) = (mean_off(&ours, &truth), mean_off(&before, &truth));
                    assert!(
                        ours <= 2.0 && ours <= before + 0.1,
                        "{what}: {ours:.2} levels from the picture on average, through the converter {before:.2}"
                    );
                }
            }
        }
    }

    #[test]
    fn bgr_order_and_nhwc_layout() {
        let options = PreprocessOptions {
            mean: vec![0.0],
            std: vec![1.0],
            channel_order: ChannelOrder::Bgr,
            ..Default::default()
        };
        let out = solid(
            gst_video::VideoFormat::Rgb,
            [255, 0, 51],
            options,
            Layout::Nhwc,
        );
        for px in out.chunks(3) {
            assert!(
                (px[0] - 0.2).abs() < 1e-6 && px[1].abs() < 1e-6 && (px[2] - 1.0).abs() < 1e-6,
                "{px:?}"
            );
        }
    }

    /// A region's model input is that of a frame made of the region's pixels alone, for
    /// each crop of one run (the colour conversion shared), and crops outside are refused.
    #[test]
    fn a_region_is_classified_as_if_it_were_the_frame() {
        gst::init().unwrap();
        let gray = |w: u32, h: u32, at: &dyn Fn(u32, u32) -> u8| {
            let info = gst_video::VideoInfo::builder(gst_video::VideoFormat::Gray8, w, h)
                .build()
                .unwrap();
            let mut buf = gst::Buffer::with_size(info.size()).unwrap();
            {
                let mut f =
                    gst_video::VideoFrameRef::from_buffer_ref_writable(buf.make_mut(), &info)
                        .unwrap();
                let stride = f.plane_stride()[0] as usize;
                let data = f.plane_data_mut(0).unwrap();
                for y in 0..h {
                    for x in 0..w {
                        data[y as usize * stride + x as usize] = at(x, y);
                    }
                }
            }
            (buf, info)
        };
        let pattern = |x: u32, y: u32| ((x * 7 + y * 13) % 256) as u8;
        let (frame_buf, frame_info) = gray(64, 48, &pattern);
        let frame =
            gst_video::VideoFrameRef::from_buffer_ref_readable(&frame_buf, &frame_info).unwrap();
        let input = InputSpec {
            layout: Layout::Nchw,
            channels: 3,
            height: 8,
            width: 8,
        };
        for resize in [
            ResizeMode::Stretch,
            ResizeMode::Letterbox,
            ResizeMode::CenterCrop,
        ] {
            let options = PreprocessOptions {
                resize,
                ..Default::default()
            };
            let mut pre = Preprocessor::new(options, input).unwrap();
            let regions = [
                Rect {
                    x: 5,
                    y: 3,
                    w: 21,
                    h: 9,
                },
                Rect {
                    x: 40,
                    y: 30,
                    w: 24,
                    h: 18,
                },
            ];
            let crops: Vec<Crop> = regions.iter().map(|&r| Crop::Region(r)).collect();
            let mut out = vec![f32::NAN; 2 * input.frame_len()];
            pre.run(&view(&frame).unwrap(), &crops, &mut out).unwrap();
            for (r, got) in regions.iter().zip(out.chunks(input.frame_len())) {
                let (alone_buf, alone_info) = gray(r.w as u32, r.h as u32, &|x, y| {
                    pattern(x + r.x as u32, y + r.y as u32)
                });
                let alone =
                    gst_video::VideoFrameRef::from_buffer_ref_readable(&alone_buf, &alone_info)
                        .unwrap();
                let mut want = vec![f32::NAN; input.frame_len()];
                pre.run(&view(&alone).unwrap(), &[Crop::Whole], &mut want)
                    .unwrap();
                // Inside, the same values; the edge pixels' filter also reads the frame's
                // pixels around the region (as for center-crop), where the region alone has
                // none.
                let (_, dst) = geometry((r.w, r.h), (8, 8), resize);
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    let (y, x) = (((i / 8) % 8) as i32, (i % 8) as i32);
                    let edge = y == dst.y
                        || x == dst.x
                        || y == dst.y + dst.h - 1
                        || x == dst.x + dst.w - 1;
                    let tolerance = if edge { 1.0 } else { 1e-6 };
                    assert!(
                        (g - w).abs() <= tolerance,
                        "{resize:?} {r:?}: value {i} is {g}, alone {w}"
                    );
                }
            }
            let outside = Crop::Region(Rect {
                x: 64,
                y: 0,
                w: 5,
                h: 5,
            });
            let err = pre
                .run(
                    &view(&frame).unwrap(),
                    &[outside],
                    &mut out[..input.frame_len()],
                )
                .unwrap_err();
            assert!(err.to_string().contains("outside the 64x48 frame"), "{err}");
        }
    }

    #[test]
    fn letterbox_border_is_the_mean() {
        gst::init().unwrap();
        // A white 64x16 frame letterboxed into 8x8: rows 0-2 and 5-7 are border.
        let info = gst_video::VideoInfo::builder(gst_video::VideoFormat::Gray8, 64, 16)
            .build()
            .unwrap();
        let mut buf = gst::Buffer::with_size(info.size()).unwrap();
        buf.make_mut().map_writable().unwrap().fill(255);
        let input = InputSpec {
            layout: Layout::Nchw,
            channels: 3,
            height: 8,
            width: 8,
        };
        let options = PreprocessOptions {
            resize: ResizeMode::Letterbox,
            ..Default::default()
        };
        let mut pre = Preprocessor::new(options, input).unwrap();
        let frame = gst_video::VideoFrameRef::from_buffer_ref_readable(&buf, &info).unwrap();
        let mut out = vec![f32::NAN; input.frame_len()];
        pre.run(&view(&frame).unwrap(), &[Crop::Whole], &mut out)
            .unwrap();
        for c in 0..3 {
            let plane = &out[c * 64..(c + 1) * 64];
            assert!(plane[0].abs() < 0.03, "border of channel {c}: {}", plane[0]);
            assert!(
                plane[4 * 8 + 4] > 2.0,
                "picture of channel {c}: {}",
                plane[36]
            );
        }
    }
}
