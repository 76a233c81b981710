//! The fused ops of `strata::candle::fused` (CPU candle) against the decomposed candle ops they
//! replace: values and gradients at several shapes (grouped-query heads, odd lengths, key tiles
//! crossed, sliding windows, queries after a KV cache, strided keys), in f32, bf16 and f16; their
//! gradients against finite differences; a whole block fused against decomposed; the same bits
//! on one thread and on several; errors for what they cannot take; gradients summed in place in
//! f32; and with `candle-cuda` on a GPU, the CUDA kernels (and the accumulating linear's cuBLAS
//! weight gradient) against the CPU code.
//!
//! Tolerances, as the largest difference over the largest reference value (measured on
//! 2026-11-26, in brackets): f32 4e-6 (7.4e-7: the fused ops sum in another order than
//! candle's); bf16 1e-2 (4.5e-3), values and gradients, against the decomposed ops in f32 on the
//! same bf16 inputs (a bf16 result is rounded once, to 2⁻⁹ relative), f16 2e-3 (5.4e-4); finite
//! differences 1e-3 over the largest gradient (2.1e-5: f32 differences of a loss summed in f64,
//! step 1e-2).

use candle_core::{DType, Device, Tensor, Var, D};
use strata::candle::fused;
use strata::candle::llama::{
    block_forward_with, random_weights, softmax_last_dim, BlockWeights, Compute, Rope, SeededRng,
};
use strata::candle::LlamaConfig;

fn randn(rng: &mut SeededRng, shape: &[usize]) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|_| rng.normal(1.0) as f32).collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

