//! strata::optim against a plain in-memory reference written here, with budgets so small that
//! the optimizer state spills to Disk: every engine, SGD and AdamW, f32 and bf16 parameters.

mod common;

use std::sync::Arc;

use common::{each_backend, Backend, Rng};
use half::bf16;
use strata::optim::{AdamW, Algorithm, Engine, Optimizer, OptimizerConfig, Sgd};
use strata::{DType, Group, Store, Tier};

const N: usize = 20_000; // more than three 4096-element blocks: several threads get work
const PARAMS: usize = 3;
const STEPS: u64 = 5;

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4).map(|c| f32::from_ne_bytes([c[0], c[1], c[2], c[3]])).collect()
}

fn bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_ne_bytes()).collect()
}

/// PyTorch's single-tensor AdamW, written out from its source: hyperparameters are Python
/// floats (f64), each scalar is rounded to f32 where it meets a tensor, and `lerp` takes its
/// second form for weights of 0.5 and more.
fn reference_adamw(h: &AdamW, p: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32], t: u64) {
    let bc1 = 1.0 - h.beta1.powi(t as i32);
    let bc2 = 1.0 - h.beta2.powi(t as i32);
    let step_size = (h.lr / bc1) as f32;
    let bc2_sqrt = bc2.sqrt() as f32;
    let decay = (1.0 - h.lr * h.weight_decay) as f32;
    let w = (1.0 - h.beta1) as f32;
    for i in 0..p.len() {
        p[i] *= decay;
        m[i] =
            if w.abs() < 0.5 { m[i] + w * (g[i] - m[i]) } else { g[i] - (g[i] - m[i]) * (1.0 - w) };
        v[i] = v[i] * h.beta2 as f32 + (1.0 - h.beta2) as f32 * g[i] * g[i];
        let denom = v[i].sqrt() / bc2_sqrt + h.eps as f32;
        p[i] += -step_size * (m[i] / denom);
    }
}

fn reference_sgd(h: &Sgd, p: &mut [f32], g: &[f32]) {
    for (p, &g) in p.iter_mut().zip(g) {
        let g = g + h.weight_decay as f32 * *p;
        *p += -(h.lr as f32) * g;
    }
}

fn store(backend: Backend, mapped: bool) -> Arc<Store> {
    let dir = tempfile::tempdir().unwrap();
    let s = backend
        .builder()
        .capacity(Tier::Device, 4 << 20)
        .capacity(Tier::Pinned, 200 << 10) // the parameters and a little: the state spills
        .capacity(Tier::Mapped, if mapped { 4 << 20 } else { 0 })
        .capacity(Tier::Disk, 16 << 20)
        .disk_dir(dir.path())
        .build()
        .unwrap();
    std::mem::forget(dir); // the store's slab file lives in it until the process ends
    Arc::new(s)
}

/// Runs STEPS steps of `alg` on `engine` with seeded gradients; returns the final parameters
/// (as f32) and the tiers the state ended in.
fn train(
    backend: Backend,
    alg: Algorithm,
    engine: Engine,
    threads: usize,
    dtype: DType,
) -> (Vec<Vec<f32>>, Vec<Tier>) {
    let store = store(backend, engine == Engine::GpuMapped);
    let mut rng = Rng::new(7);
    let init: Vec<Vec<f32>> =
        (0..PARAMS).map(|_| (0..N).map(|_| rng.next_f32() * 2.0 - 1.0).collect()).collect();
    let ids: Vec<_> = init
        .iter()
        .enumerate()
        .map(|(i, w)| {
            let data = match dtype {
                DType::F32 => bytes(w),
                _ => w.iter().flat_map(|x| bf16::from_f32(*x).to_bits().to_ne_bytes()).collect(),
            };
            store.put_group(&format!("w{i}"), Group::Param, dtype, &[100, N / 100], &data).unwrap()
        })
        .collect();
    for &id in &ids {
        store.move_to(id, Tier::Pinned).unwrap();
    }
    let s = store.stream().unwrap();
    let mut cfg = OptimizerConfig::new(alg, engine);
    cfg.threads = threads;
    cfg.grad_dtype = Some(DType::F32);
    let mut opt = Optimizer::new(store.clone(), &s, &ids, cfg).unwrap();
    let mut grng = Rng::new(11);
    for _ in 0..STEPS {
        for &id in &ids[..PARAMS] {
            let g: Vec<f32> = (0..N).map(|_| grng.next_f32() - 0.5).collect();
            store.write(opt.grad(id).unwrap(), &bytes(&g)).unwrap();
            opt.update(id).unwrap();
        }
        opt.finish().unwrap();
    }
    s.synchronize().unwrap();
    store.check_err().unwrap();
    let tiers = opt.state_tensors().iter().map(|&id| store.tier_of(id).unwrap()).collect();
    let out = ids
        .iter()
        .map(|&id| {
            let b = store.read(id).unwrap();
            match dtype {
                DType::F32 => f32s(&b),
                _ => b
                    .chunks_exact(2)
                    .map(|c| bf16::from_bits(u16::from_ne_bytes([c[0], c[1]])).to_f32())
                    .collect(),
            }
        })
        .collect();
    (out, tiers)
}

