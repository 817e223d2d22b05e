//! Reading a BPF iterator's output: records written by `bpf_seq_write`, decoded as they are
//! read through a few small reused buffers (a dump is never held in memory as bytes).
use std::time::{Duration, Instant};

use aya::programs::Iter;
use connreap_ebpf::{HeldElsewhere, OwnerRecord};

use super::IterError;

/// What one iterator dump was: its records, and the time spent in `read`, i.e. in the kernel
/// producing them.
#[derive(Debug, Default, Clone, Copy)]
pub struct Dump {
    pub records: usize,
    /// Time in read(): the iterator producing records.
    pub in_kernel: Duration,
    /// The whole dump: attach, reads, and decoding the records.
    pub total: Duration,
}

/// Bytes asked for per read (the kernel returns at most its seq buffer, 32 KiB, per read).
const CHUNK: usize = 64 * 1024;
/// A first read of at least this much means a big dump: the rest of it is read on a second
/// thread while this one decodes (see [`pipelined`]). Smaller ones, most namespaces' dumps,
/// are read and decoded on this thread alone.
const BIG: usize = 16 * 1024;
/// Buffers in flight between the reading thread and the decoding one.
const BUFFERS: usize = 4;

/// How a big dump is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Reading {
    /// A second thread reads while this one decodes (see [`pipelined`]): the wall time of a
    /// one-shot `snapshot` is about the kernel's part alone.
    #[default]
    Pipelined,
    /// Read and decode on this thread, one read after the other: no hand-over between
    /// threads per read (a wake-up and a context switch each, ~350 per dump at 100k
    /// sockets). The daemon reads so: its CPU per scan is what counts there, not a scan's
    /// wall time (BENCHMARKS.md has the two side by side).
    OneThread,
}

/// Run `it` and hand the bytes read so far to `decode`, which returns how many of them it
/// consumed (whole records) and how many records those were; the rest is kept for the next
/// read.
fn run(
    it: &mut Iter,
    reading: Reading,
    decode: impl FnMut(&[u8]) -> (usize, usize),
) -> Result<Dump, IterError> {
    let start = Instant::now();
    let id = it.attach()?;
    let link = it.take_link(id)?;
    let file = link.into_file()?;
    let mut dump = read_all(file, reading, decode)?;
    dump.total = start.elapsed();
    Ok(dump)
}

/// Read `file` to its end, decoding as [`run`] says (`total` left 0).
fn read_all(
    mut file: impl std::io::Read + Send,
    reading: Reading,
    decode: impl FnMut(&[u8]) -> (usize, usize),
) -> std::io::Result<Dump> {
    let mut dump = Dump::default();
    let mut carry = Carry {
        decode,
        rest: Vec::new(),
    };
    let mut buf = vec![0u8; CHUNK];
    let n = read_chunk(&mut file, &mut buf, &mut dump.in_kernel)?;
    if n > 0 {
        carry.feed(&buf[..n], &mut dump);
        if n >= BIG && reading == Reading::Pipelined {
            pipelined(file, buf, &mut carry, &mut dump)?;
        } else {
            loop {
                let n = read_chunk(&mut file, &mut buf, &mut dump.in_kernel)?;
                if n == 0 {
                    break;
                }
                carry.feed(&buf[..n], &mut dump);
            }
        }
    }
    Ok(dump)
}

/// One read of the iterator's output into `buf` (0: the end), its time added to `in_kernel`.
fn read_chunk(
    file: &mut impl std::io::Read,
    buf: &mut [u8],
    in_kernel: &mut Duration,
) -> std::io::Result<usize> {
    loop {
        let t = Instant::now();
        let read = file.read(buf);
        *in_kernel += t.elapsed();
        match read {
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            read => return read,
        }
    }
}

/// The decoder and the bytes of a record cut by the end of a read.
struct Carry<F> {
    decode: F,
    rest: Vec<u8>,
}

impl<F: FnMut(&[u8]) -> (usize, usize)> Carry<F> {
    fn feed(&mut self, bytes: &[u8], dump: &mut Dump) {
        if self.rest.is_empty() {
            let (used, records) = (self.decode)(bytes);
            dump.records += records;
            self.rest.extend_from_slice(&bytes[used..]);
        } else {
            self.rest.extend_from_slice(bytes);
            let (used, records) = (self.decode)(&self.rest);
            dump.records += records;
            self.rest.drain(..used);
        }
    }
}

