//! Agent start-up and shutdown: builds the sandbox, wires the listener to the ttrpc service and
//! the stream port, then runs until DestroySandbox, SIGTERM or a listener failure. In guest mode
//! the VM is powered off at the end.

use std::{sync::Arc, time::Duration};

use crate::{
    cli::{AgentOpts, Listen, Mode},
    reaper::Reaper,
    sandbox::Sandbox,
    service, stream_attach,
    transport::{self, Conn, Dispatch},
};

/// Runs the agent until DestroySandbox (or a fatal listener error).
pub async fn serve(opts: AgentOpts) -> anyhow::Result<()> {
    let reaper = Reaper::start()?;
    let sandbox = Arc::new(Sandbox::new(&opts, reaper)?);
    if sandbox.mode == Mode::Namespace {
        tracing::warn!("namespace mode: containers share the host kernel (no VM isolation)");
    }
    let (ttrpc_tx, ttrpc_rx) = tokio::sync::mpsc::channel(16);
    let (stream_tx, mut stream_rx) = tokio::sync::mpsc::channel::<Conn>(64);
    let dispatch = Dispatch { ttrpc: ttrpc_tx, streams: stream_tx, frame_stall: opts.frame_stall_ms };
    let sb = sandbox.clone();
    tokio::spawn(async move {
        while let Some(conn) = stream_rx.recv().await {
            tokio::spawn(stream_attach::attach(sb.clone(), conn));
        }
    });
    let (shutdown_tx, mut shutdown_rx) = tokio::sync::mpsc::channel::<()>(1);
    let mut sigterm = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let mut server = service::server(sandbox.clone(), ttrpc_rx, shutdown_tx)?;
    server.start().await?;
    let listener = match opts.listen.clone() {
        Listen::Unix(path) => {
            let listener = match opts.listen_fd {
                Some(fd) => transport::inherited_unix(fd)?,
                None => transport::bind_unix(&path)?,
            };
            tokio::spawn(async move { transport::serve_unix(listener, dispatch).await })
        }
        Listen::Vsock => tokio::spawn(async move { transport::serve_vsock(dispatch).await }),
    };
    tokio::select! {
        r = listener => {
            match r {
                Ok(Ok(())) => anyhow::bail!("listener ended"),
                Ok(Err(e)) => anyhow::bail!("listener: {e}"),
                Err(e) => anyhow::bail!("listener task: {e}"),
            }
        }
        _ = shutdown_rx.recv() => {
            tracing::info!("sandbox destroyed; shutting down");
            // Let the DestroySandbox response reach the shim.
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        _ = sigterm.recv() => {
            // The namespace backend (or an operator) asks PID 1 to stop: same as DestroySandbox
            // with a short grace period.
            tracing::info!("SIGTERM: destroying the sandbox");
            sandbox.destroy(Duration::from_secs(2)).await;
        }
    }
    if sandbox.mode == Mode::Guest {
        nix::unistd::sync();
        let _ = nix::sys::reboot::reboot(nix::sys::reboot::RebootMode::RB_POWER_OFF);
    }
    Ok(())
}
