//! What a dynamically linked agent needs to execute itself again inside its minimal root
//! (crate::guest_init::minimal_root): its ELF interpreter and the shared libraries it maps, read
//! only, each reachable by the names the dynamic loader looks them up by (on a merged-/usr host
//! `/lib64/ld-linux-x86-64.so.2` and `/lib/x86_64-linux-gnu/libc.so.6` both pass through
//! symbolic links, which are copied as links). A static build (the initramfs's) needs none.
//!
//! Only host reads happen here; the entries are made by `minimal_root::build` through `Syscall`.

use std::collections::BTreeSet;
use std::io::Read;
use std::path::{Component, Path, PathBuf};

use anyhow::Context;

/// One thing to make in the minimal root, at its host path.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum Entry {
    Dir(PathBuf),
    /// A symbolic link with the host's target, as written.
    Symlink {
        link: PathBuf,
        target: PathBuf,
    },
    /// A regular file, bound read-only from the host.
    File(PathBuf),
}

/// Where the loader looks for a library without a path (Debian's multiarch directories, then
/// the others distributions use), besides /etc/ld.so.cache, which the root does not keep.
const SEARCH_DIRS: [&str; 6] =
    ["/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64", "/usr/lib64", "/lib", "/usr/lib"];

/// Most symbolic links followed for one path (the kernel's own limit).
const MAX_LINKS: usize = 40;

/// How much of the binary is read to find its program headers and interpreter.
const ELF_HEAD: u64 = 64 << 10;

/// The interpreter a 64-bit little-endian ELF image names (PT_INTERP), if `head` (the file's
/// start) holds it. `None` for a static binary or anything that is not such an ELF.
pub fn interpreter(head: &[u8]) -> Option<PathBuf> {
    const PT_INTERP: u32 = 3;
    let u16_at = |o: usize| Some(u16::from_le_bytes(head.get(o..o + 2)?.try_into().ok()?));
    let u32_at = |o: usize| Some(u32::from_le_bytes(head.get(o..o + 4)?.try_into().ok()?));
    let u64_at = |o: usize| Some(u64::from_le_bytes(head.get(o..o + 8)?.try_into().ok()?));
    // Magic, ELFCLASS64, ELFDATA2LSB.
    if head.get(..6)? != b"\x7fELF\x02\x01" {
        return None;
    }
    let phoff = usize::try_from(u64_at(0x20)?).ok()?;
    let phentsize = usize::from(u16_at(0x36)?);
    let phnum = usize::from(u16_at(0x38)?);
    for i in 0..phnum {
        let ph = phoff.checked_add(i.checked_mul(phentsize)?)?;
        if u32_at(ph)? != PT_INTERP {
            continue;
        }
        let offset = usize::try_from(u64_at(ph + 8)?).ok()?;
        let size = usize::try_from(u64_at(ph + 32)?).ok()?;
        let bytes = head.get(offset..offset.checked_add(size)?)?;
        let name = bytes.split(|b| *b == 0).next()?;
        return Some(PathBuf::from(std::str::from_utf8(name).ok()?));
    }
    None
}

/// The files a process maps (from its `/proc/<pid>/maps`), but `exe`: for the agent, its loader
/// and libraries, by their real paths.
pub fn mapped_objects(maps: &str, exe: &Path) -> Vec<PathBuf> {
    let mut found = BTreeSet::new();
    for line in maps.lines() {
        // address perms offset dev inode [path]
        let mut fields = line.splitn(6, ' ');
        let inode = fields.nth(4);
        let Some(path) = fields.next().map(str::trim_start) else { continue };
        if inode == Some("0") || !path.starts_with('/') || path.ends_with(" (deleted)") || Path::new(path) == exe {
            continue;
        }
        found.insert(PathBuf::from(path));
    }
    found.into_iter().collect()
}

/// The entries that make `path` (a host path, maybe through symbolic links) resolve in the
/// root as on the host, ending in the file it names; appended to `out` unless already there.
pub fn resolve_into(path: &Path, out: &mut Vec<Entry>) -> anyhow::Result<()> {
    let mut pending = path.to_path_buf();
    for _ in 0..MAX_LINKS {
        match walk(&pending, out)? {
            None => return Ok(()),
            Some(rest) => pending = rest,
        }
    }
    anyhow::bail!("{}: more than {MAX_LINKS} symbolic links", path.display())
}

