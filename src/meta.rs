// SPDX-License-Identifier: MPL-2.0
//! The classification metadata attached to every buffer.
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
//!
//! The meta has no tags, so elements that copy metadata (`queue`, `tee`, `videoconvert`,
//! `videoscale`) keep it; the classification describes the whole picture, so it stays valid
//! through scaling and colour conversion.

pub const META_NAME: &str = "TrtClassifyMeta";
pub const STRUCTURE_NAME: &str = "trtclassify-classification";

/// One reported class.
#[derive(Debug, Clone, PartialEq)]
pub struct ClassEntry {
    pub class_id: u32,
    pub label: String,
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
    /// The top-k classes, best first.
    pub classes: Vec<ClassEntry>,
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
    pub fn to_structure(&self) -> gst::Structure {
        let ids = gst::Array::new(self.classes.iter().map(|c| c.class_id as i32));
        let labels = gst::Array::new(self.classes.iter().map(|c| c.label.as_str()));
        let confidences = gst::Array::new(self.classes.iter().map(|c| f64::from(c.confidence)));
        gst::Structure::builder(STRUCTURE_NAME)
            .field("model", &self.model)
            .field("frame", self.frame)
            .field("fresh", self.fresh)
            .field("class-ids", ids)
            .field("labels", labels)
            .field("confidences", confidences)
            .build()
    }

    pub fn from_structure(s: &gst::StructureRef) -> Option<Self> {
        if s.name() != STRUCTURE_NAME {
            return None;
        }
        let ids = s.get::<gst::Array>("class-ids").ok()?;
        let labels = s.get::<gst::Array>("labels").ok()?;
        let confidences = s.get::<gst::Array>("confidences").ok()?;
        let classes = ids
            .iter()
            .zip(labels.iter())
            .zip(confidences.iter())
            .map(|((id, label), confidence)| {
                Some(ClassEntry {
                    class_id: id.get::<i32>().ok()? as u32,
                    label: label.get::<String>().ok()?,
                    confidence: confidence.get::<f64>().ok()? as f32,
                })
            })
            .collect::<Option<Vec<_>>>()?;
        Some(Classification {
            model: s.get("model").ok()?,
            frame: s.get("frame").ok()?,
            fresh: s.get("fresh").ok()?,
            classes,
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
