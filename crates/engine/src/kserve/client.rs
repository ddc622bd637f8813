// SPDX-License-Identifier: MPL-2.0
//! The gRPC connection to a KServe v2 server: the URL and TLS files made into a channel, the
//! start-up checks, and inference requests with their retries, all on a small tokio runtime
//! of the engine's own (GStreamer's streaming threads are not async; they wait on it).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tonic::Code;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

use super::proto::grpc_inference_service_client::GrpcInferenceServiceClient;
use super::proto::{
    ModelInferRequest, ModelInferResponse, ModelMetadataRequest, ModelMetadataResponse,
    ModelReadyRequest, ServerLiveRequest,
};

/// Where the server is and how to reach it: the element's `server-*` properties.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ServerOptions {
    /// `grpc://host:port`, or `grpcs://host:port` for TLS.
    pub url: String,
    /// The model's name on the server.
    pub model: String,
    /// The model's version; empty: the server's choice.
    pub version: String,
    /// The longest a batch may wait for its answer, retries included.
    pub timeout: Duration,
    /// TLS: the CA certificate (PEM) that signed the server's; `None`: the system's roots.
    pub ca: Option<PathBuf>,
    /// TLS: this client's certificate and key (PEM), for servers that ask for one.
    pub identity: Option<(PathBuf, PathBuf)>,
}

/// Responses as large as a batch of 64 scores of a large model, or an echo of a batch of
/// images; tonic's default (4 MiB) is smaller than one batch of 32 ImageNet scores would need
/// with some servers' padding.
const MAX_MESSAGE: usize = 256 << 20;

/// The tries of one request: the first and two retries, within `ServerOptions::timeout`.
const TRIES: u32 = 3;

/// The pause before the first retry; doubled before the next.
const FIRST_RETRY: Duration = Duration::from_millis(50);

/// A connection to the server, usable from any thread.
pub(crate) struct Client {
    grpc: GrpcInferenceServiceClient<Channel>,
    /// Taken by `drop`.
    runtime: Option<tokio::runtime::Runtime>,
    pub(crate) options: ServerOptions,
}

/// An answer on its way: the task that waits for it, and where it arrives with the instant
/// it came.
pub(crate) struct Pending<T> {
    task: tokio::task::JoinHandle<()>,
    answer: std::sync::mpsc::Receiver<(T, Instant)>,
}

impl<T> Pending<T> {
    /// Waits for the answer; `None` where the task ended without one (cancelled). The wait
    /// is a plain channel's, not the runtime's `block_on`, which panics when the caller is
    /// itself inside a tokio runtime (an application that drives GStreamer from async code).
    pub(crate) fn wait(self) -> Option<T> {
        self.wait_timed().map(|(answer, _)| answer)
    }

    /// Waits for the answer, as `wait`, and the instant it came: an answer may be read
    /// long after (the element collects it when a later batch needs its place).
    pub(crate) fn wait_timed(self) -> Option<(T, Instant)> {
        self.answer.recv().ok()
    }

    /// Gives the answer up.
    pub(crate) fn cancel(&self) {
        self.task.abort();
    }
}

impl Drop for Client {
    /// Stops the runtime without waiting for its threads (a DNS lookup may hold one), and
    /// without the panic a plain drop raises inside a tokio runtime.
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

impl Client {
    /// A channel to `options.url`; connects lazily (the first call connects, and a channel
    /// reconnects by itself after the server restarts).
    pub(crate) fn new(options: &ServerOptions) -> Result<Self, String> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("trtclassify-kserve")
            .enable_all()
            .build()
            .map_err(|e| format!("cannot start the gRPC client's thread: {e}"))?;
        let endpoint = endpoint(options)?;
        let channel = {
            let _inside = runtime.enter();
            endpoint.connect_lazy()
        };
        let grpc = GrpcInferenceServiceClient::new(channel)
            .max_decoding_message_size(MAX_MESSAGE)
            .max_encoding_message_size(MAX_MESSAGE);
        Ok(Self {
            grpc,
            runtime: Some(runtime),
            options: options.clone(),
        })
    }