/// Walks `path` from `/`: directories and the final file become entries; at the first symbolic
/// link, the link becomes an entry and the path to walk next (its target, then the rest) is
/// returned.
fn walk(path: &Path, out: &mut Vec<Entry>) -> anyhow::Result<Option<PathBuf>> {
    let add = |out: &mut Vec<Entry>, e: Entry| {
        if !out.contains(&e) {
            out.push(e);
        }
    };
    let components: Vec<Component> = path.components().collect();
    let mut at = PathBuf::from("/");
    for (i, component) in components.iter().enumerate() {
        let name = match component {
            Component::Normal(name) => name,
            // `..` after real directories only (every link so far was followed): lexical is right.
            Component::ParentDir => {
                at.pop();
                continue;
            }
            _ => continue,
        };
        let next = at.join(name);
        let meta = std::fs::symlink_metadata(&next).with_context(|| format!("stat {}", next.display()))?;
        if meta.file_type().is_symlink() {
            let target = std::fs::read_link(&next).with_context(|| format!("read link {}", next.display()))?;
            let mut rest = at.join(&target);
            rest.extend(&components[i + 1..]);
            add(out, Entry::Symlink { link: next, target });
            return Ok(Some(rest));
        }
        if meta.is_dir() {
            add(out, Entry::Dir(next.clone()));
            at = next;
            continue;
        }
        anyhow::ensure!(
            i + 1 == components.len() && meta.is_file(),
            "{} is neither a directory nor the file {} names",
            next.display(),
            path.display()
        );
        add(out, Entry::File(next));
        return Ok(None);
    }
    anyhow::bail!("{} names a directory, not a file", path.display())
}