/// The largest `|a - b|` over the largest `|b|`.
fn rel(a: &Tensor, b: &Tensor) -> f32 {
    let a = a.to_dtype(DType::F32).unwrap().to_device(&Device::Cpu).unwrap();
    let b = b.to_dtype(DType::F32).unwrap().to_device(&Device::Cpu).unwrap();
    assert_eq!(a.dims(), b.dims());
    let diff = (&a - &b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
    let scale = b.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
    diff / scale.max(1e-30)
}

/// Attention written with plain candle ops over `[batch, seq, heads, head_dim]`: the
/// reference.
fn reference_attention(q: &Tensor, k: &Tensor, v: &Tensor, window: Option<usize>) -> Tensor {
    let (_, sq, nh, d) = q.dims4().unwrap();
    let (b, skv, nkv, _) = k.dims4().unwrap();
    let n = nh / nkv;
    let heads = |t: &Tensor| t.transpose(1, 2).unwrap().contiguous().unwrap();
    let repeat = |t: &Tensor| {
        let t = heads(t);
        Tensor::cat(&vec![&t; n], 2).unwrap().reshape((b, nh, skv, d)).unwrap()
    };
    let (qh, kh, vh) = (heads(q), repeat(k), repeat(v));
    let scores = (qh.matmul(&kh.t().unwrap()).unwrap() * (1.0 / (d as f64).sqrt())).unwrap();
    let offset = skv - sq;
    let w = window.unwrap_or(usize::MAX);
    let mask: Vec<f32> = (0..sq)
        .flat_map(|i| {
            (0..skv).map(move |j| {
                let p = offset + i;
                if j > p || p - j >= w {
                    f32::NEG_INFINITY
                } else {
                    0.0
                }
            })
        })
        .collect();
    let mask = Tensor::from_vec(mask, (sq, skv), &Device::Cpu).unwrap();
    let p = softmax_last_dim(&scores.broadcast_add(&mask).unwrap()).unwrap();
    p.matmul(&vh).unwrap().transpose(1, 2).unwrap()
}

/// The value of `f(inputs)` and the gradients of `sum(f(inputs) · r)` for a fixed random `r`,
/// the inputs made `Var`s of `dtype` (on the inputs' device).
fn value_and_grads(
    inputs: &[Tensor],
    dtype: DType,
    f: &dyn Fn(&[Tensor]) -> Tensor,
) -> (Tensor, Vec<Tensor>) {
    let vars: Vec<Var> =
        inputs.iter().map(|t| Var::from_tensor(&t.to_dtype(dtype).unwrap()).unwrap()).collect();
    let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let y = f(&ts);
    let r = randn(&mut SeededRng::new(99), y.dims());
    let r = r.to_dtype(y.dtype()).unwrap().to_device(y.device()).unwrap();
    let grads = y.mul(&r).unwrap().sum_all().unwrap().backward().unwrap();
    let g = vars.iter().map(|v| grads.get(v.as_tensor()).expect("a gradient").clone()).collect();
    (y, g)
}

/// The fused `f` against the reference `r` on `inputs`: values and gradients, f32 (within
/// 4e-6), bf16 and f16 (within 1e-2 and 2e-3 of the reference in f32 on the rounded inputs).
fn check(
    what: &str,
    inputs: &[Tensor],
    f: &dyn Fn(&[Tensor]) -> Tensor,
    r: &dyn Fn(&[Tensor]) -> Tensor,
) {
    let (fy, fg) = value_and_grads(inputs, DType::F32, f);
    let (ry, rg) = value_and_grads(inputs, DType::F32, r);
    assert!(rel(&fy, &ry) < 4e-6, "{what} f32 value: {}", rel(&fy, &ry));
    for (i, (a, b)) in fg.iter().zip(&rg).enumerate() {
        assert!(rel(a, b) < 4e-6, "{what} f32 gradient {i}: {}", rel(a, b));
    }
    for (dtype, tol) in [(DType::BF16, 1e-2), (DType::F16, 2e-3)] {
        let rounded: Vec<Tensor> = inputs.iter().map(|t| t.to_dtype(dtype).unwrap()).collect();
        let (fy, fg) = value_and_grads(&rounded, dtype, f);
        let (ry, rg) = value_and_grads(&rounded, DType::F32, r);
        assert_eq!(fy.dtype(), dtype);
        assert!(rel(&fy, &ry) < tol, "{what} {dtype:?} value: {}", rel(&fy, &ry));
        for (i, (a, b)) in fg.iter().zip(&rg).enumerate() {
            assert_eq!(a.dtype(), dtype);
            assert!(rel(a, b) < tol, "{what} {dtype:?} gradient {i}: {}", rel(a, b));
        }
    }
}

/// `sum(f(inputs) · r)` in f64 (the same `r` as [`value_and_grads`]).
fn loss(inputs: &[Tensor], f: &dyn Fn(&[Tensor]) -> Tensor) -> f64 {
    let y = f(inputs);
    let r = randn(&mut SeededRng::new(99), y.dims());
    let y: Vec<f32> = y.flatten_all().unwrap().to_vec1().unwrap();
    let r: Vec<f32> = r.flatten_all().unwrap().to_vec1().unwrap();
    y.iter().zip(&r).map(|(a, b)| f64::from(*a) * f64::from(*b)).sum()
}

/// `f`'s gradients (f32) against central differences at a few elements of each input.
fn finite_differences(what: &str, inputs: &[Tensor], f: &dyn Fn(&[Tensor]) -> Tensor) {
    let (_, grads) = value_and_grads(inputs, DType::F32, f);
    let h = 1e-2f32;
    let mut rng = SeededRng::new(5);
    for (a, (x, g)) in inputs.iter().zip(&grads).enumerate() {
        let shape = x.dims().to_vec();
        let base: Vec<f32> = x.flatten_all().unwrap().to_vec1().unwrap();
        let g: Vec<f32> = g.flatten_all().unwrap().to_vec1().unwrap();
        let gmax = g.iter().fold(0f32, |m, v| m.max(v.abs()));
        for _ in 0..6 {
            let e = rng.below(base.len() as u64) as usize;
            let at = |delta: f32| {
                let mut v = base.clone();
                v[e] += delta;
                let mut ins = inputs.to_vec();
                ins[a] = Tensor::from_vec(v, shape.as_slice(), &Device::Cpu).unwrap();
                loss(&ins, f)
            };
            let fd = (at(h) - at(-h)) / (2.0 * f64::from(h));
            let err = (fd - f64::from(g[e])).abs() / f64::from(gmax).max(1e-6);
            assert!(err < 1e-3, "{what}: input {a} element {e}: {fd} against {}", g[e]);
        }
    }
}

/// (batch, q_len, kv_len, heads, kv_heads, head_dim, window)
type AttentionShape = (usize, usize, usize, usize, usize, usize, Option<usize>);

const ATTENTION_SHAPES: [AttentionShape; 6] = [
    (2, 37, 37, 4, 2, 16, None),    // grouped-query, odd length
    (1, 70, 70, 2, 2, 8, Some(20)), // across key tiles, a sliding window
    (1, 5, 70, 6, 3, 8, None),      // queries after 65 cached positions
    (1, 3, 130, 4, 1, 8, Some(64)), // one key/value head, a window over a cache
    (1, 1, 9, 2, 1, 8, None),       // one new token
    (1, 66, 66, 3, 3, 12, Some(1)), // a window of one: each query sees itself
];

#[test]
fn attention_equals_the_decomposed_attention_values_and_gradients() {
    let mut rng = SeededRng::new(1);
    for (b, sq, skv, nh, nkv, d, window) in ATTENTION_SHAPES {
        let q = randn(&mut rng, &[b, sq, nh, d]);
        let k = randn(&mut rng, &[b, skv, nkv, d]);
        let v = randn(&mut rng, &[b, skv, nkv, d]);
        let scale = 1.0 / (d as f64).sqrt();
        check(
            &format!("attention {:?}", (b, sq, skv, nh, nkv, d, window)),
            &[q, k, v],
            &|t| fused::attention(&t[0], &t[1], &t[2], scale, window).unwrap(),
            &|t| reference_attention(&t[0], &t[1], &t[2], window),
        );
    }
}

#[test]
fn attention_reads_strided_keys_in_place() {
    // Keys and values as a KV cache holds them, [batch, kv_heads, positions, head_dim], read
    // through a transposed view.
    let mut rng = SeededRng::new(2);
    let q = randn(&mut rng, &[2, 4, 4, 8]);
    let kc = randn(&mut rng, &[2, 2, 11, 8]);
    let vc = randn(&mut rng, &[2, 2, 11, 8]);
    check(
        "attention over a transposed cache",
        &[q, kc, vc],
        &|t| {
            let (k, v) = (t[1].transpose(1, 2).unwrap(), t[2].transpose(1, 2).unwrap());
            fused::attention(&t[0], &k, &v, 0.3, None).unwrap()
        },
        &|t| {
            let (k, v) = (t[1].transpose(1, 2).unwrap(), t[2].transpose(1, 2).unwrap());
            let q = (&t[0] * (0.3 * 8f64.sqrt())).unwrap(); // the reference scales by 1/sqrt(d)
            reference_attention(&q, &k, &v, None)
        },
    );
}

fn reference_rms_norm(x: &Tensor, w: &Tensor) -> Tensor {
    strata::candle::llama::rms_norm(x, w, 1e-5).unwrap()
}

fn reference_rope(x: &Tensor, rope: &Rope, offset: usize) -> Tensor {
    // Rope::apply takes [batch, heads, seq, head_dim].
    let xh = x.transpose(1, 2).unwrap().contiguous().unwrap();
    rope.apply(&xh, offset).unwrap().transpose(1, 2).unwrap()
}

fn rope_config() -> LlamaConfig {
    LlamaConfig::from_json(
        r#"{"hidden_size": 36, "intermediate_size": 8, "num_hidden_layers": 1,
            "num_attention_heads": 3, "vocab_size": 5, "max_position_embeddings": 80}"#,
    )
    .unwrap()
}

