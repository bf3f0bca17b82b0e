//! Guest mode: how many of the VM's CPUs are online. The vm backend boots a pod's VM with the
//! vCPUs it may grow into (`vm.max_vcpus`) and keeps only the pod's share online; a resize brings
//! more online or takes them off again through sysfs (CPU hotplug), so the pod's processes see
//! the CPUs it has (`nproc`, runtimes that size thread pools from it). cpu0 always stays.

use std::fs;
use std::path::{Path, PathBuf};

use crate::error::{AgentError, Result};

/// Where the kernel lists its CPUs.
pub const SYSFS_CPUS: &str = "/sys/devices/system/cpu";

/// A kernel CPU list ("0-3,5"), as in `present` and `online`; `None` if malformed.
fn parse_list(text: &str) -> Option<Vec<u32>> {
    let mut cpus = Vec::new();
    for part in text.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b) = (a.parse::<u32>().ok()?, b.parse::<u32>().ok()?);
                // A guest has at most a few dozen CPUs; a longer range is not a list we wrote.
                if b < a || b - a > 4096 {
                    return None;
                }
                cpus.extend(a..=b);
            }
            None => cpus.push(part.parse().ok()?),
        }
    }
    Some(cpus)
}

fn read_list(root: &Path, name: &str) -> Result<Vec<u32>> {
    let path = root.join(name);
    let text = fs::read_to_string(&path).map_err(|e| AgentError::internal(&format!("read {}", path.display()), e))?;
    parse_list(&text).ok_or_else(|| AgentError::Internal(format!("{}: not a CPU list: {text:?}", path.display())))
}

/// Brings CPUs 0..`count` (of those present, in order) online and the others offline, under
/// `root` ([`SYSFS_CPUS`]); returns how many are online afterwards.
pub fn set(root: &Path, count: u32) -> Result<u32> {
    let present = read_list(root, "present")?;
    let have = u32::try_from(present.len()).unwrap_or(u32::MAX);
    if count == 0 || count > have {
        return Err(AgentError::InvalidArgument(format!("{count} CPUs online: the guest has {have} (at least 1)")));
    }
    let online = read_list(root, "online")?;
    // Up first, then down: the guest never has fewer than it keeps while it moves.
    let (up, down): (Vec<_>, Vec<_>) = present.iter().enumerate().partition(|(k, _)| (*k as u32) < count);
    for (_, cpu) in up.iter().filter(|(_, c)| !online.contains(c)) {
        write_online(root, **cpu, true)?;
    }
    for (_, cpu) in down.iter().filter(|(_, c)| online.contains(c) && **c != 0) {
        write_online(root, **cpu, false)?;
    }
    let now = read_list(root, "online")?;
    Ok(u32::try_from(now.len()).unwrap_or(u32::MAX))
}

fn write_online(root: &Path, cpu: u32, up: bool) -> Result<()> {
    let path: PathBuf = root.join(format!("cpu{cpu}/online"));
    fs::write(&path, if up { "1" } else { "0" })
        .map_err(|e| AgentError::internal(&format!("bring cpu{cpu} {}", if up { "online" } else { "offline" }), e))?;
    tracing::info!(cpu, online = up, "guest CPU");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sysfs look-alike: `present`, `online`, and a `cpuN/online` file per CPU but cpu0. Files
    /// do not update `online` as the kernel does, so the test writes it back from the cpuN files.
    fn fake(present: &str, online: &str) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join("present"), present).unwrap();
        fs::write(dir.path().join("online"), online).unwrap();
        let on = parse_list(online).unwrap();
        for cpu in parse_list(present).unwrap().into_iter().filter(|c| *c != 0) {
            fs::create_dir(dir.path().join(format!("cpu{cpu}"))).unwrap();
            fs::write(dir.path().join(format!("cpu{cpu}/online")), if on.contains(&cpu) { "1" } else { "0" }).unwrap();
        }
        dir
    }

    fn states(dir: &Path, cpus: u32) -> Vec<String> {
        (1..cpus).map(|c| fs::read_to_string(dir.join(format!("cpu{c}/online"))).unwrap()).collect()
    }

    #[test]
    fn lists_are_read_as_the_kernel_writes_them() {
        assert_eq!(parse_list("0-3,5\n"), Some(vec![0, 1, 2, 3, 5]));
        assert_eq!(parse_list("0"), Some(vec![0]));
        for bad in ["0-", "a", "3-1", "0-99999999", "1,,x"] {
            assert_eq!(parse_list(bad), None, "{bad}");
        }
    }

    #[test]
    fn cpus_come_online_and_go_offline_in_order_and_cpu0_stays() {
        let dir = fake("0-3", "0");
        set(dir.path(), 3).unwrap();
        assert_eq!(states(dir.path(), 4), ["1", "1", "0"]);
        let dir = fake("0-3", "0-3");
        set(dir.path(), 1).unwrap();
        assert_eq!(states(dir.path(), 4), ["0", "0", "0"]);
    }

    #[test]
    fn a_count_the_guest_cannot_have_is_refused() {
        let dir = fake("0-1", "0-1");
        for count in [0, 3] {
            let err = set(dir.path(), count).unwrap_err().to_string();
            assert!(err.contains("the guest has 2"), "{err}");
        }
        assert_eq!(states(dir.path(), 2), ["1"], "nothing changed");
        let garbled = fake("0-1", "0-1");
        fs::write(garbled.path().join("online"), "zero").unwrap();
        assert!(set(garbled.path(), 1).unwrap_err().to_string().contains("not a CPU list"));
    }
}
