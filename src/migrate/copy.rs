//! Copies of a tensor's bytes, prepared under the store's lock and carried out after.
//!
//! A [`Copy`] names its source and destination by leases and plain ranges (never by the extent
//! tokens, which stay with the tensor), and the events it must wait for. Copies between host
//! memory and the device are DMA on a copy stream: they are *issued* (asynchronously, cheaply)
//! under the lock. Everything else needs the host: disk reads and writes, host memcpys, staging
//! through pinned buffers. That runs without the lock, while the tensor is in flight; its result
//! is committed under the lock afterwards.

use std::sync::Arc;
use std::time::Instant;

use smallvec::SmallVec;

use super::timeline::{Span, TimePoint, Track};
use super::Shared;
use crate::backend::{RawEvent, RawStream};
use crate::base::error::{Error, Result};
use crate::base::types::{TensorId, Tier};
use crate::tiers::arena::{self, ReadLease, StagingBuf, WriteLease};
use crate::tiers::disk::DiskRange;
use crate::tiers::file::ExternalFile;
use crate::tiers::staging::{copier, StagingSet};

/// Where a copy reads.
pub(crate) enum Src<'a> {
    /// An extent of a memory tier.
    Mem(Tier, ReadLease),
    /// An extent of the disk slab, and the crc its bytes must have.
    Disk(DiskRange, u32),
    /// A range of a user's file.
    File(Arc<ExternalFile>, u64),
    /// The caller's bytes (a put, a write, a promotion of bytes just read).
    User(&'a [u8]),
}

/// Where a copy writes.
pub(crate) enum Dst {
    /// An extent of a memory tier.
    Mem(Tier, WriteLease),
    /// An extent of the disk slab.
    Disk(DiskRange),
}

/// One prepared copy of tensor `id`.
pub(crate) struct HostCopy<'a> {
    pub(crate) id: TensorId,
    pub(crate) name: Arc<str>,
    pub(crate) src: Src<'a>,
    pub(crate) dst: Dst,
    /// Events after which the source's bytes are valid and no other work writes them (its
    /// `ready`; for a device source, the tensor's uses too).
    pub(crate) waits: SmallVec<[RawEvent; 2]>,
    /// The trace row of the disk reads the copy makes (a worker's index).
    pub(crate) lane: usize,
}

/// What a finished (or issued) copy leaves behind.
pub(crate) struct Done {
    /// The event after which the destination is valid (`None`: valid now).
    pub(crate) ready: Option<RawEvent>,
    /// The crc32 of the bytes written into a disk destination.
    pub(crate) crc: Option<u32>,
    /// Timeline spans, pushed under the lock at commit.
    pub(crate) spans: Vec<Span>,
    /// A copy stream that read the source (its key and event): a use of the tensor.
    pub(crate) use_by: Option<(RawStream, RawEvent)>,
}

