//! What a wake-up costs on this machine: the same small piece of work (a 16 KiB message copied and
//! hashed, 32 small allocations), done back to back or each after a sleep, with the process's CPU
//! per piece (its time on a CPU from `/proc/self/schedstat`, the wake-ups included) and the piece's
//! own time. The controller's CPU per node grows with slower node timings for the same work
//! (docs/performance.md, "CPU"); this tells how much of that any process pays here for work that
//! comes spread out.
//!
//! `cargo run --release -p bench --example wake_cost [-- <spacing µs> ...]`

use std::time::{Duration, Instant};

/// Nanoseconds this process has spent on a CPU (the first field of `/proc/self/schedstat`).
fn on_cpu_ns() -> u64 {
    let stat = std::fs::read_to_string("/proc/self/schedstat").expect("/proc/self/schedstat");
    stat.split_whitespace()
        .next()
        .and_then(|ns| ns.parse().ok())
        .expect("a count of nanoseconds")
}

/// One message's worth of work. `#[inline(never)]` and the returned digest keep the optimiser from
/// folding it away.
#[inline(never)]
fn piece(message: &mut [u8], round: u64) -> u64 {
    let copy = message.to_vec();
    let mut digest: u64 = 0xcbf2_9ce4_8422_2325 ^ round;
    for byte in &copy {
        digest ^= u64::from(*byte);
        digest = digest.wrapping_mul(0x0100_0000_01b3);
    }
    let small: Vec<Box<[u8; 64]>> = (0..32u8).map(|i| Box::new([i; 64])).collect();
    digest ^= small.iter().map(|b| u64::from(b[0])).sum::<u64>();
    let at = usize::try_from(round).unwrap_or(0) % message.len();
    message[at] = digest.to_le_bytes()[0];
    digest
}

fn main() {
    let given: Vec<u64> = std::env::args()
        .skip(1)
        .map(|spacing| spacing.parse().expect("a spacing in µs"))
        .collect();
    let spacings = if given.is_empty() {
        vec![0, 100, 1_000, 10_000, 100_000]
    } else {
        given
    };
    println!("spacing, µs | pieces | CPU per piece, µs | the piece's own time, µs");
    let mut message = vec![7u8; 16 * 1024];
    let mut digests = 0u64;
    for spacing in spacings {
        // About 20 s at most for each spacing, and enough pieces for a steady mean.
        let pieces = (20_000_000 / spacing.max(1_000)).clamp(200, 20_000);
        let mut own = Duration::ZERO;
        let cpu_before = on_cpu_ns();
        for round in 0..pieces {
            if spacing > 0 {
                std::thread::sleep(Duration::from_micros(spacing));
            }
            let started = Instant::now();
            digests ^= piece(&mut message, round);
            own += started.elapsed();
        }
        let cpu = on_cpu_ns() - cpu_before;
        // Counts far below 2^52: exact as f64.
        #[allow(clippy::cast_precision_loss)]
        let (cpu_us, own_us) = (
            cpu as f64 / pieces as f64 / 1e3,
            own.as_nanos() as f64 / pieces as f64 / 1e3,
        );
        println!("{spacing} | {pieces} | {cpu_us:.1} | {own_us:.1}");
    }
    // Printed so that the work is observable.
    println!("(digest {})", digests % 10);
}
