// SPDX-License-Identifier: MPL-2.0
//! A real RTSP camera stand-in: gst-rtsp-server on loopback serving H.264, classified through
//! `rtspsrc`; stopping the server mid-stream ends in a clean error or EOS, never a hang.

mod common;

use std::time::Duration;

use gst::prelude::*;
use gst_rtsp_server::prelude::*;

/// Serves `/cam`, a red test pattern in H.264, on 127.0.0.1 at a free port. The server runs
/// on its own GLib main loop thread.
struct Camera {
    server: gst_rtsp_server::RTSPServer,
    main_loop: glib::MainLoop,
    /// The listening socket's source on the server's main loop.
    source: Option<glib::SourceId>,
    thread: Option<std::thread::JoinHandle<()>>,
    port: i32,
}

impl Camera {
    fn start() -> Self {
        Self::start_with("red")
    }

    /// A camera showing `pattern` (a videotestsrc pattern: red, green, blue, white, ...).
    fn start_with(pattern: &str) -> Self {
        let context = glib::MainContext::new();
        let main_loop = glib::MainLoop::new(Some(&context), false);
        let server = gst_rtsp_server::RTSPServer::new();
        server.set_address("127.0.0.1");
        server.set_service("0");
        let factory = gst_rtsp_server::RTSPMediaFactory::new();
        factory.set_launch(&format!(
            "( videotestsrc is-live=true pattern={pattern} ! video/x-raw,width=160,height=120,framerate=30/1 ! \
               openh264enc ! h264parse ! rtph264pay name=pay0 pt=96 config-interval=1 )"
        ));
        factory.set_shared(true);
        server.mount_points().unwrap().add_factory("/cam", factory);
        let source = server.attach(Some(&context)).expect("the server listens");
        let port = server.bound_port();
        let thread_loop = main_loop.clone();
        let thread = std::thread::spawn(move || {
            thread_loop
                .context()
                .with_thread_default(|| thread_loop.run())
                .unwrap();
        });
        Camera {
            server,
            main_loop,
            source: Some(source),
            thread: Some(thread),
            port,
        }
    }

    /// Stops listening, drops every client connection and stops serving, as a camera that
    /// loses power would.
    fn stop(&mut self) {
        if let Some(id) = self.source.take()
            && let Some(source) = self.main_loop.context().find_source_by_id(&id)
        {
            source.destroy();
        }
        self.server
            .client_filter(Some(&mut |_, _| gst_rtsp_server::RTSPFilterResult::Remove));
        // The connections close on the server's main loop: let it run that before it stops.
        std::thread::sleep(Duration::from_millis(300));
        self.main_loop.quit();
        if let Some(thread) = self.thread.take() {
            thread.join().unwrap();
        }
    }
}

/// Whether the RTSP server's and client's elements are here; says SKIPPED where not.
fn rtsp_elements(test: &str) -> bool {
    common::init();
    if gst::ElementFactory::find("openh264enc").is_some()
        && gst::ElementFactory::find("rtspsrc").is_some()
    {
        return true;
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "CI must install gstreamer1.0-plugins-bad and -good"
    );
    common::skipped(&format!(
        "{test}: openh264enc or rtspsrc missing (gstreamer1.0-plugins-bad/-good)"
    ));
    false
}

/// Pulls `n` frames from `sink` and checks each is classified as `colour`.
fn expect_colour(sink: &gst_app::AppSink, colour: &str, n: usize) {
    for i in 0..n {
        let sample = sink
            .try_pull_sample(gst::ClockTime::from_seconds(20))
            .unwrap_or_else(|| panic!("frame {i} from the {colour} camera"));
        let result =
            gsttrtclassify::meta::Classification::from_buffer(sample.buffer().unwrap()).unwrap();
        let top = result.top().unwrap();
        assert_eq!(top.label, colour, "frame {i}: {result:?}");
        assert!(top.confidence > 0.9, "frame {i}: {top:?}");
    }
}

