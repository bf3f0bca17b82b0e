//! Traffic control in the pod's network namespace, over rtnetlink:
//! - a `clsact` qdisc per interface we filter on (its ingress hook is the `ingress` qdisc's;
//!   its egress hook serves the namespace backend), removed whole at teardown;
//! - the redirect: u32 match-all + mirred egress redirect, Kata's "tcfilter" mode;
//! - the metadata drop: a classic BPF program in direct-action mode (cls_bpf) that returns
//!   TC_ACT_SHOT for the metadata addresses and "continue" for everything else. It needs no tc
//!   action module (act_gact is missing from some kernels, this host's among them).
//!
//! Kernel pieces used: sch_ingress (clsact), cls_u32, cls_bpf, act_mirred.

use futures::{StreamExt, TryStreamExt};
use rtnetlink::packet_core::{
    DefaultNla, NetlinkMessage, NetlinkPayload, NLM_F_ACK, NLM_F_CREATE, NLM_F_EXCL, NLM_F_REQUEST,
};
use rtnetlink::packet_route::tc::{TcAttribute, TcBpfFlags, TcFilterBpfOption, TcHandle, TcMessage, TcOption};
use rtnetlink::packet_route::RouteNetlinkMessage;
use rtnetlink::Handle;

use super::error::NetworkError;

/// `TC_H_CLSACT` (== `TC_H_INGRESS`): the parent of a clsact or ingress qdisc.
const TC_H_CLSACT: u32 = 0xFFFF_FFF1;
/// The clsact qdisc's own handle, `ffff:`.
const CLSACT_HANDLE: u32 = 0xFFFF_0000;
const CLSACT: &str = "clsact";
/// `TCA_BPF_OPS_LEN` / `TCA_BPF_OPS`: a classic BPF program given inline.
const TCA_BPF_OPS_LEN: u16 = 4;
const TCA_BPF_OPS: u16 = 5;
/// Every frame, whatever its ethertype (the filters look at the frame themselves).
const ETH_P_ALL_BE: u16 = (libc::ETH_P_ALL as u16).to_be();

/// Filter priorities on one hook: the metadata drop runs before the redirect.
pub const PRIO_METADATA_DROP: u16 = 1;
pub const PRIO_REDIRECT: u16 = 2;

/// Where on an interface a filter sits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hook {
    /// Frames the interface receives (for a tap: what the VMM writes, i.e. the guest sends).
    Ingress,
    /// Frames the interface transmits.
    Egress,
}

impl Hook {
    fn parent(self) -> u32 {
        let minor = match self {
            Hook::Ingress => TcHandle::MIN_INGRESS,
            Hook::Egress => TcHandle::MIN_EGRESS,
        };
        0xFFFF_0000 | u32::from(minor)
    }
}

fn netlink(what: String) -> impl FnOnce(rtnetlink::Error) -> NetworkError {
    move |e| NetworkError::netlink(what, e)
}

/// Sends one request and waits for its ACK.
async fn request(h: &mut Handle, message: RouteNetlinkMessage, flags: u16, what: String) -> Result<(), NetworkError> {
    let mut req = NetlinkMessage::from(message);
    req.header.flags = NLM_F_REQUEST | NLM_F_ACK | flags;
    let mut responses = h.request(req).map_err(netlink(what.clone()))?;
    while let Some(response) = responses.next().await {
        if let NetlinkPayload::Error(e) = response.payload {
            if e.code.is_some() {
                return Err(NetworkError::netlink(what, rtnetlink::Error::NetlinkError(e)));
            }
        }
    }
    Ok(())
}

/// The kind (`clsact`, `ingress`) of the qdisc on the ingress slot of `index`, if any.
pub async fn ingress_qdisc(h: &Handle, index: u32) -> Result<Option<String>, NetworkError> {
    let mut dump = h.qdisc().get().execute();
    while let Some(q) = dump.try_next().await.map_err(netlink(format!("list qdiscs of link {index}")))? {
        if q.header.index == index as i32 && u32::from(q.header.parent) == TC_H_CLSACT {
            let kind = q.attributes.iter().find_map(|a| match a {
                TcAttribute::Kind(k) => Some(k.clone()),
                _ => None,
            });
            return Ok(Some(kind.unwrap_or_default()));
        }
    }
    Ok(None)
}

/// Adds a clsact qdisc to `index`; fails if the slot is taken (by anyone).
pub async fn add_clsact(h: &mut Handle, index: u32) -> Result<(), NetworkError> {
    request(
        h,
        RouteNetlinkMessage::NewQueueDiscipline(clsact_message(index)),
        NLM_F_CREATE | NLM_F_EXCL,
        format!("add clsact qdisc to link {index}"),
    )
    .await
}

/// Removes the clsact qdisc of `index` (and every filter on it); nothing if it has none.
pub async fn del_clsact(h: &mut Handle, index: u32) -> Result<(), NetworkError> {
    if ingress_qdisc(h, index).await?.as_deref() != Some(CLSACT) {
        return Ok(());
    }
    request(
        h,
        RouteNetlinkMessage::DelQueueDiscipline(clsact_message(index)),
        0,
        format!("delete clsact qdisc of link {index}"),
    )
    .await
}

