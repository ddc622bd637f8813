// SPDX-License-Identifier: MPL-2.0
//! Reading an ONNX file and checking that it is an image classifier, before any backend sees
//! it: every problem found here names the file and says what is wrong with it.

use std::fmt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use tract_onnx::pb;
use tract_onnx::prelude::tract_itertools::Itertools;

use super::external_data::ExternalData;
use super::spec::{InputSpec, Layout};

/// A larger input side is taken for a broken model rather than allocated.
const MAX_SIDE: usize = 8192;

/// ONNX `TensorProto.DataType` code of float32.
const ONNX_FLOAT: i32 = 1;

/// Why a model cannot be used; every message starts with the file's path.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The file cannot be read, or is a directory.
    #[error("{}: cannot read the model: {source}", path.display())]
    Io {
        /// The model file.
        path: PathBuf,
        /// What the read failed with.
        #[source]
        source: std::io::Error,
    },
    /// Not an ONNX model: empty, not a protobuf, no graph, or an output that no node produces.
    #[error("{}: not an ONNX model: {reason}", path.display())]
    NotOnnx {
        /// The model file.
        path: PathBuf,
        /// What is wrong, for the message.
        reason: String,
    },
    /// A model that breaks ONNX's rules: an axis beyond its tensor's rank, bad external data.
    #[error("{}: invalid model: {reason}", path.display())]
    Invalid {
        /// The model file.
        path: PathBuf,
        /// What is wrong, for the message.
        reason: String,
    },
    /// Not one float32 image input (1 or 3 channels, NCHW or NHWC) and an output.
    #[error("{}: not an image classifier: {reason}", path.display())]
    NotClassifier {
        /// The model file.
        path: PathBuf,
        /// What is wrong, for the message.
        reason: String,
    },
}

/// One axis of the input: a number, or a name when the model leaves it open.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Dim {
    /// A size the model fixes.
    Fixed(usize),
    /// Left open: the ONNX `dim_param` name, or empty when the axis is unnamed.
    Dynamic(String),
}

impl Dim {
    /// The size, if the model fixes it.
    pub fn fixed(&self) -> Option<usize> {
        match self {
            Dim::Fixed(n) => Some(*n),
            Dim::Dynamic(_) => None,
        }
    }
}

impl fmt::Display for Dim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Dim::Fixed(n) => write!(f, "{n}"),
            Dim::Dynamic(name) if name.is_empty() => write!(f, "?"),
            Dim::Dynamic(name) => write!(f, "{name}"),
        }
    }
}

/// The image input of a classifier: batch, channel and spatial axes found from its shape.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageInput {
    /// The input's name in the graph.
    pub name: String,
    /// Where the channel axis is: 1 (NCHW) or 3 (NHWC).
    pub layout: Layout,
    /// Images per inference; often dynamic.
    pub batch: Dim,
    /// Colour channels: 1 or 3.
    pub channels: usize,
    /// Input height in pixels; dynamic when the model accepts any.
    pub height: Dim,
    /// Input width in pixels; dynamic when the model accepts any.
    pub width: Dim,
}

impl ImageInput {
    /// The input with its spatial size settled: from the model, or from `input_size`
    /// (height, width) for models that leave it open.
    pub fn spec(&self, input_size: Option<(usize, usize)>) -> Result<InputSpec, String> {
        let axis = |name: &str, dim: &Dim, forced: Option<usize>| {
            let n = match (dim.fixed(), forced) {
                (Some(n), None) | (None, Some(n)) => n,
                (Some(n), Some(m)) if n == m => n,
                (Some(n), Some(m)) => {
                    return Err(format!(
                        "input-{name} is {m} but the model's input `{}` fixes its {name} at {n}",
                        self.name
                    ));
                }
                (None, None) => {
                    return Err(format!(
                        "the {name} of input `{}` is dynamic ({dim}); set input-width and input-height",
                        self.name
                    ));
                }
            };
            if n > MAX_SIDE {
                return Err(format!(
                    "the {name} of input `{}` is {n}; at most {MAX_SIDE} is supported",
                    self.name
                ));
            }
            Ok(n)
        };
        Ok(InputSpec {
            layout: self.layout,
            channels: self.channels,
            height: axis("height", &self.height, input_size.map(|s| s.0))?,
            width: axis("width", &self.width, input_size.map(|s| s.1))?,
        })
    }
}

/// What the engines need of a model besides its graph and weights, for a start that finds
/// its engine built: small enough to remember beside the model's digest, so that such a
/// start need not read the model (hundreds of megabytes) at all.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelFacts {
    /// The one image input.
    pub input: ImageInput,
    /// The operator producing the output (`OnnxModel::output_op`).
    pub output_op: Option<String>,
}

impl ModelFacts {
    /// Whether the model's own last operator makes probabilities (Softmax, Sigmoid), so that
    /// `softmax=auto` leaves its scores alone.
    pub fn outputs_probabilities(&self) -> bool {
        matches!(self.output_op.as_deref(), Some("Softmax" | "Sigmoid"))
    }
}

