//! A `--prepare`d VMM's API server: before its VM exists it answers `info` and `shutdown`, vets
//! a `restore` against the snapshot and hands it to the main thread, which builds the VM and
//! takes the socket and the client over.

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bulkhead_vmm_api::api::{encode_line, parse_request, Request, Response, RestoreReport, RunState, VmInfo};
use bulkhead_vmm_api::memory::Mib;
use bulkhead_vmm_api::restore::RestoreConfig;
use vmm_sys_util::eventfd::EventFd;

use crate::thread::{spawn_confined, Confine, Mailbox, Slot};

use super::{malformed, RequestLines, IO_TIMEOUT};

/// How long a prepared VMM's API thread waits for the main thread to take or refuse a restore
/// (it checks the run's paths: a few stat calls).
const VERDICT_TIMEOUT: Duration = Duration::from_secs(5);

/// What a prepared VMM does with one request line.
#[derive(Debug)]
pub enum PreparedRequest {
    /// Answered at once (refused or malformed).
    Answer(Response),
    Info,
    /// To check against the snapshot, then hand to the main thread.
    Restore(RestoreConfig),
    Shutdown,
}

/// Decides what a prepared VMM does with `line` (without its newline); `more_pending` says the
/// client already sent bytes after it, which a `restore` must not have (its answer comes first).
pub fn prepared_request(line: &[u8], more_pending: bool) -> PreparedRequest {
    match parse_request(line) {
        Ok(Request::Restore { config }) if !more_pending => PreparedRequest::Restore(config),
        Ok(Request::Restore { .. }) => {
            PreparedRequest::Answer(Response::error("send nothing after `restore` before its answer"))
        }
        Ok(Request::Info) => PreparedRequest::Info,
        Ok(Request::Shutdown) => PreparedRequest::Shutdown,
        Ok(_) => PreparedRequest::Answer(Response::error("this VMM is prepared and waits for `restore`")),
        Err(e) => PreparedRequest::Answer(malformed(&e)),
    }
}

/// What a prepared VMM's API thread tells the main thread.
pub enum PreparedEvent {
    /// A `restore` whose run settings fit the snapshot. The main thread checks the run's paths
    /// and puts its verdict in `verdict`: refused, the API thread answers and keeps waiting;
    /// taken, it hands its socket and the client over and ends.
    Restore { config: RestoreConfig, requested_unix_ns: u64, verdict: Arc<Slot<Result<(), String>>> },
    /// `shutdown` (answered); the API thread has ended.
    Shutdown,
    /// The API thread could not go on serving.
    Failed(String),
}

/// The socket and client a prepared VMM's API thread hands over once the main thread took a
/// restore: the running VM's API server answers the client and serves both from then on.
pub struct Handover {
    pub listener: UnixListener,
    pub client: UnixStream,
}

/// The main thread's end of a prepared VMM's API thread.
pub struct PreparedApi {
    events: Arc<Mailbox<PreparedEvent>>,
    /// Signalled with every event; the main thread polls it beside the signalfd.
    wake: EventFd,
    handover: Arc<Slot<Handover>>,
}

impl PreparedApi {
    pub fn wake_fd(&self) -> RawFd {
        self.wake.as_raw_fd()
    }

    /// The events since the last call.
    pub fn events(&self) -> Vec<PreparedEvent> {
        let _ = self.wake.read();
        self.events.drain()
    }

    /// What the API thread hands over after a restore was taken (it does so at once).
    pub fn handover(&self) -> Result<Handover, String> {
        self.handover
            .take_until(Instant::now() + VERDICT_TIMEOUT)
            .ok_or_else(|| "the API thread did not hand its socket over".to_string())
    }
}

