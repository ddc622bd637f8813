// SPDX-License-Identifier: MPL-2.0
//! GStreamer's CUDA memory (`video/x-raw(memory:CUDAMemory)`, from `nvh264dec`, `nvh265dec`,
//! `nvjpegdec`, `cudaupload`, `cudaconvert`, ...), read where it is.
//!
//! Two things make decoded frames reach the engine without a trip through host memory:
//! - the CUDA context is shared with the decoder through GStreamer's context mechanism
//!   (`gst.cuda.context`): the element offers a context wrapping the CUDA primary context,
//!   which the engine runs in, so the decoder writes its frames where our kernels read them;
//! - a buffer's planes are mapped as device pointers (`GST_MAP_CUDA`) and handed to the
//!   engine's preprocessing kernel as they are. A frame from another context (one an
//!   application set on the decoder) is copied on the GPU into ours first.
//!
//! GStreamer's CUDA library (`libgstcuda-1.0`, public since GStreamer 1.22, part of
//! gst-plugins-bad) is loaded at run time: where it is missing, the element offers system
//! memory only and nothing here runs.

use std::ffi::c_void;
use std::sync::{Arc, LazyLock, Mutex};

use gst::glib;
use gst::glib::translate::*;
use gst::prelude::*;

/// The caps feature of CUDA memory.
pub const CAPS_FEATURE: &str = "memory:CUDAMemory";
/// `GST_CUDA_CONTEXT_TYPE`: the context type that CUDA elements share.
pub const CONTEXT_TYPE: &str = "gst.cuda.context";
/// `GST_CUDA_MEMORY_TYPE_NAME`.
const MEMORY_TYPE: &str = "gst.cuda.memory";
/// `GST_MAP_CUDA`: map the device memory rather than a copy in system memory.
const MAP_CUDA: u32 = gst::ffi::GST_MAP_FLAG_LAST << 1;

type CuContext = *mut c_void;

/// The functions of libgstcuda-1.0 that this module calls.
struct Library {
    _lib: libloading::Library,
    context_get_handle: unsafe extern "C" fn(*mut gst::ffi::GstObject) -> CuContext,
    context_new_wrapped: unsafe extern "C" fn(CuContext, i32) -> *mut gst::ffi::GstObject,
    context_new_cuda_context:
        unsafe extern "C" fn(*mut gst::ffi::GstObject) -> *mut gst::ffi::GstContext,
    handle_set_context: unsafe extern "C" fn(
        *mut gst::ffi::GstElement,
        *mut gst::ffi::GstContext,
        i32,
        *mut *mut gst::ffi::GstObject,
    ) -> glib::ffi::gboolean,
    handle_context_query: unsafe extern "C" fn(
        *mut gst::ffi::GstElement,
        *mut gst::ffi::GstQuery,
        *mut gst::ffi::GstObject,
    ) -> glib::ffi::gboolean,
    /// `gst_cuda_memory_sync` (GStreamer ≥ 1.24, where decoders may leave work queued on a
    /// stream of their own); absent before, where mapped memory is always ready.
    memory_sync: Option<unsafe extern "C" fn(*mut gst::ffi::GstMemory)>,
}

impl Library {
    fn load() -> Result<Self, String> {
        // SAFETY: loading GStreamer's own CUDA library, whose constructors only register types.
        let lib = unsafe { libloading::Library::new("libgstcuda-1.0.so.0") }
            .map_err(|e| format!("cannot load libgstcuda-1.0.so.0: {e}"))?;
        // SAFETY: each symbol is declared with its signature in GStreamer's gst/cuda headers
        // (1.22 and later).
        unsafe {
            macro_rules! sym {
                ($name:literal) => {
                    *lib.get(concat!($name, "\0").as_bytes())
                        .map_err(|e| format!("libgstcuda-1.0: {}: {e}", $name))?
                };
            }
            // The library reaches CUDA through a table it fills here (nvcodec's plugin does
            // the same at load); without it, its first CUDA call aborts the process.
            let load_cuda: unsafe extern "C" fn() -> glib::ffi::gboolean =
                sym!("gst_cuda_load_library");
            if load_cuda() == glib::ffi::GFALSE {
                return Err("libgstcuda-1.0 cannot load the CUDA driver".into());
            }
            Ok(Library {
                context_get_handle: sym!("gst_cuda_context_get_handle"),
                context_new_wrapped: sym!("gst_cuda_context_new_wrapped"),
                context_new_cuda_context: sym!("gst_context_new_cuda_context"),
                handle_set_context: sym!("gst_cuda_handle_set_context"),
                handle_context_query: sym!("gst_cuda_handle_context_query"),
                memory_sync: lib.get(b"gst_cuda_memory_sync\0").ok().map(|s| *s),
                _lib: lib,
            })
        }
    }
}