/// A parsed ONNX file that passed the classifier checks.
pub struct OnnxModel {
    /// The file it was read from; external weights are found relative to its folder.
    pub path: PathBuf,
    /// The decoded protobuf, which the backends import.
    pub proto: pb::ModelProto,
    /// The one image input.
    pub input: ImageInput,
    /// The name of the graph's first output: the scores.
    pub output: String,
    /// The operator producing the output, to tell whether scores already are probabilities.
    pub output_op: Option<String>,
    /// The tensors whose values lie in files beside the model, checked.
    pub external: Vec<ExternalData>,
}

impl OnnxModel {
    /// Reads `path` and checks it is an image classifier.
    pub fn load(path: &Path) -> Result<Self, ModelError> {
        let bytes = read(path)?;
        Self::from_bytes(path, &bytes)
    }

    /// Checks the model in `bytes`; `path` names it in errors and locates its external weights.
    pub fn from_bytes(path: &Path, bytes: &[u8]) -> Result<Self, ModelError> {
        let not_onnx = |reason: String| ModelError::NotOnnx {
            path: path.to_owned(),
            reason,
        };
        let not_classifier = |reason: String| ModelError::NotClassifier {
            path: path.to_owned(),
            reason,
        };
        if bytes.is_empty() {
            return Err(not_onnx("the file is empty".into()));
        }
        let proto = <pb::ModelProto as prost::Message>::decode(bytes).map_err(|e| {
            not_onnx(format!(
                "the protobuf does not decode ({e}); is the file truncated?"
            ))
        })?;
        let graph = proto
            .graph
            .as_ref()
            .filter(|g| !g.node.is_empty())
            .ok_or_else(|| not_onnx("it holds no graph".into()))?;

        let inputs: Vec<&pb::ValueInfoProto> = graph
            .input
            .iter()
            .filter(|i| !graph.initializer.iter().any(|t| t.name == i.name))
            .collect();
        let input = match inputs.as_slice() {
            [input] => *input,
            [] => return Err(not_classifier("the model has no input".into())),
            many => {
                return Err(not_classifier(format!(
                    "the model has {} inputs ({}); one image input is expected",
                    many.len(),
                    many.iter().map(|i| &i.name).join(", ")
                )));
            }
        };
        let input = image_input(input).map_err(not_classifier)?;
        super::ranks::check_axes(graph, &input.name, 4).map_err(|reason| ModelError::Invalid {
            path: path.to_owned(),
            reason,
        })?;

        // tract indexes values by name and panics on an output that nothing defines.
        let defined = |name: &str| {
            graph.input.iter().any(|i| i.name == name)
                || graph.initializer.iter().any(|t| t.name == name)
                || graph
                    .node
                    .iter()
                    .any(|n| n.output.iter().any(|o| o == name))
        };
        if let Some(undefined) = graph.output.iter().find(|o| !defined(&o.name)) {
            return Err(not_onnx(format!(
                "graph output `{}` is not produced by any node",
                undefined.name
            )));
        }
        let output = graph
            .output
            .first()
            .ok_or_else(|| not_classifier("the model has no output".into()))?
            .name
            .clone();
        let output_op = graph
            .node
            .iter()
            .find(|n| n.output.contains(&output))
            .map(|n| n.op_type.clone());
        let external = super::external_data::check(graph, &folder(path)).map_err(|reason| {
            ModelError::Invalid {
                path: path.to_owned(),
                reason,
            }
        })?;

        Ok(OnnxModel {
            path: path.to_owned(),
            proto,
            input,
            output,
            output_op,
            external,
        })
    }

    /// The model input with its spatial size settled: from the model, or from `input_size`
    /// (height, width) for models that leave it open.
    pub fn input_spec(&self, input_size: Option<(usize, usize)>) -> Result<InputSpec, String> {
        self.input.spec(input_size)
    }

    /// What a start needs of the model besides its weights (`ModelFacts`).
    pub fn facts(&self) -> ModelFacts {
        ModelFacts {
            input: self.input.clone(),
            output_op: self.output_op.clone(),
        }
    }

    /// The folder the model's relative paths (external weights) start from.
    pub fn folder(&self) -> PathBuf {
        folder(&self.path)
    }

    /// The files holding external weights, each once.
    pub fn external_files(&self) -> Vec<PathBuf> {
        self.external
            .iter()
            .map(|e| e.path.clone())
            .unique()
            .collect()
    }

    /// Whether the model's own last operator makes probabilities (Softmax, Sigmoid), so that
    /// `softmax=auto` leaves its scores alone.
    pub fn outputs_probabilities(&self) -> bool {
        self.facts().outputs_probabilities()
    }

