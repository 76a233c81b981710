//! The typed API: `put_slice`, `read_vec`, `write_slice` and typed views, for every element type,
//! through every tier; a type that is not the tensor's dtype is a typed error.

use crate::common;

use common::{each_backend, Backend};
use strata::half::{bf16, f16};
use strata::{DType, Element, Error, Store, Tier};

fn store(b: Backend) -> Store {
    b.builder()
        .capacity(Tier::Device, 1 << 20)
        .capacity(Tier::Pinned, 1 << 20)
        .capacity(Tier::Mapped, 1 << 20)
        .capacity(Tier::Disk, 8 << 20)
        .build()
        .unwrap()
}

/// Puts `vals`, then moves the tensor through every tier, reading it back typed in each.
fn round_trip<T: Element>(s: &Store, vals: &[T]) {
    let name = format!("{}", T::DTYPE);
    let id = s.put_slice(&name, &[vals.len()], vals).unwrap();
    let info = s.info(id).unwrap();
    assert_eq!((info.dtype, info.shape.as_slice()), (T::DTYPE, &[vals.len()][..]), "{name}");
    for t in [Tier::Disk, Tier::Mapped, Tier::Pinned, Tier::Device] {
        s.move_to(id, t).unwrap();
        assert_eq!(s.read_vec::<T>(id).unwrap(), vals, "{name} read from {t}");
    }
    // Byte-for-byte what the byte API sees.
    let bytes = s.read(id).unwrap();
    assert_eq!(bytes.len(), std::mem::size_of_val(vals), "{name}");
    s.remove(id).unwrap();
}

#[test]
fn every_element_type_round_trips_through_every_tier() {
    each_backend("every_element_type_round_trips_through_every_tier", |b| {
        let s = store(b);
        let n = 1000usize;
        round_trip(&s, &(0..n).map(|i| i as f64 * 0.25 - 7.0).collect::<Vec<_>>());
        round_trip(&s, &(0..n).map(|i| i as f32 * -1.5).collect::<Vec<_>>());
        round_trip(&s, &(0..n).map(|i| f16::from_f32(i as f32 / 8.0)).collect::<Vec<_>>());
        round_trip(&s, &(0..n).map(|i| bf16::from_f32(i as f32 * 3.0)).collect::<Vec<_>>());
        round_trip(&s, &(0..n).map(|i| i as i64 * -1_000_000_007).collect::<Vec<_>>());
        round_trip(&s, &(0..n).map(|i| i as i32 - 500).collect::<Vec<_>>());
        round_trip(&s, &(0..n).map(|i| i as i16 * -3).collect::<Vec<_>>());
        round_trip(&s, &(0..n).map(|i| (i % 256) as i8).collect::<Vec<_>>());
        round_trip(&s, &(0..n).map(|i| u64::MAX - i as u64).collect::<Vec<_>>());
        round_trip(&s, &(0..n).map(|i| i as u32 * 4_000_000).collect::<Vec<_>>());
        round_trip(&s, &(0..n).map(|i| i as u16 * 60).collect::<Vec<_>>());
        round_trip(&s, &(0..n).map(|i| (i % 256) as u8).collect::<Vec<_>>());
        round_trip(&s, &(0..n).map(|i| i % 3 == 0).collect::<Vec<_>>());
        // Empty tensors too.
        round_trip::<f32>(&s, &[]);
    });
}

#[test]
fn a_type_that_is_not_the_dtype_is_a_typed_error() {
    let s = store(Backend::Host);
    let w = s.put_slice("w", &[2, 2], &[1.0f32, 2.0, 3.0, 4.0]).unwrap();
    match s.read_vec::<bf16>(w) {
        Err(Error::DTypeMismatch { id, dtype: DType::F32, asked }) => {
            assert_eq!(id, w);
            assert!(asked.contains("bf16"), "{asked}");
        }
        other => panic!("read f32 as bf16: {other:?}"),
    }
    let msg = s.read_vec::<u32>(w).unwrap_err().to_string();
    assert!(msg.contains("read it as f32") && msg.contains("u32"), "{msg}");
    assert!(matches!(s.write_slice(w, &[1u32; 4]), Err(Error::DTypeMismatch { .. })));
    assert_eq!(s.read_vec::<f32>(w).unwrap(), [1.0, 2.0, 3.0, 4.0], "a refused write changed it");

    // FP8 has no Rust type: the message says to read its bytes.
    let f8 = s.put("f8", DType::F8E4M3, &[2], &[0x38, 0x40]).unwrap();
    let msg = s.read_vec::<u8>(f8).unwrap_err().to_string();
    assert!(msg.contains("bytes"), "{msg}");

    // The wrong number of values for the shape.
    assert!(matches!(
        s.put_slice("short", &[3], &[1.0f32, 2.0]),
        Err(Error::LengthMismatch { expected: 12, got: 8, .. })
    ));
    assert!(matches!(s.write_slice(w, &[1.0f32; 3]), Err(Error::LengthMismatch { .. })));

    // A bool tensor whose bytes are not 0 or 1 is refused, not turned into undefined bools.
    let b = s.put("flags", DType::Bool, &[3], &[0, 1, 7]).unwrap();
    assert!(matches!(s.read_vec::<bool>(b), Err(Error::InvalidArgument(_))));
    s.write_slice(b, &[true, false, true]).unwrap();
    assert_eq!(s.read_vec::<bool>(b).unwrap(), [true, false, true]);
    assert_eq!(s.read(b).unwrap(), [1, 0, 1]);
}

#[test]
fn typed_views() {
    each_backend("typed_views", |b| {
        let s = store(b);
        let m = s.put_slice("m", &[4], &[0i32; 4]).unwrap();
        s.move_to(m, Tier::Pinned).unwrap();
        {
            let mut v = s.host_view(m).unwrap();
            assert!(matches!(v.values::<f32>(), Err(Error::DTypeMismatch { .. })));
            for (i, x) in v.values_mut::<i32>().unwrap().iter_mut().enumerate() {
                *x = i as i32 * 10;
            }
            assert_eq!(v.values::<i32>().unwrap(), [0, 10, 20, 30]);
        }
        assert_eq!(s.read_vec::<i32>(m).unwrap(), [0, 10, 20, 30]);

        let w = s.put_slice("w", &[3], &[bf16::from_f32(1.0); 3]).unwrap();
        let stream = s.stream().unwrap();
        let mut v = s.device_view(w, &stream).unwrap();
        assert!(matches!(v.typed_cuda_view::<f32>(), Err(Error::DTypeMismatch { .. })));
        match b {
            Backend::Host => {
                assert!(matches!(v.typed_cuda_view::<bf16>(), Err(Error::BackendMismatch(_))));
                v.with_host_values_mut(|x: &mut [bf16]| x[1] = bf16::from_f32(-2.0)).unwrap();
                let got = v.with_host_values(|x: &[bf16]| x.to_vec()).unwrap();
                assert_eq!(got[1].to_f32(), -2.0);
            }
            Backend::Cuda => {
                let cuda = stream.cuda().unwrap();
                let host: Vec<bf16> =
                    cuda.clone_dtoh(&v.typed_cuda_view::<bf16>().unwrap()).unwrap();
                assert_eq!(host, [bf16::from_f32(1.0); 3]);
                let mut cv = v.typed_cuda_view_mut::<bf16>().unwrap();
                cuda.memcpy_htod(&[bf16::from_f32(-2.0); 3], &mut cv).unwrap();
            }
        }
        drop(v);
        assert_eq!(s.read_vec::<bf16>(w).unwrap()[1].to_f32(), -2.0);
    });
}
