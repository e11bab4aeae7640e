//! Blocks of loopback ports for test servers, instead of ports picked by hand.
//!
//! A [`PortBlock`] is `base..base+10` (nodes, one server each) plus `base+100..base+110` (the
//! services of a local cluster at `base+100..base+104`, the last the standby coordinator, see the
//! `cluster` module). The blocks are cut from [`AREA`] so that no two overlap:
//! `base(k) = AREA.start + 200 * (k / 10) + 10 * (k % 10)`, 700 blocks in all. Everything
//! stays below 32768, where Linux's ephemeral range begins (any client socket of a concurrently
//! running test may hold a port there), and away from the fixed base ports of the scripts
//! (`scripts/test.sh` 29001, `bench/*.sh` 24801 and 25801, `bench/catchup.sh`'s Citus 28800,
//! `bench/routing.sh` 30000 and `bench/cpu_per_txn.sh` 31000, `scripts/demo.sh` 6001).
//!
//! A block is held by an exclusive `flock` on `/tmp/remus-test-ports/<base>.lock`, taken
//! without waiting and kept until the [`PortBlock`] is dropped. `flock` locks belong to an
//! open file description, so two threads of one test binary exclude each other just as two test
//! processes do, and the kernel releases the lock of a process that dies. After taking the
//! lock every port of the block is bound once (a bind-probe), so a block that something else
//! uses (a cluster left running by hand, a foreign server) is passed over. A process-wide
//! counter, started at an offset derived from the PID, spreads the search so that concurrent
//! processes and successive tests of one process rarely ask for the same block.

use std::fs::{File, OpenOptions, TryLockError};
use std::net::TcpListener;
use std::ops::Range;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::atomic::{AtomicU32, Ordering};

/// Where blocks are cut from: `base(k)` of the last block plus 110 stays below this end.
pub const AREA: Range<u16> = 10000..24000;
/// Ports `base..base+NODE_PORTS` of a block.
pub const NODE_PORTS: u16 = 10;
/// The second run of a block starts at `base + SERVICE_OFFSET`...
pub const SERVICE_OFFSET: u16 = 100;
/// ...and has this many ports.
pub const SERVICE_PORTS: u16 = 10;

// Every port of every block stays below the ephemeral range.
const _: () = assert!(AREA.end <= 32768);

const STRIDE: u16 = 2 * SERVICE_OFFSET;
const BLOCKS: u32 =
    (AREA.end - AREA.start) as u32 / STRIDE as u32 * (SERVICE_OFFSET / NODE_PORTS) as u32;
const LOCK_DIR: &str = "/tmp/remus-test-ports";

/// A reserved block of ports; see the module documentation.
#[derive(Debug)]
pub struct PortBlock {
    base: u16,
    // Held for the life of the block: dropping the file releases the lock.
    _lock: File,
}

fn base_of(k: u32) -> u16 {
    let k = k % BLOCKS;
    AREA.start + STRIDE * (k / 10) as u16 + NODE_PORTS * (k % 10) as u16
}

fn ports_of(base: u16) -> impl Iterator<Item = u16> {
    (base..base + NODE_PORTS).chain(base + SERVICE_OFFSET..base + SERVICE_OFFSET + SERVICE_PORTS)
}

fn lock_file(base: u16) -> Option<File> {
    let dir = Path::new(LOCK_DIR);
    if !dir.is_dir() {
        let _ = std::fs::create_dir_all(dir);
        // Root and other users' test runs share the directory (world-writable, sticky).
        let _ = std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o1777));
    }
    let path = dir.join(format!("{base}.lock"));
    // A lock file another user created is not writable, but can still be locked read-only.
    OpenOptions::new()
        .append(true)
        .create(true)
        .open(&path)
        .or_else(|_| File::open(&path))
        .ok()
}

impl PortBlock {
    /// Reserves a block nobody else holds and whose ports are all free right now.
    pub fn reserve() -> PortBlock {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let start = std::process::id().wrapping_mul(7919);
        for _ in 0..BLOCKS {
            let base = base_of(start.wrapping_add(NEXT.fetch_add(1, Ordering::SeqCst)));
            let Some(file) = lock_file(base) else {
                continue;
            };
            match file.try_lock() {
                Ok(()) => {}
                Err(TryLockError::WouldBlock) => continue,
                Err(TryLockError::Error(e)) => panic!("locking {LOCK_DIR}/{base}.lock: {e}"),
            }
            if ports_of(base).all(|p| TcpListener::bind(("127.0.0.1", p)).is_ok()) {
                return PortBlock { base, _lock: file };
            }
        }
        panic!("no free block of test ports in {AREA:?} (locks in {LOCK_DIR})");
    }

    /// The first port of the block.
    pub fn base(&self) -> u16 {
        self.base
    }

    /// Port `base + i`, for `i < NODE_PORTS`.
    pub fn port(&self, i: u16) -> u16 {
        assert!(
            i < NODE_PORTS,
            "a block has {NODE_PORTS} node ports, not {}",
            i + 1
        );
        self.base + i
    }

    /// Keeps the block reserved until the process exits and returns its first port: for a
    /// server a test spawns and never stops.
    pub fn keep_for_process(self) -> u16 {
        let base = self.base;
        std::mem::forget(self);
        base
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_disjoint_and_below_the_ephemeral_range() {
        let mut seen = std::collections::BTreeSet::new();
        for k in 0..BLOCKS {
            for p in ports_of(base_of(k)) {
                assert!(seen.insert(p), "port {p} in two blocks");
                assert!(p < AREA.end, "port {p} outside {AREA:?}");
            }
        }
        assert_eq!(BLOCKS, 700);
    }

    #[test]
    fn a_reserved_block_is_not_handed_out_again_while_held() {
        let held: Vec<PortBlock> = (0..20).map(|_| PortBlock::reserve()).collect();
        let bases: std::collections::BTreeSet<u16> = held.iter().map(|b| b.base()).collect();
        assert_eq!(bases.len(), held.len());
        // Another open file description of a held block's lock file cannot take the lock.
        let again = lock_file(held[0].base()).unwrap();
        assert!(matches!(again.try_lock(), Err(TryLockError::WouldBlock)));
    }
}