    /// Operators of the graph, each once, in the order they first appear.
    pub fn op_types(&self) -> Vec<String> {
        self.proto
            .graph
            .iter()
            .flat_map(|g| &g.node)
            .map(|n| match n.domain.as_str() {
                "" | "ai.onnx" => n.op_type.clone(),
                domain => format!("{domain}.{}", n.op_type),
            })
            .unique()
            .collect()
    }
}

/// The folder a model's relative paths start from.
fn folder(path: &Path) -> PathBuf {
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir.to_owned(),
        _ => PathBuf::from("."),
    }
}

fn read(path: &Path) -> Result<Vec<u8>, ModelError> {
    let io = |source| ModelError::Io {
        path: path.to_owned(),
        source,
    };
    if std::fs::metadata(path).map_err(io)?.is_dir() {
        return Err(io(std::io::Error::new(
            std::io::ErrorKind::IsADirectory,
            "it is a directory, not a file",
        )));
    }
    std::fs::read(path).map_err(io)
}

fn image_input(input: &pb::ValueInfoProto) -> Result<ImageInput, String> {
    let name = &input.name;
    let Some(pb::type_proto::Value::TensorType(tensor)) =
        input.r#type.as_ref().and_then(|t| t.value.as_ref())
    else {
        return Err(format!("input `{name}` is not a tensor"));
    };
    if tensor.elem_type != ONNX_FLOAT {
        let ty = pb::tensor_proto::DataType::try_from(tensor.elem_type)
            .map(|t| format!("{t:?}").to_lowercase())
            .unwrap_or_else(|_| format!("type {}", tensor.elem_type));
        return Err(format!(
            "input `{name}` holds {ty}; an image input of float32 is expected"
        ));
    }
    let dims: Vec<Dim> = tensor
        .shape
        .as_ref()
        .ok_or_else(|| format!("input `{name}` has no shape"))?
        .dim
        .iter()
        .map(|d| match &d.value {
            Some(pb::tensor_shape_proto::dimension::Value::DimValue(n)) if *n > 0 => {
                Dim::Fixed(*n as usize)
            }
            Some(pb::tensor_shape_proto::dimension::Value::DimParam(p)) => Dim::Dynamic(p.clone()),
            _ => Dim::Dynamic(String::new()),
        })
        .collect();
    let shape = || dims.iter().join("×");
    let [batch, a, b, c] = dims.as_slice() else {
        return Err(format!(
            "input `{name}` has shape {} ({} axes); an image input has 4 axes, NCHW or NHWC",
            shape(),
            dims.len()
        ));
    };
    let is_channels = |d: &Dim| matches!(d.fixed(), Some(1 | 3));
    let (layout, channels, height, width) = if is_channels(a) {
        (Layout::Nchw, a, b, c)
    } else if is_channels(c) {
        (Layout::Nhwc, c, a, b)
    } else {
        return Err(format!(
            "input `{name}` has shape {}: neither axis 1 (NCHW) nor axis 3 (NHWC) holds 1 or 3 colour channels",
            shape()
        ));
    };
    Ok(ImageInput {
        name: name.clone(),
        layout,
        batch: batch.clone(),
        channels: channels.fixed().expect("checked above"),
        height: height.clone(),
        width: width.clone(),
    })
}

/// The number of classes in a model output of `shape` for `batch` frames: after the batch
/// axis, one axis of scores; other axes must be 1 (`[N, classes, 1, 1]` is read as
/// `[N, classes]`), so that an output that is not one score vector per image (`[N, 3, 4]`)
/// is refused rather than read as 12 classes.
pub fn class_count(shape: &[usize], batch: usize) -> Result<usize, String> {
    let Some((_, rest)) = shape.split_first().filter(|(n, _)| **n == batch) else {
        return Err(format!(
            "the output shape {shape:?} does not start with the batch axis ({batch}); class scores per image are expected"
        ));
    };
    if rest.contains(&0) {
        return Err(format!("the output shape {shape:?} holds no class scores"));
    }
    match rest.iter().filter(|&&d| d != 1).count() {
        0 | 1 => Ok(rest.iter().product()),
        _ => Err(format!(
            "the output shape {shape:?} is not one vector of class scores per image ([N, classes], or [N, classes, 1, 1])"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::class_count;

    #[test]
    fn class_count_takes_one_axis_of_scores_after_the_batch() {
        assert_eq!(class_count(&[8, 1000], 8), Ok(1000));
        assert_eq!(class_count(&[8, 1000, 1, 1], 8), Ok(1000));
        assert_eq!(class_count(&[8, 1, 1000], 8), Ok(1000));
        assert_eq!(class_count(&[8, 1], 8), Ok(1));
        assert!(
            class_count(&[8, 3, 4], 8)
                .unwrap_err()
                .contains("not one vector")
        );
        assert!(
            class_count(&[8, 0], 8)
                .unwrap_err()
                .contains("no class scores")
        );
        assert!(
            class_count(&[4, 10], 8)
                .unwrap_err()
                .contains("batch axis (8)")
        );
        assert!(class_count(&[], 8).unwrap_err().contains("batch axis"));
    }
}