/// The reference run: the same init and gradients, f32 master weights, rounded to bf16 at the
/// end when the parameters are bf16.
fn expected(alg: Algorithm, dtype: DType) -> Vec<Vec<f32>> {
    let mut rng = Rng::new(7);
    let mut p: Vec<Vec<f32>> =
        (0..PARAMS).map(|_| (0..N).map(|_| rng.next_f32() * 2.0 - 1.0).collect()).collect();
    if dtype == DType::BF16 {
        for w in &mut p {
            for x in w.iter_mut() {
                *x = bf16::from_f32(*x).to_f32();
            }
        }
    }
    let mut m = vec![vec![0f32; N]; PARAMS];
    let mut v = vec![vec![0f32; N]; PARAMS];
    let mut grng = Rng::new(11);
    for t in 1..=STEPS {
        for i in 0..PARAMS {
            let g: Vec<f32> = (0..N).map(|_| grng.next_f32() - 0.5).collect();
            match &alg {
                Algorithm::AdamW(h) => reference_adamw(h, &mut p[i], &mut m[i], &mut v[i], &g, t),
                Algorithm::Sgd(h) => reference_sgd(h, &mut p[i], &g),
            }
        }
    }
    if dtype == DType::BF16 {
        for w in &mut p {
            for x in w.iter_mut() {
                *x = bf16::from_f32(*x).to_f32();
            }
        }
    }
    p
}

fn assert_close(got: &[Vec<f32>], want: &[Vec<f32>], what: &str) {
    for (g, w) in got.iter().zip(want) {
        for (i, (a, b)) in g.iter().zip(w).enumerate() {
            let tol = 1e-6 * b.abs().max(1e-3);
            assert!((a - b).abs() <= tol, "{what}: element {i}: {a} vs reference {b}");
        }
    }
}

fn algorithms() -> [Algorithm; 3] {
    [
        Algorithm::Sgd(Sgd { lr: 0.05, weight_decay: 0.01 }),
        Algorithm::AdamW(AdamW { lr: 0.01, weight_decay: 0.1, ..AdamW::default() }),
        // beta1 below 0.5: torch's lerp takes its other form.
        Algorithm::AdamW(AdamW { lr: 0.01, beta1: 0.3, ..AdamW::default() }),
    ]
}

#[test]
fn every_engine_matches_the_reference_with_state_on_disk() {
    each_backend("every_engine_matches_the_reference_with_state_on_disk", |backend| {
        for alg in algorithms() {
            for dtype in [DType::F32, DType::BF16] {
                let want = expected(alg, dtype);
                let (cpu1, tiers) = train(backend, alg, Engine::Cpu, 1, dtype);
                assert_close(&cpu1, &want, &format!("{alg:?} {dtype} cpu"));
                if alg.moments() > 0 {
                    assert!(tiers.contains(&Tier::Disk), "state spilled to disk: {tiers:?}");
                }
                let (cpu4, _) = train(backend, alg, Engine::Cpu, 4, dtype);
                assert_eq!(cpu1, cpu4, "1 and 4 threads give the same bits");
                for engine in [Engine::GpuMapped, Engine::GpuResident] {
                    let (got, tiers) = train(backend, alg, engine, 1, dtype);
                    assert_close(&got, &want, &format!("{alg:?} {dtype} {engine}"));
                    if engine == Engine::GpuMapped {
                        assert!(tiers.iter().all(|&t| t == Tier::Mapped), "{tiers:?}");
                    }
                }
            }
        }
    });
}

#[test]
fn auto_picks_an_engine_and_says_why() {
    let store = store(Backend::Host, true);
    let w = store.put("w", DType::F32, &[N], &vec![0u8; N * 4]).unwrap();
    let s = store.stream().unwrap();
    let cfg = OptimizerConfig::new(Algorithm::AdamW(AdamW::default()), Engine::Auto);
    let opt = Optimizer::new(store.clone(), &s, &[w], cfg).unwrap();
    let choice = opt.choice().expect("auto says why");
    assert_ne!(opt.engine(), Engine::Auto);
    assert_eq!(choice.engine, opt.engine());
    assert_eq!(choice.estimates.len(), 3);
    let fastest = choice
        .estimates
        .iter()
        .filter_map(|(e, r)| r.as_ref().ok().map(|s| (*e, *s)))
        .min_by(|a, b| a.1.total_cmp(&b.1))
        .unwrap();
    assert_eq!(fastest.0, choice.engine, "{choice}");
    assert!(choice.to_string().starts_with("auto chose"));
}

#[test]
fn bad_parameters_are_typed_errors() {
    let store = store(Backend::Host, true);
    let s = store.stream().unwrap();
    let i = store.put("idx", DType::I64, &[4], &[0u8; 32]).unwrap();
    let cfg = OptimizerConfig::new(Algorithm::AdamW(AdamW::default()), Engine::Cpu);
    let e = Optimizer::new(store.clone(), &s, &[i], cfg).unwrap_err();
    assert!(matches!(e, strata::Error::InvalidArgument(ref m) if m.contains("idx")), "{e}");
    let w = store.put("w", DType::F32, &[4], &[0u8; 16]).unwrap();
    let empty = store.put("empty", DType::F32, &[0], &[]).unwrap();
    let twice = Optimizer::new(store.clone(), &s, &[w, w], cfg).unwrap_err();
    assert!(
        matches!(twice, strata::Error::InvalidArgument(ref m) if m.contains("twice")),
        "{twice}"
    );
    let mut opt = Optimizer::new(store.clone(), &s, &[w, empty], cfg).unwrap();
    // A tensor the optimizer does not train is a typed error naming it, not a panic.
    assert!(
        matches!(opt.update(i), Err(strata::Error::InvalidArgument(ref m)) if m.contains(&i.to_string()))
    );
    assert!(opt.grad(i).is_err() && opt.master(i).is_err());
    assert_eq!(opt.params().collect::<Vec<_>>(), vec![w, empty]);
    opt.update(empty).unwrap(); // zero elements: nothing to do, and the worker lives on
    opt.update(w).unwrap();
    opt.finish().unwrap();
    assert_eq!(opt.steps(), 1);
    assert_eq!("gpu-mapped".parse::<Engine>().unwrap(), Engine::GpuMapped);
    assert!("gpu".parse::<Engine>().is_err());
}