#[test]
fn norm_rope_and_swiglu_equal_the_decomposed_ops_values_and_gradients() {
    let mut rng = SeededRng::new(3);
    for (rows, hidden) in [(1, 8), (70, 33), (2 * 37, 64)] {
        let x = randn(&mut rng, &[rows, hidden]);
        let w = randn(&mut rng, &[hidden]).affine(0.1, 1.0).unwrap();
        check(
            &format!("rms_norm {rows}x{hidden}"),
            &[x.reshape((1, rows, hidden)).unwrap(), w],
            &|t| fused::rms_norm(&t[0], &t[1], 1e-5).unwrap(),
            &|t| reference_rms_norm(&t[0], &t[1]),
        );
        let (g, u) = (randn(&mut rng, &[rows, hidden]), randn(&mut rng, &[rows, hidden]));
        check(
            &format!("swiglu {rows}x{hidden}"),
            &[g, u],
            &|t| fused::swiglu(&t[0], &t[1]).unwrap(),
            &|t| t[0].silu().unwrap().mul(&t[1]).unwrap(),
        );
    }
    let c = rope_config();
    let rope = Rope::new(&c, 80, &Device::Cpu).unwrap();
    for (b, s, h, offset) in [(2, 7, 3, 0), (1, 1, 3, 79), (1, 33, 1, 40)] {
        let x = randn(&mut rng, &[b, s, h, 12]);
        check(
            &format!("rope {:?}", (b, s, h, offset)),
            &[x],
            &|t| rope.apply_fused(&t[0], offset).unwrap(),
            &|t| reference_rope(&t[0], &rope, offset),
        );
    }
    // Strided input: the heads of a [batch, heads, seq, head_dim] tensor, transposed.
    let x = randn(&mut rng, &[2, 3, 5, 12]);
    check(
        "rope of a transposed view",
        &[x],
        &|t| rope.apply_fused(&t[0].transpose(1, 2).unwrap(), 4).unwrap(),
        &|t| reference_rope(&t[0].transpose(1, 2).unwrap(), &rope, 4),
    );
}

/// The fused SwiGLU over a joint gate/up output read in place gives the two-tensor SwiGLU's
/// values of its halves and, as one gradient, their gradients side by side: bit for bit, in
/// f32, bf16 and f16, rank 2 and 3; one work item of the CPU's, several (600 rows of 33: two),
/// and rows wider than a work item (one row each).
#[test]
fn swiglu_over_the_joint_output_is_swiglu_of_its_halves_bit_for_bit() {
    let mut rng = SeededRng::new(8);
    let shapes =
        [vec![1, 2], vec![70, 66], vec![2, 37, 128], vec![600, 66], vec![3, 1, 2 * 20_000]];
    for shape in shapes {
        let inner = shape[shape.len() - 1] / 2;
        let y = randn(&mut rng, &shape).affine(3.0, 0.0).unwrap();
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let what = format!("{shape:?} {dtype:?}");
            let (jy, jg) = value_and_grads(std::slice::from_ref(&y), dtype, &|t| {
                fused::swiglu_joined(&t[0]).unwrap()
            });
            let (sy, sg) = value_and_grads(std::slice::from_ref(&y), dtype, &|t| {
                let (g, u) =
                    (t[0].narrow(D::Minus1, 0, inner), t[0].narrow(D::Minus1, inner, inner));
                fused::swiglu(&g.unwrap(), &u.unwrap()).unwrap()
            });
            assert_eq!(jy.dims(), sy.dims(), "{what}");
            assert_eq!(jy.dtype(), dtype, "{what}");
            assert_eq!(jg[0].dims(), y.dims(), "{what}");
            let bits = |t: &Tensor| {
                t.flatten_all().unwrap().to_dtype(DType::F64).unwrap().to_vec1::<f64>().unwrap()
            };
            assert_eq!(bits(&jy), bits(&sy), "{what}: values");
            // (The halves' gradients, each padded to the joint's width and summed, are the
            // joint's up to the sign of a zero.)
            assert_eq!(bits(&jg[0]), bits(&sg[0]), "{what}: gradients");
        }
    }
    let y = randn(&mut rng, &[4, 14]);
    finite_differences("swiglu_joined", &[y], &|t| fused::swiglu_joined(&t[0]).unwrap());
}

