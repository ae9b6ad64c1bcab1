//! A node's apid endpoint: TCP listener, mutual TLS terminated with tokio-rustls (client certificate
//! required, verified against the Talos OS CA, EKU exactly ClientAuth), and the tonic services served
//! over the resulting streams.
//!
//! Connections are wrapped in [`NodeConn`], which fails all I/O once the node's boot token is
//! cancelled. tonic spawns a task per connection that aborting the server task would not reach; the
//! wrapper is what makes a simulated power cut drop every open connection and stream at once, while
//! aborting the server task closes the listening socket (connection refused).

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use rustls::client::danger::HandshakeSignatureValid;
use rustls::server::WebPkiClientVerifier;
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{
    CertificateError, DigitallySignedStruct, DistinguishedName, RootCertStore, SignatureScheme,
};
use rustls_pki_types::{CertificateDer, UnixTime};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};
use tonic::body::Body;
use tonic::codegen::{BoxFuture, Service, http};
use tonic::transport::Server;
use tonic::transport::server::Connected;

use super::auth::{self, PeerIdentity};
use super::cluster::Cluster;
use super::cluster_service::ClusterApi;
use super::cosi::StateApi;
use super::lifecycle_service::{ImageApi, LifecycleApi};
use super::machine_service::MachineApi;
use super::node::Node;
use super::pki::{CertAuthority, ServerIdentity};
use super::routing::ApiContext;
use talos_api::proto::cluster::cluster_service_server::ClusterServiceServer;
use talos_api::proto::cosi::resource::state_server::StateServer;
use talos_api::proto::machine::image_service_server::ImageServiceServer;
use talos_api::proto::machine::lifecycle_service_server::LifecycleServiceServer;
use talos_api::proto::machine::machine_service_server::MachineServiceServer;

/// Talos's `GRPCMaxMessageSize`.
const MAX_MESSAGE_SIZE: usize = 32 * 1024 * 1024;

/// A handshake that has not finished by then is dropped (a plain-text client, a stalled peer).
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Building the TLS configuration failed.
#[derive(Debug, thiserror::Error)]
pub enum TlsSetupError {
    #[error("TLS configuration: {0}")]
    Rustls(#[from] rustls::Error),
    #[error("client certificate verifier: {0}")]
    Verifier(#[from] rustls::server::VerifierBuilderError),
}

/// apid's client-certificate check: the WebPKI chain check against the OS CA, plus Talos's rule that
/// the extended key usage is exactly ClientAuth.
#[derive(Debug)]
struct TalosClientVerifier {
    inner: Arc<dyn ClientCertVerifier>,
}

impl ClientCertVerifier for TalosClientVerifier {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        true
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.inner.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        let verified = self
            .inner
            .verify_client_cert(end_entity, intermediates, now)?;
        auth::check_client_eku(end_entity).map_err(|reason| {
            tracing::debug!(%reason, "client certificate refused");
            rustls::Error::InvalidCertificate(CertificateError::InvalidPurpose)
        })?;
        Ok(verified)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// The rustls server configuration of one node: TLS 1.2+ with the ring provider, ALPN h2, client
/// certificates required.
pub(crate) fn tls_config(
    ca: &CertAuthority,
    identity: ServerIdentity,
) -> Result<Arc<rustls::ServerConfig>, TlsSetupError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = RootCertStore::empty();
    roots.add(ca.cert_der().clone())?;
    let inner =
        WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone()).build()?;
    let verifier = Arc::new(TalosClientVerifier { inner });
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])?
        .with_client_cert_verifier(verifier)
        .with_single_cert(vec![identity.cert], identity.key)?;
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(Arc::new(config))
}

/// A TLS connection that can be dropped at once when the node's power is cut hard.
pub(crate) struct NodeConn {
    tls: TlsStream<TcpStream>,
    killed: Pin<Box<WaitForCancellationFutureOwned>>,
    dead: bool,
    peer: PeerIdentity,
}

impl NodeConn {
    /// Register for the power cut and report it as an I/O error once it happened.
    fn power_check(&mut self, cx: &mut Context<'_>) -> Option<io::Error> {
        if !self.dead && self.killed.as_mut().poll(cx).is_ready() {
            self.dead = true;
        }
        self.dead.then(|| {
            io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "simulated node powered off",
            )
        })
    }
}

impl AsyncRead for NodeConn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if let Some(err) = this.power_check(cx) {
            return Poll::Ready(Err(err));
        }
        Pin::new(&mut this.tls).poll_read(cx, buf)
    }
}

impl AsyncWrite for NodeConn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if let Some(err) = this.power_check(cx) {
            return Poll::Ready(Err(err));
        }
        Pin::new(&mut this.tls).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if let Some(err) = this.power_check(cx) {
            return Poll::Ready(Err(err));
        }
        Pin::new(&mut this.tls).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if let Some(err) = this.power_check(cx) {
            return Poll::Ready(Err(err));
        }
        Pin::new(&mut this.tls).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if let Some(err) = this.power_check(cx) {
            return Poll::Ready(Err(err));
        }
        Pin::new(&mut this.tls).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.tls.is_write_vectored()
    }
}

impl Connected for NodeConn {
    /// Handlers read the caller's roles from the request extensions.
    type ConnectInfo = PeerIdentity;

    fn connect_info(&self) -> PeerIdentity {
        self.peer.clone()
    }
}

/// Dispatches by gRPC service name to the node's services (what tonic's optional router feature
/// would do); unknown services answer `Unimplemented`, like any gRPC server.
#[derive(Clone)]
struct NodeRouter {
    machine: MachineServiceServer<MachineApi>,
    image: ImageServiceServer<ImageApi>,
    lifecycle: LifecycleServiceServer<LifecycleApi>,
    state: StateServer<StateApi>,
    cluster: ClusterServiceServer<ClusterApi>,
}