/// Serves a prepared VMM's API on the `api` thread, confined like the running VM's, until a
/// `restore` is taken: `info` reports `prepared`, `shutdown` stops, anything else is refused.
/// `check` vets a restore's run settings against the snapshot (no I/O); the main thread then
/// checks the paths. Clients are served one at a time, each bounded by the I/O timeout.
pub fn spawn_prepared(
    listener: UnixListener,
    info: VmInfo,
    check: impl Fn(&RestoreConfig) -> Result<(), String> + Send + 'static,
    confine: Confine,
) -> std::io::Result<PreparedApi> {
    let events = Mailbox::new();
    let wake = EventFd::new(libc::EFD_NONBLOCK)?;
    let handover = Slot::new();
    let server = PreparedServer {
        listener,
        info,
        check,
        events: Arc::clone(&events),
        wake: wake.try_clone()?,
        handover: Arc::clone(&handover),
    };
    spawn_confined("api".into(), confine, move || server.serve())?;
    Ok(PreparedApi { events, wake, handover })
}

/// What the prepared API thread does with one request.
enum Step {
    /// This line (encoded) goes back to the client.
    Answer(Vec<u8>),
    /// The main thread took the restore: hand over.
    Taken,
    Stop,
}

fn answer(response: Response) -> Step {
    Step::Answer(encode_line(&response))
}

struct PreparedServer<C> {
    listener: UnixListener,
    info: VmInfo,
    check: C,
    events: Arc<Mailbox<PreparedEvent>>,
    wake: EventFd,
    handover: Arc<Slot<Handover>>,
}

impl<C: Fn(&RestoreConfig) -> Result<(), String>> PreparedServer<C> {
    fn tell_main(&self, event: PreparedEvent) {
        self.events.post(event);
        if let Err(e) = self.wake.write(1) {
            tracing::error!(error = %e, "cannot wake the main thread of a prepared VMM");
        }
    }

    /// Accepts (blocking: this thread has nothing else to do) and serves clients until a restore
    /// is taken (the socket and client are handed over) or `shutdown`.
    fn serve(self) {
        loop {
            let mut client = match self.listener.accept() {
                Ok((c, _)) => c,
                Err(e) => {
                    self.tell_main(PreparedEvent::Failed(format!("accept on the API socket: {e}")));
                    return;
                }
            };
            if client.set_read_timeout(Some(IO_TIMEOUT)).is_err() || client.set_write_timeout(Some(IO_TIMEOUT)).is_err()
            {
                continue;
            }
            let mut lines = RequestLines::default();
            'client: loop {
                let mut chunk = [0u8; 1024];
                let n = match client.read(&mut chunk) {
                    Ok(0) | Err(_) => break 'client,
                    Ok(n) => n,
                };
                lines.push(&chunk[..n]);
                while let Some(line) = lines.next_line() {
                    let step = match prepared_request(&line, lines.pending() > 0) {
                        PreparedRequest::Answer(response) => answer(response),
                        PreparedRequest::Info => answer(Response { info: Some(self.info.clone()), ..Response::ok() }),
                        PreparedRequest::Restore(config) => self.restore(config),
                        PreparedRequest::Shutdown => Step::Stop,
                    };
                    match step {
                        Step::Answer(line) => {
                            if client.write_all(&line).is_err() {
                                break 'client;
                            }
                        }
                        Step::Taken => {
                            self.handover.put(Handover { listener: self.listener, client });
                            return;
                        }
                        Step::Stop => {
                            let _ = client.write_all(&encode_line(&Response::ok()));
                            self.tell_main(PreparedEvent::Shutdown);
                            return;
                        }
                    }
                }
                if lines.overlong() {
                    break 'client;
                }
            }
        }
    }

    /// Checks the run against the snapshot, then asks the main thread, which checks the run's
    /// paths and restores.
    fn restore(&self, config: RestoreConfig) -> Step {
        if let Err(e) = (self.check)(&config) {
            return answer(Response::error(format!("restore refused: {e}")));
        }
        let verdict = Slot::new();
        let requested_unix_ns = crate::vcpu::unix_ns();
        self.tell_main(PreparedEvent::Restore { config, requested_unix_ns, verdict: Arc::clone(&verdict) });
        match verdict.take_until(Instant::now() + VERDICT_TIMEOUT) {
            Some(Ok(())) => Step::Taken,
            Some(Err(e)) => answer(Response::error(format!("restore refused: {e}"))),
            None => answer(Response::error("the VMM did not take the restore in time")),
        }
    }
}

