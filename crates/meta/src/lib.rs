// SPDX-License-Identifier: MPL-2.0
#![warn(missing_docs)]
//! The classification metadata that `trtclassify` attaches to every buffer, and its typed
//! reader for applications (and for `trtclassifyoverlay`). A crate of its own so that readers
//! link GStreamer only, not the engines.
//!
//! It is a `GstCustomMeta` named [`META_NAME`] so that C and Python read it without this crate:
//! `gst_buffer_get_custom_meta (buffer, "TrtClassifyMeta")` then
//! `gst_custom_meta_get_structure ()`. The structure, named [`STRUCTURE_NAME`], holds:
//!
//! | field | type | meaning |
//! |---|---|---|
//! | `model` | string | file name of the ONNX model |
//! | `frame` | guint64 | index of the frame in the stream, from 0 |
//! | `fresh` | gboolean | false when the result was carried from an earlier frame (`interval`) |
//! | `class-ids` | GstValueArray of gint | the top-k class ids, best first |
//! | `labels` | GstValueArray of string | their labels |
//! | `confidences` | GstValueArray of gdouble | their confidences |
//! | `regions` | GstValueArray of GstStructure | with `roi=regions` or `both`: one per classified region (below) |
//!
//! With `roi=regions`, the frame's own class fields are empty arrays. Each structure of
//! `regions`, named [`REGION_STRUCTURE_NAME`], holds the region's ROI meta `id`, `roi-type`,
//! `x`, `y`, `width`, `height` (guint, as classified: clipped to the frame) and its own
//! `class-ids`, `labels` and `confidences`. The same result is also a param of the region's
//! `GstVideoRegionOfInterestMeta` (see the plugin's `regions` module and [`PARAM_NAME`]), which follows the region through
//! scaling; the coordinates here describe the frame as the classifier saw it.
//!
//! The meta has no tags, so elements that copy metadata (`queue`, `tee`, `videoconvert`,
//! `videoscale`) keep it; the classification describes the whole picture, so it stays valid
//! through scaling and colour conversion.

/// The name the custom meta is registered with (`gst_buffer_get_custom_meta`).
pub const META_NAME: &str = "TrtClassifyMeta";
/// The name of the meta's structure, which holds a frame's result.
pub const STRUCTURE_NAME: &str = "trtclassify-classification";
/// The name of the structures in its `regions` array, one per classified region.
pub const REGION_STRUCTURE_NAME: &str = "trtclassify-region";
/// The name of the param structure each classifier adds to a region's ROI meta.
pub const PARAM_NAME: &str = "classification";

/// One reported class.
#[derive(Debug, Clone, PartialEq)]
pub struct ClassEntry {
    /// The class's index among the model's outputs.
    pub class_id: u32,
    /// Its label from `labels-location`, or its number where there is none.
    pub label: String,
    /// Its score, after the softmax where one applies.
    pub confidence: f32,
}

/// The result attached to one buffer.
#[derive(Debug, Clone, PartialEq)]
pub struct Classification {
    /// File name of the model that produced it.
    pub model: String,
    /// Index of the frame in the stream, from 0.
    pub frame: u64,
    /// False when the result was inferred on an earlier frame and carried to this one.
    pub fresh: bool,
    /// The top-k classes of the whole frame, best first (none with `roi=regions`).
    pub classes: Vec<ClassEntry>,
    /// Each classified region's result, with `roi=regions` or `both`.
    pub regions: Vec<RegionResult>,
}

/// The result of one region of interest.
#[derive(Debug, Clone, PartialEq)]
pub struct RegionResult {
    /// The id of the region's `GstVideoRegionOfInterestMeta`.
    pub id: i32,
    /// The region's type (the ROI meta's `roi_type`, a detector's label).
    pub roi_type: String,
    /// The region as classified (clipped to the frame): x, y, width, height.
    pub rect: (u32, u32, u32, u32),
    /// The top-k classes, best first.
    pub classes: Vec<ClassEntry>,
}

fn class_arrays(classes: &[ClassEntry]) -> (gst::Array, gst::Array, gst::Array) {
    (
        gst::Array::new(classes.iter().map(|c| c.class_id as i32)),
        gst::Array::new(classes.iter().map(|c| c.label.as_str())),
        gst::Array::new(classes.iter().map(|c| f64::from(c.confidence))),
    )
}