#[test]
fn gradients_match_finite_differences() {
    let mut rng = SeededRng::new(4);
    let q = randn(&mut rng, &[1, 6, 4, 8]);
    let k = randn(&mut rng, &[1, 9, 2, 8]);
    let v = randn(&mut rng, &[1, 9, 2, 8]);
    finite_differences("attention", &[q.clone(), k.clone(), v.clone()], &|t| {
        fused::attention(&t[0], &t[1], &t[2], 0.35, None).unwrap()
    });
    finite_differences("windowed attention", &[q, k, v], &|t| {
        fused::attention(&t[0], &t[1], &t[2], 0.35, Some(3)).unwrap()
    });
    let x = randn(&mut rng, &[3, 10]);
    let w = randn(&mut rng, &[10]).affine(0.1, 1.0).unwrap();
    finite_differences("rms_norm", &[x.clone(), w.clone()], &|t| {
        fused::rms_norm(&t[0], &t[1], 1e-5).unwrap()
    });
    // Both outputs of the residual add and norm, so the gradient reaches x and r through h and n.
    let r = randn(&mut rng, &[3, 10]);
    finite_differences("add_rms_norm", &[x, r, w], &|t| {
        let (h, n) = fused::add_rms_norm(&t[0], &t[1], &t[2], 1e-5).unwrap();
        Tensor::cat(&[h, n], 1).unwrap()
    });
    let (g, u) = (randn(&mut rng, &[4, 7]), randn(&mut rng, &[4, 7]));
    finite_differences("swiglu", &[g, u], &|t| fused::swiglu(&t[0], &t[1]).unwrap());
    let rope = Rope::new(&rope_config(), 80, &Device::Cpu).unwrap();
    let x = randn(&mut rng, &[1, 5, 2, 12]);
    finite_differences("rope", &[x], &|t| rope.apply_fused(&t[0], 3).unwrap());
}

/// A block's weights from seeded random values, each matrix scaled up so attention is not
/// nearly uniform.
fn block(c: &LlamaConfig) -> BlockWeights {
    let w: Vec<_> = random_weights(c, 11).collect();
    let p = LlamaConfig::block_prefix(0);
    BlockWeights::from_fn(c, |s| {
        let (_, shape, v) = w.iter().find(|(n, _, _)| *n == format!("{p}{s}")).unwrap();
        let t = Tensor::from_vec(v.clone(), shape.as_slice(), &Device::Cpu)?;
        if shape.len() == 2 {
            t * 10.0
        } else {
            Ok(t)
        }
    })
    .unwrap()
}

#[test]
fn a_fused_block_equals_the_decomposed_block_values_and_gradients() {
    for window in [None, Some(7)] {
        let mut c = LlamaConfig::from_json(
            r#"{"hidden_size": 48, "intermediate_size": 80, "num_hidden_layers": 1,
                "num_attention_heads": 6, "num_key_value_heads": 2, "vocab_size": 5,
                "max_position_embeddings": 80}"#,
        )
        .unwrap();
        c.sliding_window = window;
        let bw = block(&c);
        let rope = Rope::new(&c, 80, &Device::Cpu).unwrap();
        let x = randn(&mut SeededRng::new(6), &[2, 67, 48]);
        let weights =
            [&bw.input_norm, &bw.q, &bw.k, &bw.v, &bw.o, &bw.post_norm, &bw.gate, &bw.up, &bw.down];
        let mut inputs = vec![x];
        inputs.extend(weights.iter().map(|t| (*t).clone()));
        let (c, rope) = (&c, &rope);
        let run = |compute: Compute| {
            move |t: &[Tensor]| {
                let w = BlockWeights {
                    input_norm: t[1].clone(),
                    q: t[2].clone(),
                    k: t[3].clone(),
                    v: t[4].clone(),
                    o: t[5].clone(),
                    post_norm: t[6].clone(),
                    gate: t[7].clone(),
                    up: t[8].clone(),
                    down: t[9].clone(),
                    qkv_bias: None,
                    adapters: Default::default(),
                    grad_buffers: Default::default(),
                    joints: Default::default(),
                };
                block_forward_with(compute, c, &w, &t[0], rope, 0, None).unwrap()
            }
        };
        let (fy, fg) = value_and_grads(&inputs, DType::F32, &run(Compute::Fused));
        let (ry, rg) = value_and_grads(&inputs, DType::F32, &run(Compute::Decomposed));
        assert!(rel(&fy, &ry) < 4e-6, "{window:?}: value {}", rel(&fy, &ry));
        for (i, (a, b)) in fg.iter().zip(&rg).enumerate() {
            assert!(rel(a, b) < 4e-6, "{window:?}: gradient {i}: {}", rel(a, b));
        }
        // The attention is not near uniform: the scores spread over more than a few units.
        let n = fused::rms_norm(&inputs[0], &bw.input_norm, c.rms_norm_eps).unwrap();
        let q = n.broadcast_matmul(&bw.q.t().unwrap()).unwrap();
        let spread = q.max_keepdim(D::Minus1).unwrap().max_all().unwrap();
        assert!(spread.to_scalar::<f32>().unwrap() > 3.0);
    }
}

