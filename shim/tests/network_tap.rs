//! The host side of pod networking (`bulkhead_shim::network`) against real kernel objects. Each
//! test makes two network namespaces of its own, "pod" (a CNI-like veth end `eth0` with
//! addresses and routes) and "out" (the veth's peer `peer0`, standing in for the CNI bridge),
//! and deletes both on drop, also on failure. Frames go only between those namespaces: the tap
//! is opened as the jailed VMM would open it, frames are written and read on it and captured or
//! injected on `peer0` with a packet socket.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a broken fixture fails loudly

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bulkhead_shim::network::{attach_vm, block_metadata, teardown, MetadataAccess, VmAttach, VmNetwork};

const POD_MAC: [u8; 6] = [0x02, 0x42, 0x0a, 0x63, 0x00, 0x02];
const PEER_MAC: [u8; 6] = [0x02, 0x00, 0x00, 0x00, 0x63, 0x01];
const POD_IP: [u8; 4] = [10, 99, 0, 2];
const PEER_IP: [u8; 4] = [10, 99, 0, 1];
const METADATA_V4: [u8; 4] = [169, 254, 169, 254];
const METADATA_V6: &str = "fd00:ec2::254";
/// The jailed VMM's ids in the default config.
const VMM_ID: u32 = 65534;
const VNET_HDR_LEN: usize = 12;
const WAIT: Duration = Duration::from_secs(5);

/// Root, and the iproute2 tools the fixture uses (`make setup` installs them: missing, we fail).
fn ready(test: &str) -> bool {
    if !nix::unistd::geteuid().is_root() {
        return !bulkhead_integration::skip::missing_prerequisite(test, "needs root (network namespaces, taps)");
    }
    for tool in ["ip", "tc"] {
        assert!(bulkhead_integration::which(tool).is_some(), "{tool} (iproute2) is not installed: run `make setup`");
    }
    true
}

fn run(cmd: &str, args: &[&str]) -> String {
    let out = Command::new(cmd).args(args).output().unwrap_or_else(|e| panic!("cannot run {cmd}: {e}"));
    assert!(out.status.success(), "{cmd} {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn mac(m: &[u8; 6]) -> String {
    m.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":")
}

/// The two namespaces and the veth pair between them; deleted on drop.
struct TestNet {
    pod: String,
    out: String,
    state: tempfile::TempDir,
}

impl TestNet {
    fn create() -> Self {
        static SEQ: AtomicUsize = AtomicUsize::new(0);
        let n = SEQ.fetch_add(1, Ordering::SeqCst);
        let pod = format!("bhnt-pod-{}-{n}", std::process::id());
        let out = format!("bhnt-out-{}-{n}", std::process::id());
        run("ip", &["netns", "add", &pod]);
        // From here on, Drop removes whatever exists.
        let net = Self { pod, out, state: tempfile::tempdir().unwrap() };
        run("ip", &["netns", "add", &net.out]);
        net.ip_out(&["link", "add", "peer0", "type", "veth", "peer", "name", "eth0", "netns", &net.pod]);
        net.ip_out(&["link", "set", "peer0", "address", &mac(&PEER_MAC), "mtu", "1450", "up"]);
        net.ip_out(&["addr", "add", "10.99.0.1/24", "dev", "peer0"]);
        net.ip_out(&["-6", "addr", "add", "fd00:99::1/64", "dev", "peer0", "nodad"]);
        net.ip_pod(&["link", "set", "eth0", "address", &mac(&POD_MAC), "mtu", "1450", "up"]);
        net.ip_pod(&["addr", "add", "10.99.0.2/24", "dev", "eth0"]);
        net.ip_pod(&["-6", "addr", "add", "fd00:99::2/64", "dev", "eth0", "nodad"]);
        net.ip_pod(&["route", "add", "default", "via", "10.99.0.1"]);
        net.ip_pod(&["route", "add", "192.168.77.0/24", "dev", "eth0"]);
        net.ip_pod(&["-6", "route", "add", "default", "via", "fd00:99::1"]);
        net
    }

    fn ip_pod(&self, args: &[&str]) -> String {
        let mut all = vec!["-n", &self.pod];
        all.extend_from_slice(args);
        run("ip", &all)
    }

    fn ip_out(&self, args: &[&str]) -> String {
        let mut all = vec!["-n", &self.out];
        all.extend_from_slice(args);
        run("ip", &all)
    }