/// Three loopback cameras, one engine: each camera's frames get its own colour; when one
/// camera dies, the others go on.
#[test]
fn rtsp_cameras_share_one_engine_and_outlive_a_lost_camera() {
    if !rtsp_elements("rtsp_cameras_share_one_engine_and_outlive_a_lost_camera") {
        return;
    }
    let colours = ["red", "green", "blue"];
    let mut cameras: Vec<Camera> = colours.iter().map(|c| Camera::start_with(c)).collect();
    let branches: String = cameras
        .iter()
        .enumerate()
        .map(|(i, camera)| {
            format!(
                "rtspsrc location=rtsp://127.0.0.1:{}/cam protocols=tcp latency=50 ! \
                 rtph264depay ! h264parse ! decodebin ! videoconvert ! {} ! \
                 appsink name=sink{i} sync=false ",
                camera.port,
                common::colors_element(
                    "batch-size=8 batch-timeout=40 top-k=1 model-instance-id=rtsp-cameras"
                )
            )
        })
        .collect();
    let pipeline = common::launch(&branches);
    let sinks: Vec<_> = (0..colours.len())
        .map(|i| common::appsink(&pipeline, &format!("sink{i}")))
        .collect();
    pipeline.set_state(gst::State::Playing).unwrap();
    for (sink, colour) in sinks.iter().zip(colours) {
        expect_colour(sink, colour, 15);
    }

    cameras[0].stop();
    for (sink, colour) in sinks.iter().zip(colours).skip(1) {
        // Frames queued before the loss first, then at least 15 new ones.
        while sink.try_pull_sample(gst::ClockTime::ZERO).is_some() {}
        expect_colour(sink, colour, 15);
    }
    assert_eq!(
        pipeline.set_state(gst::State::Null),
        Ok(gst::StateChangeSuccess::Success)
    );
    for camera in cameras.iter_mut().skip(1) {
        camera.stop();
    }
}

#[test]
fn rtsp_camera_is_classified_and_its_loss_ends_cleanly() {
    if !rtsp_elements("rtsp_camera_is_classified_and_its_loss_ends_cleanly") {
        return;
    }
    let mut camera = Camera::start();
    let pipeline = common::launch(&format!(
        "rtspsrc location=rtsp://127.0.0.1:{}/cam protocols=tcp latency=50 tcp-timeout=3000000 timeout=3000000 ! rtph264depay ! h264parse ! \
         decodebin ! videoconvert ! {} ! appsink name=sink sync=false",
        camera.port,
        common::colors_element("batch-size=4 batch-timeout=40 top-k=1")
    ));
    let sink = common::appsink(&pipeline, "sink");
    pipeline.set_state(gst::State::Playing).unwrap();

    expect_colour(&sink, "red", 20);

    // The camera goes away mid-stream.
    camera.stop();
    let started = std::time::Instant::now();
    let bus = pipeline.bus().unwrap();
    let end = bus.timed_pop_filtered(
        gst::ClockTime::from_seconds(30),
        &[
            gst::MessageType::Eos,
            gst::MessageType::Error,
            gst::MessageType::Warning,
        ],
    );
    // rtspsrc reports a closed connection as a warning (then waits for its RTP session
    // timeout before EOS); an application stops the pipeline on it.
    let end = end.expect("losing the camera ends in a warning, an error or EOS, not a hang");
    match end.view() {
        gst::MessageView::Error(err) => {
            eprintln!(
                "camera lost after {:?}: error from {:?}: {}",
                started.elapsed(),
                err.src().map(|s| s.path_string()),
                err.error()
            );
            // The error comes from the network side, not from the classifier.
            assert!(
                !err.src()
                    .is_some_and(|s| s.name().starts_with("trtclassify")),
                "trtclassify failed: {}",
                err.error()
            );
        }
        gst::MessageView::Warning(w) => {
            eprintln!(
                "camera lost after {:?}: warning: {}",
                started.elapsed(),
                w.error()
            );
            assert!(
                w.src().is_some_and(|s| s.name().starts_with("rtspsrc")),
                "{:?}",
                w.src()
            );
        }
        _ => eprintln!("camera lost after {:?}: EOS", started.elapsed()),
    }
    assert_eq!(
        pipeline.set_state(gst::State::Null),
        Ok(gst::StateChangeSuccess::Success)
    );
    assert!(started.elapsed() < Duration::from_secs(30));
}
