//! Text-level edits of containerd's top-level `imports` array.
//!
//! The user's file is never re-serialised: we splice one string into the array (or add one line), then parse both
//! versions and check that the only difference is our entry. Anything else is refused, not written.

use std::path::{Component, Path, PathBuf};

/// Top-level `imports` of a parsed config.
pub fn list(doc: &toml::Table) -> Vec<String> {
    doc.get("imports")
        .and_then(|v| v.as_array())
        .map(|a| a.iter().filter_map(|v| v.as_str().map(str::to_string)).collect())
        .unwrap_or_default()
}

/// containerd resolves relative imports against the config file's directory.
pub fn resolve(entry: &str, config_dir: &Path) -> PathBuf {
    let p = Path::new(entry);
    let joined = if p.is_absolute() { p.to_path_buf() } else { config_dir.join(p) };
    clean(&joined)
}

fn clean(p: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in p.components() {
        match c {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            other => out.push(other.as_os_str()),
        }
    }
    out
}

pub fn is_glob(entry: &str) -> bool {
    entry.contains(['*', '?', '['])
}

/// Does import `entry` load `target` (both as containerd sees them)?
pub fn covers(entry: &str, config_dir: &Path, target: &Path) -> bool {
    let pattern = resolve(entry, config_dir);
    if !is_glob(entry) {
        return pattern == target;
    }
    let pc: Vec<_> = pattern.components().collect();
    let tc: Vec<_> = target.components().collect();
    pc.len() == tc.len()
        && pc.iter().zip(&tc).all(|(p, t)| {
            fnmatch(p.as_os_str().to_string_lossy().as_bytes(), t.as_os_str().to_string_lossy().as_bytes())
        })
}

/// `*` and `?` within one path component (what Go's filepath.Match does, minus `[...]` classes, which we
/// treat literally: at worst we add an explicit import of a file a glob already loads, which is harmless).
pub fn fnmatch(pat: &[u8], s: &[u8]) -> bool {
    match (pat.first(), s.first()) {
        (None, None) => true,
        (Some(b'*'), _) => fnmatch(&pat[1..], s) || (!s.is_empty() && fnmatch(pat, &s[1..])),
        (Some(b'?'), Some(_)) => fnmatch(&pat[1..], &s[1..]),
        (Some(a), Some(b)) if a == b => fnmatch(&pat[1..], &s[1..]),
        _ => false,
    }
}

/// Byte span of the top-level `imports = [ ... ]` array: (index of '[', index of matching ']').
fn array_span(text: &str) -> Option<(usize, usize)> {
    let mut offset = 0;
    for line in text.split_inclusive('\n') {
        let t = line.trim_start();
        if t.starts_with('[') {
            return None; // first table header: top-level keys end here
        }
        if let Some(rest) = t.strip_prefix("imports") {
            let rest_trim = rest.trim_start();
            if let Some(after_eq) = rest_trim.strip_prefix('=') {
                let open_rel = after_eq.find('[')?;
                let open = offset + (line.len() - after_eq.len()) + open_rel;
                return matching_bracket(text, open).map(|close| (open, close));
            }
        }
        offset += line.len();
    }
    None
}

/// Scan from '[' to its ']' honouring TOML strings and comments.
fn matching_bracket(text: &str, open: usize) -> Option<usize> {
    let b = text.as_bytes();
    let (mut i, mut depth) = (open, 0usize);
    while i < b.len() {
        match b[i] {
            b'[' => depth += 1,
            b']' => {
                depth -= 1;
                if depth == 0 {
                    return Some(i);
                }
            }
            b'#' => {
                while i < b.len() && b[i] != b'\n' {
                    i += 1;
                }
            }
            q @ (b'"' | b'\'') => {
                i += 1;
                while i < b.len() && b[i] != q {
                    if q == b'"' && b[i] == b'\\' {
                        i += 1;
                    }
                    i += 1;
                }
            }
            _ => {}
        }
        i += 1;
    }
    None
}

/// Last character inside the array that is not whitespace or comment.
fn last_significant(inner: &str) -> Option<char> {
    let mut last = None;
    for line in inner.lines() {
        // A '#' outside strings starts a comment; import paths rarely hold '#', and verify() catches the rest.
        let code = strip_comment(line);
        if let Some(c) = code.trim_end().chars().last() {
            last = Some(c);
        }
    }
    last
}

fn strip_comment(line: &str) -> &str {
    let mut in_str: Option<char> = None;
    for (i, c) in line.char_indices() {
        match (in_str, c) {
            (None, '#') => return &line[..i],
            (None, '"' | '\'') => in_str = Some(c),
            (Some(q), c) if c == q => in_str = None,
            _ => {}
        }
    }
    line
}

fn quote(entry: &str) -> String {
    // A TOML basic string; serde-json escaping is a subset of TOML's.
    serde_json::to_string(entry).unwrap_or_else(|_| format!("\"{entry}\""))
}

