//! What a process costs the host in memory, read from `/proc/<pid>/smaps_rollup`: RSS (every
//! resident page in full), PSS (shared pages split between the processes mapping them) and USS
//! (pages only this process maps); and from `/proc/<pid>/status` the kernel memory PSS does not
//! see that is the process's own: its page tables and its threads' kernel stacks. Summed PSS over a set of processes is what the set occupies;
//! the growth of that sum when one more pod starts is the pod's marginal cost. Also finds a pod's
//! processes by their command lines and parents.

use std::ops::{Add, Sub};

/// Memory figures of a process (or a sum of them), KiB.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Mem {
    pub rss: u64,
    pub pss: u64,
    /// Private_Clean + Private_Dirty.
    pub uss: u64,
    pub pss_anon: u64,
    pub pss_file: u64,
    pub pss_shmem: u64,
    /// Page tables (VmPTE) and kernel stacks (`KERNEL_STACK_KIB` per thread): not in PSS.
    pub kernel: u64,
}

/// An x86-64 thread's kernel stack (THREAD_SIZE), KiB.
pub const KERNEL_STACK_KIB: u64 = 16;

/// Page tables plus kernel stacks (KiB) from the text of `/proc/<pid>/status`.
pub fn kernel_kib(status: &str) -> Option<u64> {
    let field = |name: &str| -> Option<u64> {
        status.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))?.split_whitespace().next()?.parse().ok()
    };
    Some(field("VmPTE")? + KERNEL_STACK_KIB * field("Threads")?)
}

impl Mem {
    /// Parses the text of `smaps_rollup`; None when a field is missing.
    pub fn parse(text: &str) -> Option<Self> {
        let field = |name: &str| -> Option<u64> {
            let line = text.lines().find(|l| l.starts_with(name) && l[name.len()..].starts_with(':'))?;
            line.split_whitespace().nth(1)?.parse().ok()
        };
        Some(Self {
            rss: field("Rss")?,
            pss: field("Pss")?,
            uss: field("Private_Clean")? + field("Private_Dirty")?,
            // Older kernels have no split; the sum is still right.
            pss_anon: field("Pss_Anon").unwrap_or(0),
            pss_file: field("Pss_File").unwrap_or(0),
            pss_shmem: field("Pss_Shmem").unwrap_or(0),
            kernel: 0,
        })
    }

    /// The figures of a live process; None once it is gone (or for a kernel thread).
    pub fn of(pid: u32) -> Option<Self> {
        let mut m = Self::parse(&std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).ok()?)?;
        m.kernel = kernel_kib(&std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?)?;
        Some(m)
    }

    pub fn sum<'a>(all: impl IntoIterator<Item = &'a Mem>) -> Mem {
        all.into_iter().fold(Mem::default(), |a, b| a + *b)
    }
}

impl Add for Mem {
    type Output = Mem;
    fn add(self, o: Mem) -> Mem {
        Mem {
            rss: self.rss + o.rss,
            pss: self.pss + o.pss,
            uss: self.uss + o.uss,
            pss_anon: self.pss_anon + o.pss_anon,
            pss_file: self.pss_file + o.pss_file,
            pss_shmem: self.pss_shmem + o.pss_shmem,
            kernel: self.kernel + o.kernel,
        }
    }
}

/// Signed difference of PSS, USS, RSS and kernel memory (KiB): a later sum minus an earlier one.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemDelta {
    pub rss: i64,
    pub pss: i64,
    pub uss: i64,
    pub kernel: i64,
}

impl Sub for Mem {
    type Output = MemDelta;
    fn sub(self, o: Mem) -> MemDelta {
        let d = |a: u64, b: u64| a as i64 - b as i64;
        MemDelta {
            rss: d(self.rss, o.rss),
            pss: d(self.pss, o.pss),
            uss: d(self.uss, o.uss),
            kernel: d(self.kernel, o.kernel),
        }
    }
}

/// A host process: pid, parent, executable's file name and command line (NULs as spaces).
#[derive(Debug, Clone)]
pub struct Proc {
    pub pid: u32,
    pub ppid: u32,
    pub exe: String,
    pub cmdline: String,
}

/// The parent pid from the text of `/proc/<pid>/stat` (the field after the `)` of the name).
pub fn parse_ppid(stat: &str) -> Option<u32> {
    stat.rsplit_once(')')?.1.split_whitespace().nth(1)?.parse().ok()
}