    /// Starts `f` on the client's runtime.
    pub(crate) fn start<T: Send + 'static>(
        &self,
        f: impl Future<Output = T> + Send + 'static,
    ) -> Pending<T> {
        let (sender, answer) = std::sync::mpsc::channel();
        let runtime = self.runtime.as_ref().expect("taken only by drop");
        let task = runtime.spawn(async move {
            let answer = f.await;
            let _ = sender.send((answer, Instant::now()));
        });
        Pending { task, answer }
    }

    /// The server is live, the model ready; its metadata.
    pub(crate) fn check(&self) -> Result<ModelMetadataResponse, String> {
        let ServerOptions {
            url,
            model: name,
            version,
            timeout,
            ..
        } = self.options.clone();
        let mut grpc = self.grpc.clone();
        self.start(async move {
            let live = with_timeout(timeout, grpc.server_live(ServerLiveRequest {}))
                .await
                .map_err(|e| format!("server-url {url}: the server does not answer: {e}"))?;
            if !live.live {
                return Err(format!("server-url {url}: the server says it is not live"));
            }
            let model = ModelReadyRequest {
                name: name.clone(),
                version: version.clone(),
            };
            let ready = with_timeout(timeout, grpc.model_ready(model))
                .await
                .map_err(|e| format!("server-model {name}: {e}"))?;
            if !ready.ready {
                return Err(format!(
                    "server-model {name}{}: the model is not ready on {url}",
                    version_note(&version)
                ));
            }
            let metadata = ModelMetadataRequest {
                name: name.clone(),
                version: version.clone(),
            };
            with_timeout(timeout, grpc.model_metadata(metadata))
                .await
                .map_err(|e| format!("server-model {name}: no metadata: {e}"))
        })
        .wait()
        .unwrap_or_else(|| Err("the gRPC client stopped".into()))
    }

    /// Sends `request` on the runtime, retrying what may pass on a second try (the server
    /// restarting, overloaded) with a pause that doubles, until `server-timeout` from now.
    pub(crate) fn infer(
        &self,
        request: ModelInferRequest,
    ) -> Pending<Result<ModelInferResponse, String>> {
        let (mut grpc, timeout) = (self.grpc.clone(), self.options.timeout);
        self.start(async move {
            let until = Instant::now() + timeout;
            let mut pause = FIRST_RETRY;
            let mut tries = 0;
            loop {
                tries += 1;
                let left = until.saturating_duration_since(Instant::now());
                match with_timeout(left, grpc.model_infer(request.clone())).await {
                    Ok(response) => return Ok(response),
                    Err(Failure::Status(status))
                        if tries < TRIES
                            && retriable(status.code())
                            && Instant::now() + pause < until =>
                    {
                        tokio::time::sleep(pause).await;
                        pause *= 2;
                    }
                    Err(e) if tries == 1 => return Err(e.to_string()),
                    Err(e) => return Err(format!("{e} (after {tries} tries)")),
                }
            }
        })
    }
}

/// Why a call failed.
#[derive(Debug)]
enum Failure {
    Status(tonic::Status),
    TimedOut(Duration),
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Status(s) => write!(f, "{:?}: {}", s.code(), s.message()),
            Failure::TimedOut(t) => write!(f, "no answer within server-timeout ({t:.1?})"),
        }
    }
}

/// `call`'s answer, or `TimedOut` after `timeout`.
async fn with_timeout<T>(
    timeout: Duration,
    call: impl Future<Output = Result<tonic::Response<T>, tonic::Status>>,
) -> Result<T, Failure> {
    match tokio::time::timeout(timeout, call).await {
        Ok(Ok(response)) => Ok(response.into_inner()),
        Ok(Err(status)) => Err(Failure::Status(status)),
        Err(_) => Err(Failure::TimedOut(timeout)),
    }
}

/// Whether a call that failed with `code` may pass when tried again: the connection failed
/// (server restarting) or the server was busy; not a request the server refused.
fn retriable(code: Code) -> bool {
    matches!(
        code,
        Code::Unavailable | Code::ResourceExhausted | Code::Aborted | Code::Unknown
    )
}

fn version_note(version: &str) -> String {
    match version {
        "" => String::new(),
        v => format!(" (version {v})"),
    }
}

