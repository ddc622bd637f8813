// SPDX-License-Identifier: MPL-2.0
//! A classifier whose weights pass protobuf's 2 GiB limit, stored as exporters store such
//! models: a small `.onnx` and a file of external data beside it. The weights file is sparse
//! (every weight is 0 but four), so writing it costs no disk space and little time.

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use prost::Message;
use tract_onnx::pb;

pub const SIDE: usize = 448;
pub const CLASSES: usize = 900;
/// Values of a flattened 3×448×448 image: one row of weights each.
pub const FEATURES: usize = 3 * SIDE * SIDE;
/// Bytes of the weight matrix, [FEATURES, CLASSES] as f32: 2,167,603,200, over 2 GiB.
pub const WEIGHT_BYTES: u64 = (FEATURES * CLASSES * 4) as u64;
/// The class with a bias, the only nonzero bias.
pub const BIASED: usize = CLASSES - 1;
pub const BIAS: f32 = 0.25;

/// Which input value (flattened NCHW index) each of classes 0, 1 and 2 reads: the first red
/// value, a green one, and the last blue value, whose weight lies past 2 GiB into the file.
pub const READS: [usize; 3] = [0, SIDE * SIDE + 100, FEATURES - 1];

/// Writes `large.onnx` and `large.weights` into `dir`: `Gemm(Flatten(image), W, bias)`, W
/// [602112, 900] with `W[READS[c], c] = 1` for c in 0..3, the bias (after W in the same file,
/// at an offset past 2 GiB) 0 but for class `BIASED`. Returns the model's path.
pub fn write(dir: &Path) -> PathBuf {
    let weights = dir.join("large.weights");
    let file = std::fs::File::create(&weights).unwrap();
    file.set_len(WEIGHT_BYTES + (CLASSES * 4) as u64).unwrap();
    for (class, &feature) in READS.iter().enumerate() {
        let at = ((feature * CLASSES + class) * 4) as u64;
        file.write_all_at(&1f32.to_le_bytes(), at).unwrap();
    }
    file.write_all_at(&BIAS.to_le_bytes(), WEIGHT_BYTES + (BIASED * 4) as u64)
        .unwrap();

    let external = |name: &str, dims: Vec<i64>, offset: u64, length: u64| pb::TensorProto {
        name: name.into(),
        dims,
        data_type: 1,
        data_location: Some(1),
        external_data: [
            ("location", "large.weights".to_owned()),
            ("offset", offset.to_string()),
            ("length", length.to_string()),
        ]
        .into_iter()
        .map(|(key, value)| pb::StringStringEntryProto {
            key: key.into(),
            value,
        })
        .collect(),
        ..Default::default()
    };
    let value = |name: &str, dims: &[Option<usize>]| pb::ValueInfoProto {
        name: name.into(),
        r#type: Some(pb::TypeProto {
            value: Some(pb::type_proto::Value::TensorType(pb::type_proto::Tensor {
                elem_type: 1,
                shape: Some(pb::TensorShapeProto {
                    dim: dims
                        .iter()
                        .map(|d| pb::tensor_shape_proto::Dimension {
                            value: Some(match d {
                                Some(n) => {
                                    pb::tensor_shape_proto::dimension::Value::DimValue(*n as i64)
                                }
                                None => {
                                    pb::tensor_shape_proto::dimension::Value::DimParam("N".into())
                                }
                            }),
                            ..Default::default()
                        })
                        .collect(),
                }),
            })),
            ..Default::default()
        }),
        ..Default::default()
    };
    let node =
        |name: &str, op: &str, input: &[&str], attribute: Vec<pb::AttributeProto>| pb::NodeProto {
            name: name.into(),
            op_type: op.into(),
            input: input.iter().map(|s| s.to_string()).collect(),
            output: vec![format!("{name}_out")],
            attribute,
            ..Default::default()
        };
    let axis = pb::AttributeProto {
        name: "axis".into(),
        r#type: pb::attribute_proto::AttributeType::Int as i32,
        i: 1,
        ..Default::default()
    };
    let model = pb::ModelProto {
        ir_version: 8,
        opset_import: vec![pb::OperatorSetIdProto {
            domain: String::new(),
            version: 13,
        }],
        producer_name: "trtclassify tests".into(),
        graph: Some(pb::GraphProto {
            name: "large".into(),
            node: vec![
                node("flatten", "Flatten", &["image"], vec![axis]),
                node("gemm", "Gemm", &["flatten_out", "w", "bias"], vec![]),
            ],
            initializer: vec![
                external("w", vec![FEATURES as i64, CLASSES as i64], 0, WEIGHT_BYTES),
                external(
                    "bias",
                    vec![CLASSES as i64],
                    WEIGHT_BYTES,
                    CLASSES as u64 * 4,
                ),
            ],
            input: vec![value("image", &[None, Some(3), Some(SIDE), Some(SIDE)])],
            output: vec![value("gemm_out", &[None, Some(CLASSES)])],
            ..Default::default()
        }),
        ..Default::default()
    };
    let path = dir.join("large.onnx");
    std::fs::write(&path, model.encode_to_vec()).unwrap();
    path
}

/// Four images, NCHW, and the class each must score highest: all-red reads class 0, all-green
/// class 1, all-blue class 2, black (zeros) only the bias of `BIASED`.
pub fn images() -> (Vec<f32>, [usize; 4]) {
    let plane = SIDE * SIDE;
    let mut input = vec![0f32; 4 * FEATURES];
    for channel in 0..3 {
        let start = channel * FEATURES + channel * plane;
        input[start..start + plane].fill(1.0);
    }
    (input, [0, 1, 2, BIASED])
}

/// The exact scores of image `i` of `images()`.
pub fn expected_scores(i: usize) -> Vec<f32> {
    let mut scores = vec![0f32; CLASSES];
    scores[BIASED] = BIAS;
    if i < 3 {
        scores[i] = 1.0;
    }
    scores
}