static LIBRARY: LazyLock<Result<Library, String>> = LazyLock::new(Library::load);

/// Why CUDA memory cannot be read here, or `None` when it can (GStreamer's CUDA library
/// loads).
pub fn unavailable_reason() -> Option<&'static str> {
    LIBRARY.as_ref().err().map(String::as_str)
}

/// Whether frames in CUDA memory can be read here at all: GStreamer's CUDA library and the
/// cuda engine's libraries both load. Settled once per process.
pub fn usable() -> bool {
    static USABLE: LazyLock<bool> = LazyLock::new(|| {
        unavailable_reason().is_none() && crate::engine::cuda::unavailable_reason().is_none()
    });
    *USABLE
}

fn library() -> Option<&'static Library> {
    LIBRARY.as_ref().ok()
}

/// A `GstCudaContext`: a CUDA context as GStreamer's CUDA elements share it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Context(gst::Object);

impl Context {
    /// The CUDA context (`CUcontext`) it wraps.
    pub fn handle(&self) -> usize {
        let lib = library().expect("a Context exists only where the library loads");
        // SAFETY: `self.0` is a GstCudaContext.
        unsafe { (lib.context_get_handle)(self.0.as_ptr()) as usize }
    }

    /// The GStreamer context that carries it, for the bus and for queries.
    pub fn to_gst_context(&self) -> gst::Context {
        let lib = library().expect("a Context exists only where the library loads");
        // SAFETY: returns a new GstContext holding a reference to the GstCudaContext.
        unsafe { from_glib_full((lib.context_new_cuda_context)(self.0.as_ptr())) }
    }
}

impl Context {
    /// The GPU it is a context of.
    pub fn device(&self) -> Option<u32> {
        device_id(self.0.upcast_ref())
    }
}

/// An object's `cuda-device-id` (a GstCudaContext's, a CUDA element's) where it names a GPU;
/// `None` where it has no such property, or it is -1 (any GPU).
fn device_id(object: &glib::Object) -> Option<u32> {
    object.find_property("cuda-device-id")?;
    let value = object.property_value("cuda-device-id");
    value.get::<u32>().ok().or_else(|| {
        value
            .get::<i32>()
            .ok()
            .and_then(|id| u32::try_from(id).ok())
    })
}

/// The GPU of the CUDA element upstream of `sinkpad` (a decoder of one GPU, such as
/// `nvh264device1dec`), before any frame flows: the first element upstream, through queues,
/// converters and bins, whose `cuda-device-id` names a GPU; else, once the elements upstream
/// are ready, the context a CUDA element upstream answers a query with. `None`: nothing
/// upstream says (system memory, or a decoder not plugged in yet).
pub fn device_upstream(sinkpad: &gst::Pad) -> Option<u32> {
    device_of_elements_upstream(sinkpad).or_else(|| {
        library()?;
        let mut query = gst::query::Context::new(CONTEXT_TYPE);
        if !sinkpad.peer_query(&mut query) {
            return None;
        }
        let context = query.context_owned()?;
        let object = context.structure().get::<glib::Object>(CONTEXT_TYPE).ok()?;
        device_id(&object)
    })
}

fn device_of_elements_upstream(sinkpad: &gst::Pad) -> Option<u32> {
    let mut pad = sinkpad.peer()?;
    // A bound, in case of a loop of links.
    for _ in 0..32 {
        // A bin's source pad stands for a pad inside it.
        while let Some(ghost) = pad.downcast_ref::<gst::GhostPad>() {
            pad = ghost.target()?;
        }
        let element = pad.parent_element()?;
        if let Some(gpu) = device_id(element.upcast_ref()) {
            return Some(gpu);
        }
        // Elements of one input (queues, parsers, converters) pass the frames of the one
        // upstream; past a mixer the frames' GPU is not one element's.
        let mut sinks = element.sink_pads();
        if sinks.len() != 1 {
            return None;
        }
        pad = sinks.pop()?.peer()?;
    }
    None
}

