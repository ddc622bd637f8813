// SPDX-License-Identifier: MPL-2.0
//! The enums of the element's properties, as GObject types.
//!
//! The engine's own enums are plain Rust (the engine does not link GStreamer); these mirror
//! them variant for variant, with the GType names, nicks and values the element has always
//! had, so `gst-launch-1.0` lines and applications setting them by nick or value keep working.

use gst::glib;

use crate::engine;
use crate::preprocess;

/// Declares a property enum beside the engine's enum it mirrors, with conversions both ways.
macro_rules! mirror {
    (
        $(#[$meta:meta])*
        $name:ident => $engine:path, $type_name:literal {
            $($(#[$vmeta:meta])* $variant:ident = $value:literal, $nick:literal, $label:literal;)+
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Eq, PartialEq, Hash, Clone, Copy, glib::Enum)]
        #[repr(u32)]
        #[enum_type(name = $type_name)]
        pub enum $name {
            $(
                $(#[$vmeta])*
                #[enum_value(name = $label, nick = $nick)]
                $variant = $value,
            )+
        }

        impl From<$name> for $engine {
            fn from(value: $name) -> Self {
                use $engine as E;
                match value {
                    $($name::$variant => E::$variant,)+
                }
            }
        }

        impl From<$engine> for $name {
            fn from(value: $engine) -> Self {
                use $engine as E;
                match value {
                    $(E::$variant => $name::$variant,)+
                }
            }
        }
    };
}

mirror! {
    /// The `backend` property.
    Backend => engine::Backend, "GstTrtClassifyBackend" {
        /// The CUDA engine where a GPU can build it, else the CPU.
        Auto = 0, "auto", "Auto: the fastest backend that works on this machine";
        /// The embedded CPU engine, always fp32.
        Cpu = 1, "cpu", "CPU: embedded, works anywhere (fp32)";
        /// Our own CUDA engine (cuDNN, cuBLASLt and compiled kernels) on an NVIDIA GPU.
        Cuda = 2, "cuda", "CUDA: our fp16 engine on NVIDIA GPUs";
        /// TensorRT; this build lacks it, so asking for it is an error.
        Tensorrt = 3, "tensorrt", "TensorRT: where TensorRT 10 is installed";
        /// A remote server speaking the KServe v2 protocol over gRPC.
        Kserve = 4, "kserve", "KServe: a remote Triton / KServe v2 server (server-url, server-model)";
    }
}

mirror! {
    /// The `precision` property.
    Precision => engine::Precision, "GstTrtClassifyPrecision" {
        /// Half precision on GPUs; the CPU backend runs fp32 anyway.
        Fp16 = 0, "fp16", "FP16: half precision on GPUs (the CPU backend runs fp32)";
        /// Single precision everywhere.
        Fp32 = 1, "fp32", "FP32: single precision";
        /// int8 products and convolutions on GPUs, calibrated (calibration-location).
        Int8 = 2, "int8", "INT8: int8 products and convolutions with a calibration table (calibration-location), the rest fp16; GPUs of compute capability 7.5+";
        /// FP8 E4M3 products and convolutions on GPUs, calibrated (calibration-location).
        Fp8 = 3, "fp8", "FP8: FP8 E4M3 products and convolutions with a calibration table (calibration-location), the rest fp16; GPUs of compute capability 8.9+";
    }
}

mirror! {
    /// The `resize-mode` property.
    ResizeMode => preprocess::ResizeMode, "GstTrtClassifyResizeMode" {
        /// Scales the frame to the input size, ignoring its aspect ratio.
        Stretch = 0, "stretch", "Stretch: scale to the input size, ignoring the aspect ratio";
        /// Keeps the aspect ratio and pads the rest with the mean colour.
        Letterbox = 1, "letterbox", "Letterbox: keep the aspect ratio, pad the rest with the mean colour";
        /// Keeps the aspect ratio and cuts the middle of the frame.
        CenterCrop = 2, "center-crop", "Center crop: keep the aspect ratio, crop the middle of the frame";
    }
}

mirror! {
    /// The `channel-order` property.
    ChannelOrder => preprocess::ChannelOrder, "GstTrtClassifyChannelOrder" {
        /// Red, green, blue along the channel axis.
        Rgb = 0, "rgb", "RGB";
        /// Blue, green, red along the channel axis.
        Bgr = 1, "bgr", "BGR";
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use glib::prelude::*;

    fn values<T: StaticType>() -> Vec<(i32, String)> {
        let class = glib::EnumClass::with_type(T::static_type()).unwrap();
        class
            .values()
            .iter()
            .map(|v| (v.value(), v.nick().to_owned()))
            .collect()
    }

    fn pairs(list: &[(i32, &str)]) -> Vec<(i32, String)> {
        list.iter().map(|(v, n)| (*v, n.to_string())).collect()
    }

    /// The GObject values and nicks are what `gst-launch-1.0` lines and applications use:
    /// they stay as they were when the enums lived in the engine.
    #[test]
    fn property_enums_keep_their_values_and_nicks() {
        let backends = [
            (0, "auto"),
            (1, "cpu"),
            (2, "cuda"),
            (3, "tensorrt"),
            (4, "kserve"),
        ];
        assert_eq!(values::<Backend>(), pairs(&backends));
        assert_eq!(
            values::<Precision>(),
            pairs(&[(0, "fp16"), (1, "fp32"), (2, "int8"), (3, "fp8")])
        );
        let modes = [(0, "stretch"), (1, "letterbox"), (2, "center-crop")];
        assert_eq!(values::<ResizeMode>(), pairs(&modes));
        assert_eq!(values::<ChannelOrder>(), pairs(&[(0, "rgb"), (1, "bgr")]));
        assert_eq!(Backend::static_type().name(), "GstTrtClassifyBackend");
    }

    /// Each variant reaches the engine as the same variant, and comes back.
    #[test]
    fn variants_round_trip_through_the_engine() {
        use engine::Backend as E;
        for (ours, theirs) in [
            (Backend::Auto, E::Auto),
            (Backend::Cpu, E::Cpu),
            (Backend::Cuda, E::Cuda),
            (Backend::Tensorrt, E::Tensorrt),
            (Backend::Kserve, E::Kserve),
        ] {
            assert_eq!(E::from(ours), theirs);
            assert_eq!(Backend::from(theirs), ours);
        }
        for p in [
            Precision::Fp16,
            Precision::Fp32,
            Precision::Int8,
            Precision::Fp8,
        ] {
            assert_eq!(Precision::from(engine::Precision::from(p)), p);
        }
        for m in [
            ResizeMode::Stretch,
            ResizeMode::Letterbox,
            ResizeMode::CenterCrop,
        ] {
            assert_eq!(ResizeMode::from(preprocess::ResizeMode::from(m)), m);
        }
        for c in [ChannelOrder::Rgb, ChannelOrder::Bgr] {
            assert_eq!(ChannelOrder::from(preprocess::ChannelOrder::from(c)), c);
        }
    }
}