#[test]
fn results_have_the_same_bits_on_one_thread_and_on_several() {
    let mut rng = SeededRng::new(7);
    let inputs = [
        randn(&mut rng, &[2, 70, 4, 8]),
        randn(&mut rng, &[2, 70, 2, 8]),
        randn(&mut rng, &[2, 70, 2, 8]),
        randn(&mut rng, &[70, 40]),
        randn(&mut rng, &[40]),
    ];
    let run = || {
        let f = |t: &[Tensor]| {
            let a = fused::attention(&t[0], &t[1], &t[2], 0.3, Some(50)).unwrap();
            let n = fused::rms_norm(&t[3], &t[4], 1e-6).unwrap();
            Tensor::cat(&[a.flatten_all().unwrap(), n.flatten_all().unwrap()], 0).unwrap()
        };
        let (y, g) = value_and_grads(&inputs, DType::F32, &f);
        let mut all: Vec<f32> = y.to_vec1().unwrap();
        for g in g {
            all.extend(g.flatten_all().unwrap().to_vec1::<f32>().unwrap());
        }
        all.into_iter().map(f32::to_bits).collect::<Vec<u32>>()
    };
    let pool = |n| rayon::ThreadPoolBuilder::new().num_threads(n).build().unwrap();
    let one = pool(1).install(run);
    assert_eq!(one, pool(3).install(run));
}

#[test]
fn what_the_fused_ops_cannot_take_is_an_error() {
    let z = |shape: &[usize]| Tensor::zeros(shape, DType::F32, &Device::Cpu).unwrap();
    let q = z(&[1, 4, 4, 8]);
    let kv = z(&[1, 4, 2, 8]);
    for (e, says) in [
        (fused::attention(&q, &z(&[1, 4, 3, 8]), &z(&[1, 4, 3, 8]), 1.0, None), "multiple"),
        (fused::attention(&q, &z(&[1, 3, 2, 8]), &z(&[1, 3, 2, 8]), 1.0, None), "at least"),
        (fused::attention(&q, &kv, &z(&[1, 4, 2, 4]), 1.0, None), "one shape"),
        (fused::attention(&q, &kv, &kv, 1.0, Some(0)), "window of 0"),
        (fused::attention(&q, &kv.to_dtype(DType::BF16).unwrap(), &kv, 1.0, None), "one dtype"),
        (
            fused::attention(
                &q.to_dtype(DType::F64).unwrap(),
                &kv.to_dtype(DType::F64).unwrap(),
                &kv.to_dtype(DType::F64).unwrap(),
                1.0,
                None,
            ),
            "f32, bf16 or f16",
        ),
        (fused::rms_norm(&z(&[2, 8]), &z(&[7]), 1e-6), "weight"),
        (fused::add_rms_norm(&z(&[2, 8]), &z(&[2, 8]), &z(&[7]), 1e-6).map(|p| p.1), "weight"),
        (fused::add_rms_norm(&z(&[2, 8]), &z(&[8]), &z(&[8]), 1e-6).map(|p| p.1), "one shape"),
        (fused::swiglu(&z(&[2, 8]), &z(&[2, 7])), "one shape"),
        (fused::swiglu_joined(&z(&[2, 7])), "must be even"),
        (fused::swiglu_joined(&Tensor::new(1f32, &Device::Cpu).unwrap()), "must be even"),
        (fused::rope(&q, &z(&[3, 8]), &z(&[3, 8]), 0), "past the rotary tables"),
        (fused::rope(&q, &z(&[8, 6]), &z(&[8, 6]), 0), "heads of 8"),
    ] {
        let e = e.unwrap_err().to_string();
        assert!(e.contains(says), "{says}: {e}");
    }
}

/// Gradients summed in place on `dev`: random bf16 gradients into an f32 buffer, then rows of an
/// embedding's gradient added where repeated ids say; the two sums read back.
fn sums_in_place(dev: &Device) -> (Vec<f32>, Vec<f32>) {
    let mut rng = SeededRng::new(11);
    let acc = randn(&mut rng, &[33, 70]).to_device(dev).unwrap();
    for _ in 0..5 {
        let g = randn(&mut rng, &[33, 70]).to_dtype(DType::BF16).unwrap().to_device(dev).unwrap();
        fused::accumulate(&acc, &g).unwrap();
    }
    let table = Tensor::zeros((7, 70), DType::F32, dev).unwrap();
    let ids: Vec<u32> = (0..40).map(|_| rng.below(7) as u32).collect();
    let ids = Tensor::new(ids.as_slice(), dev).unwrap();
    let rows = randn(&mut rng, &[40, 70]).to_dtype(DType::BF16).unwrap().to_device(dev).unwrap();
    fused::index_add_rows(&table, &ids, &rows).unwrap();
    let flat = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    (flat(&acc), flat(&table))
}

