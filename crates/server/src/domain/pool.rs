//! Warm machines (docs/memory.md, "Warm machines"): which pool a machine
//! belongs to, whether one more fits the pool's memory budget, and when the
//! host is short enough of memory that the pool gives its machines back.

use crate::domain::quota::{Free, Reserve, START_MIB};

/// What a warm machine of a pool holds on the host before it was measured
/// (an idle guest restored from its template holds less: tens of MiB of
/// memory and QEMU's own pages).
pub(crate) const FIRST_ESTIMATE_BYTES: u64 = 256 << 20;

/// A pool holds no machine of a shape nobody took from for this long.
pub(crate) const KEY_IDLE_MS: i64 = 15 * 60 * 1000;

/// The pool of an image and shape: machines of one pool are restored from
/// the same template, so a create of that image and shape can take any.
pub(crate) fn key(vcpu: u32, memory_mib: u32, disk_mib: u32, image: Option<&str>) -> String {
    format!(
        "{vcpu}c-{memory_mib}m-{disk_mib}d-{}",
        image.unwrap_or("base")
    )
}

/// Whether a pool of `ready` machines (and `target` wanted) starts one more,
/// whose host memory is estimated at `estimate` bytes, while all pools
/// hold `used` bytes of a `budget`.
pub(crate) fn may_fill(ready: usize, target: u32, used: u64, estimate: u64, budget: u64) -> bool {
    ready < target as usize && used.saturating_add(estimate) <= budget
}

/// Whether the host is short of memory: a create now would be refused for
/// want of room (docs/security.md), so the pools give back what they hold
/// and start nothing until it passes.
pub(crate) fn under_pressure(free: &Free, r: &Reserve) -> bool {
    let floor = r.memory_mib + START_MIB;
    free.memory_available < floor || (free.ram_dir_total > 0 && free.ram_dir_free < floor)
}

/// Whether a pool nobody took from since `last_taken_ms` is given up at `now`.
pub(crate) fn idle(last_taken_ms: i64, now: i64) -> bool {
    now - last_taken_ms >= KEY_IDLE_MS
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pool_is_one_image_and_shape() {
        assert_eq!(key(2, 4096, 4096, None), "2c-4096m-4096d-base");
        assert_eq!(key(1, 1024, 4096, Some("abc")), "1c-1024m-4096d-abc");
        assert_ne!(key(1, 1024, 4096, None), key(1, 1024, 8192, None));
        assert_ne!(key(1, 1024, 4096, None), key(1, 1024, 4096, Some("x")));
    }

    #[test]
    fn a_pool_fills_up_to_its_size_within_the_budget() {
        let mib = 1 << 20;
        assert!(may_fill(0, 2, 0, 100 * mib, 1024 * mib));
        assert!(may_fill(1, 2, 900 * mib, 100 * mib, 1024 * mib));
        // Its size reached.
        assert!(!may_fill(2, 2, 0, 100 * mib, 1024 * mib));
        // Off.
        assert!(!may_fill(0, 0, 0, 1, 1024 * mib));
        // The budget would be passed.
        assert!(!may_fill(1, 2, 1000 * mib, 100 * mib, 1024 * mib));
        assert!(!may_fill(0, 2, 0, 100 * mib, 0));
    }

    #[test]
    fn the_pool_gives_back_when_a_create_would_be_refused() {
        let r = Reserve::default();
        let plenty = Free {
            memory_total: 24_000,
            memory_available: 20_000,
            ram_dir_total: 12_000,
            ram_dir_free: 12_000,
            disk: 100_000,
        };
        assert!(!under_pressure(&plenty, &r));
        let floor = r.memory_mib + START_MIB;
        let short = Free {
            memory_available: floor - 1,
            ..plenty
        };
        assert!(under_pressure(&short, &r));
        assert!(!under_pressure(
            &Free {
                memory_available: floor,
                ..plenty
            },
            &r
        ));
        let shm_full = Free {
            ram_dir_free: floor - 1,
            ..plenty
        };
        assert!(under_pressure(&shm_full, &r));
        // Unknown RAM directory: only the memory counts.
        let no_shm = Free {
            ram_dir_total: 0,
            ram_dir_free: 0,
            ..plenty
        };
        assert!(!under_pressure(&no_shm, &r));
    }

    #[test]
    fn a_pool_nobody_takes_from_is_given_up() {
        assert!(!idle(1_000, 1_000 + KEY_IDLE_MS - 1));
        assert!(idle(1_000, 1_000 + KEY_IDLE_MS));
    }
}
