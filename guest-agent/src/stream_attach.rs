//! The stream port: each stdio connection names its container, exec and stream in a header;
//! it is looked up, acknowledged (or rejected with the reason) and attached to the process's
//! I/O. A bad header costs only its own connection.

use std::{sync::Arc, time::Duration};

use bulkhead_protocol::stream::{StreamAck, StreamHeader};

use crate::{sandbox::Sandbox, transport::Conn};

const STREAM_HEADER_TIMEOUT: Duration = Duration::from_secs(5);

/// Serves one stream connection: header, lookup, ack, attach.
pub async fn attach(sandbox: Arc<Sandbox>, mut conn: Conn) {
    let header = match StreamHeader::read_from(&mut conn, STREAM_HEADER_TIMEOUT).await {
        Ok(h) => h,
        Err(e) => {
            tracing::warn!(error = %e, "bad stream header");
            let _ = StreamAck::Rejected(e.to_string()).write_to(&mut conn).await;
            return;
        }
    };
    let exec = header.exec_id.clone().unwrap_or_default();
    let process = sandbox.container(&header.container_id).and_then(|c| c.process(&exec));
    let process = match process {
        Ok(p) => p,
        Err(e) => {
            let _ = StreamAck::Rejected(e.to_string()).write_to(&mut conn).await;
            return;
        }
    };
    if let Err(e) = process.io.check(header.kind) {
        let _ = StreamAck::Rejected(e).write_to(&mut conn).await;
        return;
    }
    if StreamAck::Attached.write_to(&mut conn).await.is_err() {
        return;
    }
    if let Err(e) = process.io.attach(header.kind, conn) {
        tracing::warn!(container = %header.container_id, exec = %exec, kind = %header.kind,
            error = %e, "stream attach failed after ack");
    }
}