#[test]
fn gradients_sum_in_place_in_f32_and_bad_operands_are_errors() {
    let dev = Device::Cpu;
    // A thousand bf16 gradients of ones: 1000 in the f32 buffer, where a bf16 sum stops at 256.
    let ones = Tensor::ones((3, 4), DType::BF16, &dev).unwrap();
    let acc = Tensor::zeros((3, 4), DType::F32, &dev).unwrap();
    let mut in_bf16 = Tensor::zeros((3, 4), DType::BF16, &dev).unwrap();
    for _ in 0..1000 {
        fused::accumulate(&acc, &ones).unwrap();
        in_bf16 = (&in_bf16 + &ones).unwrap();
    }
    assert_eq!(acc.to_vec2::<f32>().unwrap(), [[1000.0; 4]; 3]);
    assert_eq!(in_bf16.to_dtype(DType::F32).unwrap().to_vec2::<f32>().unwrap(), [[256.0; 4]; 3]);
    // An embedding's rows: a thousand tokens of one id, in f32, and the others' rows untouched.
    let table = Tensor::zeros((5, 4), DType::F32, &dev).unwrap();
    let ids = Tensor::new(&[2u32; 1000], &dev).unwrap();
    fused::index_add_rows(&table, &ids, &Tensor::ones((1000, 4), DType::BF16, &dev).unwrap())
        .unwrap();
    let t = table.to_vec2::<f32>().unwrap();
    assert_eq!(t[2], [1000.0; 4]);
    assert!(t[0] == [0.0; 4] && t[4] == [0.0; 4]);
    // The same sums, gradient by gradient and row by row, as the reference order gives them.
    let (a, b) = sums_in_place(&dev);
    assert_eq!((a.len(), b.len()), (33 * 70, 7 * 70));

    let err = |r: candle_core::Result<()>| r.unwrap_err().to_string();
    let bf16_acc = Tensor::zeros((3, 4), DType::BF16, &dev).unwrap();
    assert!(err(fused::accumulate(&bf16_acc, &ones)).contains("f32"));
    let other = Tensor::ones((4, 3), DType::BF16, &dev).unwrap();
    assert!(err(fused::accumulate(&acc, &other)).contains("[4, 3]"));
    let strided = Tensor::zeros((4, 3), DType::F32, &dev).unwrap().t().unwrap();
    assert!(err(fused::accumulate(&strided, &ones)).contains("contiguous"));
    let past = Tensor::new(&[1u32, 5], &dev).unwrap();
    let two = Tensor::ones((2, 4), DType::F32, &dev).unwrap();
    assert!(err(fused::index_add_rows(&table, &past, &two)).contains("id 5 in a table of 5"));
    assert!(err(fused::index_add_rows(&table, &past, &ones)).contains("rows"));
    // A refused id changed nothing.
    assert_eq!(table.to_vec2::<f32>().unwrap(), t);
}

