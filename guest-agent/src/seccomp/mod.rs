//! Seccomp from the OCI spec without libseccomp: the profile is compiled to classic BPF with
//! `seccompiler` (pure Rust, so the static musl agent stays static) and installed by the
//! container's executor right before `execve`, after capabilities are dropped.
//!
//! Installing a filter without CAP_SYS_ADMIN requires no_new_privs, so a profile is accepted
//! only with `process.noNewPrivileges: true` (Kubernetes: `allowPrivilegeEscalation: false`,
//! as the restricted Pod Security Standard requires). Anything else is refused, never ignored.
//!
//! OCI semantics on top of seccompiler's one-action-per-filter model: the kernel runs every
//! stacked filter and keeps the most restrictive verdict, so
//! - a "default" filter answers `defaultAction` for syscalls no rule names, Allow otherwise;
//! - one filter per other action answers that action for its rules, Allow otherwise.

mod table_x86_64;

use std::collections::BTreeMap;

use oci_spec::runtime::{LinuxSeccomp, LinuxSeccompAction, LinuxSeccompOperator};
use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter, SeccompRule, TargetArch,
};

/// Bounds for the compiled form (the kernel's own limit is 4096 instructions per filter).
pub const MAX_FILTERS: usize = 16;
pub const MAX_INSNS: usize = 4096;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SeccompError {
    #[error("seccomp: {0}")]
    Unsupported(String),
    #[error("seccomp: {0}")]
    Invalid(String),
}

pub fn syscall_nr(name: &str) -> Option<i64> {
    table_x86_64::SYSCALLS.binary_search_by(|(n, _)| n.cmp(&name)).ok().map(|i| table_x86_64::SYSCALLS[i].1)
}

fn action(a: LinuxSeccompAction, errno: Option<u32>) -> Result<SeccompAction, SeccompError> {
    Ok(match a {
        LinuxSeccompAction::ScmpActAllow => SeccompAction::Allow,
        LinuxSeccompAction::ScmpActErrno => SeccompAction::Errno(errno.unwrap_or(libc::EPERM as u32)),
        LinuxSeccompAction::ScmpActKill | LinuxSeccompAction::ScmpActKillThread => SeccompAction::KillThread,
        LinuxSeccompAction::ScmpActKillProcess => SeccompAction::KillProcess,
        LinuxSeccompAction::ScmpActTrap => SeccompAction::Trap,
        LinuxSeccompAction::ScmpActLog => SeccompAction::Log,
        LinuxSeccompAction::ScmpActTrace => SeccompAction::Trace(errno.unwrap_or(0)),
        LinuxSeccompAction::ScmpActNotify => {
            return Err(SeccompError::Unsupported("SCMP_ACT_NOTIFY is not supported".into()))
        }
    })
}

fn condition(a: &oci_spec::runtime::LinuxSeccompArg) -> Result<SeccompCondition, SeccompError> {
    let index = u8::try_from(a.index()).map_err(|_| SeccompError::Invalid(format!("argument index {}", a.index())))?;
    let (op, value) = match a.op() {
        LinuxSeccompOperator::ScmpCmpNe => (SeccompCmpOp::Ne, a.value()),
        LinuxSeccompOperator::ScmpCmpLt => (SeccompCmpOp::Lt, a.value()),
        LinuxSeccompOperator::ScmpCmpLe => (SeccompCmpOp::Le, a.value()),
        LinuxSeccompOperator::ScmpCmpEq => (SeccompCmpOp::Eq, a.value()),
        LinuxSeccompOperator::ScmpCmpGe => (SeccompCmpOp::Ge, a.value()),
        LinuxSeccompOperator::ScmpCmpGt => (SeccompCmpOp::Gt, a.value()),
        // libseccomp: value is the mask, valueTwo the datum.
        LinuxSeccompOperator::ScmpCmpMaskedEq => (SeccompCmpOp::MaskedEq(a.value()), a.value_two().unwrap_or(0)),
    };
    SeccompCondition::new(index, SeccompCmpArgLen::Qword, op, value)
        .map_err(|e| SeccompError::Invalid(format!("argument {index}: {e}")))
}