impl HostCopy<'_> {
    fn source_tier(&self) -> Option<Tier> {
        match &self.src {
            Src::Mem(t, _) => Some(*t),
            Src::Disk(..) | Src::File(..) => Some(Tier::Disk),
            Src::User(_) => None,
        }
    }

    fn dest_tier(&self) -> Tier {
        match &self.dst {
            Dst::Mem(t, _) => *t,
            Dst::Disk(_) => Tier::Disk,
        }
    }

    /// Whether the copy is a DMA between host memory and the device: issued under the lock,
    /// with no host work.
    pub(crate) fn is_dma(&self, shared: &Shared) -> bool {
        let cpu = |t: Tier| shared.mem.arena(t).is_some_and(|a| a.cpu_reachable());
        match (&self.src, &self.dst) {
            (Src::Mem(a, _), Dst::Mem(b, _)) => {
                (*a == Tier::Device) != (*b == Tier::Device)
                    && (cpu(*a) || *a == Tier::Device)
                    && (cpu(*b) || *b == Tier::Device)
            }
            _ => false,
        }
    }

    /// Issues a DMA copy ([`Copy::is_dma`]); called under the lock.
    pub(crate) fn issue(self, shared: &Shared) -> Result<Done> {
        let (Src::Mem(from, src), Dst::Mem(to, dst)) = (&self.src, &self.dst) else {
            return Err(Error::InvalidArgument("issue of a copy that needs the host".into()));
        };
        let be = &shared.backend;
        let stream = if *to == Tier::Device { be.h2d() } else { be.d2h() };
        for ev in &self.waits {
            stream.wait(ev)?;
        }
        let timing = shared.timing;
        let start = if timing { Some(stream.record_timed()?) } else { None };
        arena::dma_copy(stream, dst, src)?;
        let ready = if timing { stream.record_timed()? } else { stream.record()? };
        let mut spans = Vec::new();
        if let Some(start) = start {
            let (track, what) =
                if *to == Tier::Device { (Track::H2d, "h2d") } else { (Track::D2h, "d2h") };
            spans.push(Span {
                track,
                what,
                tensor: self.name.clone(),
                bytes: src.len() as u64,
                start: TimePoint::Ev(start),
                end: TimePoint::Ev(ready.clone()),
            });
        }
        let _ = from;
        Ok(Done {
            ready: Some(ready.clone()),
            crc: None,
            spans,
            use_by: Some((stream.clone(), ready)),
        })
    }

    /// Carries out a copy that needs the host, without the store's lock: the tensor is in
    /// flight. `staging` is where device copies go through (a worker's own buffers, or taken
    /// from the store's pool when `None`).
    pub(crate) fn run(self, shared: &Shared, staging: Option<&mut [StagingBuf]>) -> Result<Done> {
        crate::base::sync::assert_unlocked("a copy's host work");
        if self.is_dma(shared) {
            // A DMA that must also be finished now (a move that returns when done).
            let done = self.issue(shared)?;
            if let Some(ev) = &done.ready {
                ev.synchronize()?;
            }
            return Ok(done);
        }
        let t0 = Instant::now();
        let track = match (self.source_tier(), self.dest_tier()) {
            (Some(Tier::Device), _) => Track::D2h,
            (_, Tier::Device) => Track::H2d,
            _ => Track::Host,
        };
        let bytes = match &self.dst {
            Dst::Mem(_, l) => l.len() as u64,
            Dst::Disk(r) => r.bytes,
        };
        let (id, name) = (self.id, self.name.clone());
        let mut done = self.run_host(shared, staging)?;
        if let (true, Track::H2d, Some(last)) = (shared.timing, track, &done.ready) {
            // A staged upload ends on its last piece's pooled event, which cannot be timed (on
            // CUDA its span would never resolve, nor free its event): a timed event after it on
            // the same stream stands for it, as the span's end and as the copy's `ready`. If it
            // cannot be recorded the copy fails, once its pieces have landed (the destination
            // is freed after a failure).
            match shared.backend.h2d().record_timed() {
                Ok(ev) => done.ready = Some(ev),
                Err(e) => {
                    let _ = last.synchronize();
                    return Err(e);
                }
            }
        }
        if shared.timing {
            let end = match &done.ready {
                Some(ev) => TimePoint::Ev(ev.clone()),
                None => TimePoint::Host(Instant::now()),
            };
            let what = match track {
                Track::H2d => "h2d",
                Track::D2h => "d2h",
                _ => "host copy",
            };
            done.spans.push(Span {
                track,
                what,
                tensor: name.clone(),
                bytes,
                start: TimePoint::Host(t0),
                end,
            });
        }
        let _ = id;
        Ok(done)
    }

    fn run_host(self, shared: &Shared, staging: Option<&mut [StagingBuf]>) -> Result<Done> {
        let be = &shared.backend;
        let HostCopy { id, name, src, mut dst, waits, lane } = self;
        let mut spans = Vec::new();
        let corrupt = |found: u32, expected: u32| Error::Corrupt {
            id,
            name: name.to_string(),
            path: shared.mem.disk.as_ref().map(|d| d.name()).unwrap_or_default(),
            expected,
            found,
        };
        let none = |ready: Option<RawEvent>, crc: Option<u32>| Done {
            ready,
            crc,
            spans: Vec::new(),
            use_by: None,
        };
        // A host source: its bytes must be in place before the CPU reads them.
        let host_src = !matches!(&src, Src::Mem(Tier::Device, _));
        if host_src {
            for ev in &waits {
                ev.synchronize()?;
            }
        }
        let disk = || shared.mem.disk.as_ref().ok_or(Error::TierDisabled { tier: Tier::Disk });
        match (&src, &mut dst) {
            // CPU to CPU: memcpy.
            (Src::Mem(_, s), Dst::Mem(_, d)) if s.bytes().is_some() && d.bytes().is_some() => {
                let (Some(sb), Some(db)) = (s.bytes(), d.bytes_mut()) else { unreachable!() };
                crate::base::failpoint::check(
                    crate::base::failpoint::Site::HostCopy,
                    "<host copy>".as_ref(),
                )?;
                copier().copy(db, sb);
                Ok(none(None, None))
            }
            (Src::User(data), Dst::Mem(_, d)) if d.bytes().is_some() => {
                let db = d.bytes_mut().expect("checked");
                crate::base::failpoint::check(
                    crate::base::failpoint::Site::HostCopy,
                    "<host copy>".as_ref(),
                )?;
                copier().copy(db, data);
                Ok(none(None, None))
            }
            // Into the device through staging: the CPU fills a buffer while the last one's DMA
            // runs.
            (_, Dst::Mem(Tier::Device, d)) => {
                let mut taken = None;
                let bufs = staging_bufs(shared, staging, &mut taken, d.len())?;
                let mut crc = crc32fast::Hasher::new();
                let last = match &src {
                    Src::User(data) => arena::upload(be.h2d(), d, bufs, |off, b| {
                        copier().copy(b, &data[off..off + b.len()]);
                        Ok(())
                    })?,
                    Src::Mem(_, s) => {
                        let sb = s.bytes().ok_or_else(|| {
                            Error::InvalidArgument("a device-to-device staged copy".into())
                        })?;
                        arena::upload(be.h2d(), d, bufs, |off, b| {
                            copier().copy(b, &sb[off..off + b.len()]);
                            Ok(())
                        })?
                    }
                    Src::Disk(r, _) => {
                        let slab = disk()?;
                        arena::upload(be.h2d(), d, bufs, |off, b| {
                            let t0 = Instant::now();
                            slab.read_range(*r, off as u64, b)?;
                            if shared.timing {
                                spans.push(Span {
                                    track: Track::Disk(lane),
                                    what: "disk read",
                                    tensor: name.clone(),
                                    bytes: b.len() as u64,
                                    start: TimePoint::Host(t0),
                                    end: TimePoint::Host(Instant::now()),
                                });
                            }
                            crc.update(b);
                            Ok(())
                        })?
                    }
                    Src::File(f, at) => {
                        arena::upload(be.h2d(), d, bufs, |off, b| f.read_at(at + off as u64, b))?
                    }
                };
                if let Src::Disk(_, expected) = &src {
                    let found = crc.finalize();
                    if found != *expected {
                        if let Some(ev) = &last {
                            ev.synchronize()?;
                        }
                        return Err(corrupt(found, *expected));
                    }
                }
                let mut done = none(last, None);
                done.spans = spans;
                Ok(done)
            }
            // Out of the device through staging, into a host tier or the disk.
            (Src::Mem(Tier::Device, s), _) => {
                let d2h = be.d2h();
                for ev in &waits {
                    d2h.wait(ev)?;
                }
                let mut taken = None;
                let bufs = staging_bufs(shared, staging, &mut taken, s.len())?;
                match &mut dst {
                    Dst::Disk(r) => {
                        let slab = disk()?;
                        let mut crc = crc32fast::Hasher::new();
                        arena::download(d2h, s, bufs, |off, piece| {
                            crc.update(piece);
                            slab.write_range(*r, off as u64, piece)
                        })?;
                        Ok(none(None, Some(crc.finalize())))
                    }
                    Dst::Mem(_, d) => {
                        let db = d.bytes_mut().ok_or_else(|| {
                            Error::InvalidArgument("a device-to-device staged copy".into())
                        })?;
                        arena::download(d2h, s, bufs, |off, piece| {
                            db[off..off + piece.len()].copy_from_slice(piece);
                            Ok(())
                        })?;
                        Ok(none(None, None))
                    }
                }
            }
            // Host memory or the caller's bytes into the disk.
            (Src::Mem(_, s), Dst::Disk(r)) => {
                let sb = s.bytes().ok_or_else(|| Error::InvalidArgument("no host bytes".into()))?;
                let crc = disk()?.write(*r, sb)?;
                Ok(none(None, Some(crc)))
            }
            (Src::User(data), Dst::Disk(r)) => {
                let crc = disk()?.write(*r, data)?;
                Ok(none(None, Some(crc)))
            }
            // The disk into host memory: checked against the crc.
            (Src::Disk(r, expected), Dst::Mem(_, d)) => {
                let db =
                    d.bytes_mut().ok_or_else(|| Error::InvalidArgument("no host bytes".into()))?;
                let found = disk()?.read(*r, db)?;
                if found != *expected {
                    return Err(corrupt(found, *expected));
                }
                Ok(none(None, None))
            }
            (Src::File(f, at), Dst::Mem(_, d)) => {
                let db =
                    d.bytes_mut().ok_or_else(|| Error::InvalidArgument("no host bytes".into()))?;
                f.read_at(*at, db)?;
                Ok(none(None, None))
            }
            // A user's file into the disk tier, in pieces.
            (Src::File(f, at), Dst::Disk(r)) => {
                const PIECE: u64 = 8 << 20;
                let slab = disk()?;
                let len = r.bytes;
                let mut buf = vec![0u8; PIECE.min(len) as usize];
                let mut crc = crc32fast::Hasher::new();
                let mut off = 0;
                while off < len {
                    let n = PIECE.min(len - off) as usize;
                    f.read_at(at + off, &mut buf[..n])?;
                    crc.update(&buf[..n]);
                    slab.write_range(*r, off, &buf[..n])?;
                    off += n as u64;
                }
                Ok(none(None, Some(crc.finalize())))
            }
            (Src::Disk(..), Dst::Disk(_)) | (Src::Mem(..), Dst::Mem(..)) | (Src::User(_), _) => {
                Err(Error::InvalidArgument("an unsupported copy between tiers".into()))
            }
        }
    }
}

