//! The pod's tap devices. A tap is made through /dev/net/tun (tun devices cannot be created
//! over rtnetlink), persistent and owned by the jailed VMM's uid/gid, so that the VMM, without
//! CAP_NET_ADMIN, may attach to it (TUNSETIFF with IFF_TAP | IFF_NO_PI | IFF_VNET_HDR).
//! Must run on a thread inside the pod's network namespace: the device is made in the
//! namespace of the thread that opens /dev/net/tun.

use std::fs::OpenOptions;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;

use super::error::NetworkError;

/// Name of the tap for the pod interface at position `i` (a name a CNI plugin does not pick).
pub fn name(i: usize) -> String {
    format!("bhtap{i}")
}

/// Creates the persistent tap `name`, owned by `uid`/`gid`. Fails (EBUSY) when any device of
/// that name exists: an existing one is never adopted.
pub fn create_persistent(name: &str, uid: u32, gid: u32) -> Result<(), NetworkError> {
    // Right after the failed ioctl: errno is still its.
    let err = |what: &'static str| NetworkError::Tap {
        name: name.to_string(),
        what,
        source: std::io::Error::last_os_error(),
    };
    let ifr_name = ifr_name(name)?;
    let tun = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC)
        .open("/dev/net/tun")
        .map_err(|source| NetworkError::Tap { name: name.to_string(), what: "open /dev/net/tun", source })?;
    // SAFETY: ifreq is plain data (a name and a union of integers); all zeroes is valid.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    req.ifr_name = ifr_name;
    // The VMM attaches with the same flags; IFF_TUN_EXCL refuses a name already taken.
    req.ifr_ifru.ifru_flags =
        (libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR | libc::IFF_TUN_EXCL) as libc::c_short;
    // SAFETY: TUNSETIFF reads and writes one ifreq, which `req` is; the fd is ours and open.
    if unsafe { libc::ioctl(tun.as_raw_fd(), libc::TUNSETIFF, &mut req) } < 0 {
        return Err(err("TUNSETIFF (create)"));
    }
    // Until TUNSETPERSIST succeeds the device goes away with the fd, so a failure below leaves nothing.
    // SAFETY: TUNSETOWNER/TUNSETGROUP/TUNSETPERSIST take their argument by value; the fd is ours.
    if unsafe { libc::ioctl(tun.as_raw_fd(), libc::TUNSETOWNER, libc::c_ulong::from(uid)) } < 0 {
        return Err(err("TUNSETOWNER"));
    }
    // SAFETY: as above.
    if unsafe { libc::ioctl(tun.as_raw_fd(), libc::TUNSETGROUP, libc::c_ulong::from(gid)) } < 0 {
        return Err(err("TUNSETGROUP"));
    }
    // SAFETY: as above.
    if unsafe { libc::ioctl(tun.as_raw_fd(), libc::TUNSETPERSIST, 1 as libc::c_ulong) } < 0 {
        return Err(err("TUNSETPERSIST"));
    }
    Ok(())
}

/// Turns IPv6 off on the tap (best effort): the pod namespace's own stack has nothing to say
/// to the guest, so no router solicitation or DAD of the tap's link-local address reaches it.
pub fn disable_ipv6(name: &str) {
    let path = format!("/proc/sys/net/ipv6/conf/{name}/disable_ipv6");
    if let Err(e) = std::fs::write(&path, b"1") {
        // A kernel without IPv6 has no such file.
        tracing::debug!(tap = name, "{path}: {e}");
    }
}

/// `name` as a NUL-padded `ifr_name`, once it passed the one rule for interface names (the
/// VMM checks the same rule before it attaches).
fn ifr_name(name: &str) -> Result<[libc::c_char; libc::IFNAMSIZ], NetworkError> {
    bulkhead_vmm_api::ifname::check_ifname(name)
        .map_err(|e| NetworkError::Unsupported(format!("{name:?} is not a valid interface name: it {e}")))?;
    let bytes = name.as_bytes();
    let mut out = [0 as libc::c_char; libc::IFNAMSIZ];
    for (o, &b) in out.iter_mut().zip(bytes) {
        *o = b as libc::c_char;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tap_names_fit_ifnamsiz() {
        assert_eq!(name(0), "bhtap0");
        assert!(ifr_name(&name(9999)).is_ok());
        for bad in ["", "a/b", "sixteen-chars-xx"] {
            assert!(ifr_name(bad).is_err(), "{bad:?}");
        }
    }
}