fn clsact_message(index: u32) -> TcMessage {
    let mut msg = TcMessage::with_index(index as i32);
    msg.header.parent = TC_H_CLSACT.into();
    msg.header.handle = CLSACT_HANDLE.into();
    msg.attributes.push(TcAttribute::Kind(CLSACT.into()));
    msg
}

/// Redirects every frame on `hook` of `from` to the egress of `to` (mirred).
pub async fn add_redirect(h: &Handle, from: u32, hook: Hook, to: u32, prio: u16) -> Result<(), NetworkError> {
    h.traffic_filter(from as i32)
        .add()
        .parent(hook.parent())
        .priority(prio)
        .protocol(ETH_P_ALL_BE)
        .redirect(to)
        .map_err(netlink(format!("build redirect {from} -> {to}")))?
        .execute()
        .await
        .map_err(netlink(format!("add redirect filter {from} -> {to}")))
}

/// Drops frames to the cloud metadata addresses on `hook` of `index`.
pub async fn add_metadata_drop(h: &mut Handle, index: u32, hook: Hook, prio: u16) -> Result<(), NetworkError> {
    let program = metadata_drop_program();
    let ops: Vec<u8> = program
        .iter()
        .flat_map(|i| {
            let mut b = Vec::with_capacity(8);
            b.extend_from_slice(&i.code.to_ne_bytes());
            b.extend_from_slice(&[i.jt, i.jf]);
            b.extend_from_slice(&i.k.to_ne_bytes());
            b
        })
        .collect();
    let mut msg = TcMessage::with_index(index as i32);
    msg.header.parent = hook.parent().into();
    msg.header.info = (u32::from(prio) << 16) | u32::from(ETH_P_ALL_BE);
    msg.attributes.push(TcAttribute::Kind("bpf".into()));
    msg.attributes.push(TcAttribute::Options(vec![
        TcOption::Bpf(TcFilterBpfOption::Other(DefaultNla::new(
            TCA_BPF_OPS_LEN,
            (program.len() as u16).to_ne_bytes().to_vec(),
        ))),
        TcOption::Bpf(TcFilterBpfOption::Other(DefaultNla::new(TCA_BPF_OPS, ops))),
        TcOption::Bpf(TcFilterBpfOption::Flags(TcBpfFlags::DirectAction)),
    ]));
    request(
        h,
        RouteNetlinkMessage::NewTrafficFilter(msg),
        NLM_F_CREATE | NLM_F_EXCL,
        format!("add metadata drop filter to link {index}"),
    )
    .await
}

/// `TC_ACT_SHOT`: drop.
const ACT_SHOT: u32 = 2;
/// `TC_ACT_UNSPEC` (-1): not ours to decide, the next filter runs.
const ACT_CONTINUE: u32 = u32::MAX;
/// 169.254.169.254.
const METADATA_V4: u32 = 0xA9FE_A9FE;
/// fd00:ec2::254, as four big-endian words.
const METADATA_V6: [u32; 4] = [0xFD00_0EC2, 0, 0, 0x0000_0254];

fn stmt(code: u32, k: u32) -> libc::sock_filter {
    libc::sock_filter { code: code as u16, jt: 0, jf: 0, k }
}