/// The endpoint for `options.url`: `grpc://` in the clear, `grpcs://` over TLS with the CA
/// and client identity given (or the system's roots).
fn endpoint(options: &ServerOptions) -> Result<Endpoint, String> {
    let url = &options.url;
    let (tls, rest) = if let Some(rest) = url.strip_prefix("grpc://") {
        (false, rest)
    } else if let Some(rest) = url.strip_prefix("grpcs://") {
        (true, rest)
    } else {
        return Err(format!(
            "server-url {url:?}: expected grpc://host:port, or grpcs://host:port for TLS"
        ));
    };
    let host = rest.split(['/', ':']).next().unwrap_or_default();
    if host.is_empty() || !rest.contains(':') {
        return Err(format!(
            "server-url {url:?}: expected grpc://host:port, or grpcs://host:port for TLS"
        ));
    }
    let scheme = if tls { "https" } else { "http" };
    let mut endpoint = Endpoint::from_shared(format!("{scheme}://{rest}"))
        .map_err(|e| format!("server-url {url:?}: {e}"))?
        .connect_timeout(options.timeout)
        .tcp_nodelay(true);
    if tls {
        let mut config = ClientTlsConfig::new().domain_name(host.trim_matches(['[', ']']));
        config = match &options.ca {
            Some(ca) => config.ca_certificate(Certificate::from_pem(read_pem(ca, "server-ca")?)),
            None => config.with_native_roots(),
        };
        if let Some((cert, key)) = &options.identity {
            config = config.identity(Identity::from_pem(
                read_pem(cert, "server-cert")?,
                read_pem(key, "server-key")?,
            ));
        }
        endpoint = endpoint
            .tls_config(config)
            .map_err(|e| format!("server-url {url:?}: TLS: {e}"))?;
    } else if options.ca.is_some() || options.identity.is_some() {
        return Err(format!(
            "server-url {url:?}: TLS files are set but the URL is not grpcs://"
        ));
    }
    Ok(endpoint)
}

/// A PEM file for the property `property`.
fn read_pem(path: &Path, property: &str) -> Result<Vec<u8>, String> {
    let pem =
        std::fs::read(path).map_err(|e| format!("{property}-location {}: {e}", path.display()))?;
    if !pem.starts_with(b"-----BEGIN") && !String::from_utf8_lossy(&pem).contains("-----BEGIN") {
        return Err(format!(
            "{property}-location {}: not a PEM file (no -----BEGIN line)",
            path.display()
        ));
    }
    Ok(pem)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(url: &str) -> ServerOptions {
        ServerOptions {
            url: url.into(),
            model: "m".into(),
            timeout: Duration::from_secs(1),
            ..Default::default()
        }
    }

    #[test]
    fn urls_need_a_grpc_scheme_a_host_and_a_port() {
        assert!(endpoint(&options("grpc://127.0.0.1:8001")).is_ok());
        assert!(endpoint(&options("grpc://[::1]:8001")).is_ok());
        for bad in [
            "http://127.0.0.1:8001",
            "127.0.0.1:8001",
            "grpc://",
            "grpc://host",
        ] {
            let e = endpoint(&options(bad)).unwrap_err();
            assert!(e.contains("expected grpc://host:port"), "{bad}: {e}");
        }
    }

    #[test]
    fn tls_files_are_read_and_checked() {
        let mut o = options("grpcs://localhost:8001");
        o.ca = Some("/nonexistent/ca.pem".into());
        let e = endpoint(&o).unwrap_err();
        assert!(e.contains("server-ca-location /nonexistent/ca.pem"), "{e}");
        let not_pem = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(not_pem.path(), b"hello").unwrap();
        o.ca = Some(not_pem.path().into());
        assert!(endpoint(&o).unwrap_err().contains("not a PEM file"));
        let mut clear = options("grpc://localhost:8001");
        clear.ca = Some(not_pem.path().into());
        assert!(endpoint(&clear).unwrap_err().contains("not grpcs://"));
    }

    #[test]
    fn only_failures_that_may_pass_are_retried() {
        assert!(retriable(Code::Unavailable));
        assert!(!retriable(Code::InvalidArgument));
        assert!(!retriable(Code::NotFound));
    }
}
