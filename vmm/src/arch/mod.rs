//! x86_64 boot-time CPU state: GDT and segments, identity page tables, boot_params/e820, CPUID
//! filtering and boot MSRs. Pure functions where possible so they are unit-testable without KVM.

pub mod boot_params;
pub mod cpuid;
pub mod gdt;
pub mod mptable;
pub mod msr;
pub mod paging;
pub mod regs;