/// Rules of one action: syscall -> None (unconditional) or the alternative conditions.
type RuleSet = BTreeMap<i64, Option<Vec<SeccompRule>>>;

fn add(set: &mut RuleSet, nr: i64, rule: Option<SeccompRule>) {
    let entry = set.entry(nr).or_insert_with(|| Some(Vec::new()));
    match (entry.as_mut(), rule) {
        (Some(v), Some(r)) => v.push(r),
        // An unconditional rule subsumes every conditional one.
        (_, None) => *entry = None,
        (None, Some(_)) => {}
    }
}

fn filter(set: RuleSet, on_match: SeccompAction, otherwise: SeccompAction) -> Result<BpfProgram, SeccompError> {
    let rules: BTreeMap<i64, Vec<SeccompRule>> = set.into_iter().map(|(nr, r)| (nr, r.unwrap_or_default())).collect();
    let f = SeccompFilter::new(rules, otherwise, on_match, TargetArch::x86_64)
        .map_err(|e| SeccompError::Invalid(e.to_string()))?;
    let prog = BpfProgram::try_from(f).map_err(|e| SeccompError::Invalid(e.to_string()))?;
    if prog.len() > MAX_INSNS {
        return Err(SeccompError::Invalid(format!(
            "profile compiles to {} BPF instructions, the kernel takes {MAX_INSNS}",
            prog.len()
        )));
    }
    Ok(prog)
}

/// Compiles an OCI seccomp profile into the filters to stack, in install order.
/// Syscall names unknown on x86_64 are skipped (as runc does); the count is returned.
pub fn compile(s: &LinuxSeccomp, no_new_privs: bool) -> Result<(Vec<BpfProgram>, usize), SeccompError> {
    if !no_new_privs {
        return Err(SeccompError::Unsupported(
            "a profile needs process.noNewPrivileges=true in this agent (filters are installed \
             after capabilities are dropped; libseccomp is not linked)"
                .into(),
        ));
    }
    if s.listener_path().is_some() {
        return Err(SeccompError::Unsupported("listenerPath (seccomp notify) is not supported".into()));
    }
    let default = action(s.default_action(), s.default_errno_ret())?;
    let mut all = RuleSet::new();
    let mut by_action: BTreeMap<u32, (SeccompAction, RuleSet)> = BTreeMap::new();
    let mut unknown = 0;
    for sc in s.syscalls().as_deref().unwrap_or_default() {
        let act = action(sc.action(), sc.errno_ret())?;
        let rule = match sc.args().as_deref() {
            None | Some([]) => None,
            Some(args) => Some(
                SeccompRule::new(args.iter().map(condition).collect::<Result<_, _>>()?)
                    .map_err(|e| SeccompError::Invalid(e.to_string()))?,
            ),
        };
        for name in sc.names() {
            let Some(nr) = syscall_nr(name) else {
                unknown += 1;
                continue;
            };
            add(&mut all, nr, rule.clone());
            if act != SeccompAction::Allow {
                let key = u32::from(act.clone());
                add(&mut by_action.entry(key).or_insert_with(|| (act.clone(), RuleSet::new())).1, nr, rule.clone());
            }
        }
    }
    let mut filters = Vec::new();
    if default != SeccompAction::Allow {
        filters.push(filter(all, SeccompAction::Allow, default)?);
    }
    for (_, (act, set)) in by_action {
        filters.push(filter(set, act, SeccompAction::Allow)?);
    }
    if filters.len() > MAX_FILTERS {
        return Err(SeccompError::Invalid(format!("profile needs {} filters", filters.len())));
    }
    Ok((filters, unknown))
}

/// Serialized form handed to the libcontainer helper: per filter a u32 instruction count,
/// then (u16 code, u8 jt, u8 jf, u32 k) little-endian per instruction.
pub fn encode(filters: &[BpfProgram]) -> Vec<u8> {
    let mut out = Vec::new();
    for f in filters {
        out.extend_from_slice(&(f.len() as u32).to_le_bytes());
        for i in f {
            out.extend_from_slice(&i.code.to_le_bytes());
            out.push(i.jt);
            out.push(i.jf);
            out.extend_from_slice(&i.k.to_le_bytes());
        }
    }
    out
}

