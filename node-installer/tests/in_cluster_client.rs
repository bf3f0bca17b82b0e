//! The real in-cluster client against a local HTTPS stand-in for the API server (Python's http.server + ssl, with a
//! throwaway CA from openssl): TLS with only the given CA trusted, bearer token, merge-patch content type, 409.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a broken fixture fails loudly

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};

use bulkhead_node_installer::kube::{self, InCluster, NodeApi, PatchError};
use serde_json::json;

const SERVER: &str = r#"
import http.server, json, ssl, sys
node = {"metadata": {"name": "n1", "resourceVersion": "5", "labels": {}},
        "spec": {"taints": [{"key": "bulkhead.io/not-ready", "effect": "NoSchedule"}]}}
def merge(t, p):
    if not isinstance(p, dict): return p
    t = dict(t) if isinstance(t, dict) else {}
    for k, v in p.items():
        if v is None: t.pop(k, None)
        else: t[k] = merge(t.get(k), v)
    return t
class H(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def reply(self, code, body):
        b = json.dumps(body).encode()
        self.send_response(code); self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(b))); self.end_headers(); self.wfile.write(b)
    def authed(self):
        if self.headers.get("Authorization") != "Bearer tok-123":
            self.reply(401, {"kind": "Status", "code": 401}); return False
        if self.path != "/api/v1/nodes/n1":
            self.reply(404, {"kind": "Status", "code": 404}); return False
        return True
    def do_GET(self):
        if self.authed(): self.reply(200, node)
    def do_PATCH(self):
        global node
        if not self.authed(): return
        if self.headers.get("Content-Type") != "application/merge-patch+json":
            return self.reply(415, {"kind": "Status", "code": 415})
        p = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        rv = p.get("metadata", {}).pop("resourceVersion", None)
        if rv is not None and rv != node["metadata"]["resourceVersion"]:
            return self.reply(409, {"kind": "Status", "code": 409})
        node = merge(node, p)
        node["metadata"]["resourceVersion"] = str(int(node["metadata"]["resourceVersion"]) + 1)
        self.reply(200, node)
srv = http.server.HTTPServer(("127.0.0.1", 0), H)
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER); ctx.load_cert_chain(sys.argv[1], sys.argv[2])
srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
print(srv.server_address[1], flush=True)
srv.serve_forever()
"#;

struct Server(Child);
impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill(); // our own child, by handle
        let _ = self.0.wait();
    }
}

fn openssl(dir: &Path, args: &[&str]) -> bool {
    Command::new("openssl")
        .current_dir(dir)
        .args(args)
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

/// A CA, and a server certificate for 127.0.0.1 signed by it.
fn make_certs(dir: &Path) -> bool {
    std::fs::write(dir.join("san.ext"), "subjectAltName=IP:127.0.0.1\n").is_ok()
        && openssl(
            dir,
            &[
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-keyout",
                "ca.key",
                "-out",
                "ca.crt",
                "-days",
                "1",
                "-subj",
                "/CN=test-ca",
            ],
        )
        && openssl(
            dir,
            &[
                "req",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-keyout",
                "srv.key",
                "-out",
                "srv.csr",
                "-subj",
                "/CN=127.0.0.1",
            ],
        )
        && openssl(
            dir,
            &[
                "x509",
                "-req",
                "-in",
                "srv.csr",
                "-CA",
                "ca.crt",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-out",
                "srv.crt",
                "-days",
                "1",
                "-extfile",
                "san.ext",
            ],
        )
}

#[tokio::test]
async fn in_cluster_client_talks_tls_token_and_merge_patch() {
    let dir = tempfile::tempdir().unwrap();
    if !make_certs(dir.path()) {
        bulkhead_integration::skip::missing_prerequisite(
            "in_cluster_client_talks_tls_token_and_merge_patch",
            "openssl could not make test certificates (make setup installs openssl)",
        );
        return;
    }
    let mut child = match Command::new("python3")
        .arg("-c")
        .arg(SERVER)
        .arg(dir.path().join("srv.crt"))
        .arg(dir.path().join("srv.key"))
        .stdout(Stdio::piped())
        .spawn()
    {
        Ok(c) => c,
        Err(e) => {
            bulkhead_integration::skip::missing_prerequisite(
                "in_cluster_client_talks_tls_token_and_merge_patch",
                &format!("python3 not available: {e}"),
            );
            return;
        }
    };
    let stdout = child.stdout.take().unwrap();
    let _server = Server(child);
    let mut port = String::new();
    BufReader::new(stdout).read_line(&mut port).unwrap();
    let base = format!("https://127.0.0.1:{}", port.trim());
    std::fs::write(dir.path().join("token"), "tok-123\n").unwrap();
    let ca = std::fs::read(dir.path().join("ca.crt")).unwrap();

    let api = InCluster::new(base.clone(), &ca, dir.path().join("token")).unwrap();
    let n = api.get("n1").await.unwrap();
    assert_eq!(n.pointer("/metadata/name"), Some(&json!("n1")));

    kube::label_ready(&api, "n1", "ok", "0.1.0").await.unwrap();
    kube::remove_taint(&api, "n1", "bulkhead.io/not-ready").await.unwrap();
    let n = api.get("n1").await.unwrap();
    assert_eq!(n.pointer("/metadata/labels/bulkhead.io~1runtime"), Some(&json!("ready")));
    assert_eq!(n.pointer("/spec/taints"), Some(&json!([])));

    let stale = api.merge_patch("n1", &json!({"metadata": {"resourceVersion": "1"}, "spec": {"taints": []}})).await;
    assert!(matches!(stale, Err(PatchError::Conflict)), "{stale:?}");

    // Wrong token: a clear API error, not a panic.
    std::fs::write(dir.path().join("token"), "wrong").unwrap();
    let err = api.get("n1").await.unwrap_err().to_string();
    assert!(err.contains("401"), "{err}");

    // A CA that did not sign the server's certificate: TLS fails.
    assert!(openssl(
        dir.path(),
        &[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "o.key",
            "-out",
            "other.crt",
            "-days",
            "1",
            "-subj",
            "/CN=other"
        ]
    ));
    let other = std::fs::read(dir.path().join("other.crt")).unwrap();
    let untrusting = InCluster::new(base, &other, dir.path().join("token")).unwrap();
    assert!(untrusting.get("n1").await.is_err());
}