    fn tc_pod(&self, args: &[&str]) -> String {
        let mut all = vec!["-n", &self.pod];
        all.extend_from_slice(args);
        run("tc", &all)
    }

    fn netns_path(&self, name: &str) -> PathBuf {
        PathBuf::from("/run/netns").join(name)
    }

    fn record(&self) -> PathBuf {
        self.state.path().join("network.json")
    }

    async fn attach(&self, metadata: MetadataAccess) -> VmNetwork {
        let pod = self.netns_path(&self.pod);
        let record = self.record();
        attach_vm(&VmAttach { netns: &pod, record: &record, tap_uid: VMM_ID, tap_gid: VMM_ID, metadata })
            .await
            .expect("attach_vm")
    }

    /// Runs `f` on a fresh thread inside namespace `name` (the thread ends with it).
    fn in_netns<T: Send + 'static>(&self, name: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
        let ns = File::open(self.netns_path(name)).unwrap();
        std::thread::spawn(move || {
            // SAFETY: setns on a namespace fd we hold; it changes only this short-lived thread.
            assert_eq!(unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) }, 0, "setns");
            f()
        })
        .join()
        .unwrap()
    }

    /// A packet socket on `peer0` (outside the pod), for capturing and injecting frames.
    fn peer_socket(&self) -> OwnedFd {
        self.in_netns(&self.out, || {
            // SAFETY: plain socket(2); the fd is owned at once.
            let fd = unsafe {
                libc::socket(
                    libc::AF_PACKET,
                    libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                    i32::from((libc::ETH_P_ALL as u16).to_be()),
                )
            };
            assert!(fd >= 0, "packet socket: {}", std::io::Error::last_os_error());
            // SAFETY: fd is a fresh socket we own.
            let fd = unsafe { OwnedFd::from_raw_fd(fd) };
            // SAFETY: sockaddr_ll is plain data; all zeroes is valid.
            let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
            sll.sll_family = libc::AF_PACKET as u16;
            sll.sll_protocol = (libc::ETH_P_ALL as u16).to_be();
            // SAFETY: the name is a valid NUL-terminated string.
            sll.sll_ifindex = unsafe { libc::if_nametoindex(c"peer0".as_ptr()) } as i32;
            assert!(sll.sll_ifindex > 0);
            // SAFETY: binds our socket to a sockaddr_ll of the stated size.
            let rc = unsafe {
                libc::bind(
                    fd.as_raw_fd(),
                    &sll as *const libc::sockaddr_ll as *const libc::sockaddr,
                    std::mem::size_of::<libc::sockaddr_ll>() as u32,
                )
            };
            assert_eq!(rc, 0, "bind peer0: {}", std::io::Error::last_os_error());
            fd
        })
    }

    /// Opens tap `name` as the jailed VMM does (vmm/src/devices/virtio/net/tap.rs), as
    /// `uid`/`gid` (no capabilities), with a 12-byte vnet header; the error when the kernel
    /// refuses the attach.
    fn open_tap_as(&self, name: &str, uid: u32, gid: u32) -> std::io::Result<OwnedFd> {
        let name = name.to_string();
        self.in_netns(&self.pod, move || {
            let tun = std::fs::OpenOptions::new().read(true).write(true).open("/dev/net/tun")?;
            // Credentials are per thread at the syscall level (libc's wrappers would change
            // every thread of the test process); this thread ends after the attach.
            // SAFETY: raw setgroups/setresgid/setresuid change only this thread's credentials.
            unsafe {
                assert_eq!(libc::syscall(libc::SYS_setgroups, 0, std::ptr::null::<libc::gid_t>()), 0);
                assert_eq!(libc::syscall(libc::SYS_setresgid, gid, gid, gid), 0);
                assert_eq!(libc::syscall(libc::SYS_setresuid, uid, uid, uid), 0);
            }
            // SAFETY: ifreq is plain data; all zeroes is valid.
            let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
            for (o, b) in req.ifr_name.iter_mut().zip(name.bytes()) {
                *o = b as libc::c_char;
            }
            req.ifr_ifru.ifru_flags = (libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR) as libc::c_short;
            // SAFETY: TUNSETIFF reads and writes one ifreq; the fd is open.
            if unsafe { libc::ioctl(tun.as_raw_fd(), libc::TUNSETIFF, &mut req) } < 0 {
                return Err(std::io::Error::last_os_error());
            }
            let len = VNET_HDR_LEN as libc::c_int;
            // SAFETY: TUNSETVNETHDRSZ reads one int through the pointer.
            assert_eq!(unsafe { libc::ioctl(tun.as_raw_fd(), libc::TUNSETVNETHDRSZ, &len) }, 0);
            // The VMM probes offloads, then sets none until the guest negotiates them.
            for offloads in [libc::TUN_F_CSUM | libc::TUN_F_TSO4 | libc::TUN_F_TSO6, 0] {
                // SAFETY: TUNSETOFFLOAD takes its argument by value; the fd is open.
                let rc = unsafe { libc::ioctl(tun.as_raw_fd(), libc::TUNSETOFFLOAD, libc::c_ulong::from(offloads)) };
                assert_eq!(rc, 0, "TUNSETOFFLOAD {offloads:#x}: {}", std::io::Error::last_os_error());
            }
            Ok(OwnedFd::from(tun))
        })
    }
}

