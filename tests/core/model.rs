//! Model-based randomized test: long random sequences of put / read / write / remove / move_to /
//! lookup over tiny budgets, checked after every step against a plain `HashMap` shadow.
//!
//! Seeded and deterministic: a failure names the policy, seed and step. Rerun one seed with
//! `STRATA_MODEL_SEED=<seed> cargo test --test core model::`.

use crate::common;

use std::collections::HashMap;

use common::{assert_budgets, env_seed, is_space_error, Backend, Rng};
use strata::{DType, Error, PolicyKind, Store, TensorId, Tier};

const KIB: u64 = 1024;
const MAX_BYTES: u64 = 40 * KIB;
/// Names drawn from a small pool so that puts collide (DuplicateName) and the store stays near
/// full (64 tensors of ~11 KiB average more than fill the ~670 KiB of all tiers).
const NAMES: u64 = 64;
const SEEDS: [u64; 4] = [1, 2, 3, 0xDEAD_BEEF];
const STEPS: usize = 1500;

fn build(backend: Backend, policy: PolicyKind) -> Store {
    backend
        .builder()
        .capacity(Tier::Device, 64 * KIB)
        .capacity(Tier::Pinned, 64 * KIB)
        .capacity(Tier::Mapped, 32 * KIB)
        .capacity(Tier::Disk, 512 * KIB)
        .policy(policy)
        .build()
        .expect("build store")
}

