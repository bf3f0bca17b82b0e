//! Dropping root for good: no supplementary groups, the jail's gid and uid (real, effective and
//! saved), no capability in any set, no_new_privs, and a check that all of it took.

use nix::unistd::{getgroups, getresgid, getresuid, setgroups, setresgid, setresuid, Gid, Uid};

use super::error::{sys, JailError};

/// `_LINUX_CAPABILITY_VERSION_3`: two 32-bit words per set.
const CAP_VERSION_3: u32 = 0x2008_0522;

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

fn capget() -> std::io::Result<[CapData; 2]> {
    let mut header = CapHeader { version: CAP_VERSION_3, pid: 0 };
    let mut data = [CapData::default(); 2];
    // SAFETY: header and data are valid, correctly laid out for version 3 (two data elements).
    let rc = unsafe { libc::syscall(libc::SYS_capget, &mut header, data.as_mut_ptr()) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(data)
}

fn capset(data: &[CapData; 2]) -> std::io::Result<()> {
    let mut header = CapHeader { version: CAP_VERSION_3, pid: 0 };
    // SAFETY: as in capget; the kernel only reads `data`.
    let rc = unsafe { libc::syscall(libc::SYS_capset, &mut header, data.as_ptr()) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// prctl with integer arguments; Ok(return value).
fn prctl(option: libc::c_int, arg2: libc::c_ulong, arg3: libc::c_ulong) -> std::io::Result<libc::c_int> {
    // SAFETY: every option used here takes integer arguments only.
    let rc = unsafe { libc::prctl(option, arg2, arg3, 0 as libc::c_ulong, 0 as libc::c_ulong) };
    if rc < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(rc)
}

/// Capability numbers this kernel knows (PR_CAPBSET_READ fails past the last one).
fn known_caps() -> impl Iterator<Item = libc::c_ulong> {
    (0..64).take_while(|cap| prctl(libc::PR_CAPBSET_READ, *cap, 0).is_ok())
}

pub fn drop_to(uid: u32, gid: u32) -> Result<(), JailError> {
    // While still root: empty the bounding, inheritable and ambient sets, which a uid change
    // alone would leave in place.
    for cap in known_caps() {
        prctl(libc::PR_CAPBSET_DROP, cap, 0).map_err(sys(format!("drop capability {cap} from the bounding set")))?;
    }
    let mut caps = capget().map_err(sys("capget"))?;
    for c in &mut caps {
        c.inheritable = 0;
    }
    capset(&caps).map_err(sys("clear the inheritable capabilities"))?;
    prctl(libc::PR_CAP_AMBIENT, libc::PR_CAP_AMBIENT_CLEAR_ALL as libc::c_ulong, 0)
        .map_err(sys("clear the ambient capabilities"))?;

    let (u, g) = (Uid::from_raw(uid), Gid::from_raw(gid));
    setgroups(&[]).map_err(sys("setgroups([])"))?;
    setresgid(g, g, g).map_err(sys(format!("setresgid({gid})")))?;
    // Leaving uid 0 clears the effective and permitted sets.
    setresuid(u, u, u).map_err(sys(format!("setresuid({uid})")))?;
    nix::sys::prctl::set_no_new_privs().map_err(sys("PR_SET_NO_NEW_PRIVS"))?;
    verify(u, g)
}

/// Refuses to go on unless the drop is complete.
fn verify(uid: Uid, gid: Gid) -> Result<(), JailError> {
    let fail = |what: String| Err(JailError::NotDropped(what));
    let r = getresuid().map_err(sys("getresuid"))?;
    let g = getresgid().map_err(sys("getresgid"))?;
    if [r.real, r.effective, r.saved] != [uid; 3] || [g.real, g.effective, g.saved] != [gid; 3] {
        return fail(format!("ids are {r:?} {g:?}"));
    }
    if !getgroups().map_err(sys("getgroups"))?.is_empty() {
        return fail("supplementary groups remain".into());
    }
    if capget().map_err(sys("capget"))?.iter().any(|c| c.effective | c.permitted | c.inheritable != 0) {
        return fail("a capability remains in the effective, permitted or inheritable set".into());
    }
    for cap in known_caps() {
        let bounding = prctl(libc::PR_CAPBSET_READ, cap, 0).map_err(sys("PR_CAPBSET_READ"))?;
        let ambient = prctl(libc::PR_CAP_AMBIENT, libc::PR_CAP_AMBIENT_IS_SET as libc::c_ulong, cap)
            .map_err(sys("PR_CAP_AMBIENT_IS_SET"))?;
        if bounding != 0 || ambient != 0 {
            return fail(format!("capability {cap} remains in the bounding or ambient set"));
        }
    }
    if !nix::sys::prctl::get_no_new_privs().map_err(sys("PR_GET_NO_NEW_PRIVS"))? {
        return fail("no_new_privs is not set".into());
    }
    Ok(())
}
