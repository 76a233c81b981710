//! Model checks: the host backend in simulated time (`StoreBuilder::simulate`, `--simulate h100`)
//! places copies and kernels on a simulated timeline, deterministically, so the pipeline the
//! store builds for the out-of-core MLP at the shapes of its GPU rows (L=32, H=8192, 4 GiB of weights)
//! can be checked on a machine without a GPU, in milliseconds: what waits for what, how many bytes
//! cross, and where the simulated step lands against its floors, under the model
//! `strata::Simulation` documents (whose own checks are `tests/simulate.rs`). They check the model, not the MLP's GPU targets: those are GPU
//! figures, measured by `benches/gpu/run perf` on a GPU and recorded in docs/benchmarks.md.

use strata::Error;

use super::{run, MlpConfig, MlpReport};

fn simulate(flags: &[&str]) -> MlpReport {
    let mut args = vec!["--layers", "32", "--hidden", "8192", "--simulate", "h100", "--steps", "6"];
    args.extend_from_slice(flags);
    let cfg = MlpConfig::parse(&args).unwrap();
    let report = run(&cfg, |_| Ok(())).unwrap_or_else(|e| panic!("{flags:?}: {e}"));
    assert!(report.simulated);
    assert_eq!(report.matches_resident, Some(true), "{flags:?}: differs from the resident run");
    report
}

/// One layer of the L=32, H=8192 bf16 model: 128 MiB.
const LAYER: u64 = 8192 * 8192 * 2;

/// Steps after the first: no misses, and into the device at most what must cross plus the one
/// layer in flight.
fn steady(report: &MlpReport, flags: &[&str]) {
    for (i, s) in report.steps.iter().enumerate().skip(1) {
        assert_eq!(s.prefetch_misses, 0, "{flags:?}: step {} missed", i + 1);
        assert!(
            s.h2d_bytes <= report.min_bytes.0 + LAYER,
            "{flags:?}: step {} moved {} into the device, more than the {} that must cross and \
             a layer",
            i + 1,
            s.h2d_bytes,
            report.min_bytes.0
        );
    }
}

#[test]
fn model_check_forward_streams_at_the_simulated_pcie_floor() {
    // In the model, the forward pipeline keeps the copy engine busy: the simulated step never
    // below max(compute, PCIe) (a floor) and within 5% of it at 1 GiB of budget with few
    // (transfer-bound: 1.048x) and many (compute-bound: 1.000x) rows; at 2 GiB within 15%
    // (1.140x: the layer in flight is one more of 16 that cross, and the copies of a shorter
    // stream overlap less). Not the GPU target.
    for (flags, most) in [
        (&["--rows", "2048", "--device-budget", "1GiB"][..], 1.05),
        (&["--rows", "16384", "--device-budget", "1GiB"], 1.05),
        (&["--rows", "2048", "--device-budget", "2GiB"], 1.15),
    ] {
        let r = simulate(flags);
        steady(&r, flags);
        let ratio = r.ratio.expect("both floors are known");
        assert!((0.999..=most).contains(&ratio), "{flags:?}: {ratio:.3}x its floor");
    }
}

#[test]
fn model_check_training_moves_weights_both_ways_near_the_simulated_floor() {
    // In the model, the training pipeline moves weights both ways within 25% of its floor
    // (1.222x: 2(M - B) = 6 GiB in, exactly the least, but 3.5 GiB out where 3 GiB must), with
    // the byte counts below. Not the GPU target.
    let flags = &["--mode", "train", "--rows", "4096", "--device-budget", "1GiB"][..];
    let r = simulate(flags);
    let ratio = r.ratio.expect("both floors are known");
    assert!((0.999..=1.25).contains(&ratio), "{ratio:.3}x its floor");
    assert_eq!(r.min_bytes, (6 << 30, 3 << 30), "the least that must cross a training step");
    assert!(r.steps[1..].iter().all(|s| s.prefetch_misses == 0));
    for s in &r.steps[3..] {
        // Once the schedule policy's order has settled (step 4): 48 of the 64 layer loads of a
        // step (forward and backward) and 28 of 32 write-backs. The 4 pinned layers (half the
        // budget) never cross; the other half of the budget keeps the 4 layers at each turn of
        // the step.
        assert_eq!((s.h2d_bytes, s.d2h_bytes), (6 << 30, 7 << 29));
    }
    // Without the pinned half the 4 layers are written back too, and the step is slower.
    let all = simulate(&[flags, &["--keep", "0"][..]].concat());
    assert!(all.steps[3..].iter().all(|s| s.d2h_bytes == 4 << 30));
    assert!(all.step_seconds > r.step_seconds * 1.03, "{} s", all.step_seconds);
}

#[test]
fn model_check_simulated_runs_are_deterministic() {
    // From Pinned without hints, and from the Disk tier (no disk-worker threads in simulated
    // time: the copies go through staging on the issuing thread).
    for flags in [
        &["--rows", "2048", "--device-budget", "1GiB", "--hints", "off"][..],
        &["--rows", "2048", "--device-budget", "1GiB", "--weights-in", "disk"],
    ] {
        let (a, b) = (simulate(flags), simulate(flags));
        let steps = |r: &MlpReport| {
            r.steps.iter().map(|s| (s.seconds, s.h2d_bytes, s.issue_seconds)).collect::<Vec<_>>()
        };
        assert_eq!(steps(&a), steps(&b), "{flags:?}");
    }
    // From Pinned the host issues a step in a fraction of its time. (From Disk it does not: the
    // caller's thread waits for staging buffers, where a GPU store's disk workers would.)
    let r = simulate(&["--rows", "2048", "--device-budget", "1GiB"]);
    assert!(r.steps[1..].iter().all(|s| s.issue_seconds < s.seconds / 10.0), "host-bound");
}

#[test]
fn model_check_the_two_link_sharing_rules_bracket_training() {
    // The later of two copies in opposite directions gets what the earlier leaves of the two-way
    // bandwidth (h100), or half of it (h100-half): forward moves one way only and is the same
    // under both; training is faster under the optimistic one.
    let flags = &["--mode", "train", "--rows", "4096", "--device-budget", "1GiB"][..];
    let half = simulate(&[flags, &["--simulate", "h100-half"][..]].concat());
    let leftover = simulate(flags);
    assert!(half.step_seconds < leftover.step_seconds);
    let fwd = &["--rows", "2048", "--device-budget", "1GiB"][..];
    let (a, b) = (simulate(fwd), simulate(&[fwd, &["--simulate", "h100-half"][..]].concat()));
    assert!((a.step_seconds - b.step_seconds).abs() < 1e-9);
}

#[test]
fn a_simulation_it_does_not_know_is_refused() {
    assert!(matches!(
        MlpConfig::parse(["--simulate", "a100"]),
        Err(Error::InvalidArgument(m)) if m.contains("--simulate")
    ));
}