/// What `info` says about a prepared VMM.
pub fn prepared_info(vcpus: u8, mem_mib: Mib, irqchip: bool, start_unix_ns: u64, restore: RestoreReport) -> VmInfo {
    VmInfo {
        state: RunState::Prepared,
        pid: std::process::id(),
        vcpus,
        mem_mib,
        irqchip,
        start_unix_ns,
        first_kvm_run_unix_ns: None,
        restore: Some(restore),
        boot: None,
        balloon: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::bind_api_socket;
    use crate::thread::unconfined;
    use std::io::{BufRead, BufReader};

    fn call(stream: &mut UnixStream, line: &str) -> Response {
        stream.write_all(format!("{line}\n").as_bytes()).unwrap();
        let mut reader = BufReader::new(stream.try_clone().unwrap());
        let mut answer = String::new();
        reader.read_line(&mut answer).unwrap();
        serde_json::from_str(&answer).unwrap()
    }

    /// Waits (bounded) for the API thread's next event.
    fn next_event(api: &PreparedApi) -> PreparedEvent {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(e) = api.events().into_iter().next() {
                return e;
            }
            assert!(Instant::now() < deadline, "no event from the API thread");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn a_prepared_api_answers_checks_and_hands_a_taken_restore_over() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("api.sock");
        let info = prepared_info(1, Mib(32), true, 7, RestoreReport::default());
        let check = |run: &RestoreConfig| if run.vsock_uds_path.is_some() { Ok(()) } else { Err("no vsock".into()) };
        let api = spawn_prepared(bind_api_socket(&path).unwrap(), info, check, unconfined()).unwrap();
        let mut client = UnixStream::connect(&path).unwrap();
        assert_eq!(call(&mut client, r#"{"cmd":"info"}"#).info.unwrap().state, RunState::Prepared);
        assert!(!call(&mut client, r#"{"cmd":"pause"}"#).ok);
        let refused = call(&mut client, r#"{"cmd":"restore","config":{}}"#);
        assert!(refused.error.unwrap().contains("no vsock"), "refused on the API thread");

        // The main thread refuses the first (its paths), takes the second.
        let restore = r#"{"cmd":"restore","config":{"vsock_uds_path":"/nonexistent/v.sock"}}"#;
        client.write_all(format!("{restore}\n").as_bytes()).unwrap();
        let PreparedEvent::Restore { verdict, .. } = next_event(&api) else { panic!("not a restore") };
        verdict.put(Err("vsock uds_path: no such directory".into()));
        let mut reader = BufReader::new(client.try_clone().unwrap());
        let mut answer = String::new();
        reader.read_line(&mut answer).unwrap();
        assert!(answer.contains("no such directory"), "{answer}");
        client.write_all(format!("{restore}\n").as_bytes()).unwrap();
        let PreparedEvent::Restore { config, verdict, .. } = next_event(&api) else { panic!("not a restore") };
        assert_eq!(config.vsock_uds_path, Some("/nonexistent/v.sock".into()));
        verdict.put(Ok(()));
        let handover = api.handover().unwrap();
        // The handed-over client is the one that asked: it sees what the new owner writes.
        (&handover.client).write_all(b"answer\n").unwrap();
        let mut answer = String::new();
        reader.read_line(&mut answer).unwrap();
        assert_eq!(answer, "answer\n");
    }

    #[test]
    fn a_prepared_api_stops_on_shutdown() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("api.sock");
        let info = prepared_info(1, Mib(32), true, 7, RestoreReport::default());
        let api = spawn_prepared(bind_api_socket(&path).unwrap(), info, |_| Ok(()), unconfined()).unwrap();
        let mut client = UnixStream::connect(&path).unwrap();
        assert!(call(&mut client, r#"{"cmd":"shutdown"}"#).ok);
        assert!(matches!(next_event(&api), PreparedEvent::Shutdown));
    }
}
