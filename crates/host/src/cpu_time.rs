//! The CPU time a guest used: its QEMU's vCPU threads, read from `/proc`.

use std::time::Duration;

/// CPU time of the vCPU threads of a QEMU process (threads named
/// `CPU n/TCG` or `CPU n/KVM`): what the guest used, not QEMU's own work.
pub(crate) fn vcpu_time(pid: u32) -> Option<Duration> {
    // SAFETY: sysconf has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    let ticks = if ticks > 0 { ticks as u64 } else { 100 };
    let mut total: u64 = 0;
    for t in std::fs::read_dir(format!("/proc/{pid}/task"))
        .ok()?
        .flatten()
    {
        let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
        if !is_vcpu_thread(&comm) {
            continue;
        }
        let stat = std::fs::read_to_string(t.path().join("stat")).unwrap_or_default();
        total += stat_ticks(&stat);
    }
    Some(ticks_to_duration(total, ticks))
}

/// The resident set of a process (`/proc/<pid>/statm`'s second field, in
/// pages): the host memory a machine holds, guest RAM it touched included.
pub(crate) fn resident_bytes(pid: u32) -> Option<u64> {
    let statm = std::fs::read_to_string(format!("/proc/{pid}/statm")).ok()?;
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    let page = if page > 0 { page as u64 } else { 4096 };
    statm_resident(&statm).map(|pages| pages.saturating_mul(page))
}

/// The resident pages of a `statm` line.
fn statm_resident(statm: &str) -> Option<u64> {
    statm.split_whitespace().nth(1)?.parse().ok()
}

/// Whether a thread's `comm` names one of QEMU's vCPU threads.
fn is_vcpu_thread(comm: &str) -> bool {
    comm.starts_with("CPU ")
}

/// User plus system time of one `/proc/<pid>/task/<tid>/stat` line, in
/// clock ticks; a field that is missing or not a number counts as 0.
fn stat_ticks(stat: &str) -> u64 {
    // Fields after the ")" that ends the name: utime is the 12th, stime the 13th.
    let rest = stat.rsplit(')').next().unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    let (u, s) = (
        f.get(11).and_then(|v| v.parse::<u64>().ok()),
        f.get(12).and_then(|v| v.parse::<u64>().ok()),
    );
    u.unwrap_or(0) + s.unwrap_or(0)
}

/// `total` clock ticks of `ticks_per_sec` each second, as a duration.
fn ticks_to_duration(total: u64, ticks_per_sec: u64) -> Duration {
    Duration::from_nanos(total.saturating_mul(1_000_000_000 / ticks_per_sec))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A vCPU thread's stat line as Linux writes it: utime 250, stime 30.
    const STAT: &str = "4242 (CPU 0/TCG) S 1 4240 4240 0 -1 4194624 1500 0 3 0 250 30 0 0 20 0 5 0 812 \
                        1190000000 30000 18446744073709551615 0 0 0 0 0 0 0 4096 0 0 0 -1 1 0 0 0 0 0";

    #[test]
    fn resident_pages_are_statm_s_second_field() {
        assert_eq!(statm_resident("262144 5120 1024 1 0 4096 0\n"), Some(5120));
        assert_eq!(statm_resident("garbage"), None);
        // This test's own process holds some memory.
        assert!(resident_bytes(std::process::id()).is_some_and(|b| b > 0));
    }

    #[test]
    fn stat_ticks_adds_user_and_system_time() {
        assert_eq!(stat_ticks(STAT), 280);
    }

    #[test]
    fn stat_ticks_counts_fields_after_the_last_parenthesis() {
        // A name may hold ") " itself: only what follows the last ")" counts.
        let odd = STAT.replace("(CPU 0/TCG)", "(CPU 0) S 9 9 9 9 9 9 9 9 9 9 9 9)");
        assert_eq!(stat_ticks(&odd), 280);
    }

    #[test]
    fn stat_ticks_of_a_short_or_broken_line_is_what_it_has() {
        assert_eq!(stat_ticks(""), 0);
        assert_eq!(stat_ticks("1 (x) S 1 2 3"), 0);
        // Only stime is a number.
        assert_eq!(stat_ticks("1 (x) S 1 1 1 0 -1 0 0 0 0 0 ? 7"), 7);
    }

    #[test]
    fn only_vcpu_threads_count() {
        assert!(is_vcpu_thread("CPU 0/KVM\n"));
        assert!(is_vcpu_thread("CPU 12/TCG\n"));
        assert!(!is_vcpu_thread("qemu-system-x86\n"));
        assert!(!is_vcpu_thread("IO mon_iothread\n"));
        assert!(!is_vcpu_thread("cpu 0/kvm\n"));
    }

    #[test]
    fn ticks_become_time() {
        assert_eq!(ticks_to_duration(280, 100), Duration::from_millis(2800));
        assert_eq!(ticks_to_duration(3, 1000), Duration::from_millis(3));
        assert_eq!(
            ticks_to_duration(u64::MAX, 100),
            Duration::from_nanos(u64::MAX)
        );
    }

    #[test]
    fn a_process_without_vcpus_used_none_and_a_gone_one_has_no_answer() {
        // This test process runs no thread named "CPU …".
        assert_eq!(vcpu_time(std::process::id()), Some(Duration::ZERO));
        assert_eq!(vcpu_time(u32::MAX), None);
    }
}
