//! A private TLS `redis-server` (`--port 0 --tls-port <free>`) with a CA,
//! a server certificate and a client certificate the test generates
//! (rcgen), all in a temporary directory. The server is killed and the
//! directory removed on drop.

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The name on the server certificate: `rediss://localhost:<port>` verifies,
/// `rediss://127.0.0.1:<port>` is a host name mismatch.
pub const SERVER_NAME: &str = "localhost";

/// PEM files in a temporary directory: a CA, a server and a client
/// certificate it signed, and a second CA that signed nothing.
pub struct TestPki {
    dir: tempfile::TempDir,
}

impl TestPki {
    pub fn generate() -> Self {
        Self::generate_for(&[SERVER_NAME])
    }

    /// [`TestPki::generate`] with the server certificate valid for `names`
    /// (host names or IP addresses: Sentinel names masters by address).
    pub fn generate_for(names: &[&str]) -> Self {
        let dir = tempfile::TempDir::new().expect("tempdir");
        let ca_key = KeyPair::generate().expect("CA key");
        let params = ca_params("idemgate test CA");
        let ca_cert = params.self_signed(&ca_key).expect("self-sign the CA");
        let issuer = Issuer::new(params, ca_key);
        let write = |name: &str, text: String| {
            std::fs::write(dir.path().join(name), text).expect("write a PEM file")
        };
        write("ca.pem", ca_cert.pem());
        // The server certificate is a client one too: cluster nodes present
        // it to each other on the (always mutually authenticated) bus.
        for (name, san, purposes) in [
            (
                "server",
                names,
                vec![
                    ExtendedKeyUsagePurpose::ServerAuth,
                    ExtendedKeyUsagePurpose::ClientAuth,
                ],
            ),
            (
                "client",
                &["idemgate-client"][..],
                vec![ExtendedKeyUsagePurpose::ClientAuth],
            ),
        ] {
            let key = KeyPair::generate().expect("leaf key");
            let sans: Vec<String> = san.iter().map(|n| n.to_string()).collect();
            let mut params = CertificateParams::new(sans).expect("leaf params");
            params.distinguished_name.push(DnType::CommonName, san[0]);
            params.use_authority_key_identifier_extension = true;
            params.key_usages.push(KeyUsagePurpose::DigitalSignature);
            params.extended_key_usages = purposes;
            let cert = params.signed_by(&key, &issuer).expect("sign a leaf");
            write(&format!("{name}.pem"), cert.pem());
            write(&format!("{name}.key"), key.serialize_pem());
        }
        let other_key = KeyPair::generate().expect("other CA key");
        let other = ca_params("some other CA")
            .self_signed(&other_key)
            .expect("self-sign the other CA");
        write("other-ca.pem", other.pem());
        Self { dir }
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// The CA that signed the server and client certificates.
    pub fn ca(&self) -> String {
        self.file("ca.pem")
    }

    /// A CA that did not sign the server's certificate.
    pub fn other_ca(&self) -> String {
        self.file("other-ca.pem")
    }

    pub fn client_cert(&self) -> String {
        self.file("client.pem")
    }

    pub fn client_key(&self) -> String {
        self.file("client.key")
    }

    fn file(&self, name: &str) -> String {
        self.path(name).display().to_string()
    }
}

fn ca_params(name: &str) -> CertificateParams {
    let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, name);
    params.key_usages.push(KeyUsagePurpose::KeyCertSign);
    params.key_usages.push(KeyUsagePurpose::DigitalSignature);
    params
}

/// Whether the server asks clients for a certificate (`--tls-auth-clients`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClientAuth {
    No,
    Required,
}

/// A `redis-server` speaking TLS only, on a free port; killed on drop.
pub struct TlsRedis {
    pub port: u16,
    pub pki: TestPki,
    child: Option<Child>,
}

impl TlsRedis {
    pub fn start(auth: ClientAuth) -> Self {
        let pki = TestPki::generate();
        let port = super::free_port().port();
        let child = wait_listening(port, spawn_tls_server(&pki, port, auth, &[]));
        Self {
            port,
            pki,
            child: Some(child),
        }
    }

    /// `rediss://localhost:<port>`: the name the certificate carries.
    pub fn url(&self) -> String {
        format!("rediss://{SERVER_NAME}:{}", self.port)
    }

    /// Kills the server and waits for it to exit.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for TlsRedis {
    fn drop(&mut self) {
        self.kill();
    }
}

/// `redis-server` with TLS on `port` only, the PKI's server certificate,
/// and `extra` arguments (for cluster nodes). Never persists.
pub fn spawn_tls_server(pki: &TestPki, port: u16, auth: ClientAuth, extra: &[&str]) -> Child {
    let file = |name: &str| pki.path(name).display().to_string();
    let auth = match auth {
        ClientAuth::No => "no",
        ClientAuth::Required => "yes",
    };
    let mut args: Vec<String> = [
        "--port",
        "0",
        "--tls-port",
        &port.to_string(),
        "--bind",
        "127.0.0.1",
        "--tls-cert-file",
        &file("server.pem"),
        "--tls-key-file",
        &file("server.key"),
        "--tls-ca-cert-file",
        &file("ca.pem"),
        "--tls-auth-clients",
        auth,
        "--save",
        "",
        "--appendonly",
        "no",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend(extra.iter().map(|s| s.to_string()));
    Command::new("redis-server")
        .args(&args)
        .current_dir(pki.dir.path())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn redis-server (is it installed, built with TLS, and on PATH?)")
}

/// Waits until `port` accepts TCP connections (a TLS server cannot be
/// PINGed in plain text); panics if the server exits first.
pub fn wait_listening(port: u16, mut child: Child) -> Child {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return child;
        }
        if let Ok(Some(status)) = child.try_wait() {
            panic!("redis-server --tls-port {port} exited: {status} (is it built with TLS?)");
        }
        assert!(
            Instant::now() < deadline,
            "redis-server --tls-port {port} did not listen within 10 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}
