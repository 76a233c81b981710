//! The host backend in simulated time (`StoreBuilder::simulate`): a copy takes its simulated
//! time and overlaps the host, bad simulations are refused, and a simulated store's streams do
//! not mix with another store's. The model checks of the out-of-core MLP's pipeline in simulated
//! time (`strata train-demo --simulate h100`) are the binary's unit tests
//! (`src/cli/mlp/simulated_tests.rs`).

use strata::{DType, Error, Machine, Simulation, Store, Tier};

/// The simulator's view of the H100 preset.
fn h100() -> Simulation {
    Simulation::of(&Machine::h100()).unwrap()
}

#[test]
fn model_check_a_copy_takes_its_simulated_time_and_overlaps_the_host() {
    // Each byte stands for 1 MiB: 64 KiB is timed as 64 GiB, about 1.27 s at 54.3 GB/s.
    let sim = h100().scaled((1 << 20) as f64, 1.0);
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
    let mut sim = h100();
    sim.h2d_bytes_per_s = -1.0;
    assert!(matches!(Store::builder().simulate(sim).build(), Err(Error::InvalidArgument(_))));
}

#[test]
fn streams_of_a_simulated_store_and_a_real_one_do_not_mix() {
    let sim = Store::builder().simulate(h100()).build().unwrap();
    let real = Store::builder().host_backend().build().unwrap();
    let w = sim.put("w", DType::U8, &[4096], &[1; 4096]).unwrap();
    let v = real.put("v", DType::U8, &[4096], &[2; 4096]).unwrap();
    let (s_sim, s_real) = (sim.stream().unwrap(), real.stream().unwrap());
    assert!(matches!(sim.device_view(w, &s_real), Err(Error::BackendMismatch(_))));
    assert!(matches!(real.device_view(v, &s_sim), Err(Error::BackendMismatch(_))));
    assert!(sim.device_view(w, &s_sim).is_ok());
    assert!(real.device_view(v, &s_real).is_ok());
    // Two simulated stores have two clocks.
    let other = Store::builder().simulate(h100()).build().unwrap();
    let s_other = other.stream().unwrap();
    assert!(matches!(sim.device_view(w, &s_other), Err(Error::BackendMismatch(_))));
    assert!(matches!(strata::linalg::Linalg::new(&sim, &s_other), Err(Error::BackendMismatch(_))));
}