/// A `jeq #k` at position `at` jumping to position `yes` or `no` (classic BPF jumps are relative).
fn jeq(at: usize, k: u32, yes: usize, no: usize) -> libc::sock_filter {
    libc::sock_filter {
        code: (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16,
        jt: (yes - at - 1) as u8,
        jf: (no - at - 1) as u8,
        k,
    }
}

/// The metadata drop as classic BPF over the frame (offsets from the Ethernet header, which is
/// where cls_bpf starts on both hooks). It reads the frame itself rather than trusting
/// `skb->protocol`; a single VLAN tag is already taken off by the kernel before tc ingress, so a
/// frame still tagged here carried two and is dropped too (its inner header would go unchecked).
/// A frame too short for a load ends the program with 0 (TC_ACT_OK): it carries no address to
/// match and is not redirected.
pub fn metadata_drop_program() -> Vec<libc::sock_filter> {
    let ld_h = |off| stmt(libc::BPF_LD | libc::BPF_H | libc::BPF_ABS, off);
    let ld_w = |off| stmt(libc::BPF_LD | libc::BPF_W | libc::BPF_ABS, off);
    const PASS: usize = 15;
    const DROP: usize = 16;
    vec![
        /* 0 */ ld_h(12), // ethertype
        /* 1 */ jeq(1, libc::ETH_P_IP as u32, 2, 4),
        /* 2 */ ld_w(14 + 16), // IPv4 destination
        /* 3 */ jeq(3, METADATA_V4, DROP, PASS),
        /* 4 */ jeq(4, libc::ETH_P_IPV6 as u32, 5, 13),
        /* 5 */ ld_w(14 + 24), // IPv6 destination, word by word
        /* 6 */ jeq(6, METADATA_V6[0], 7, PASS),
        /* 7 */ ld_w(14 + 28),
        /* 8 */ jeq(8, METADATA_V6[1], 9, PASS),
        /* 9 */ ld_w(14 + 32),
        /* 10 */ jeq(10, METADATA_V6[2], 11, PASS),
        /* 11 */ ld_w(14 + 36),
        /* 12 */ jeq(12, METADATA_V6[3], DROP, PASS),
        /* 13 */ jeq(13, libc::ETH_P_8021Q as u32, DROP, 14),
        /* 14 */ jeq(14, libc::ETH_P_8021AD as u32, DROP, PASS),
        /* PASS */ stmt(libc::BPF_RET | libc::BPF_K, ACT_CONTINUE),
        /* DROP */ stmt(libc::BPF_RET | libc::BPF_K, ACT_SHOT),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The subset of classic BPF the program uses, with the kernel's rule that a load past the
    /// end of the frame returns 0.
    fn run(program: &[libc::sock_filter], frame: &[u8]) -> u32 {
        let mut a: u32 = 0;
        let mut pc = 0;
        loop {
            let i = program[pc];
            let code = u32::from(i.code);
            let k = i.k as usize;
            match code {
                c if c == libc::BPF_LD | libc::BPF_H | libc::BPF_ABS => match frame.get(k..k + 2) {
                    Some(b) => a = u32::from(u16::from_be_bytes([b[0], b[1]])),
                    None => return 0,
                },
                c if c == libc::BPF_LD | libc::BPF_W | libc::BPF_ABS => match frame.get(k..k + 4) {
                    Some(b) => a = u32::from_be_bytes([b[0], b[1], b[2], b[3]]),
                    None => return 0,
                },
                c if c == libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K => {
                    pc += usize::from(if a == i.k { i.jt } else { i.jf });
                }
                c if c == libc::BPF_RET | libc::BPF_K => return i.k,
                other => panic!("unexpected opcode {other:#x}"),
            }
            pc += 1;
        }
    }

    fn frame(ethertype: u16, l3: &[u8]) -> Vec<u8> {
        let mut f = vec![0xff; 12];
        f.extend_from_slice(&ethertype.to_be_bytes());
        f.extend_from_slice(l3);
        f
    }

    fn ipv4(dst: [u8; 4]) -> Vec<u8> {
        let mut h = vec![0x45, 0, 0, 28, 0, 0, 0, 0, 64, 17, 0, 0, 10, 0, 0, 2];
        h.extend_from_slice(&dst);
        h.extend_from_slice(&[0; 8]);
        h
    }

    fn ipv6(dst: std::net::Ipv6Addr) -> Vec<u8> {
        let mut h = vec![0x60, 0, 0, 0, 0, 8, 17, 64];
        h.extend_from_slice(&"fd00::2".parse::<std::net::Ipv6Addr>().unwrap().octets());
        h.extend_from_slice(&dst.octets());
        h.extend_from_slice(&[0; 8]);
        h
    }

    #[test]
    fn metadata_addresses_are_dropped_and_nothing_else() {
        let p = metadata_drop_program();
        assert_eq!(run(&p, &frame(0x0800, &ipv4([169, 254, 169, 254]))), ACT_SHOT);
        assert_eq!(run(&p, &frame(0x0800, &ipv4([169, 254, 169, 253]))), ACT_CONTINUE);
        assert_eq!(run(&p, &frame(0x0800, &ipv4([10, 0, 0, 1]))), ACT_CONTINUE);
        assert_eq!(run(&p, &frame(0x86dd, &ipv6("fd00:ec2::254".parse().unwrap()))), ACT_SHOT);
        assert_eq!(run(&p, &frame(0x86dd, &ipv6("fd00:ec2::253".parse().unwrap()))), ACT_CONTINUE);
        assert_eq!(run(&p, &frame(0x86dd, &ipv6("fd00:ec3::254".parse().unwrap()))), ACT_CONTINUE);
        assert_eq!(run(&p, &frame(0x86dd, &ipv6("fd00::1".parse().unwrap()))), ACT_CONTINUE);
        // ARP carries the address too, but is not traffic to it.
        assert_eq!(run(&p, &frame(0x0806, &[0; 28])), ACT_CONTINUE);
    }

    #[test]
    fn still_tagged_frames_are_dropped() {
        let p = metadata_drop_program();
        for tpid in [0x8100, 0x88a8] {
            let mut inner = vec![0, 1, 0x08, 0];
            inner.extend_from_slice(&ipv4([10, 0, 0, 1]));
            assert_eq!(run(&p, &frame(tpid, &inner)), ACT_SHOT, "{tpid:#x}");
        }
    }

    #[test]
    fn truncated_frames_are_not_redirected() {
        let p = metadata_drop_program();
        // A header cut before the destination: the load fails, the program returns 0 (TC_ACT_OK).
        assert_eq!(run(&p, &frame(0x0800, &[0x45, 0, 0, 20])), 0);
        assert_eq!(run(&p, &[0u8; 6]), 0);
    }

    #[test]
    fn hooks_name_the_clsact_parents() {
        assert_eq!(Hook::Ingress.parent(), 0xFFFF_FFF2);
        assert_eq!(Hook::Egress.parent(), 0xFFFF_FFF3);
    }
}