fn classes_of(s: &gst::StructureRef) -> Option<Vec<ClassEntry>> {
    let ids = s.get::<gst::Array>("class-ids").ok()?;
    let labels = s.get::<gst::Array>("labels").ok()?;
    let confidences = s.get::<gst::Array>("confidences").ok()?;
    ids.iter()
        .zip(labels.iter())
        .zip(confidences.iter())
        .map(|((id, label), confidence)| {
            Some(ClassEntry {
                class_id: id.get::<i32>().ok()? as u32,
                label: label.get::<String>().ok()?,
                confidence: confidence.get::<f64>().ok()? as f32,
            })
        })
        .collect()
}

impl RegionResult {
    fn to_structure(&self) -> gst::Structure {
        let (ids, labels, confidences) = class_arrays(&self.classes);
        let (x, y, width, height) = self.rect;
        gst::Structure::builder(REGION_STRUCTURE_NAME)
            .field("id", self.id)
            .field("roi-type", &self.roi_type)
            .field("x", x)
            .field("y", y)
            .field("width", width)
            .field("height", height)
            .field("class-ids", ids)
            .field("labels", labels)
            .field("confidences", confidences)
            .build()
    }

    fn from_structure(s: &gst::StructureRef) -> Option<Self> {
        Some(RegionResult {
            id: s.get("id").ok()?,
            roi_type: s.get("roi-type").ok()?,
            rect: (
                s.get("x").ok()?,
                s.get("y").ok()?,
                s.get("width").ok()?,
                s.get("height").ok()?,
            ),
            classes: classes_of(s)?,
        })
    }
}

/// Registers the meta. Called by the plugin's init; harmless to call again.
pub fn register() {
    if gst::meta::CustomMeta::is_registered(META_NAME) {
        return;
    }
    // The default transform of a custom meta copies it only on plain copies; a classification
    // also holds for a scaled or converted picture, so copy it on every transform.
    gst::meta::CustomMeta::register_with_transform(META_NAME, &[], |dest, meta, _src, _type| {
        match gst::meta::CustomMeta::add(dest, META_NAME) {
            Ok(mut copy) => {
                copy_fields(meta.structure(), copy.mut_structure());
                true
            }
            Err(_) => false,
        }
    });
}

/// A custom meta owns its structure, so results are copied into it field by field.
fn copy_fields(src: &gst::StructureRef, dest: &mut gst::StructureRef) {
    dest.set_name(src.name());
    for (field, value) in src.iter() {
        dest.set_value(field, value.clone());
    }
}

impl Classification {
    /// The meta's structure for this result (see the table above).
    pub fn to_structure(&self) -> gst::Structure {
        let (ids, labels, confidences) = class_arrays(&self.classes);
        let mut s = gst::Structure::builder(STRUCTURE_NAME)
            .field("model", &self.model)
            .field("frame", self.frame)
            .field("fresh", self.fresh)
            .field("class-ids", ids)
            .field("labels", labels)
            .field("confidences", confidences)
            .build();
        if !self.regions.is_empty() {
            s.set(
                "regions",
                gst::Array::new(self.regions.iter().map(RegionResult::to_structure)),
            );
        }
        s
    }

    /// The result a meta's structure holds; `None` when it is not one (another name, a
    /// field missing or of another type).
    pub fn from_structure(s: &gst::StructureRef) -> Option<Self> {
        if s.name() != STRUCTURE_NAME {
            return None;
        }
        let regions = match s.get::<gst::Array>("regions") {
            Ok(regions) => regions
                .iter()
                .map(|r| RegionResult::from_structure(r.get::<gst::Structure>().ok()?.as_ref()))
                .collect::<Option<Vec<_>>>()?,
            Err(_) => Vec::new(),
        };
        Some(Classification {
            model: s.get("model").ok()?,
            frame: s.get("frame").ok()?,
            fresh: s.get("fresh").ok()?,
            classes: classes_of(s)?,
            regions,
        })
    }

    /// Attaches this result to `buffer`, replacing an earlier one from this element.
    pub fn attach(&self, buffer: &mut gst::BufferRef) {
        let structure = self.to_structure();
        if let Ok(mut meta) = gst::meta::CustomMeta::from_mut_buffer(buffer, META_NAME) {
            copy_fields(&structure, meta.mut_structure());
            return;
        }
        if let Ok(mut meta) = gst::meta::CustomMeta::add(buffer, META_NAME) {
            copy_fields(&structure, meta.mut_structure());
        }
    }

    /// The result attached to `buffer`, if any.
    pub fn from_buffer(buffer: &gst::BufferRef) -> Option<Self> {
        let meta = gst::meta::CustomMeta::from_buffer(buffer, META_NAME).ok()?;
        Self::from_structure(meta.structure())
    }

    /// The best class, if any passed the threshold.
    pub fn top(&self) -> Option<&ClassEntry> {
        self.classes.first()
    }
}