thread_local! {
    static UNKNOWN_SEEN: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

#[derive(Default)]
struct Shadow {
    data: HashMap<TensorId, Vec<u8>>,
    names: HashMap<String, TensorId>,
    ids_of: HashMap<TensorId, String>,
    /// Ids that were removed: they must stay unknown.
    removed: Vec<TensorId>,
}

/// A random dtype and shape of 1 byte ..= 40 KiB (a quantized dtype's: whole blocks).
fn random_tensor(rng: &mut Rng) -> (DType, Vec<usize>, usize) {
    let dtype = *rng.pick(&DType::ALL);
    let size = dtype.size_of() as u64;
    // Mostly small, sometimes up to the maximum.
    let max_elems = if rng.chance(1, 2) { MAX_BYTES / size } else { 4 * KIB / size };
    let n = rng.range(1, max_elems) as usize;
    // `n` elements, or of a block-quantized dtype `n` blocks (`size` is a block's bytes).
    let per = dtype.block().map_or(1, |(elems, _)| elems);
    let shape = if n % 2 == 0 && rng.chance(1, 2) { vec![2, n / 2 * per] } else { vec![n * per] };
    (dtype, shape, n * size as usize)
}

/// Any id the shadow knows about, or a removed one now and then (`None`: no ids yet).
fn random_id(rng: &mut Rng, sh: &Shadow) -> Option<TensorId> {
    if !sh.removed.is_empty() && (sh.data.is_empty() || rng.chance(1, 8)) {
        return Some(*rng.pick(&sh.removed));
    }
    if sh.data.is_empty() {
        return None;
    }
    let mut ids: Vec<TensorId> = sh.data.keys().copied().collect();
    ids.sort();
    Some(*rng.pick(&ids))
}

fn expect_unknown<T: std::fmt::Debug>(res: strata::Result<T>, id: TensorId, ctx: &str) {
    UNKNOWN_SEEN.with(|c| c.set(c.get() + 1));
    match res {
        Err(Error::UnknownId(got)) => assert_eq!(got, id, "{ctx}: UnknownId names another id"),
        other => panic!("{ctx}: expected UnknownId({id:?}), got {other:?}"),
    }
}

/// Checks that hold after every step.
fn check_invariants(store: &Store, sh: &Shadow, ctx: &str) {
    let stats = store.stats();
    assert_budgets(&stats, ctx);
    assert_eq!(stats.tensors, sh.data.len(), "{ctx}: tensor count");
    let mut want: Vec<TensorId> = sh.data.keys().copied().collect();
    want.sort();
    assert_eq!(store.ids(), want, "{ctx}: ids()");
}

/// Reads every tensor and compares; checks names and residency of each.
fn check_all(store: &Store, sh: &Shadow, ctx: &str) {
    for (name, &id) in &sh.names {
        assert_eq!(store.lookup(name), Some(id), "{ctx}: lookup({name})");
        let info = store.info(id).unwrap_or_else(|e| panic!("{ctx}: info({id:?}): {e}"));
        assert_eq!(&info.name, name, "{ctx}: info name");
        assert!(!info.tiers.is_empty(), "{ctx}: {name} has no copy");
        assert_eq!(store.tier_of(id).unwrap(), info.tiers[0], "{ctx}: tier_of vs info.tiers");
        let got = store.read(id).unwrap_or_else(|e| panic!("{ctx}: read({name}): {e}"));
        assert!(got == sh.data[&id], "{ctx}: contents of {name} differ");
    }
    for &id in &sh.removed {
        expect_unknown(store.tier_of(id), id, ctx);
    }
    for k in 0..NAMES {
        let name = format!("t{k}");
        assert_eq!(store.lookup(&name), sh.names.get(&name).copied(), "{ctx}: lookup({name})");
    }
}

/// What the steps did, to show the run reached the interesting states.
#[derive(Default, Debug)]
struct Tally {
    puts: usize,
    put_space_errors: usize,
    moves: usize,
    move_space_errors: usize,
    writes: usize,
    write_space_errors: usize,
    unknown_id_errors: usize,
}

fn step(store: &Store, sh: &mut Shadow, rng: &mut Rng, tally: &mut Tally, ctx: &str) {
    match rng.below(100) {
        // put
        0..=24 => {
            let name = format!("t{}", rng.below(NAMES));
            let (dtype, shape, len) = random_tensor(rng);
            let data = rng.bytes(len);
            let tensors_before = store.stats().tensors;
            match store.put(&name, dtype, &shape, &data) {
                Ok(id) => {
                    assert!(
                        !sh.names.contains_key(&name),
                        "{ctx}: put of a taken name {name} succeeded"
                    );
                    assert!(
                        !sh.data.contains_key(&id) && !sh.removed.contains(&id),
                        "{ctx}: id {id:?} reused"
                    );
                    sh.data.insert(id, data);
                    sh.names.insert(name.clone(), id);
                    sh.ids_of.insert(id, name);
                    tally.puts += 1;
                }
                Err(Error::DuplicateName(n)) => {
                    assert_eq!(n, name, "{ctx}");
                    assert!(
                        sh.names.contains_key(&name),
                        "{ctx}: DuplicateName for a free name {name}"
                    );
                }
                Err(e) if is_space_error(&e) => {
                    assert!(!sh.names.contains_key(&name), "{ctx}: {e} for a taken name {name}");
                    assert_eq!(store.lookup(&name), None, "{ctx}: failed put left its name behind");
                    assert_eq!(
                        store.stats().tensors,
                        tensors_before,
                        "{ctx}: failed put left a tensor"
                    );
                    tally.put_space_errors += 1;
                }
                Err(e) => panic!("{ctx}: put({name}, {len} bytes) failed: {e}"),
            }
        }
        // read
        25..=49 => {
            let Some(id) = random_id(rng, sh) else { return };
            match sh.data.get(&id) {
                Some(want) => {
                    let got = store.read(id).unwrap_or_else(|e| panic!("{ctx}: read({id:?}): {e}"));
                    assert!(&got == want, "{ctx}: read({id:?}) returned other bytes");
                }
                None => expect_unknown(store.read(id), id, ctx),
            }
        }
        // write (sometimes with a wrong length)
        50..=64 => {
            let Some(id) = random_id(rng, sh) else { return };
            let Some(len) = sh.data.get(&id).map(Vec::len) else {
                expect_unknown(store.write(id, &[1, 2, 3]), id, ctx);
                return;
            };
            if rng.chance(1, 10) {
                let bad = if len > 1 && rng.chance(1, 2) { len - 1 } else { len + 1 };
                match store.write(id, &rng.bytes(bad)) {
                    Err(Error::LengthMismatch { expected, got, .. }) => {
                        assert_eq!((expected, got), (len as u64, bad as u64), "{ctx}");
                    }
                    other => panic!("{ctx}: write of {bad} bytes into {len}: {other:?}"),
                }
                return;
            }
            let data = rng.bytes(len);
            let before = store.tier_of(id).unwrap();
            let tiers_before = store.info(id).unwrap().tiers;
            match store.write(id, &data) {
                Ok(()) => {
                    assert_eq!(
                        store.info(id).unwrap().tiers,
                        vec![before],
                        "{ctx}: write keeps one replica, in the tier of the fastest"
                    );
                    sh.data.insert(id, data);
                    tally.writes += 1;
                }
                // A write needs room for its new bytes beside the old ones until it is done
                // (a failed write must leave the old bytes intact): a full store refuses it,
                // and the tensor is as it was.
                Err(e @ (Error::OutOfMemory { .. } | Error::TooLarge { .. })) => {
                    assert_eq!(store.info(id).unwrap().tiers, tiers_before, "{ctx}: {e}");
                    let got = store.read(id).unwrap();
                    assert!(&got == sh.data.get(&id).unwrap(), "{ctx}: {e} changed the bytes");
                    tally.write_space_errors += 1;
                }
                Err(e) => panic!("{ctx}: write({id:?}): {e}"),
            }
        }
        // remove
        65..=72 => {
            let Some(id) = random_id(rng, sh) else { return };
            if sh.data.contains_key(&id) {
                store.remove(id).unwrap_or_else(|e| panic!("{ctx}: remove({id:?}): {e}"));
                sh.data.remove(&id);
                let name = sh.ids_of.remove(&id).expect("shadow names");
                sh.names.remove(&name);
                sh.removed.push(id);
                assert_eq!(store.lookup(&name), None, "{ctx}: name of a removed tensor");
                expect_unknown(store.read(id), id, ctx);
                expect_unknown(store.info(id), id, ctx);
            } else {
                expect_unknown(store.remove(id), id, ctx);
            }
        }
        // move_to
        73..=94 => {
            let Some(id) = random_id(rng, sh) else { return };
            let to = *rng.pick(&Tier::ALL);
            if !sh.data.contains_key(&id) {
                expect_unknown(store.move_to(id, to), id, ctx);
                return;
            }
            match store.move_to(id, to) {
                Ok(()) => {
                    assert_eq!(
                        store.tier_of(id).unwrap(),
                        to,
                        "{ctx}: tier_of after move_to({to})"
                    );
                    let held = store.info(id).unwrap().tiers;
                    assert_eq!(held[0], to, "{ctx}: tiers after move_to({to}): {held:?}");
                    tally.moves += 1;
                }
                Err(e) if is_space_error(&e) => {
                    assert!(
                        !store.info(id).unwrap().tiers.is_empty(),
                        "{ctx}: failed move lost every copy"
                    );
                    tally.move_space_errors += 1;
                }
                Err(e) => panic!("{ctx}: move_to({id:?}, {to}) failed: {e}"),
            }
        }
        // lookup / tier_of / info
        _ => {
            let name = format!("t{}", rng.below(NAMES));
            let got = store.lookup(&name);
            assert_eq!(got, sh.names.get(&name).copied(), "{ctx}: lookup({name})");
            if let Some(id) = got {
                let info = store.info(id).unwrap();
                assert_eq!(info.name, name, "{ctx}");
                assert_eq!(info.bytes as usize, sh.data[&id].len(), "{ctx}: info bytes");
                assert_eq!(store.tier_of(id).unwrap(), info.tiers[0], "{ctx}");
            }
        }
    }
}

fn run(backend: Backend, policy: PolicyKind, seed: u64, steps: usize, tally: &mut Tally) -> u64 {
    let store = build(backend, policy);
    let mut sh = Shadow::default();
    let mut rng = Rng::new(seed);
    for i in 0..steps {
        let ctx = format!("policy {policy}, seed {seed}, step {i}");
        step(&store, &mut sh, &mut rng, tally, &ctx);
        check_invariants(&store, &sh, &ctx);
        if i % 250 == 249 {
            check_all(&store, &sh, &ctx);
        }
    }
    check_all(&store, &sh, &format!("policy {policy}, seed {seed}, end"));
    let evictions = store.stats().evictions;
    // Empty the store: everything is freed.
    for id in sh.data.keys().copied().collect::<Vec<_>>() {
        store.remove(id).unwrap();
    }
    // Memory a copy still in flight touches (an upload a read's promotion issued) is freed
    // once that copy has run.
    store.wait_for_copies().unwrap();
    let s = store.stats();
    for t in Tier::ALL {
        assert_eq!(s.used(t), 0, "policy {policy}, seed {seed}: {t} still used when empty");
    }
    evictions
}

#[test]
fn random_operations_match_a_hashmap_shadow() {
    common::each_backend("random_operations_match_a_hashmap_shadow", |backend| {
        // The count of UnknownId checks is per thread: start each backend's run from zero.
        UNKNOWN_SEEN.with(|c| c.set(0));
        let seeds: Vec<u64> = match env_seed("STRATA_MODEL_SEED") {
            Some(s) => vec![s],
            None => SEEDS.to_vec(),
        };
        let mut total = 0;
        let mut evictions = 0;
        let mut tally = Tally::default();
        for policy in PolicyKind::ALL {
            for &seed in &seeds {
                evictions += run(backend, policy, seed, STEPS, &mut tally);
                total += STEPS;
            }
        }
        tally.unknown_id_errors = UNKNOWN_SEEN.with(|c| c.get());
        eprintln!("{}: {total} operations, {evictions} evictions, {tally:?}", backend.name());
        assert!(seeds.len() < SEEDS.len() || total >= 10_000, "only {total} operations");
        // The budgets are tiny on purpose: the run must have exercised eviction and full tiers.
        assert!(
            evictions > 0,
            "no evictions in {total} operations: budgets too large for the test"
        );
        assert!(tally.put_space_errors + tally.move_space_errors > 0, "the store was never full");
        assert!(tally.unknown_id_errors > 0 && tally.moves > 0 && tally.puts > 0, "{tally:?}");
        assert!(tally.writes > tally.write_space_errors, "{tally:?}");
    });
}