impl Drop for TestNet {
    fn drop(&mut self) {
        for ns in [&self.pod, &self.out] {
            if let Ok(o) = Command::new("ip").args(["netns", "del", ns]).output() {
                if !o.status.success() && !String::from_utf8_lossy(&o.stderr).contains("No such file") {
                    eprintln!("warning: could not delete netns {ns}: {}", String::from_utf8_lossy(&o.stderr));
                }
            }
        }
    }
}

// ---- frames --------------------------------------------------------------------------------

fn eth(dst: [u8; 6], src: [u8; 6], ethertype: u16, payload: &[u8]) -> Vec<u8> {
    let mut f = Vec::new();
    f.extend_from_slice(&dst);
    f.extend_from_slice(&src);
    f.extend_from_slice(&ethertype.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

fn ipv4(proto: u8, dst: [u8; 4], l4: &[u8]) -> Vec<u8> {
    let len = (20 + l4.len()) as u16;
    let mut h = vec![0x45, 0];
    h.extend_from_slice(&len.to_be_bytes());
    h.extend_from_slice(&[0, 0, 0x40, 0, 64, proto, 0, 0]);
    h.extend_from_slice(&POD_IP);
    h.extend_from_slice(&dst);
    let sum = !h.chunks(2).fold(0u32, |s, w| {
        let s = s + u32::from(u16::from_be_bytes([w[0], w[1]]));
        (s & 0xffff) + (s >> 16)
    }) as u16;
    h[10..12].copy_from_slice(&sum.to_be_bytes());
    h.extend_from_slice(l4);
    h
}

fn ipv6(next: u8, dst: std::net::Ipv6Addr, l4: &[u8]) -> Vec<u8> {
    let mut h = vec![0x60, 0, 0, 0];
    h.extend_from_slice(&(l4.len() as u16).to_be_bytes());
    h.extend_from_slice(&[next, 64]);
    h.extend_from_slice(&"fd00:99::2".parse::<std::net::Ipv6Addr>().unwrap().octets());
    h.extend_from_slice(&dst.octets());
    h.extend_from_slice(l4);
    h
}

fn udp(dport: u16, payload: &[u8]) -> Vec<u8> {
    let mut u = vec![0x30, 0x39];
    u.extend_from_slice(&dport.to_be_bytes());
    u.extend_from_slice(&((8 + payload.len()) as u16).to_be_bytes());
    u.extend_from_slice(&[0, 0]);
    u.extend_from_slice(payload);
    u
}

/// A TCP SYN to port 80 whose sequence number spells a marker.
fn tcp_syn(marker: [u8; 4]) -> Vec<u8> {
    let mut t = vec![0xd4, 0x31, 0, 80];
    t.extend_from_slice(&marker);
    t.extend_from_slice(&[0, 0, 0, 0, 0x50, 0x02, 0xff, 0xff, 0, 0, 0, 0]);
    t
}

fn from_guest(l3_type: u16, l3: &[u8]) -> Vec<u8> {
    eth(PEER_MAC, POD_MAC, l3_type, l3)
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

/// Writes one frame into the tap, vnet header first (as the VMM does for the guest).
fn write_tap(tap: &OwnedFd, frame: &[u8]) {
    let mut buf = vec![0u8; VNET_HDR_LEN];
    buf.extend_from_slice(frame);
    // SAFETY: writes `buf` (valid for its length) to our fd.
    let n = unsafe { libc::write(tap.as_raw_fd(), buf.as_ptr().cast(), buf.len()) };
    assert_eq!(n, buf.len() as isize, "write tap: {}", std::io::Error::last_os_error());
}

fn poll_in(fd: RawFd, until: Instant) -> bool {
    let left = until.saturating_duration_since(Instant::now()).as_millis() as i32;
    let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    // SAFETY: polls one pollfd we own for at most `left` ms.
    unsafe { libc::poll(&mut p, 1, left) > 0 }
}

/// Frames arriving at `peer0` (not the ones it sends) until one contains `last`, or `WAIT`;
/// then a little longer, so a frame written before `last` cannot slip past unseen.
fn capture_until(sock: &OwnedFd, last: &[u8]) -> Vec<Vec<u8>> {
    let mut frames = Vec::new();
    let mut until = Instant::now() + WAIT;
    let mut seen_last = false;
    while poll_in(sock.as_raw_fd(), until) {
        let mut buf = vec![0u8; 4096];
        // SAFETY: sockaddr_ll is plain data; all zeroes is valid.
        let mut from: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        let mut len = std::mem::size_of::<libc::sockaddr_ll>() as u32;
        // SAFETY: receives into buffers we own, of the stated sizes.
        let n = unsafe {
            libc::recvfrom(
                sock.as_raw_fd(),
                buf.as_mut_ptr().cast(),
                buf.len(),
                libc::MSG_DONTWAIT,
                &mut from as *mut libc::sockaddr_ll as *mut libc::sockaddr,
                &mut len,
            )
        };
        if n <= 0 || from.sll_pkttype == libc::PACKET_OUTGOING {
            continue;
        }
        buf.truncate(n as usize);
        if !seen_last && contains(&buf, last) {
            seen_last = true;
            until = Instant::now() + Duration::from_millis(300);
        }
        frames.push(buf);
    }
    assert!(seen_last, "the control frame {last:?} never came out of peer0 ({} other frames)", frames.len());
    frames
}

/// Sends one frame out of `peer0` (so it arrives at the pod's `eth0`).
fn send_peer(sock: &OwnedFd, frame: &[u8]) {
    // SAFETY: sends `frame` (valid for its length) on our bound packet socket.
    let n = unsafe { libc::send(sock.as_raw_fd(), frame.as_ptr().cast(), frame.len(), 0) };
    assert_eq!(n, frame.len() as isize, "send on peer0: {}", std::io::Error::last_os_error());
}

/// Reads frames from the tap until one contains `needle` (vnet header stripped), or panics.
fn read_tap_until(tap: &OwnedFd, needle: &[u8]) -> Vec<u8> {
    let until = Instant::now() + WAIT;
    while poll_in(tap.as_raw_fd(), until) {
        let mut buf = vec![0u8; 65536];
        // SAFETY: reads into a buffer we own, of the stated size.
        let n = unsafe { libc::read(tap.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        if n > VNET_HDR_LEN as isize && contains(&buf[VNET_HDR_LEN..n as usize], needle) {
            return buf[VNET_HDR_LEN..n as usize].to_vec();
        }
    }
    panic!("no frame with {needle:?} arrived on the tap within {WAIT:?}");
}

fn set_nonblocking(fd: &OwnedFd) {
    // SAFETY: fcntl on our own fd.
    unsafe {
        let flags = libc::fcntl(fd.as_raw_fd(), libc::F_GETFL);
        libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, flags | libc::O_NONBLOCK);
    }
}

// ---- tests ---------------------------------------------------------------------------------

#[tokio::test]
async fn vm_tap_redirects_both_ways_drops_metadata_and_tears_down() {
    if !ready("vm_tap_redirects_both_ways_drops_metadata_and_tears_down") {
        return;
    }
    let net = TestNet::create();
    let vm = net.attach(MetadataAccess::Blocked).await;

    // What the VMM and the agent are given: the CNI interface's MAC, MTU, addresses and routes.
    assert_eq!(vm.nics.len(), 1);
    let nic = &vm.nics[0];
    assert_eq!((nic.tap.as_str(), nic.mac.as_str(), nic.mtu), ("bhtap0", "02:42:0a:63:00:02", 1450));
    assert_eq!(nic.guest.name, "eth0");
    assert_eq!(nic.guest.addresses, vec!["10.99.0.2/24".to_string(), "fd00:99::2/64".to_string()]);
    let routes: Vec<(&str, &str, &str)> =
        vm.routes.iter().map(|r| (r.destination.as_str(), r.gateway.as_str(), r.device.as_str())).collect();
    assert!(routes.contains(&("default", "10.99.0.1", "eth0")), "{routes:?}");
    assert!(routes.contains(&("192.168.77.0/24", "", "eth0")), "{routes:?}");
    assert!(routes.contains(&("default", "fd00:99::1", "eth0")), "{routes:?}");
    assert!(!routes.iter().any(|(d, _, _)| *d == "10.99.0.0/24"), "kernel prefix route copied: {routes:?}");

    // Owned by the VMM's ids: they may attach without CAP_NET_ADMIN, others may not.
    let link = net.ip_pod(&["-d", "link", "show", "bhtap0"]);
    // iproute2 prints the owner by name when it has one (65534 is `nobody` on Debian).
    let owned = [format!("user {VMM_ID} "), "user nobody ".into()].iter().any(|o| link.contains(o.as_str()));
    assert!(link.contains("tun type tap") && link.contains("persist on") && owned, "{link}");
    let err = net.open_tap_as("bhtap0", VMM_ID - 1, VMM_ID - 1).expect_err("a stranger attached to the tap");
    assert_eq!(err.raw_os_error(), Some(libc::EPERM), "{err}");
    let tap = net.open_tap_as("bhtap0", VMM_ID, VMM_ID).expect("the VMM's uid attaches to its tap");
    set_nonblocking(&tap);
    let peer = net.peer_socket();
    // With the VMM attached the tap has carrier; the namespace's own stack still says nothing to
    // the guest: no IPv6 (link-local) address on the tap.
    let v6 = net.ip_pod(&["-6", "addr", "show", "dev", "bhtap0"]);
    assert!(v6.trim().is_empty(), "{v6}");

    // Guest -> pod interface -> out.
    write_tap(&tap, &from_guest(0x0800, &ipv4(17, PEER_IP, &udp(9, b"bh-guest-out"))));
    capture_until(&peer, b"bh-guest-out");

    // Out -> pod interface -> guest.
    send_peer(&peer, &eth(POD_MAC, PEER_MAC, 0x0800, &ipv4(17, POD_IP, &udp(9, b"bh-guest-in"))));
    let frame = read_tap_until(&tap, b"bh-guest-in");
    assert_eq!(&frame[..6], &POD_MAC, "the frame reaches the guest unchanged");

    // Frames to the metadata endpoint never leave, however they are dressed.
    let md6: std::net::Ipv6Addr = METADATA_V6.parse().unwrap();
    let md_v4_udp = from_guest(0x0800, &ipv4(17, METADATA_V4, &udp(80, b"bh-md-v4-udp")));
    let md_v4_tcp = from_guest(0x0800, &ipv4(6, METADATA_V4, &tcp_syn(*b"bhT4")));
    let md_v6_udp = from_guest(0x86dd, &ipv6(17, md6, &udp(80, b"bh-md-v6-udp")));
    let md_v6_tcp = from_guest(0x86dd, &ipv6(6, md6, &tcp_syn(*b"bhT6")));
    let mut vlan = vec![0x00, 0x07, 0x08, 0x00];
    vlan.extend_from_slice(&ipv4(17, METADATA_V4, &udp(80, b"bh-md-vlan")));
    let md_vlan = from_guest(0x8100, &vlan);
    let mut qinq = vec![0x00, 0x07, 0x81, 0x00, 0x00, 0x08, 0x08, 0x00];
    qinq.extend_from_slice(&ipv4(17, METADATA_V4, &udp(80, b"bh-md-qinq")));
    let md_qinq = from_guest(0x88a8, &qinq);
    for f in [&md_v4_udp, &md_v4_tcp, &md_v6_udp, &md_v6_tcp, &md_vlan, &md_qinq] {
        write_tap(&tap, f);
    }
    write_tap(&tap, &from_guest(0x0800, &ipv4(17, PEER_IP, &udp(9, b"bh-after-md"))));
    let out = capture_until(&peer, b"bh-after-md");
    for marker in [&b"bh-md-v4-udp"[..], b"bhT4", b"bh-md-v6-udp", b"bhT6", b"bh-md-vlan", b"bh-md-qinq"] {
        assert!(!out.iter().any(|f| contains(f, marker)), "{} came out", String::from_utf8_lossy(marker));
    }
    drop(tap);

    // Teardown from the record alone (as `delete` after a crash), twice: nothing of ours is left.
    teardown(&net.record()).await.expect("teardown");
    teardown(&net.record()).await.expect("second teardown");
    assert!(!net.record().exists());
    let links = net.ip_pod(&["-d", "link", "show"]);
    assert!(!links.contains("bhtap") && !links.contains("tun type"), "{links}");
    let qdiscs = net.tc_pod(&["qdisc", "show", "dev", "eth0"]);
    assert!(!qdiscs.contains("clsact") && !qdiscs.contains("ingress"), "{qdiscs}");
    let filters = net.tc_pod(&["filter", "show", "dev", "eth0", "ingress"]);
    assert!(filters.trim().is_empty(), "{filters}");
}

#[tokio::test]
async fn vm_tap_passes_metadata_when_allowed() {
    if !ready("vm_tap_passes_metadata_when_allowed") {
        return;
    }
    let net = TestNet::create();
    net.attach(MetadataAccess::Allowed).await;
    let tap = net.open_tap_as("bhtap0", VMM_ID, VMM_ID).expect("attach");
    let peer = net.peer_socket();
    write_tap(&tap, &from_guest(0x0800, &ipv4(17, METADATA_V4, &udp(80, b"bh-md-allowed"))));
    capture_until(&peer, b"bh-md-allowed");
    drop(tap);
    teardown(&net.record()).await.expect("teardown");
    assert!(!net.ip_pod(&["link", "show"]).contains("bhtap"));
}

#[tokio::test]
async fn vm_attach_refuses_a_taken_ingress_and_leaves_nothing() {
    if !ready("vm_attach_refuses_a_taken_ingress_and_leaves_nothing") {
        return;
    }
    let net = TestNet::create();
    net.tc_pod(&["qdisc", "add", "dev", "eth0", "ingress"]);
    let pod = net.netns_path(&net.pod);
    let record = net.record();
    let err = attach_vm(&VmAttach {
        netns: &pod,
        record: &record,
        tap_uid: VMM_ID,
        tap_gid: VMM_ID,
        metadata: MetadataAccess::Blocked,
    })
    .await
    .expect_err("attached over someone else's ingress qdisc");
    assert!(err.to_string().contains("eth0 already has an ingress qdisc"), "{err}");
    assert!(!record.exists());
    assert!(!net.ip_pod(&["link", "show"]).contains("bhtap"));
    // Someone else's qdisc is still there.
    assert!(net.tc_pod(&["qdisc", "show", "dev", "eth0"]).contains("ingress"));
}

#[tokio::test]
async fn namespace_pod_egress_to_metadata_is_dropped() {
    if !ready("namespace_pod_egress_to_metadata_is_dropped") {
        return;
    }
    let net = TestNet::create();
    block_metadata(&net.netns_path(&net.pod), &net.record()).await.expect("block_metadata");
    let peer = net.peer_socket();

    // The workload's own sockets, in the pod namespace: UDP both families and a TCP connect.
    net.in_netns(&net.pod, || {
        let v4 = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
        v4.send_to(b"bh-ns-md-v4", "169.254.169.254:80").unwrap();
        let v6 = std::net::UdpSocket::bind("[::]:0").unwrap();
        v6.send_to(b"bh-ns-md-v6", format!("[{METADATA_V6}]:80")).unwrap();
        let tcp =
            std::net::TcpStream::connect_timeout(&"169.254.169.254:80".parse().unwrap(), Duration::from_millis(300));
        assert!(tcp.is_err(), "connected to the metadata address");
        v4.send_to(b"bh-ns-control", "10.99.0.1:9").unwrap();
    });
    let out = capture_until(&peer, b"bh-ns-control");
    for marker in [&b"bh-ns-md-v4"[..], b"bh-ns-md-v6"] {
        assert!(!out.iter().any(|f| contains(f, marker)), "{} came out", String::from_utf8_lossy(marker));
    }
    let syn_to_metadata = out.iter().any(|f| f.len() > 34 && f[12..14] == [0x08, 0x00] && f[30..34] == METADATA_V4);
    assert!(!syn_to_metadata, "a packet to 169.254.169.254 came out");

    teardown(&net.record()).await.expect("teardown");
    assert!(!net.tc_pod(&["qdisc", "show", "dev", "eth0"]).contains("clsact"));
    assert!(!net.record().exists());
}

#[tokio::test]
async fn teardown_after_the_namespace_is_gone_only_forgets() {
    if !ready("teardown_after_the_namespace_is_gone_only_forgets") {
        return;
    }
    let net = TestNet::create();
    block_metadata(&net.netns_path(&net.pod), &net.record()).await.expect("block_metadata");
    assert!(net.record().exists());
    run("ip", &["netns", "del", &net.pod]);
    teardown(&net.record()).await.expect("teardown of a vanished namespace");
    assert!(!net.record().exists());
}
