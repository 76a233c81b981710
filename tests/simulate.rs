//! Model checks: the host backend in simulated time (`StoreBuilder::simulate`, `--simulate h100`)
//! places copies and kernels on a simulated timeline, deterministically, so the pipeline the
//! store builds for the out-of-core MLP at the shapes of its GPU rows (L=32, H=8192, 4 GiB of weights)
//! can be checked on a machine without a GPU, in milliseconds: what waits for what, how many bytes
//! cross, and where the simulated step lands against its floors, under the model
//! `strata::Simulation` documents. They check the model, not the MLP's GPU targets: those are GPU
//! figures, measured by `benches/gpu/run perf` on a GPU and recorded in docs/benchmarks.md.

use strata::cli::mlp::{run, MlpConfig, MlpReport};
use strata::{DType, Error, Simulation, Store, Tier};

fn simulate(flags: &[&str]) -> MlpReport {
    let mut args = vec!["--layers", "32", "--hidden", "8192", "--simulate", "h100", "--steps", "6"];
    args.extend_from_slice(flags);
    let cfg = MlpConfig::parse(&args).unwrap();
    let report = run(&cfg, |_| Ok(())).unwrap_or_else(|e| panic!("{flags:?}: {e}"));
    assert!(report.simulated);
    assert_eq!(report.matches_resident, Some(true), "{flags:?}: differs from the resident run");
    report
}

/// Steps after the first: no misses, and at most `max_bytes` into the device each.
fn steady(report: &MlpReport, flags: &[&str]) {
    for (i, s) in report.steps.iter().enumerate().skip(1) {
        assert_eq!(s.prefetch_misses, 0, "{flags:?}: step {} missed", i + 1);
        assert!(
            s.h2d_bytes <= report.min_bytes.0,
            "{flags:?}: step {} moved {} into the device, more than the {} that must cross",
            i + 1,
            s.h2d_bytes,
            report.min_bytes.0
        );
    }
}

#[test]
fn model_check_forward_streams_at_the_simulated_pcie_floor() {
    // In the model, the forward pipeline keeps the copy engine busy: the simulated step within 5%
    // of max(compute, PCIe) (the bound of the MLP's forward targets), at 1 and 2 GiB of budget
    // and with both few (transfer-bound) and many (compute-bound) rows. Not the GPU target.
    for flags in [
        &["--rows", "2048", "--device-budget", "1GiB"][..],
        &["--rows", "16384", "--device-budget", "1GiB"],
        &["--rows", "2048", "--device-budget", "2GiB"],
    ] {
        let r = simulate(flags);
        steady(&r, flags);
        let ratio = r.ratio.expect("both floors are known");
        assert!(ratio <= 1.05, "{flags:?}: {ratio:.3}x its floor");
    }
}

#[test]
fn model_check_training_moves_weights_both_ways_near_the_simulated_floor() {
    // In the model, the training pipeline moves weights both ways within 15% of its floor (the
    // bound of the MLP's training target), with the byte counts below. Not the GPU target.
    let flags = &["--mode", "train", "--rows", "4096", "--device-budget", "1GiB"][..];
    let r = simulate(flags);
    let ratio = r.ratio.expect("both floors are known");
    assert!(ratio <= 1.15, "{ratio:.3}x its floor");
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
fn model_check_a_copy_takes_its_simulated_time_and_overlaps_the_host() {
    // Each byte stands for 1 MiB: 64 KiB is timed as 64 GiB, about 1.27 s at 54.3 GB/s.
    let sim = Simulation::h100().scaled((1 << 20) as f64, 1.0);
    let store = Store::builder()
        .simulate(sim)
        .capacity(Tier::Device, 1 << 20)
        .capacity(Tier::Pinned, 1 << 20)
        .timeline(true)
        .build()
        .unwrap();
    assert_eq!(store.simulation(), Some(sim));
    let w = store.put("w", DType::U8, &[65536], &[7; 65536]).unwrap();
    store.move_to(w, Tier::Pinned).unwrap();
    let copy = 65536.0 * (1 << 20) as f64 / sim.h2d_bytes_per_s;

    // A prefetch returns at once: the host's clock has only paid the launch.
    let t0 = store.simulated_seconds().unwrap();
    store.prefetch(&[w]).unwrap();
    let issued = store.simulated_seconds().unwrap() - t0;
    assert!(issued < 1e-3, "the host waited {issued} s for a prefetch");

    // Reading the bytes back waits for the copy.
    let s = store.stream().unwrap();
    let v = store.device_view(w, &s).unwrap();
    assert!(v.with_host_bytes(|b| b.iter().all(|&x| x == 7)).unwrap());
    drop(v);
    s.synchronize().unwrap();
    let waited = store.simulated_seconds().unwrap() - t0;
    assert!((waited - copy).abs() < 1e-3, "{waited} s, expected {copy} s");
    let stats = store.stats();
    assert!(stats.stall_seconds > copy * 0.99, "stall {} s", stats.stall_seconds);
}

#[test]
fn bad_simulations_are_refused() {
    let mut sim = Simulation::h100();
    sim.h2d_bytes_per_s = -1.0;
    assert!(matches!(Store::builder().simulate(sim).build(), Err(Error::InvalidArgument(_))));
    assert!(matches!(
        MlpConfig::parse(["--simulate", "a100"]),
        Err(Error::InvalidArgument(m)) if m.contains("--simulate")
    ));
}

#[test]
fn streams_of_a_simulated_store_and_a_real_one_do_not_mix() {
    let sim = Store::builder().simulate(Simulation::h100()).build().unwrap();
    let real = Store::builder().host_backend().build().unwrap();
    let w = sim.put("w", DType::U8, &[4096], &[1; 4096]).unwrap();
    let v = real.put("v", DType::U8, &[4096], &[2; 4096]).unwrap();
    let (s_sim, s_real) = (sim.stream().unwrap(), real.stream().unwrap());
    assert!(matches!(sim.device_view(w, &s_real), Err(Error::BackendMismatch(_))));
    assert!(matches!(real.device_view(v, &s_sim), Err(Error::BackendMismatch(_))));
    assert!(sim.device_view(w, &s_sim).is_ok());
    assert!(real.device_view(v, &s_real).is_ok());
    // Two simulated stores have two clocks.
    let other = Store::builder().simulate(Simulation::h100()).build().unwrap();
    let s_other = other.stream().unwrap();
    assert!(matches!(sim.device_view(w, &s_other), Err(Error::BackendMismatch(_))));
    assert!(matches!(strata::linalg::Linalg::new(&sim, &s_other), Err(Error::BackendMismatch(_))));
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