/// The context wrapping GPU `gpu_id`'s CUDA primary context, which the cuda engine runs in;
/// one per GPU for the life of the process, so that every element and decoder of every
/// pipeline can share it.
pub fn primary_context(gpu_id: u32) -> Result<Context, String> {
    type Contexts = Vec<(u32, Arc<cudarc::driver::CudaContext>, Context)>;
    static CONTEXTS: LazyLock<Mutex<Contexts>> = LazyLock::new(Default::default);
    let lib = LIBRARY.as_ref().map_err(Clone::clone)?;
    let mut contexts = CONTEXTS.lock().unwrap();
    if let Some((_, _, ctx)) = contexts.iter().find(|(id, ..)| *id == gpu_id) {
        return Ok(ctx.clone());
    }
    if let Some(reason) = crate::engine::cuda::unavailable_reason() {
        return Err(reason);
    }
    // Retains the primary context for the life of the process: the wrapper does not own it.
    let cuda = cudarc::driver::CudaContext::new(gpu_id as usize)
        .map_err(|e| format!("GPU {gpu_id}: cannot open its CUDA context: {e}"))?;
    // SAFETY: a valid context and device; returns a new GstCudaContext or NULL.
    let raw = unsafe { (lib.context_new_wrapped)(cuda.cu_ctx() as CuContext, cuda.cu_device()) };
    if raw.is_null() {
        return Err(format!(
            "GPU {gpu_id}: GStreamer's CUDA library cannot wrap its context"
        ));
    }
    // SAFETY: a new reference to a GstObject, sunk if it is still floating.
    let ctx = Context(unsafe {
        if glib::gobject_ffi::g_object_is_floating(raw as *mut _) != glib::ffi::GFALSE {
            // Turns the floating reference into the one we own.
            gst::ffi::gst_object_ref_sink(raw as *mut _);
        }
        from_glib_full(raw)
    });
    contexts.push((gpu_id, cuda, ctx.clone()));
    Ok(ctx)
}

/// Takes a CUDA context from `context` when it is one for GPU `gpu_id` (-1: any GPU)
/// (`GstElement::set_context`).
pub fn handle_set_context(
    element: &gst::Element,
    context: &gst::ContextRef,
    gpu_id: i32,
    slot: &mut Option<Context>,
) {
    let Some(lib) = library() else { return };
    if context.context_type() != CONTEXT_TYPE {
        return;
    }
    // A context already taken stays: elements of a pipeline keep the one they started with.
    if slot.is_some() {
        return;
    }
    let mut raw: *mut gst::ffi::GstObject = std::ptr::null_mut();
    // SAFETY: the call stores a new reference to a GstCudaContext of `gpu_id` in `raw`, or
    // leaves it NULL.
    unsafe {
        (lib.handle_set_context)(
            element.as_ptr(),
            context.as_ptr() as *mut _,
            gpu_id,
            &mut raw,
        );
        if !raw.is_null() {
            *slot = Some(Context(from_glib_full(raw)));
        }
    }
}

/// Answers a context query with `ctx`; true when it was answered.
pub fn handle_context_query(
    element: &gst::Element,
    query: &mut gst::QueryRef,
    ctx: Option<&Context>,
) -> bool {
    let (Some(lib), Some(ctx)) = (library(), ctx) else {
        return false;
    };
    // SAFETY: a context query and a GstCudaContext.
    unsafe {
        (lib.handle_context_query)(element.as_ptr(), query.as_mut_ptr(), ctx.0.as_ptr())
            != glib::ffi::GFALSE
    }
}

/// Whether `buffer` holds CUDA memory.
pub fn is_cuda_memory(buffer: &gst::BufferRef) -> bool {
    buffer.n_memory() > 0 && buffer.peek_memory(0).is_type(MEMORY_TYPE)
}