impl Service<http::Request<Body>> for NodeRouter {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // The generated servers are always ready.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        let path = req.uri().path();
        let service = path
            .trim_start_matches('/')
            .split('/')
            .next()
            .unwrap_or_default();
        match service {
            "machine.MachineService" => self.machine.call(req),
            "machine.ImageService" => self.image.call(req),
            "machine.LifecycleService" => self.lifecycle.call(req),
            "cosi.resource.State" => self.state.call(req),
            "cluster.ClusterService" => self.cluster.call(req),
            other => {
                let response =
                    tonic::Status::unimplemented(format!("unknown service {other}")).into_http();
                Box::pin(async move { Ok(response) })
            }
        }
    }
}

/// Listen for this boot: a new boot token (child of the simulator's) ends with the power.
///
/// This is the [`crate::cluster::StartApid`] the simulator puts in its [`Cluster`]: the sequences
/// that power a node on reach it through there.
pub(crate) fn start(cluster: &Arc<Cluster>, node: &Arc<Node>, listener: TcpListener) {
    let boot = cluster.shutdown.child_token();
    let kill = cluster.shutdown.child_token();
    let ctx = ApiContext::new(cluster.clone(), node.clone());
    let handle = spawn(ctx, listener, boot.clone(), kill.clone());
    node.set_power_on(boot, kill, handle);
}

/// Serve `ctx.endpoint`'s API on `listener`. When `boot` ends, the listener closes at once and tonic
/// shuts down gracefully (GOAWAY, in-flight calls and streams finish); the task ends when every
/// connection is closed. `kill` drops the remaining connections outright.
fn spawn(
    ctx: ApiContext,
    listener: TcpListener,
    boot: CancellationToken,
    kill: CancellationToken,
) -> JoinHandle<()> {
    let acceptor = TlsAcceptor::from(ctx.endpoint.tls.clone());
    tokio::spawn(async move {
        let node_name = ctx.endpoint.name.clone();
        let (tx, rx) = mpsc::channel::<Result<NodeConn, io::Error>>(64);
        let router = NodeRouter {
            machine: MachineServiceServer::new(MachineApi::new(ctx.clone()))
                .max_decoding_message_size(MAX_MESSAGE_SIZE)
                .max_encoding_message_size(MAX_MESSAGE_SIZE),
            image: ImageServiceServer::new(ImageApi::new(ctx.clone()))
                .max_decoding_message_size(MAX_MESSAGE_SIZE),
            lifecycle: LifecycleServiceServer::new(LifecycleApi::new(ctx.clone()))
                .max_decoding_message_size(MAX_MESSAGE_SIZE),
            state: StateServer::new(StateApi::new(ctx.clone()))
                .max_decoding_message_size(MAX_MESSAGE_SIZE)
                .max_encoding_message_size(MAX_MESSAGE_SIZE),
            cluster: ClusterServiceServer::new(ClusterApi::new(ctx.clone())),
        };
        let serve = Server::builder().serve_with_incoming_shutdown(
            router,
            ReceiverStream::new(rx),
            boot.clone().cancelled_owned(),
        );
        let accept = accept_loop(listener, acceptor, boot, kill, tx);
        let (result, ()) = tokio::join!(serve, accept);
        if let Err(e) = result {
            tracing::warn!(node = %node_name, error = %e, "simulated apid stopped");
        }
    })
}

/// Accept and handshake until the boot ends; returning drops the listener (connection refused).
async fn accept_loop(
    listener: TcpListener,
    acceptor: TlsAcceptor,
    boot: CancellationToken,
    kill: CancellationToken,
    tx: mpsc::Sender<Result<NodeConn, io::Error>>,
) {
    loop {
        let accepted = tokio::select! {
            _ = boot.cancelled() => return,
            accepted = listener.accept() => accepted,
        };
        let (tcp, remote) = match accepted {
            Ok(accepted) => accepted,
            Err(e) => {
                // Out of file descriptors and the like: back off instead of spinning.
                tracing::debug!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
        };
        let _ = tcp.set_nodelay(true);
        let (acceptor, boot, kill, tx) = (acceptor.clone(), boot.clone(), kill.clone(), tx.clone());
        // Handshakes run beside the accept loop so one slow client cannot block the others.
        tokio::spawn(async move {
            let handshake = tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp));
            let tls = tokio::select! {
                _ = boot.cancelled() => return,
                result = handshake => match result {
                    Ok(Ok(tls)) => tls,
                    Ok(Err(e)) => {
                        tracing::debug!(%remote, error = %e, "TLS handshake refused");
                        return;
                    }
                    Err(_) => return,
                },
            };
            let roles = tls
                .get_ref()
                .1
                .peer_certificates()
                .and_then(|certs| certs.first())
                .map(auth::roles_from_cert);
            let roles = match roles {
                Some(Ok(roles)) => roles,
                // The verifier requires a certificate, so this is a malformed one: drop the connection.
                Some(Err(reason)) => {
                    tracing::debug!(%remote, %reason, "unusable client certificate");
                    return;
                }
                None => return,
            };
            let conn = NodeConn {
                tls,
                killed: Box::pin(kill.cancelled_owned()),
                dead: false,
                peer: PeerIdentity {
                    roles,
                    remote: Some(remote),
                },
            };
            // A closed channel means the server task is gone (power cut): the connection just drops.
            let _ = tx.send(Ok(conn)).await;
        });
    }
}