/// The staging buffers a copy goes through: the caller's (a worker's own), or two taken from the
/// store's pool into `taken` (returned when it drops).
fn staging_bufs<'s: 'b, 'b>(
    shared: &'s Shared,
    staging: Option<&'b mut [StagingBuf]>,
    taken: &'b mut Option<StagingSet<'s>>,
    bytes: usize,
) -> Result<&'b mut [StagingBuf]> {
    if let Some(b) = staging {
        return Ok(b);
    }
    let pool = shared.mem.staging.as_ref().ok_or(Error::TierDisabled { tier: Tier::Device })?;
    Ok(&mut taken.insert(pool.take(pool.wanted(bytes))).bufs[..])
}

/// Reads a replica's bytes into `out` (exactly the tensor's length) without the store's lock:
/// the tensor is in a read flight.
pub(crate) fn read_into(
    shared: &Shared,
    id: TensorId,
    name: &str,
    src: Src<'_>,
    waits: &[RawEvent],
    out: &mut [u8],
) -> Result<()> {
    crate::base::sync::assert_unlocked("a read's host work");
    let device = matches!(src, Src::Mem(Tier::Device, _));
    if !device {
        for ev in waits {
            ev.synchronize()?;
        }
    }
    match src {
        Src::Mem(_, s) if s.bytes().is_some() => {
            crate::base::failpoint::check(
                crate::base::failpoint::Site::HostCopy,
                "<host copy>".as_ref(),
            )?;
            copier().copy(out, s.bytes().expect("checked"));
            Ok(())
        }
        Src::Mem(_, s) => {
            let d2h = shared.backend.d2h();
            for ev in waits {
                d2h.wait(ev)?;
            }
            let mut taken = None;
            let bufs = staging_bufs(shared, None, &mut taken, s.len())?;
            arena::download(d2h, &s, bufs, |off, piece| {
                copier().copy(&mut out[off..off + piece.len()], piece);
                Ok(())
            })
        }
        Src::Disk(r, expected) => {
            let slab = shared.mem.disk.as_ref().ok_or(Error::TierDisabled { tier: Tier::Disk })?;
            let found = slab.read(r, out)?;
            if found != expected {
                return Err(Error::Corrupt {
                    id,
                    name: name.to_string(),
                    path: slab.name(),
                    expected,
                    found,
                });
            }
            Ok(())
        }
        Src::File(f, at) => f.read_at(at, out),
        Src::User(data) => {
            out.copy_from_slice(data);
            Ok(())
        }
    }
}