/// Append `entry` to `imports`, adding the key if absent. Returns the new text.
pub fn add(text: &str, entry: &str) -> Result<String, String> {
    let old = parse(text)?;
    let q = quote(entry);
    let new = match array_span(text) {
        Some((open, close)) => {
            let inner = &text[open + 1..close];
            let insert = match last_significant(inner) {
                None => q,
                Some(',') => format!(" {q}"),
                Some(_) => format!(", {q}"),
            };
            format!("{}{}{}", &text[..close], insert, &text[close..])
        }
        None if old.contains_key("imports") => return Err("imports is not a plain top-level array".into()),
        None => {
            let line = format!("imports = [{q}]\n");
            match version_line_end(text) {
                Some(end) if text[..end].ends_with('\n') => format!("{}{}{}", &text[..end], line, &text[end..]),
                Some(end) => format!("{}\n{}{}", &text[..end], line, &text[end..]),
                None => format!("{line}{text}"),
            }
        }
    };
    let mut want = list(&old);
    want.push(entry.to_string());
    verify(&old, &new, &want)?;
    Ok(new)
}

/// Remove `entry` from `imports` (fallback when the byte-exact backup cannot be used).
pub fn remove(text: &str, entry: &str) -> Result<String, String> {
    let old = parse(text)?;
    let want: Vec<String> = list(&old).into_iter().filter(|e| e != entry).collect();
    let q = quote(entry);
    let whole_line = format!("imports = [{q}]\n");
    let mut candidates = vec![];
    if let Some(i) = text.find(&whole_line) {
        candidates.push(format!("{}{}", &text[..i], &text[i + whole_line.len()..]));
    }
    if let Some((open, close)) = array_span(text) {
        for pat in [format!(", {q}"), format!(" {q}"), format!("{q},"), q.clone()] {
            if let Some(rel) = text[open..=close].find(&pat) {
                let i = open + rel;
                candidates.push(format!("{}{}", &text[..i], &text[i + pat.len()..]));
            }
        }
    }
    candidates
        .into_iter()
        .find(|c| verify(&old, c, &want).is_ok())
        .ok_or_else(|| format!("could not remove import {entry} without touching anything else"))
}

fn version_line_end(text: &str) -> Option<usize> {
    let mut offset = 0;
    for line in text.split_inclusive('\n') {
        let t = line.trim_start();
        if t.starts_with('[') {
            return None;
        }
        offset += line.len();
        if t.strip_prefix("version").is_some_and(|r| r.trim_start().starts_with('=')) {
            return Some(offset);
        }
    }
    None
}

pub fn parse(text: &str) -> Result<toml::Table, String> {
    text.parse::<toml::Table>().map_err(|e| format!("not valid TOML: {e}"))
}

/// The new text must parse, hold exactly `want` as imports, and equal the old document in everything else.
fn verify(old: &toml::Table, new_text: &str, want: &[String]) -> Result<(), String> {
    let new = parse(new_text)?;
    if list(&new) != want {
        return Err(format!("imports would be {:?}, expected {:?}", list(&new), want));
    }
    let (mut a, mut b) = (old.clone(), new);
    a.remove("imports");
    b.remove("imports");
    if a != b {
        return Err("edit would change settings other than imports".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: &str = "/etc/containerd/conf.d/zz-bulkhead.toml";

    fn roundtrip(orig: &str) -> String {
        let added = add(orig, P).unwrap();
        assert_eq!(list(&parse(&added).unwrap()).last().map(String::as_str), Some(P));
        // Byte-exact uninstall comes from the backup; this fallback only has to be semantically exact.
        assert_eq!(parse(&remove(&added, P).unwrap()).unwrap(), parse(orig).unwrap());
        added
    }

    #[test]
    fn adds_line_after_version_when_no_imports() {
        let added = roundtrip("# mine\nversion = 2\n\n[plugins]\n");
        assert_eq!(added, format!("# mine\nversion = 2\nimports = [\"{P}\"]\n\n[plugins]\n"));
    }

    #[test]
    fn adds_line_at_top_without_version() {
        let added = roundtrip("[grpc]\naddress = \"/x\"\n");
        assert!(added.starts_with("imports = ["));
    }

    #[test]
    fn appends_to_existing_arrays() {
        // `imports = []` + ours reads the same as a line we added; removal may drop the line: both are fine.
        let added = add("version = 2\nimports = []\n", P).unwrap();
        assert_eq!(added, format!("version = 2\nimports = [\"{P}\"]\n"));
        for orig in [
            "version = 2\nimports = [\"/a.toml\"]\n",
            "version = 2\nimports = [\"/a.toml\",]\n",
            "version = 2\nimports = [\n  \"/a.toml\", # first ] tricky\n  \"/b.toml\" # second\n]\n[x]\ny = 1\n",
        ] {
            let added = roundtrip(orig);
            assert_eq!(list(&parse(&added).unwrap()).len(), list(&parse(orig).unwrap()).len() + 1, "{added}");
        }
    }

    #[test]
    fn our_entry_goes_last() {
        let added = add("imports = [\"/a.toml\"]\n", P).unwrap();
        assert_eq!(list(&parse(&added).unwrap()), vec!["/a.toml".to_string(), P.to_string()]);
    }

    #[test]
    fn refuses_invalid_toml() {
        assert!(add("version = = 2", P).is_err());
    }

    #[test]
    fn glob_coverage() {
        let dir = Path::new("/etc/containerd");
        let t = Path::new("/etc/containerd/config.d/zz-bulkhead.toml");
        assert!(covers("/etc/containerd/config.d/*.toml", dir, t));
        assert!(covers("config.d/*.toml", dir, t));
        assert!(covers("/etc/containerd/config.d/zz-bulkhead.toml", dir, t));
        assert!(!covers("/etc/containerd/config.d/*.conf", dir, t));
        assert!(!covers("/etc/containerd/*.toml", dir, t));
    }
}