/// Every process on the host (this one's own excepted).
pub fn processes() -> Vec<Proc> {
    let mut found = Vec::new();
    let Ok(entries) = std::fs::read_dir("/proc") else { return found };
    for entry in entries.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
        if pid == std::process::id() {
            continue;
        }
        let path = entry.path();
        let (Ok(stat), Ok(raw)) = (std::fs::read_to_string(path.join("stat")), std::fs::read(path.join("cmdline")))
        else {
            continue;
        };
        let Some(ppid) = parse_ppid(&stat) else { continue };
        let exe = std::fs::read_link(path.join("exe"))
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_string_lossy().trim_end_matches(" (deleted)").to_string()))
            .unwrap_or_default();
        found.push(Proc { pid, ppid, exe, cmdline: String::from_utf8_lossy(&raw).replace('\0', " ") });
    }
    found
}

/// Of `procs` whose command line contains `needle` and whose executable is `exe`: the one whose
/// parent is not among them (the first process) and its children among them.
pub fn parent_and_children(procs: &[Proc], exe: &str, needle: &str) -> (Option<u32>, Vec<u32>) {
    let matching: Vec<&Proc> = procs.iter().filter(|p| p.exe == exe && p.cmdline.contains(needle)).collect();
    let is_matching = |pid: u32| matching.iter().any(|p| p.pid == pid);
    let parent = matching.iter().find(|p| !is_matching(p.ppid)).map(|p| p.pid);
    let children = matching.iter().filter(|p| Some(p.ppid) == parent).map(|p| p.pid).collect();
    (parent, children)
}

/// The children of `parent` whose executable is `exe`.
pub fn children_named(procs: &[Proc], parent: u32, exe: &str) -> Vec<u32> {
    procs.iter().filter(|p| p.ppid == parent && p.exe == exe).map(|p| p.pid).collect()
}

/// KiB as MiB.
pub fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

/// Signed KiB as MiB.
pub fn mib_i(kib: i64) -> f64 {
    kib as f64 / 1024.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smaps_rollup_gives_rss_pss_and_uss() {
        let text =
            "55d0-7ffd ---p 00000000 00:00 0  [rollup]\nRss:                8200 kB\nPss:                3100 kB\n\
                    Pss_Dirty:          2000 kB\nPss_Anon:           1900 kB\nPss_File:           1100 kB\n\
                    Pss_Shmem:           100 kB\nShared_Clean:       5000 kB\nShared_Dirty:         0 kB\n\
                    Private_Clean:       300 kB\nPrivate_Dirty:      1800 kB\n";
        let m = Mem::parse(text).unwrap();
        assert_eq!((m.rss, m.pss, m.uss), (8200, 3100, 2100));
        assert_eq!((m.pss_anon, m.pss_file, m.pss_shmem), (1900, 1100, 100));
        assert_eq!(Mem::parse("Rss: 1 kB\n"), None);
        let m = Mem { kernel: 100, ..m };
        let two = Mem::sum(&[m, m]);
        assert_eq!(two - m, MemDelta { rss: 8200, pss: 3100, uss: 2100, kernel: 100 });
        assert_eq!(kernel_kib("Name:\tx\nVmPTE:\t      52 kB\nThreads:\t3\n"), Some(52 + 3 * KERNEL_STACK_KIB));
        assert_eq!(kernel_kib("Name:\tx\n"), None);
    }

    #[test]
    fn this_process_has_figures_and_a_parent() {
        let me = Mem::of(std::process::id()).unwrap();
        assert!(me.rss >= me.pss && me.pss >= me.uss && me.uss > 0, "{me:?}");
        assert!(me.kernel >= KERNEL_STACK_KIB, "{me:?}");
        let stat = std::fs::read_to_string("/proc/self/stat").unwrap();
        assert_eq!(parse_ppid(&stat), Some(std::os::unix::process::parent_id()));
        assert_eq!(parse_ppid("12 (a) b) S 7 12"), Some(7), "a name with a parenthesis");
    }

    #[test]
    fn the_first_process_of_a_group_is_the_one_without_a_matching_parent() {
        let p = |pid, ppid, exe: &str, cmdline: &str| Proc { pid, ppid, exe: exe.into(), cmdline: cmdline.into() };
        let procs = [
            p(10, 1, "shim", "shim -id a"),
            p(11, 10, "vmm", "vmm --jail /s/a/jail.json"),
            p(12, 11, "vmm", "vmm --jail /s/a/jail.json"),
            p(13, 1, "vmm", "vmm --jail /s/b/jail.json"),
        ];
        assert_eq!(parent_and_children(&procs, "vmm", "/s/a/"), (Some(11), vec![12]));
        assert_eq!(parent_and_children(&procs, "vmm", "/s/c/"), (None, vec![]));
        assert_eq!(children_named(&procs, 10, "vmm"), vec![11]);
    }
}
