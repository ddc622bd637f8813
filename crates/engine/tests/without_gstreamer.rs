// SPDX-License-Identifier: MPL-2.0
//! The engine crate on its own, as a program without GStreamer uses it: a CPU engine built
//! from the repository's colour model classifies frames of each colour as that colour, from
//! packed RGB and from BGRx, one at a time and pushed as a batch.

use trtclassify_engine::frame::{FrameView, PixelFormat};
use trtclassify_engine::preprocess::Crop;
use trtclassify_engine::{Backend, EngineOptions, build};

const COLORS: [(&str, [u8; 3]); 6] = [
    ("black", [0, 0, 0]),
    ("white", [255, 255, 255]),
    ("red", [255, 0, 0]),
    ("green", [0, 255, 0]),
    ("blue", [0, 0, 255]),
    ("yellow", [255, 255, 0]),
];

fn repo() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn best(scores: &[f32]) -> usize {
    (0..scores.len())
        .max_by(|&a, &b| scores[a].total_cmp(&scores[b]))
        .unwrap()
}

#[test]
fn colours_are_classified_without_gstreamer() {
    let labels = std::fs::read_to_string(repo().join("models/colors.txt")).unwrap();
    let labels: Vec<&str> = labels.lines().collect();
    let mut options = EngineOptions::new(repo().join("models/colors.onnx"));
    options.batch_size = 4;
    let mut engine = build(Backend::Cpu, &options).expect("the cpu engine builds");
    assert_eq!(engine.info().num_classes, labels.len());
    let (width, height) = (40u32, 30u32);
    let rgb: Vec<Vec<u8>> = COLORS
        .iter()
        .map(|(_, c)| c.repeat((width * height) as usize))
        .collect();
    let bgrx: Vec<Vec<u8>> = COLORS
        .iter()
        .map(|(_, [r, g, b])| [*b, *g, *r, 0].repeat((width * height) as usize))
        .collect();
    for (i, (name, _)) in COLORS.iter().enumerate() {
        let scores = engine
            .classify(&[FrameView::rgb(width, height, &rgb[i])])
            .unwrap();
        assert_eq!(labels[best(&scores[0])], *name, "RGB frame");
    }
    // All six pushed, in BGRx: they run in batches of 4 and come back in order.
    for pixels in &bgrx {
        let frame = FrameView::packed_frame(PixelFormat::Bgrx, width, height, pixels);
        engine.push(&frame, &[Crop::Whole]).unwrap();
    }
    let scores = engine.run_pushed().unwrap();
    let got: Vec<&str> = scores.iter().map(|s| labels[best(s)]).collect();
    let want: Vec<&str> = COLORS.iter().map(|(name, _)| *name).collect();
    assert_eq!(got, want, "BGRx frames pushed as a batch");
}