/// Every fused op on `dev` against the same op on the CPU, values and gradients: f32 within
/// 1e-5, bf16 within 1e-2 (the two sum in other orders; bf16 rounds each once). Attention at
/// head widths of each of the CUDA kernels' three sizes (64, 128, 256), grouped, windowed,
/// cached and strided.
#[cfg_attr(not(feature = "candle-cuda"), allow(dead_code))]
fn ops_on_device_equal_the_cpu_ops(dev: &Device) {
    let mut rng = SeededRng::new(8);
    let on =
        |t: &[Tensor]| -> Vec<Tensor> { t.iter().map(|x| x.to_device(dev).unwrap()).collect() };
    let compare = |what: &str, inputs: Vec<Tensor>, f: &dyn Fn(&[Tensor]) -> Tensor| {
        for (dtype, tol) in [(DType::F32, 1e-5), (DType::BF16, 1e-2)] {
            let (cy, cg) = value_and_grads(&inputs, dtype, f);
            let (dy, dg) = value_and_grads(&on(&inputs), dtype, f);
            assert!(rel(&dy, &cy) < tol, "{what} {dtype:?} value: {}", rel(&dy, &cy));
            for (i, (a, b)) in dg.iter().zip(&cg).enumerate() {
                assert!(rel(a, b) < tol, "{what} {dtype:?} gradient {i}: {}", rel(a, b));
            }
        }
    };
    let mut shapes = ATTENTION_SHAPES.to_vec();
    shapes.extend([(1, 40, 40, 4, 2, 64, None), (1, 33, 70, 2, 1, 128, Some(30))]);
    shapes.push((1, 17, 17, 2, 2, 256, None));
    for (b, sq, skv, nh, nkv, d, window) in shapes {
        let q = randn(&mut rng, &[b, sq, nh, d]);
        let k = randn(&mut rng, &[b, skv, nkv, d]);
        let v = randn(&mut rng, &[b, skv, nkv, d]);
        let scale = 1.0 / (d as f64).sqrt();
        compare(&format!("attention {:?}", (b, sq, skv, nh, nkv, d)), vec![q, k, v], &|t| {
            fused::attention(&t[0], &t[1], &t[2], scale, window).unwrap()
        });
    }
    let q = randn(&mut rng, &[2, 4, 4, 8]);
    let (kc, vc) = (randn(&mut rng, &[2, 2, 11, 8]), randn(&mut rng, &[2, 2, 11, 8]));
    compare("attention over a transposed cache", vec![q, kc, vc], &|t| {
        let (k, v) = (t[1].transpose(1, 2).unwrap(), t[2].transpose(1, 2).unwrap());
        fused::attention(&t[0], &k, &v, 0.3, Some(6)).unwrap()
    });
    for (rows, hidden) in [(1, 8), (70, 33), (130, 4096)] {
        let x = randn(&mut rng, &[rows, hidden]);
        let w = randn(&mut rng, &[hidden]).affine(0.1, 1.0).unwrap();
        compare(&format!("rms_norm {rows}x{hidden}"), vec![x.clone(), w.clone()], &|t| {
            fused::rms_norm(&t[0], &t[1], 1e-5).unwrap()
        });
        let r = randn(&mut rng, &[rows, hidden]);
        compare(&format!("add_rms_norm {rows}x{hidden}"), vec![x, r, w], &|t| {
            let (h, n) = fused::add_rms_norm(&t[0], &t[1], &t[2], 1e-5).unwrap();
            Tensor::cat(&[h, n], 1).unwrap()
        });
        let (g, u) = (randn(&mut rng, &[rows, hidden]), randn(&mut rng, &[rows, hidden]));
        compare(&format!("swiglu {rows}x{hidden}"), vec![g, u], &|t| {
            fused::swiglu(&t[0], &t[1]).unwrap()
        });
        let y = randn(&mut rng, &[rows, 2 * hidden]);
        compare(&format!("swiglu_joined {rows}x{}", 2 * hidden), vec![y], &|t| {
            fused::swiglu_joined(&t[0]).unwrap()
        });
    }
    // More rows than a grid's y dimension holds (65,535): the kernel's row loop strides.
    let y = randn(&mut rng, &[70_000, 2 * 3]);
    compare("swiglu_joined 70000x6", vec![y], &|t| fused::swiglu_joined(&t[0]).unwrap());
    let c = rope_config();
    let (cpu_rope, dev_rope) =
        (Rope::new(&c, 80, &Device::Cpu).unwrap(), Rope::new(&c, 80, dev).unwrap());
    let rope = |t: &Tensor| if t.device().is_cpu() { &cpu_rope } else { &dev_rope };
    let x = randn(&mut rng, &[2, 3, 5, 12]);
    compare("rope of a transposed view", vec![x], &|t| {
        rope(&t[0]).apply_fused(&t[0].transpose(1, 2).unwrap(), 7).unwrap()
    });
    // Gradients summed in place: the same order, so the same bits.
    assert!(sums_in_place(dev) == sums_in_place(&Device::Cpu), "sums in place");
    // The accumulating linear: its dW (cuBLAS, f32 out, beta = 1) over two micro-batches of a
    // 3-D input against the CPU's (the gemm crate), both f32 sums of the same products.
    let (x, w, r) =
        (randn(&mut rng, &[2, 9, 48]), randn(&mut rng, &[40, 48]), randn(&mut rng, &[2, 9, 40]));
    for (dtype, tol) in [(DType::F32, 1e-5), (DType::BF16, 1e-2)] {
        let run = |d: &Device| {
            let on = |t: &Tensor| t.to_dtype(dtype).unwrap().to_device(d).unwrap();
            let dw = Tensor::zeros((40, 48), DType::F32, d).unwrap();
            let mut dxs = Vec::new();
            for m in 0..2 {
                let xv = Var::from_tensor(&(on(&x) * (m + 1) as f64).unwrap()).unwrap();
                let y = fused::accumulating_linear(xv.as_tensor(), &on(&w), &dw).unwrap();
                let g = y.mul(&on(&r)).unwrap().sum_all().unwrap().backward().unwrap();
                dxs.push(g.get(&xv).unwrap().clone());
            }
            (dxs, dw)
        };
        let ((ddx, ddw), (cdx, cdw)) = (run(dev), run(&Device::Cpu));
        assert!(rel(&ddw, &cdw) < 1e-5, "accumulating_linear {dtype:?} dW: {}", rel(&ddw, &cdw));
        for (a, b) in ddx.iter().zip(&cdx) {
            assert!(rel(a, b) < tol, "accumulating_linear {dtype:?} dX: {}", rel(a, b));
        }
    }
}