/// The rest of a big dump: a second thread reads it (the kernel's part: walking the sockets)
/// into [`BUFFERS`] reused buffers while this thread decodes the ones already read, in order.
/// `in_kernel` is the reading thread's time in read().
fn pipelined<R: std::io::Read + Send>(
    mut file: R,
    first: Vec<u8>,
    carry: &mut Carry<impl FnMut(&[u8]) -> (usize, usize)>,
    dump: &mut Dump,
) -> std::io::Result<()> {
    let read = std::thread::scope(|scope| {
        // Made inside the scope, so that a panic while decoding drops this side's ends of
        // both channels before the scope waits for the reader: the reader then stops instead
        // of waiting for a buffer forever.
        let (full_tx, full_rx) = std::sync::mpsc::sync_channel::<(Vec<u8>, usize)>(BUFFERS);
        let (free_tx, free_rx) = std::sync::mpsc::channel::<Vec<u8>>();
        for buf in std::iter::once(first).chain((1..BUFFERS).map(|_| vec![0u8; CHUNK])) {
            // The receiver is alive: it is moved into the reader below.
            let _ = free_tx.send(buf);
        }
        let reader = scope.spawn(move || -> std::io::Result<Duration> {
            let mut in_kernel = Duration::ZERO;
            // Ends at the dump's end, an error, or when the decoding side is gone.
            while let Ok(mut buf) = free_rx.recv() {
                let n = read_chunk(&mut file, &mut buf, &mut in_kernel)?;
                if n == 0 || full_tx.send((buf, n)).is_err() {
                    break;
                }
            }
            Ok(in_kernel)
        });
        for (buf, n) in full_rx.iter() {
            carry.feed(&buf[..n], dump);
            let _ = free_tx.send(buf);
        }
        reader
            .join()
            .unwrap_or_else(|p| std::panic::resume_unwind(p))
    });
    dump.in_kernel += read?;
    Ok(())
}

/// A dump of fixed-size records, each handed to `f`.
pub(super) fn fixed<T: aya::Pod>(
    it: &mut Iter,
    reading: Reading,
    mut f: impl FnMut(T),
) -> Result<Dump, IterError> {
    run(it, reading, |buf| {
        let whole = buf.len() - buf.len() % std::mem::size_of::<T>();
        let mut n = 0;
        records::<T>(&buf[..whole]).for_each(|r| {
            n += 1;
            f(r)
        });
        (whole, n)
    })
}

/// What a dump of owners that also reads other namespaces' sockets hands its caller.
pub enum Owned {
    /// A socket's owner.
    Owner(OwnerRecord),
    /// A TCP socket of another namespace than the reader's, with its owner.
    Elsewhere(HeldElsewhere),
}

/// A dump of owner records, each followed by its socket's record where `netns` is set (see
/// [`OwnerRecord::netns`]); records counts the owners.
pub(super) fn owned(
    it: &mut Iter,
    reading: Reading,
    mut f: impl FnMut(Owned),
) -> Result<Dump, IterError> {
    run(it, reading, |buf| decode_owned(buf, &mut f))
}

/// Decode the whole records at the start of `buf`: (bytes used, records).
fn decode_owned(buf: &[u8], f: &mut impl FnMut(Owned)) -> (usize, usize) {
    const OWNER: usize = std::mem::size_of::<OwnerRecord>();
    const PAIR: usize = std::mem::size_of::<HeldElsewhere>();
    let (mut at, mut n) = (0, 0);
    while let Some(owner) = buf.get(at..at + OWNER).map(read::<OwnerRecord>) {
        if owner.netns == 0 {
            f(Owned::Owner(owner));
            at += OWNER;
        } else if let Some(pair) = buf.get(at..at + PAIR) {
            f(Owned::Elsewhere(read(pair)));
            at += PAIR;
        } else {
            break;
        }
        n += 1;
    }
    (at, n)
}

/// Fixed-size records written by `bpf_seq_write`; a trailing partial record is ignored.
fn records<T: aya::Pod>(buf: &[u8]) -> impl Iterator<Item = T> + '_ {
    buf.chunks_exact(std::mem::size_of::<T>()).map(read)
}

/// A record from exactly `size_of::<T>()` bytes.
fn read<T: aya::Pod>(chunk: &[u8]) -> T {
    assert_eq!(chunk.len(), std::mem::size_of::<T>());
    // SAFETY: T is Pod (any bit pattern is a valid T) and chunk has exactly size_of::<T>()
    // bytes (checked above); read_unaligned allows any alignment of the buffer.
    unsafe { std::ptr::read_unaligned(chunk.as_ptr().cast::<T>()) }
}

#[cfg(test)]
mod tests {
    use connreap_ebpf::SockRecord;

    use super::*;

    fn bytes<T: aya::Pod>(r: &T) -> &[u8] {
        // SAFETY: reading the bytes of a Pod record.
        unsafe { std::slice::from_raw_parts(r as *const T as *const u8, std::mem::size_of::<T>()) }
    }

    fn owner(skaddr: u64, netns: u32) -> OwnerRecord {
        OwnerRecord {
            skaddr,
            tgid: 42,
            fd: 7,
            comm: *b"java\0\0\0\0\0\0\0\0\0\0\0\0",
            netns,
            _pad: 0,
        }
    }

    /// A reader that returns `sizes[i % len]` bytes on its i-th read, and an error once it
    /// has returned `fail_after` bytes, if set.
    struct Chunky {
        data: Vec<u8>,
        at: usize,
        sizes: Vec<usize>,
        reads: usize,
        fail_after: Option<usize>,
    }

