//! The out-of-core MLP ([`super`], `strata train-demo`) against the all-resident run of the same
//! loop: a tiny model whose weights do not fit the device budget, trained and run forward, with
//! and without hints, under each policy. On the host backend the GEMMs are the reference loop; on
//! CUDA, cuBLAS (where a GPU is present).

use super::{run, MlpConfig, Mode};
use crate::cli::common;

fn check(backend: common::Backend, flags: &[&str]) {
    let mut args: Vec<&str> = vec![
        "--layers",
        "4",
        "--hidden",
        "64",
        "--rows",
        "8",
        "--device-budget",
        "24KiB",
        "--steps",
        "3",
    ];
    args.extend_from_slice(flags);
    if backend == common::Backend::Host {
        args.push("--host");
    }
    let cfg = MlpConfig::parse(&args).unwrap();
    let report =
        run(&cfg, |_| Ok(())).unwrap_or_else(|e| panic!("{flags:?} on {}: {e}", backend.name()));
    assert_eq!(
        report.matches_resident,
        Some(true),
        "{flags:?} on {}: max diff {}",
        backend.name(),
        report.max_abs_diff
    );
    // The budget holds 3 of the 4 layers: every step moves weights.
    assert!(report.steps.iter().all(|s| s.h2d_bytes > 0), "{flags:?}");
    if cfg.mode == Mode::Train {
        assert!(report.steps.iter().skip(1).all(|s| s.d2h_bytes > 0), "{flags:?}: no write-back");
    }
    if cfg.hints {
        let misses: u64 = report.steps.iter().skip(1).map(|s| s.prefetch_misses).sum();
        assert_eq!(misses, 0, "{flags:?} on {}: misses after the first step", backend.name());
    }
}

#[test]
fn a_tiny_model_trained_out_of_core_matches_the_resident_run() -> strata::Result<()> {
    let cfg = MlpConfig::parse([
        "--layers",
        "4",
        "--hidden",
        "64",
        "--rows",
        "8",
        "--device-budget",
        "24KiB",
        "--mode",
        "train",
        "--host",
    ])?;
    let report = run(&cfg, |_| Ok(()))?;
    assert_eq!(report.matches_resident, Some(true));
    Ok(())
}

#[test]
fn training_out_of_core_equals_the_resident_run() {
    common::each_backend("training_out_of_core_equals_the_resident_run", |b| {
        for policy in ["schedule", "frequency", "lru"] {
            check(b, &["--mode", "train", "--policy", policy]);
            check(b, &["--mode", "train", "--policy", policy, "--hints", "off"]);
        }
        check(b, &["--mode", "train", "--weights-in", "disk"]);
    });
}

#[test]
fn forward_out_of_core_equals_the_resident_run() {
    common::each_backend("forward_out_of_core_equals_the_resident_run", |b| {
        for policy in ["schedule", "frequency"] {
            check(b, &["--mode", "forward", "--policy", policy]);
            check(b, &["--mode", "forward", "--policy", policy, "--hints", "off"]);
        }
    });
}

#[test]
fn bad_flags_are_errors() {
    for args in [
        &["--layers", "0"][..],
        &["--mode", "sideways"],
        &["--weights-in", "mapped"],
        &["--nope", "1"],
        &["--rows"],
    ] {
        assert!(MlpConfig::parse(args).is_err(), "{args:?}");
    }
}

#[test]
fn a_model_too_large_for_the_host_is_an_error_not_an_abort() {
    let cfg = MlpConfig::parse(["--layers", "4", "--hidden", "2000000", "--rows", "8", "--host"])
        .unwrap();
    match run(&cfg, |_| Ok(())) {
        Err(strata::Error::InvalidArgument(m)) => assert!(m.contains("of host memory"), "{m}"),
        other => panic!("want a clear error, got {:?}", other.map(|_| ())),
    }
}