/// The public head of `GstCudaMemory` (gstcudamemory.h, 1.22 and later).
#[repr(C)]
struct CudaMemoryHead {
    mem: gst::ffi::GstMemory,
    context: *mut gst::ffi::GstObject,
}

/// A video frame in CUDA memory, mapped as device pointers for as long as it lives.
pub struct DeviceFrame {
    frame: gst_video::ffi::GstVideoFrame,
    context: usize,
    /// The GstCudaContext of its memory.
    context_object: glib::Object,
}

// SAFETY: the mapping belongs to this value alone and is released in Drop, on any thread.
unsafe impl Send for DeviceFrame {}

impl DeviceFrame {
    /// Maps `buffer`'s planes as device pointers; the buffer must hold CUDA memory
    /// (`is_cuda_memory`) and stay alive while the frame is used.
    pub fn map(buffer: &gst::BufferRef, info: &gst_video::VideoInfo) -> Result<Self, String> {
        let lib = LIBRARY.as_ref().map_err(Clone::clone)?;
        if !is_cuda_memory(buffer) {
            return Err("the buffer holds no CUDA memory".into());
        }
        let mem = buffer.peek_memory(0).as_ptr() as *mut gst::ffi::GstMemory;
        let mut frame = std::mem::MaybeUninit::<gst_video::ffi::GstVideoFrame>::zeroed();
        // SAFETY: a readable map of a live buffer with its video info; GstCudaMemory's head
        // is public API, and its context is a GstCudaContext.
        unsafe {
            if gst_video::ffi::gst_video_frame_map(
                frame.as_mut_ptr(),
                info.to_glib_none().0,
                buffer.as_ptr() as *mut _,
                gst::ffi::GST_MAP_READ | MAP_CUDA,
            ) == glib::ffi::GFALSE
            {
                return Err("cannot map the frame's CUDA memory".into());
            }
            if let Some(sync) = lib.memory_sync {
                sync(mem);
            }
            let context_obj = (*(mem as *const CudaMemoryHead)).context;
            let context = (lib.context_get_handle)(context_obj) as usize;
            Ok(DeviceFrame {
                frame: frame.assume_init(),
                context,
                context_object: from_glib_none(context_obj as *mut glib::gobject_ffi::GObject),
            })
        }
    }

    /// The frame's geometry and format, with the strides of the mapped planes.
    pub fn info(&self) -> gst_video::VideoInfo {
        // SAFETY: the mapped frame's info is a valid GstVideoInfo.
        unsafe { from_glib_none(&self.frame.info as *const _) }
    }

    /// The CUDA context (`CUcontext`) of its memory.
    pub fn context(&self) -> usize {
        self.context
    }

    /// The GPU its memory is on.
    pub fn device(&self) -> Option<u32> {
        device_id(&self.context_object)
    }

    /// The planes as the engine reads them.
    pub fn planes(&self) -> Result<crate::engine::DevicePlanes, String> {
        let info = self.info();
        let n = info.n_planes() as usize;
        Ok(crate::engine::DevicePlanes {
            format: crate::video::frame_format(&info)?,
            ptrs: (0..n).map(|i| self.frame.data[i] as u64).collect(),
            strides: info.stride()[..n].to_vec(),
            context: self.context,
        })
    }
}