    impl std::io::Read for Chunky {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            if self.fail_after.is_some_and(|f| self.at >= f) {
                return Err(std::io::Error::other("the iterator failed"));
            }
            let want = self.sizes[self.reads % self.sizes.len()];
            self.reads += 1;
            let n = want.min(buf.len()).min(self.data.len() - self.at);
            buf[..n].copy_from_slice(&self.data[self.at..self.at + n]);
            self.at += n;
            Ok(n)
        }
    }

    fn owners_stream(n: u64) -> Vec<u8> {
        (1..=n).flat_map(|i| bytes(&owner(i, 0)).to_vec()).collect()
    }

    /// Small dumps (read here) and big ones (read on a second thread, through recycled
    /// buffers, or on this one), cut anywhere: every record once, in order; a failed read is
    /// the dump's error.
    #[test]
    fn every_record_once_in_order_however_the_reads_cut_them() {
        let cuts = [
            (3u64, vec![1, 2, 5]),
            (300, vec![7000]),
            (20_000, vec![32 * 1024, 17, 40_000, 1, 12_345]),
            (20_000, vec![BIG, CHUNK]),
        ];
        let both = [Reading::Pipelined, Reading::OneThread];
        for (reading, (n, sizes)) in both
            .into_iter()
            .flat_map(|r| cuts.iter().map(move |c| (r, c.clone())))
        {
            let data = owners_stream(n);
            let mut seen = Vec::new();
            let file = Chunky {
                data,
                at: 0,
                sizes,
                reads: 0,
                fail_after: None,
            };
            let dump = read_all(file, reading, |buf| {
                decode_owned(buf, &mut |o| {
                    if let Owned::Owner(o) = o {
                        seen.push(o.skaddr)
                    }
                })
            })
            .unwrap();
            assert_eq!(dump.records as u64, n, "{reading:?}");
            assert_eq!(seen, (1..=n).collect::<Vec<_>>(), "{reading:?}");
        }
        for (reading, fail_after) in both
            .into_iter()
            .flat_map(|r| [0, 1000, 300_000].map(|f| (r, f)))
        {
            let file = Chunky {
                data: owners_stream(20_000),
                at: 0,
                sizes: vec![32 * 1024],
                reads: 0,
                fail_after: Some(fail_after),
            };
            let err = read_all(file, reading, |buf| decode_owned(buf, &mut |_| ())).unwrap_err();
            assert_eq!(err.to_string(), "the iterator failed", "{reading:?}");
        }
    }

    /// A decoder that panics in the middle of a big dump: the panic reaches the caller (the
    /// reading thread stops; nothing waits forever).
    #[test]
    fn a_panic_while_decoding_a_big_dump_reaches_the_caller() {
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let file = Chunky {
                data: owners_stream(20_000),
                at: 0,
                sizes: vec![32 * 1024],
                reads: 0,
                fail_after: None,
            };
            let mut calls = 0;
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                read_all(file, Reading::Pipelined, |buf| {
                    calls += 1;
                    assert!(calls < 3, "a decoder bug");
                    decode_owned(buf, &mut |_| ())
                })
            }));
            let _ = done_tx.send(result.is_err());
        });
        let panicked = done_rx
            .recv_timeout(Duration::from_secs(20))
            .expect("read_all returned or panicked within 20 s");
        assert!(panicked);
    }

    #[test]
    fn decodes_records_and_ignores_partial_tail() {
        let a = owner(0xffff_8880_1234_5678, 0);
        let mut buf = Vec::new();
        for _ in 0..2 {
            buf.extend_from_slice(bytes(&a));
        }
        buf.extend_from_slice(&[1, 2, 3]);
        let recs: Vec<OwnerRecord> = records(&buf).collect();
        assert_eq!(recs, vec![a, a]);
    }

    /// Owners and owner + socket pairs interleaved, cut at every byte: each record comes once,
    /// whole, and a cut pair waits for its socket's bytes.
    #[test]
    fn owners_and_sockets_elsewhere_decode_across_any_cut() {
        let pair = HeldElsewhere {
            owner: owner(2, 4026532001),
            sock: SockRecord {
                skaddr: 2,
                inode: 99,
                sport: 8080,
                ..SockRecord::default()
            },
        };
        let mut stream = Vec::new();
        stream.extend_from_slice(bytes(&owner(1, 0)));
        stream.extend_from_slice(bytes(&pair));
        stream.extend_from_slice(bytes(&owner(3, 0)));
        for cut in 0..=stream.len() {
            let mut seen = Vec::new();
            let mut f = |o: Owned| {
                seen.push(match o {
                    Owned::Owner(o) => (o.skaddr, None),
                    Owned::Elsewhere(p) => (p.owner.skaddr, Some((p.owner.netns, p.sock.sport))),
                })
            };
            let (used, n1) = decode_owned(&stream[..cut], &mut f);
            let mut rest = stream[used..cut].to_vec();
            rest.extend_from_slice(&stream[cut..]);
            let (used2, n2) = decode_owned(&rest, &mut f);
            assert_eq!(used2, rest.len(), "cut at {cut}");
            assert_eq!(n1 + n2, 3, "cut at {cut}");
            assert_eq!(
                seen,
                vec![(1, None), (2, Some((4026532001, 8080))), (3, None)],
                "cut at {cut}"
            );
        }
    }
}
