//! The host end of a virtio-net device: an existing tap, attached through /dev/net/tun with
//! IFF_TAP | IFF_NO_PI | IFF_VNET_HDR and non-blocking, so every read and every write is one
//! frame preceded by a 12-byte `virtio_net_hdr_v1`.
//!
//! Boundaries: the VMM never creates, configures or deletes taps (the shim owns them, in the
//! pod's network namespace). It only attaches to one by name, probes which offloads it accepts
//! (TUNSETOFFLOAD) and later tells it which of those the guest negotiated.

use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;

use bulkhead_vmm_api::ifname::{check_ifname, IfNameError};

use super::packet::VNET_HDR_LEN;

/// What the device needs of its host end: one frame per read or write, vnet header first.
/// [`Tap`] is the real one; unit tests use a datagram socket pair, which also keeps frame
/// boundaries.
pub trait FrameIo: Send {
    /// Reads one frame; `WouldBlock` when none is waiting.
    fn read_frame(&mut self, buf: &mut [u8]) -> io::Result<usize>;
    fn write_frame(&mut self, frame: &[u8]) -> io::Result<usize>;
    /// The `TUN_F_*` offloads this end accepts for guest-bound frames.
    fn offloads(&self) -> u32;
    /// Sets the offloads the guest takes: a subset of [`FrameIo::offloads`], 0 for none.
    fn set_offload(&mut self, flags: u32) -> io::Result<()>;
    /// Readable when a frame is waiting (for the event loop).
    fn raw_fd(&self) -> RawFd;
}

#[derive(Debug, thiserror::Error)]
pub enum TapError {
    #[error("tap name {name:?} is not a valid interface name: it {reason}")]
    Name { name: String, reason: IfNameError },
    #[error("tap {0} does not exist in this network namespace (the VMM attaches to taps, it never creates them)")]
    Missing(String),
    #[error("cannot open /dev/net/tun: {0}")]
    Open(io::Error),
    #[error("cannot attach to tap {name} (is it a tap, single-queue, and ours to open?): {source}")]
    Attach { name: String, source: io::Error },
    #[error("tap {name}: cannot set the vnet header size: {source}")]
    VnetHeader { name: String, source: io::Error },
}

/// Offload sets tried in turn when probing; the first the tap accepts wins. TSO needs CSUM.
const OFFLOAD_PROBES: [u32; 4] = [
    libc::TUN_F_CSUM | libc::TUN_F_TSO4 | libc::TUN_F_TSO6,
    libc::TUN_F_CSUM | libc::TUN_F_TSO4,
    libc::TUN_F_CSUM | libc::TUN_F_TSO6,
    libc::TUN_F_CSUM,
];

/// An attached tap.
#[derive(Debug)]
pub struct Tap {
    file: File,
    name: String,
    offloads: u32,
}