impl Drop for DeviceFrame {
    fn drop(&mut self) {
        // SAFETY: mapped in `map`, unmapped once.
        unsafe { gst_video::ffi::gst_video_frame_unmap(&mut self.frame) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An element with a `cuda-device-id` property and a source pad, as a decoder of one GPU
    /// (`nvh264device1dec`) or a CUDA converter of any GPU (-1) has.
    mod fake {
        use std::sync::atomic::{AtomicI32, Ordering};

        use gst::glib;
        use gst::prelude::*;
        use gst::subclass::prelude::*;

        #[derive(Default)]
        pub struct CudaElement(AtomicI32);

        #[glib::object_subclass]
        impl ObjectSubclass for CudaElement {
            const NAME: &'static str = "TrtTestCudaElement";
            type Type = super::CudaElement;
            type ParentType = gst::Element;
        }

        impl ObjectImpl for CudaElement {
            fn properties() -> &'static [glib::ParamSpec] {
                static PROPERTIES: std::sync::LazyLock<Vec<glib::ParamSpec>> =
                    std::sync::LazyLock::new(|| {
                        vec![
                            glib::ParamSpecInt::builder("cuda-device-id")
                                .minimum(-1)
                                .build(),
                        ]
                    });
                PROPERTIES.as_ref()
            }

            fn set_property(&self, _id: usize, value: &glib::Value, _pspec: &glib::ParamSpec) {
                self.0.store(value.get().unwrap(), Ordering::Relaxed);
            }

            fn property(&self, _id: usize, _pspec: &glib::ParamSpec) -> glib::Value {
                self.0.load(Ordering::Relaxed).to_value()
            }

            fn constructed(&self) {
                self.parent_constructed();
                let templ = self.obj().pad_template("src").unwrap();
                self.obj()
                    .add_pad(&gst::Pad::from_template(&templ))
                    .unwrap();
            }
        }

        impl GstObjectImpl for CudaElement {}

        impl ElementImpl for CudaElement {
            fn pad_templates() -> &'static [gst::PadTemplate] {
                static TEMPLATES: std::sync::LazyLock<Vec<gst::PadTemplate>> =
                    std::sync::LazyLock::new(|| {
                        vec![
                            gst::PadTemplate::new(
                                "src",
                                gst::PadDirection::Src,
                                gst::PadPresence::Always,
                                &gst::Caps::new_any(),
                            )
                            .unwrap(),
                        ]
                    });
                TEMPLATES.as_ref()
            }
        }
    }

    glib::wrapper! {
        pub struct CudaElement(ObjectSubclass<fake::CudaElement>) @extends gst::Element, gst::Object;
    }

    fn cuda_element(gpu: i32) -> gst::Element {
        glib::Object::builder::<CudaElement>()
            .property("cuda-device-id", gpu)
            .build()
            .upcast()
    }

    fn element(factory: &str) -> gst::Element {
        gst::ElementFactory::make(factory).build().unwrap()
    }

    #[test]
    fn the_gpu_of_a_cuda_element_upstream_is_found_through_queues_and_bins() {
        gst::init().unwrap();
        // decoder(GPU 1) ! queue ! identity: the identity's frames are on GPU 1.
        let pipeline = gst::Pipeline::new();
        let (decoder, queue, sink) = (cuda_element(1), element("queue"), element("identity"));
        pipeline.add_many([&decoder, &queue, &sink]).unwrap();
        gst::Element::link_many([&decoder, &queue, &sink]).unwrap();
        assert_eq!(device_upstream(&sink.static_pad("sink").unwrap()), Some(1));

        // The decoder inside a bin, behind its ghost pad, then a converter: still GPU 1.
        let pipeline = gst::Pipeline::new();
        let bin = gst::Bin::new();
        let decoder = cuda_element(1);
        bin.add(&decoder).unwrap();
        let ghost = gst::GhostPad::with_target(&decoder.static_pad("src").unwrap()).unwrap();
        bin.add_pad(&ghost).unwrap();
        let (convert, sink) = (element("videoconvert"), element("identity"));
        pipeline
            .add_many([bin.upcast_ref(), &convert, &sink])
            .unwrap();
        gst::Element::link_many([bin.upcast_ref(), &convert, &sink]).unwrap();
        assert_eq!(device_upstream(&sink.static_pad("sink").unwrap()), Some(1));
    }

    #[test]
    fn frames_with_no_cuda_element_upstream_have_no_gpu() {
        gst::init().unwrap();
        let pipeline = gst::Pipeline::new();
        let (source, sink) = (element("videotestsrc"), element("identity"));
        pipeline.add_many([&source, &sink]).unwrap();
        source.link(&sink).unwrap();
        assert_eq!(device_upstream(&sink.static_pad("sink").unwrap()), None);
        // A CUDA element of any GPU says nothing either.
        let pipeline = gst::Pipeline::new();
        let (any_gpu, sink) = (cuda_element(-1), element("identity"));
        pipeline.add_many([&any_gpu, &sink]).unwrap();
        any_gpu.link(&sink).unwrap();
        assert_eq!(device_upstream(&sink.static_pad("sink").unwrap()), None);
        // Nor does an unlinked pad.
        assert_eq!(
            device_upstream(&element("identity").static_pad("sink").unwrap()),
            None
        );
    }
}