/// On a GPU (feature `candle-cuda`): the CUDA kernels of the fused ops against their CPU code.
#[cfg(feature = "candle-cuda")]
#[test]
fn fused_ops_on_cuda_equal_the_cpu_ops() {
    match Device::new_cuda(0) {
        Ok(dev) => ops_on_device_equal_the_cpu_ops(&dev),
        Err(e) => {
            assert!(std::env::var("STRATA_REQUIRE_GPU").is_err(), "no GPU: {e}");
            println!("SKIP fused_ops_on_cuda_equal_the_cpu_ops: no GPU ({e})");
        }
    }
}

/// On a GPU with cuDNN's attention library (feature `candle-cuda`): the built-in blocks'
/// attention under `auto` is cuDNN's where it takes the call (the same bits as
/// `fused::cudnn::attention`), its backward gives the same bits run after run (cuDNN's
/// deterministic algorithm: at 1,024 keys each query row's `dQ` sums many key tiles, so a sum
/// in another order would show), it agrees with strata's kernel to bf16's rounding, and a KV
/// cache's call stays strata's kernel. Three shapes: 8 heads over 2 of 64, with and without a
/// sliding window; and a 7B's 32 heads over 8 of 128 read as the block reads them, views of one
/// joint q/k/v output.
#[cfg(feature = "candle-cuda")]
#[test]
fn auto_attention_on_cuda_is_cudnns_deterministic_and_agrees_with_strata_s() {
    let dev = match Device::new_cuda(0) {
        Ok(d) => d,
        Err(e) => {
            assert!(std::env::var("STRATA_REQUIRE_GPU").is_err(), "no GPU: {e}");
            println!("SKIP auto_attention_on_cuda_is_cudnns_deterministic: no GPU ({e})");
            return;
        }
    };
    if let Err(e) = fused::cudnn::available() {
        assert!(std::env::var("STRATA_REQUIRE_ATTN_LIB").is_err(), "no library: {e}");
        println!("SKIP auto_attention_on_cuda_is_cudnns_deterministic: {e}");
        return;
    }
    use fused::AttentionKernel as K;
    let bits = |t: &Tensor| -> Vec<u16> {
        let t = t.to_dtype(DType::BF16).unwrap().flatten_all().unwrap();
        t.to_vec1::<half::bf16>().unwrap().iter().map(|x| x.to_bits()).collect()
    };
    let (b, s) = (1, 1024);
    for (nh, nkv, d, window) in [(8, 2, 64, None), (8, 2, 64, Some(300)), (32, 8, 128, None)] {
        // One joint [b, s, heads + 2 · kv_heads, d] tensor, q, k and v its views.
        let joint =
            randn(&mut SeededRng::new(7), &[b, s, nh + 2 * nkv, d]).to_device(&dev).unwrap();
        let scale = 1.0 / (d as f64).sqrt();
        let run = |kernel: K, cached: bool| {
            value_and_grads(std::slice::from_ref(&joint), DType::BF16, &|t: &[Tensor]| {
                let (q, k, v) = (
                    t[0].narrow(2, 0, nh).unwrap(),
                    t[0].narrow(2, nh, nkv).unwrap(),
                    t[0].narrow(2, nh + nkv, nkv).unwrap(),
                );
                fused::attention_with(kernel, &q, &k, &v, scale, window, cached).unwrap()
            })
        };
        let what = format!("{nh} heads over {nkv} of {d}, window {window:?}");
        let (auto, auto_g) = run(K::Auto, false);
        let (cudnn, cudnn_g) = run(K::Cudnn, false);
        let (strata, strata_g) = run(K::Strata, false);
        let (cached, _) = run(K::Auto, true);
        assert_eq!(bits(&auto), bits(&cudnn), "auto is cuDNN's ({what})");
        assert_eq!(bits(&auto_g[0]), bits(&cudnn_g[0]), "its gradient is cuDNN's ({what})");
        assert_eq!(bits(&cached), bits(&strata), "a cache's call is strata's ({what})");
        for again in 0..3 {
            let (o, g) = run(K::Auto, false);
            assert_eq!(bits(&o), bits(&auto), "the same output, run {again} ({what})");
            assert_eq!(bits(&g[0]), bits(&auto_g[0]), "the same gradients, run {again} ({what})");
        }
        assert!(rel(&auto, &strata) < 1e-2, "value ({what}): {}", rel(&auto, &strata));
        let g = rel(&auto_g[0], &strata_g[0]);
        assert!(g < 1e-2, "gradient ({what}): {g}");
    }
    // What a run prints after its first step: these three shapes among those cuDNN took (other
    // tests in this process may have asked about others).
    let ran = fused::cudnn::asked_so_far().expect("cuDNN was asked");
    let took = ran.split("strata's kernel where cuDNN refused").next().unwrap();
    for shape in [
        "1 × 8 heads over 2 of 64, 1024 queries over 1024 keys, Bf16",
        "1 × 8 heads over 2 of 64, 1024 queries over 1024 keys, a window of 300, Bf16",
        "1 × 32 heads over 8 of 128, 1024 queries over 1024 keys, Bf16",
    ] {
        assert!(
            took.starts_with("cuDNN's fused SDPA for") && took.contains(shape),
            "{shape}: {ran}"
        );
    }
}