pub fn decode(mut b: &[u8]) -> Result<Vec<BpfProgram>, SeccompError> {
    let bad = |w: &str| SeccompError::Invalid(format!("compiled filter file: {w}"));
    let mut filters = Vec::new();
    while !b.is_empty() {
        if filters.len() >= MAX_FILTERS {
            return Err(bad("too many filters"));
        }
        let (len, rest) = b.split_first_chunk::<4>().ok_or_else(|| bad("truncated length"))?;
        let n = u32::from_le_bytes(*len) as usize;
        if n == 0 || n > MAX_INSNS || rest.len() < n * 8 {
            return Err(bad("bad instruction count"));
        }
        let prog = rest[..n * 8]
            .chunks_exact(8)
            .map(|c| seccompiler::sock_filter {
                code: u16::from_le_bytes([c[0], c[1]]),
                jt: c[2],
                jf: c[3],
                k: u32::from_le_bytes([c[4], c[5], c[6], c[7]]),
            })
            .collect();
        filters.push(prog);
        b = &rest[n * 8..];
    }
    Ok(filters)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn profile(json: serde_json::Value) -> LinuxSeccomp {
        serde_json::from_value(json).unwrap()
    }

    #[test]
    fn table_is_sorted_and_knows_common_syscalls() {
        assert!(table_x86_64::SYSCALLS.windows(2).all(|w| w[0].0 < w[1].0));
        assert_eq!(syscall_nr("read"), Some(0));
        assert_eq!(syscall_nr("mkdir"), Some(83));
        assert_eq!(syscall_nr("no_such_call"), None);
    }

    #[test]
    fn allowlist_profile_stacks_default_and_action_filters() {
        let p = profile(serde_json::json!({
            "defaultAction": "SCMP_ACT_ERRNO",
            "syscalls": [
                {"names": ["read", "write", "exit_group", "not_a_syscall"], "action": "SCMP_ACT_ALLOW"},
                {"names": ["personality"], "action": "SCMP_ACT_ALLOW",
                 "args": [{"index": 0, "value": 8, "op": "SCMP_CMP_EQ"}]},
                {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": 38}
            ]
        }));
        let (filters, unknown) = compile(&p, true).unwrap();
        assert_eq!(filters.len(), 2);
        assert_eq!(unknown, 1);
        assert_eq!(decode(&encode(&filters)).unwrap(), filters);
    }

    #[test]
    fn denylist_profile_needs_one_filter() {
        let p = profile(serde_json::json!({
            "defaultAction": "SCMP_ACT_ALLOW",
            "syscalls": [{"names": ["mkdir", "mkdirat"], "action": "SCMP_ACT_ERRNO"}]
        }));
        assert_eq!(compile(&p, true).unwrap().0.len(), 1);
    }

    #[test]
    fn refuses_what_it_cannot_enforce() {
        let p = profile(serde_json::json!({"defaultAction": "SCMP_ACT_ERRNO"}));
        assert!(matches!(compile(&p, false), Err(SeccompError::Unsupported(_))));
        let p = profile(serde_json::json!({"defaultAction": "SCMP_ACT_NOTIFY"}));
        assert!(matches!(compile(&p, true), Err(SeccompError::Unsupported(_))));
        let p = profile(serde_json::json!({"defaultAction": "SCMP_ACT_ALLOW",
            "syscalls": [{"names": ["read"], "action": "SCMP_ACT_ERRNO",
                "args": [{"index": 9, "value": 1, "op": "SCMP_CMP_EQ"}]}]}));
        assert!(matches!(compile(&p, true), Err(SeccompError::Invalid(_))));
    }

    #[test]
    fn decode_rejects_malformed_files() {
        assert!(decode(&[1, 0]).is_err());
        assert!(decode(&[0, 0, 0, 0]).is_err());
        assert!(decode(&[2, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8]).is_err());
        assert!(decode(&u32::MAX.to_le_bytes()).is_err());
        assert_eq!(decode(&[]).unwrap(), Vec::<BpfProgram>::new());
    }
}