impl Tap {
    /// Attaches to the existing tap `name` in the caller's network namespace.
    pub fn open(name: &str) -> Result<Self, TapError> {
        let ifr_name = ifname(name)?;
        // `ifname` refused NUL bytes already.
        let cname =
            CString::new(name).map_err(|_| TapError::Name { name: name.to_string(), reason: IfNameError::Byte(0) })?;
        // SAFETY: `cname` is a valid NUL-terminated string that outlives the call.
        if unsafe { libc::if_nametoindex(cname.as_ptr()) } == 0 {
            return Err(TapError::Missing(name.to_string()));
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open("/dev/net/tun")
            .map_err(TapError::Open)?;

        // SAFETY: ifreq is plain data (a name and a union of integers); all zeroes is valid.
        let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
        req.ifr_name = ifr_name;
        req.ifr_ifru.ifru_flags = (libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR) as libc::c_short;
        // SAFETY: TUNSETIFF reads and writes one ifreq, which `req` is; the fd is ours and open.
        if unsafe { libc::ioctl(file.as_raw_fd(), libc::TUNSETIFF, &mut req) } < 0 {
            return Err(TapError::Attach { name: name.to_string(), source: io::Error::last_os_error() });
        }
        let hdr_len = VNET_HDR_LEN as libc::c_int;
        // SAFETY: TUNSETVNETHDRSZ reads one int through the pointer, which stays valid for the call.
        if unsafe { libc::ioctl(file.as_raw_fd(), libc::TUNSETVNETHDRSZ, &hdr_len) } < 0 {
            return Err(TapError::VnetHeader { name: name.to_string(), source: io::Error::last_os_error() });
        }
        let mut tap = Self { file, name: name.to_string(), offloads: 0 };
        tap.offloads = OFFLOAD_PROBES.into_iter().find(|&f| tap.ioctl_offload(f).is_ok()).unwrap_or(0);
        // Nothing is offloaded to the guest until it negotiates it.
        tap.ioctl_offload(0).map_err(|source| TapError::Attach { name: name.to_string(), source })?;
        tracing::debug!(tap = %tap.name, offloads = tap.offloads, "attached to tap");
        Ok(tap)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    fn ioctl_offload(&self, flags: u32) -> io::Result<()> {
        // SAFETY: TUNSETOFFLOAD takes its argument by value; the fd is ours and open.
        if unsafe { libc::ioctl(self.file.as_raw_fd(), libc::TUNSETOFFLOAD, libc::c_ulong::from(flags)) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
}

/// `name` as a NUL-padded `ifr_name`, once it passed the one rule for interface names.
fn ifname(name: &str) -> Result<[libc::c_char; libc::IFNAMSIZ], TapError> {
    check_ifname(name).map_err(|reason| TapError::Name { name: name.to_string(), reason })?;
    let bytes = name.as_bytes();
    let mut out = [0 as libc::c_char; libc::IFNAMSIZ];
    for (o, &b) in out.iter_mut().zip(bytes) {
        *o = b as libc::c_char;
    }
    Ok(out)
}

impl FrameIo for Tap {
    fn read_frame(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.file.read(buf)
    }

    fn write_frame(&mut self, frame: &[u8]) -> io::Result<usize> {
        self.file.write(frame)
    }

    fn offloads(&self) -> u32 {
        self.offloads
    }

    fn set_offload(&mut self, flags: u32) -> io::Result<()> {
        if flags & !self.offloads != 0 {
            return Err(io::Error::from(io::ErrorKind::Unsupported));
        }
        self.ioctl_offload(flags)
    }

    fn raw_fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{Ipv4Addr, UdpSocket};
    use std::process::Command;
    use std::time::{Duration, Instant};

    #[test]
    fn bad_names_are_refused_before_any_syscall() {
        for bad in ["", "a/b", "sixteen-chars-xx", "nul\0x"] {
            assert!(matches!(Tap::open(bad), Err(TapError::Name { .. })), "{bad:?}");
        }
        assert_eq!(ifname("tap0").unwrap()[..5], [b't' as libc::c_char, b'a' as _, b'p' as _, b'0' as _, 0]);
    }

    fn ip(args: &[&str]) {
        let out = Command::new("ip").args(args).output().expect("run ip");
        assert!(out.status.success(), "ip {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    }

    /// Runs `f` on a thread in a network namespace of its own, which vanishes with the thread
    /// (and every tap in it). Prints SKIPPED without CAP_NET_ADMIN.
    fn in_private_netns(name: &str, f: impl FnOnce() + Send + 'static) {
        let ran = std::thread::spawn(move || {
            // SAFETY: unshare(CLONE_NEWNET) only changes this thread's network namespace.
            if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
                return false;
            }
            f();
            true
        })
        .join();
        match ran {
            Ok(true) => {}
            Ok(false) => println!("SKIPPED: {name}: needs CAP_NET_ADMIN for a private network namespace"),
            Err(panic) => std::panic::resume_unwind(panic),
        }
    }

    #[test]
    fn attaches_to_an_existing_tap_and_reads_a_frame_with_its_vnet_header() {
        in_private_netns("attaches_to_an_existing_tap", || {
            assert!(matches!(Tap::open("bhnope0"), Err(TapError::Missing(_))));
            ip(&["tuntap", "add", "dev", "bhut0", "mode", "tap"]);
            let mut tap = Tap::open("bhut0").unwrap();
            assert_eq!(tap.name(), "bhut0");
            assert_ne!(tap.offloads() & libc::TUN_F_CSUM, 0, "this kernel's tap takes checksum offload");
            tap.set_offload(tap.offloads()).unwrap();
            assert!(tap.set_offload(0x8000).is_err(), "flags outside the probe are refused");
            tap.set_offload(0).unwrap();
            assert!(matches!(Tap::open("bhut0"), Err(TapError::Attach { .. })), "a single-queue tap has one owner");

            ip(&["link", "set", "bhut0", "address", "02:00:00:00:01:01", "up"]);
            ip(&["addr", "add", "10.9.0.1/24", "dev", "bhut0"]);
            ip(&["neigh", "add", "10.9.0.2", "lladdr", "02:00:00:00:01:02", "dev", "bhut0", "nud", "permanent"]);
            let s = UdpSocket::bind((Ipv4Addr::new(10, 9, 0, 1), 0)).unwrap();
            s.send_to(b"to the guest", (Ipv4Addr::new(10, 9, 0, 2), 9)).unwrap();

            let mut buf = vec![0u8; 2048];
            let deadline = Instant::now() + Duration::from_secs(5);
            let frame = loop {
                match tap.read_frame(&mut buf) {
                    Ok(n) if buf[VNET_HDR_LEN + 12..VNET_HDR_LEN + 14] == [0x08, 0x00] => break &buf[..n],
                    Ok(_) => {} // IPv6 chatter of a fresh link
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        assert!(Instant::now() < deadline, "no IPv4 frame from the tap");
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    Err(e) => panic!("tap read: {e}"),
                }
            };
            let eth = &frame[VNET_HDR_LEN..];
            assert_eq!(eth[..6], [2, 0, 0, 0, 1, 2], "to the static neighbour");
            assert!(eth.ends_with(b"to the guest"));
        });
    }
}