/// What the running agent (`exe`, a path in this mount namespace) needs in its minimal root to
/// execute itself again: empty for a static build.
pub fn entries_for(exe: &Path) -> anyhow::Result<Vec<Entry>> {
    let mut head = Vec::new();
    std::fs::File::open(exe)
        .and_then(|f| f.take(ELF_HEAD).read_to_end(&mut head))
        .with_context(|| format!("read {}", exe.display()))?;
    let maps = std::fs::read_to_string("/proc/self/maps").context("read /proc/self/maps")?;
    let objects = mapped_objects(&maps, exe);
    let Some(interp) = interpreter(&head) else {
        anyhow::ensure!(objects.is_empty(), "{} maps {objects:?} but names no ELF interpreter", exe.display());
        return Ok(Vec::new());
    };
    let mut out = Vec::new();
    resolve_into(&interp, &mut out).with_context(|| format!("the ELF interpreter {}", interp.display()))?;
    for real in &objects {
        resolve_into(real, &mut out)?;
        let Some(name) = real.file_name() else { continue };
        // The names the loader finds the library by, where they lead to this very file.
        for dir in SEARCH_DIRS {
            let candidate = Path::new(dir).join(name);
            if candidate != *real && std::fs::canonicalize(&candidate).is_ok_and(|c| c == *real) {
                resolve_into(&candidate, &mut out)?;
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A minimal ELF64 LE head with one PT_LOAD and, if given, a PT_INTERP naming `interp`.
    fn elf(interp: Option<&str>) -> Vec<u8> {
        let mut head = vec![0u8; 0x200];
        head[..6].copy_from_slice(b"\x7fELF\x02\x01");
        head[0x20..0x28].copy_from_slice(&0x40u64.to_le_bytes()); // e_phoff
        head[0x36..0x38].copy_from_slice(&56u16.to_le_bytes()); // e_phentsize
        let phnum: u16 = if interp.is_some() { 2 } else { 1 };
        head[0x38..0x3a].copy_from_slice(&phnum.to_le_bytes());
        head[0x40..0x44].copy_from_slice(&1u32.to_le_bytes()); // PT_LOAD
        if let Some(name) = interp {
            let ph = 0x40 + 56;
            head[ph..ph + 4].copy_from_slice(&3u32.to_le_bytes());
            head[ph + 8..ph + 16].copy_from_slice(&0x100u64.to_le_bytes());
            head[ph + 32..ph + 40].copy_from_slice(&(name.len() as u64 + 1).to_le_bytes());
            head[0x100..0x100 + name.len()].copy_from_slice(name.as_bytes());
        }
        head
    }

    #[test]
    fn the_interpreter_is_read_from_the_program_headers() {
        assert_eq!(interpreter(&elf(Some("/lib64/ld-linux-x86-64.so.2"))), Some("/lib64/ld-linux-x86-64.so.2".into()));
        assert_eq!(interpreter(&elf(None)), None, "a static binary");
        assert_eq!(interpreter(b"#!/bin/sh\n"), None);
        // Truncated or lying headers are no interpreter, never a panic.
        let mut lying = elf(Some("/x"));
        lying[0x40 + 56 + 8..0x40 + 56 + 16].copy_from_slice(&u64::MAX.to_le_bytes());
        assert_eq!(interpreter(&lying), None);
        assert_eq!(interpreter(&elf(Some("/x"))[..0x60]), None);
        // This test's own binary: whatever it is linked like, parsing it does not fail.
        let me = std::fs::read("/proc/self/exe").unwrap();
        let _ = interpreter(&me);
    }

    #[test]
    fn mapped_files_are_the_loader_and_libraries() {
        let maps = "\
55d0c0000000-55d0c0100000 r--p 00000000 fe:00 1234 /opt/bin/bulkhead-agent
7f0000000000-7f0000028000 r--p 00000000 fe:00 77 /usr/lib/x86_64-linux-gnu/libc.so.6
7f0000028000-7f0000100000 r-xp 00028000 fe:00 77 /usr/lib/x86_64-linux-gnu/libc.so.6
7f0000200000-7f0000201000 rw-s 00000000 00:01 99 /memfd:buf (deleted)
7f0000300000-7f0000301000 rw-p 00000000 00:00 0 
7f0000400000-7f0000428000 r--p 00000000 fe:00 80 /usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2
7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0                          [stack]";
        assert_eq!(
            mapped_objects(maps, Path::new("/opt/bin/bulkhead-agent")),
            [
                PathBuf::from("/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2"),
                PathBuf::from("/usr/lib/x86_64-linux-gnu/libc.so.6"),
            ]
        );
    }

    #[test]
    fn links_on_the_way_are_copied_as_links() {
        // A merged-/usr layout: /lib -> usr/lib, /lib64/ld.so -> /lib/x86/ld.so.
        let host = tempfile::tempdir().unwrap();
        let h = host.path();
        std::fs::create_dir_all(h.join("usr/lib/x86")).unwrap();
        std::fs::write(h.join("usr/lib/x86/ld.so"), b"elf").unwrap();
        std::os::unix::fs::symlink("usr/lib", h.join("lib")).unwrap();
        std::fs::create_dir_all(h.join("lib64")).unwrap();
        std::os::unix::fs::symlink(h.join("lib/x86/ld.so"), h.join("lib64/ld.so")).unwrap();

        let mut out = Vec::new();
        resolve_into(&h.join("lib64/ld.so"), &mut out).unwrap();
        assert!(out.contains(&Entry::Dir(h.join("lib64"))));
        assert!(out.contains(&Entry::Symlink { link: h.join("lib64/ld.so"), target: h.join("lib/x86/ld.so") }));
        assert!(out.contains(&Entry::Symlink { link: h.join("lib"), target: "usr/lib".into() }));
        assert_eq!(out.last(), Some(&Entry::File(h.join("usr/lib/x86/ld.so"))));
        // Asked again (another name of the same file), nothing is repeated.
        let before = out.len();
        resolve_into(&h.join("usr/lib/x86/ld.so"), &mut out).unwrap();
        assert_eq!(out.len(), before);

        // A loop of links ends in an error, as does a path that names a directory.
        std::os::unix::fs::symlink(h.join("b"), h.join("a")).unwrap();
        std::os::unix::fs::symlink(h.join("a"), h.join("b")).unwrap();
        assert!(resolve_into(&h.join("a"), &mut Vec::new()).is_err());
        assert!(resolve_into(&h.join("usr/lib"), &mut Vec::new()).is_err());
    }

    #[test]
    fn the_running_test_binary_can_be_planned() {
        let exe = std::fs::read_link("/proc/self/exe").unwrap();
        let entries = entries_for(&exe).unwrap();
        // Every file is a real file on this host, and every link's path exists.
        for e in &entries {
            match e {
                Entry::File(p) => assert!(std::fs::symlink_metadata(p).unwrap().is_file(), "{}", p.display()),
                Entry::Symlink { link, .. } => assert!(std::fs::symlink_metadata(link).unwrap().is_symlink()),
                Entry::Dir(p) => assert!(p.is_dir()),
            }
        }
    }
}
